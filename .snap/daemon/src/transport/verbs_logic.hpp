// Hardware-free logic of the verbs transport, unit-tested without a NIC (tests/unit/transport_logic_test.cpp):
// QP attribute building for the INIT/RTR/RTS transitions, QpInfo serialisation for the bootstrap exchange,
// work-request planning and encoding, selective signalling with send-queue accounting, and the rail-aligned
// choice of NIC per GPU from a topology given as plain data.
//
// Control-message fragments (SENDs on QP 0) have a 4-byte header: byte 0 is kFragmentMore or kFragmentLast, the
// rest zero.
//
// Only <infiniband/verbs.h> types are used here (plain structs and enums); nothing calls into libibverbs.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace tandem::daemon::transport::verbs {

// ---------------------------------------------------------------------------------------------------------
// QpInfo: what a peer needs to connect its QP to ours
// ---------------------------------------------------------------------------------------------------------

inline constexpr uint32_t kMax24Bit = 0xffffff;  // QPNs and PSNs are 24-bit fields (IBTA vol 1, 9.7.1)

/// One QP's address, sent to the peer in the bootstrap. Trivially copyable; 52 bytes on the wire.
struct QpInfo {
  uint16_t lid = 0;         ///< port LID (InfiniBand); 0 on RoCE
  uint8_t port = 1;         ///< physical port number (>= 1)
  uint8_t mtu = IBV_MTU_1024;                 ///< the port's active MTU (enum ibv_mtu value)
  uint8_t linkLayer = IBV_LINK_LAYER_INFINIBAND;  ///< IBV_LINK_LAYER_INFINIBAND or _ETHERNET (RoCE)
  uint32_t qpn = 0;         ///< 24 bits
  uint32_t psn = 0;         ///< initial packet sequence number, 24 bits
  std::array<uint8_t, 16> gid{};  ///< the port's GID at the configured index; required on RoCE
  uint32_t rkey = 0;        ///< rkey of the node's control region (flags), for the peer's flag writes
  uint64_t addr = 0;        ///< iova of that control region

  static constexpr std::size_t kWireBytes = 52;
  friend bool operator==(const QpInfo&, const QpInfo&) = default;
};

/// Wire format (little-endian): u32 magic "TQP1" | u8 version | u8 port | u8 mtu | u8 linkLayer | u16 lid
/// | u16 reserved(0) | u32 qpn | u32 psn | gid[16] | u32 rkey | u32 reserved(0) | u64 addr.
std::vector<std::byte> encodeQpInfo(const QpInfo& info);
/// Throws Error(kProtocol) for truncated, oversized or malformed input (bad magic, version, 24-bit fields
/// out of range, MTU or link layer unknown, port 0, reserved bits set, RoCE without a GID, IB without a LID).
QpInfo decodeQpInfo(std::span<const std::byte> bytes);
/// A list (u16 count, then entries), as carried in TransportAddress::blob. At most kMaxQpInfos entries.
inline constexpr std::size_t kMaxQpInfos = 1024;
std::vector<std::byte> encodeQpInfoList(std::span<const QpInfo> infos);
std::vector<QpInfo> decodeQpInfoList(std::span<const std::byte> bytes);

// ---------------------------------------------------------------------------------------------------------
// QP state transitions
// ---------------------------------------------------------------------------------------------------------

/// Local knobs for a connection. Defaults cite where they come from.
struct PathConfig {
  uint8_t port = 1;
  uint8_t gidIndex = 0;       ///< RoCE v2 is usually index 3 (`show_gids`); IB ignores it unless routed
  uint8_t activeMtu = IBV_MTU_4096;  ///< the local port's active_mtu; the path uses min(local, remote)
  uint8_t serviceLevel = 0;   ///< IB SL / RoCE priority (NCCL_IB_SL default 0)
  uint8_t trafficClass = 0;   ///< GRH traffic class (NCCL_IB_TC default 0)
  // 4.096 us * 2^18 ≈ 1.07 s local ACK timeout per retry (NCCL_IB_TIMEOUT default 18; rc_pingpong uses 14,
  // ≈ 67 ms, which large fabrics under congestion outgrow).
  uint8_t timeout = 18;
  uint8_t retryCount = 7;     ///< transport retries before IBV_WC_RETRY_EXC_ERR; 7 is the 3-bit field's max
  uint8_t rnrRetry = 7;       ///< 7 = retry forever on RNR NAK (IBTA 9.7.5.2.8); we post no receives anyway
  uint8_t minRnrTimer = 12;   ///< 0.64 ms RNR NAK delay (IBTA table 45; rc_pingpong default)
  // Outstanding RDMA READs as initiator/responder. Only the GPUDirect flush reads, one at a time, so 1 is
  // enough; must not exceed the device's max_qp_init_rd_atom / max_qp_rd_atom.
  uint8_t maxRdAtomic = 1;
  uint8_t maxDestRdAtomic = 1;
  uint8_t hopLimit = 255;     ///< GRH hop limit; 255 lets routed RoCE/IB cross any number of hops (NCCL)
};

