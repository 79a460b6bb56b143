// The proxy FIFO's shared layout and command encoding: the part of daemon/src/transport/proxy_fifo.hpp that GPU
// kernels need too (kernels/device/proxy_push.cuh pushes with these very helpers, so host and device producers
// encode commands with the same code). Plain data and constexpr functions only: no std:: containers, no fmt, so that
// nvcc device code can include it; every function is __host__ __device__ under nvcc (TANDEM_PROXY_HD).
//
// proxy_fifo.hpp has the protocol (producers, consumer, the (P1)..(P3) ordering pairs) and brings these names into
// tandem::daemon::transport, where host code uses them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define TANDEM_PROXY_HD __host__ __device__
#else
#define TANDEM_PROXY_HD
#endif

namespace tandem::proxy {

enum class ProxyOpcode : uint8_t {
  kInvalid = 0,
  kWrite = 1,  ///< srcBuffer+srcOffset -> peer's dstBuffer+dstOffset, `bytes` bytes
  kFlag = 2,   ///< store `value` into peer's dstBuffer+dstOffset (8-byte aligned), after earlier writes to peer
  kNop = 3,    ///< consumed and retired, nothing posted (fills a slot a producer must abandon)
};

/// ProxyCommand::flags bits.
inline constexpr uint8_t kProxyFlagSignal = 1;  ///< ask for a completion; advances ProxyFifoControl::completed
inline constexpr uint8_t kProxyKnownFlags = kProxyFlagSignal;

/// One transfer command: 32 bytes, four 64-bit words. Buffer ids name entries of the proxy's buffer table
/// (registered ids), never raw addresses.
///   control: [0,32) seq | [32,40) opcode | [40,48) flags | [48,64) peer      (stored last, release)
///   kWrite:  a = srcOffset (48 bits) | bytes[0,16) << 48;  b = dstOffset (48 bits) | bytes[16,32) << 48
///   kFlag:   a = value;                                    b = dstOffset
struct alignas(32) ProxyCommand {
  uint64_t control;
  uint32_t srcBuffer;  ///< local buffer id (kWrite); 0 for kFlag
  uint32_t dstBuffer;  ///< remote buffer id, resolved per peer
  uint64_t a;
  uint64_t b;
};
static_assert(sizeof(ProxyCommand) == 32);
static_assert(std::is_trivially_copyable_v<ProxyCommand> && std::is_standard_layout_v<ProxyCommand>);
static_assert(offsetof(ProxyCommand, control) == 0 && offsetof(ProxyCommand, a) == 16);

inline constexpr uint64_t kProxyMaxOffset = (uint64_t{1} << 48) - 1;
inline constexpr uint64_t kProxyMaxBytes = (uint64_t{1} << 32) - 1;

/// Header at offset 0 of the region; written once by the daemon before any producer attaches.
struct alignas(128) ProxyFifoHeader {
  uint64_t magic;      ///< kProxyFifoMagic
  uint32_t version;    ///< kProxyFifoVersion
  uint32_t capacity;   ///< slots, a power of two in [kProxyFifoMinCapacity, kProxyFifoMaxCapacity]
};
inline constexpr uint64_t kProxyFifoMagic = 0x314f464958525054ull;  // "TPRXFIO1"
inline constexpr uint32_t kProxyFifoVersion = 1;
inline constexpr uint32_t kProxyFifoMinCapacity = 8;
inline constexpr uint32_t kProxyFifoMaxCapacity = 1u << 20;

/// Indices and status words. Each group sits on its own 128-byte line so producers hammering head do not
/// slow the consumer's tail replica (false sharing). Plain integers, accessed only through atomic_ref.
struct alignas(128) ProxyFifoControl {
  alignas(128) uint64_t head;   ///< next ticket; producers fetch_add (relaxed)
  alignas(128) uint64_t tail;   ///< consumer index replica; written by the proxy only (release), lazily
  alignas(128) uint64_t completed;  ///< every signalled command with ticket < completed has completed (P3)
  uint64_t errors;                  ///< commands rejected or failed so far (P3)
  uint32_t stop;                    ///< nonzero: the FIFO is being torn down; producers stop waiting
  uint32_t reserved;
};
static_assert(sizeof(ProxyFifoControl) == 384);
static_assert(sizeof(ProxyFifoHeader) == 128);

struct ProxyFifoLayout {
  static constexpr uint64_t kHeaderOffset = 0;
  static constexpr uint64_t kControlOffset = sizeof(ProxyFifoHeader);
  static constexpr uint64_t kSlotsOffset = kControlOffset + sizeof(ProxyFifoControl);
  TANDEM_PROXY_HD static constexpr uint64_t bytesFor(uint32_t capacity) {
    return kSlotsOffset + uint64_t{capacity} * sizeof(ProxyCommand);
  }
};
static_assert(ProxyFifoLayout::kSlotsOffset == 512);

/// Index arithmetic and command encoding, constexpr for tests, host producers and kernels alike.
namespace fifo {
TANDEM_PROXY_HD constexpr bool isPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }
TANDEM_PROXY_HD constexpr uint64_t slotOf(uint64_t ticket, uint64_t capacity) { return ticket & (capacity - 1); }
/// The seq a slot holds once ticket's command is published.
TANDEM_PROXY_HD constexpr uint32_t seqOf(uint64_t ticket) { return static_cast<uint32_t>(ticket + 1); }
/// The seq a fresh slot holds: that of the ticket one lap earlier, so it never matches a live ticket.
TANDEM_PROXY_HD constexpr uint32_t initialSeq(uint64_t slot, uint64_t capacity) { return seqOf(slot - capacity); }
/// True if ticket's slot may still hold an unconsumed command, judged from a (possibly stale) tail.
/// A stale tail only makes this more conservative; unsigned wrap keeps it right across 2^64.
/// Only valid for a ticket the caller holds unpublished: the consumer cannot pass it, so tail <= ticket.
TANDEM_PROXY_HD constexpr bool looksFull(uint64_t ticket, uint64_t tail, uint64_t capacity) {
  return ticket - tail >= capacity;
}
/// The pre-claim hint: would claiming n more tickets at `head` (read before claiming) overrun a ring whose
/// consumer is at `tail`? Unlike looksFull this tolerates a tail that has already passed the head it is
/// compared with (the head value went stale while others claimed and the consumer caught up).
TANDEM_PROXY_HD constexpr bool lacksRoom(uint64_t head, uint64_t tail, uint64_t n, uint64_t capacity) {
  const auto used = static_cast<int64_t>(head - tail);  // indices never drift 2^63 apart
  return used > 0 && static_cast<uint64_t>(used) + n > capacity;
}

TANDEM_PROXY_HD constexpr uint64_t packControl(uint32_t seq, ProxyOpcode op, uint8_t flags, uint16_t peer) {
  return uint64_t{seq} | (uint64_t{static_cast<uint8_t>(op)} << 32) | (uint64_t{flags} << 40) | (uint64_t{peer} << 48);
}
TANDEM_PROXY_HD constexpr uint32_t seqField(uint64_t control) { return static_cast<uint32_t>(control); }
TANDEM_PROXY_HD constexpr ProxyOpcode opcodeField(uint64_t control) {
  return static_cast<ProxyOpcode>((control >> 32) & 0xff);
}
TANDEM_PROXY_HD constexpr uint8_t flagsField(uint64_t control) { return static_cast<uint8_t>((control >> 40) & 0xff); }
TANDEM_PROXY_HD constexpr uint16_t peerField(uint64_t control) { return static_cast<uint16_t>(control >> 48); }

constexpr uint64_t kLow48 = (uint64_t{1} << 48) - 1;
/// Unpublished command (seq 0; push fills it in). Offsets above 2^48-1 and bytes above 2^32-1 are truncated:
/// callers check with kProxyMaxOffset/kProxyMaxBytes (the host helpers below throw).
TANDEM_PROXY_HD constexpr ProxyCommand makeWrite(uint16_t peer, uint32_t srcBuffer, uint64_t srcOffset,
                                                 uint32_t dstBuffer, uint64_t dstOffset, uint32_t bytes,
                                                 uint8_t flags = 0) {
  return ProxyCommand{packControl(0, ProxyOpcode::kWrite, flags, peer), srcBuffer, dstBuffer,
                      (srcOffset & kLow48) | (uint64_t{bytes & 0xffffu} << 48),
                      (dstOffset & kLow48) | (uint64_t{bytes >> 16} << 48)};
}
TANDEM_PROXY_HD constexpr ProxyCommand makeFlag(uint16_t peer, uint32_t dstBuffer, uint64_t dstOffset,
                                                uint64_t value, uint8_t flags = 0) {
  return ProxyCommand{packControl(0, ProxyOpcode::kFlag, flags, peer), 0, dstBuffer, value, dstOffset};
}
TANDEM_PROXY_HD constexpr ProxyCommand makeNop() {
  return ProxyCommand{packControl(0, ProxyOpcode::kNop, 0, 0), 0, 0, 0, 0};
}

TANDEM_PROXY_HD constexpr uint64_t writeSrcOffset(const ProxyCommand& c) { return c.a & kLow48; }
TANDEM_PROXY_HD constexpr uint64_t writeDstOffset(const ProxyCommand& c) { return c.b & kLow48; }
TANDEM_PROXY_HD constexpr uint32_t writeBytes(const ProxyCommand& c) {
  return static_cast<uint32_t>((c.a >> 48) | ((c.b >> 48) << 16));
}
TANDEM_PROXY_HD constexpr uint64_t flagValue(const ProxyCommand& c) { return c.a; }
TANDEM_PROXY_HD constexpr uint64_t flagDstOffset(const ProxyCommand& c) { return c.b; }
}  // namespace fifo

/// What a kernel needs to push into one FIFO: device addresses (cudaHostGetDevicePointer) of the region's control
/// words and slots, and of the head counter its producers share. Filled by the host (daemon/src/cuda/
/// proxy_fifo_mapping.hpp); trivially copyable, so it travels in kernel parameters.
struct ProxyFifoDeviceRef {
  ProxyFifoControl* control = nullptr;  ///< tail, completed, errors and stop, read by producers
  ProxyCommand* slots = nullptr;        ///< capacity slots
  /// The ticket counter. Normally &control->head (host-mapped, shared with host producers); a FIFO that only one
  /// GPU's kernels push into may keep it in that GPU's memory instead (the consumer never reads head).
  uint64_t* head = nullptr;
  uint32_t capacity = 0;
  uint32_t reserved = 0;
};
static_assert(std::is_trivially_copyable_v<ProxyFifoDeviceRef> && sizeof(ProxyFifoDeviceRef) == 32);

}  // namespace tandem::proxy