/// An attribute struct plus the mask ibv_modify_qp needs for one transition.
struct QpTransition {
  ibv_qp_attr attr{};
  int mask = 0;
};

/// RESET -> INIT. accessFlags: what the peer may do to our MRs through this QP (remote write/read).
QpTransition buildInitAttr(const PathConfig& local, unsigned accessFlags);
/// INIT -> RTR, from the peer's QpInfo. Uses a GRH (is_global) when the link layer is Ethernet (RoCE needs
/// it) or the peer's GID is set and its LID is 0. Throws Error(kInvalidArgument) if the link layers differ.
QpTransition buildRtrAttr(const PathConfig& local, const QpInfo& localInfo, const QpInfo& remote);
/// RTR -> RTS with our initial PSN (the one we advertised in our QpInfo).
QpTransition buildRtsAttr(const PathConfig& local, uint32_t localPsn);

/// Bytes of an ibv_mtu value (256..4096); 0 for an invalid value.
uint32_t mtuBytes(uint8_t mtu);
/// A random 24-bit PSN (std::random_device): distinct PSNs per connection make stale packets of an earlier
/// incarnation of a QP number fall outside the window.
uint32_t randomPsn();

// ---------------------------------------------------------------------------------------------------------
// Work requests: planning, encoding, selective signalling
// ---------------------------------------------------------------------------------------------------------

enum class WrKind : uint8_t {
  kWrite = 0,      ///< RDMA WRITE of registered local bytes
  kFlag = 1,       ///< RDMA WRITE of 8 inline bytes (the flag value), no local MR needed
  kMarker = 2,     ///< zero-length signalled RDMA WRITE: a completion that retires earlier WRs on its QP
  kFlushRead = 3,  ///< RDMA READ of a few bytes on the loopback QP: the GPUDirect flush
  kSend = 4,       ///< SEND of registered local bytes into the peer's next posted receive (control messages)
};

/// One work request, before it becomes an ibv_send_wr.
struct WorkRequestPlan {
  WrKind kind = WrKind::kWrite;
  uint64_t localAddr = 0;
  uint32_t lkey = 0;
  uint32_t length = 0;
  uint64_t remoteAddr = 0;
  uint32_t rkey = 0;
  uint64_t inlineValue = 0;  ///< kFlag: the value (copied by the HCA at post time because it is inline)
  bool userSignal = false;   ///< the caller asked for a completion (cookie below)
  uint64_t cookie = 0;
};

/// Splits a write into WRs, appending them: cuts fall at multiples of maxMessageBytes (≤ the port's max_msg_sz,
/// clamped to 2^31) counted from the start of the destination region, so each WR lies in one destination
/// stripe. localBase is the iova of the local region's first byte. The last WR carries userSignal and cookie.
/// Throws Error(kInvalidArgument) for ranges outside the regions.
void planWrite(uint64_t localBase, uint64_t localBytes, uint32_t lkey, uint64_t srcOffset, const RemoteKey& dst,
               uint64_t dstOffset, uint64_t bytes, uint64_t maxMessageBytes, bool signal, uint64_t cookie,
               std::vector<WorkRequestPlan>& out);
/// A flag write: 8 bytes inline at dst+dstOffset (8-byte aligned, in bounds, else Error(kInvalidArgument)).
WorkRequestPlan planFlag(const RemoteKey& dst, uint64_t dstOffset, uint64_t value, bool signal, uint64_t cookie);

inline constexpr uint8_t kFragmentMore = 1;
inline constexpr uint8_t kFragmentLast = 2;
inline constexpr std::size_t kFragmentHeaderBytes = 4;
/// Lays `payload` out as fragments of at most `slotBytes` (header included), each starting at a multiple of
/// slotBytes in the result. Returns the bytes; `lengths` gets each fragment's length. An empty payload is one
/// header-only fragment. Throws Error(kInvalidArgument) when slotBytes leaves no room for payload.
std::vector<std::byte> fragmentMessage(std::span<const std::byte> payload, std::size_t slotBytes,
                                       std::vector<uint32_t>& lengths);
/// Appends one received fragment to `assembling`; true when it was the last (the message is complete). Throws
/// Error(kProtocol) for a fragment without a valid header or a message over maxBytes.
bool appendFragment(std::span<const std::byte> fragment, std::vector<std::byte>& assembling, std::size_t maxBytes);

/// Fills `wr` and `sge` (both owned by the caller and alive until ibv_post_send returns). `signaled` comes
/// from the SendQueueTracker; wr_id is the WR's per-QP sequence number. IBV_SEND_INLINE for kFlag.
void encodeWorkRequest(const WorkRequestPlan& plan, uint64_t wrId, bool signaled, ibv_send_wr& wr, ibv_sge& sge);

/// Send-queue accounting and selective signalling for one RC QP.
///  - WR sequence numbers start at 0 and increase by one per posted WR.
///  - A signalled WR's completion retires it and every earlier WR on the QP (RC completes in order).
///  - Signal every `signalEvery`-th WR, any WR the caller forces, and the WR that fills the queue, so the
///    number of WRs posted and not retired never exceeds `depth` and a full queue always has a completion
///    coming.
class SendQueueTracker {
 public:
  /// Throws Error(kInvalidArgument) unless 1 <= signalEvery <= depth.
  SendQueueTracker(uint32_t depth, uint32_t signalEvery);

  uint32_t depth() const { return depth_; }
  uint64_t posted() const { return posted_; }
  uint64_t retired() const { return retired_; }
  uint64_t outstanding() const { return posted_ - retired_; }
  /// WRs that may be posted now.
  uint32_t room() const { return static_cast<uint32_t>(depth_ - outstanding()); }
  /// True if some posted WR is not covered by a signalled one (a marker is needed to learn when it ends).
  bool hasUnsignaledTail() const { return posted_ > 0 && lastSignaled_ + 1 != posted_; }

  struct Slot {
    uint64_t seq;
    bool signaled;
  };
  /// Records one WR. Precondition: room() >= 1 (throws Error(kInternal) otherwise).
  Slot next(bool forceSignal);
  /// A signalled completion for WR `seq`. Returns how many WRs it retired (0 for a stale or unknown seq).
  uint64_t complete(uint64_t seq);

 private:
  uint32_t depth_;
  uint32_t signalEvery_;
  uint64_t posted_ = 0;
  uint64_t retired_ = 0;
  uint64_t lastSignaled_ = UINT64_MAX;  // seq of the last signalled WR; UINT64_MAX = none yet
  std::deque<uint64_t> signaledInFlight_;  // seqs of signalled WRs not yet completed, ascending
};

/// Takes WRs from the front of `pending` into `batch` (cleared first): at most min(maxPerPost, room) of them,
/// assigning each its seq and signalled bit from `tracker`. Returns the number taken. A WR with userSignal is
/// always signalled. The caller chains `batch` into one ibv_post_send.
struct PlannedWr {
  WorkRequestPlan plan;
  uint64_t seq;
  bool signaled;
};
std::size_t takeBatch(std::deque<WorkRequestPlan>& pending, SendQueueTracker& tracker, uint32_t maxPerPost,
                      std::vector<PlannedWr>& batch);

// ---------------------------------------------------------------------------------------------------------
// Rail-aligned NIC choice
// ---------------------------------------------------------------------------------------------------------

/// A PCI device as the topology reports it. pciPath is the sysfs path of the device, e.g.
/// "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:04.0/0000:1b:00.0" (realpath of
/// /sys/class/infiniband/<dev>/device or /sys/bus/pci/devices/<busid>).
struct PciDevice {
  std::string name;     ///< "mlx5_0", "GPU-0"
  std::string pciPath;
  int numaNode = -1;    ///< -1 unknown
};
struct NicDesc {
  PciDevice pci;
  bool active = true;   ///< port state ACTIVE
  uint8_t port = 1;
};
struct GpuDesc {
  PciDevice pci;
  int index = 0;        ///< CUDA ordinal; rails are numbered by it
};

/// How far apart two PCI devices are, nearest first (NCCL's PIX/PXB < PHB < NODE < SYS).
enum class PciDistance : uint8_t {
  kSameSwitch = 0,     ///< share a PCIe switch (a bridge below the root port)
  kSameHostBridge = 1, ///< share the root complex only
  kSameNuma = 2,       ///< different root complexes, same NUMA node
  kCrossNuma = 3,      ///< across the CPU interconnect (or unknown)
};
std::string_view pciDistanceName(PciDistance d);
PciDistance pciDistance(const PciDevice& a, const PciDevice& b);

struct NicAssignment {
  std::size_t nic;      ///< index into the NIC list as given
  PciDistance distance;
};

/// Chooses a NIC for each GPU (result in the GPUs' order): nearest active NIC first, then the least loaded,
/// then by NIC name. GPUs are taken in ordinal order and NICs compared by name, so nodes with the same
/// topology make the same choice and GPU i on every node uses the same rail. Throws Error(kUnavailable)
/// when no NIC is active.
std::vector<NicAssignment> chooseRailNics(std::span<const GpuDesc> gpus, std::span<const NicDesc> nics);

}  // namespace tandem::daemon::transport::verbs
