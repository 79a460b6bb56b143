// The control page: one per communicator rank, host memory (a memfd) that tandemd and the rank's libtandem both map,
// and the rank's streams and kernels reach through a host registration. Its layout (CommControl) is plain data shared
// by g++ and nvcc; ControlPage is its one owner on the host, and the only host code that touches its words.
//
// Stream order, per communicator rank, with epoch e = the rank's n-th op on the communicator (1, 2, ...; equal on
// every rank for the same collective):
//   client executor (client-gate): stream: [WriteValue32(ready, e) (gangs only)] WaitValue32(go >= e) kernel
//                    WriteValue32(done, e); AllGather without the WaitValue32(go): its kernel polls verdict[e] until
//                    tandemd decided e;
//   daemon executor (persistent): stream: WriteValue32(ready, e) WaitValue32(done >= e); tandemd's persistent kernel
//                    writes done (or, for a fused GEMM, tandemd's own stream after the op's kernels);
//   across nodes (host-staged): as the daemon executor; tandemd writes done itself once it ran the op.
// Stream words are 32-bit and compared cyclically by the hardware ((int32_t)(x - e) >= 0), so an abort writes
// e_last + kStreamAbortLead, which is "greater" than every pending epoch; kernels check the 64-bit abort word.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "tandem/common/fd.hpp"
#include "tandem/kernels/signals.hpp"

namespace tandem::kernels {

inline constexpr uint32_t kVerdictRing = 4096;                   // verdict entries per rank (power of two)
inline constexpr uint64_t kVerdictRejected = uint64_t{1} << 62;  // verdict = e | kVerdictRejected: skip op e
inline constexpr uint32_t kStreamAbortLead = 1u << 30;
inline constexpr uint32_t kPageRanks = 8;  // rank counts the page carries: kMaxLocalRanks (allgather.hpp includes this)

// ---- the layout -------------------------------------------------------------------------------------------------
struct alignas(128) StreamWord {
  uint32_t value;
  uint8_t pad[124];
};
struct alignas(128) CommControl {
  StreamWord go;      // tandemd -> client stream (client executor): ops <= go are decided
  StreamWord ready;   // client stream -> tandemd: the stream reached op `ready`
  StreamWord done;    // client stream (client executor), tandemd's kernel or tandemd -> tandemd: op `done` finished
  uint64_t abort;     // tandemd (peer lost), libtandem (tandemd lost) or an op entry (ranks diverged) -> kernels:
                      // non-zero aborts every wait
  uint64_t deviceEpochs;  // libtandem -> tandemd: non-zero once the rank captured an op into a CUDA graph (op_entry.hpp)
  uint8_t pad0[16];
  // A replayed MoE op's data error (a replay has no epoch of tandemd's, so no entry in `faults`): its kernels ->
  // libtandem, which reports it with the rank's next eager op. Kept (first error wins) until libtandem takes it; a
  // replay that fails while it is full counts in replayFaultsDropped instead (written by the rank's kernels only).
  OpFault replayFault;
  uint64_t replayFaultsDropped;
  uint8_t pad0b[56];
  ErrorSlot error;    // mirrored by a kernel whose wait failed (claimed last, with release)
  uint8_t pad1[64];
  uint64_t verdict[kVerdictRing];  // [e % kVerdictRing] = e (run) or e | kVerdictRejected (skip)
  // [e % kVerdictRing]: op e's data error, if it had one (written by its kernels, read by tandemd when e completes).
  // tandemd keeps a rank's undecided-or-unfinished ops within half the ring, so an entry is never reused while read.
  OpFault faults[kVerdictRing];
  // Client executor, an op whose launch needs every rank's row count on the host (GpuOp::needsRankRows: ring
  // attention's backward): tandemd writes each rank's rows of op `rankRowsEpoch` when it decides the op, before its
  // verdict; libtandem's host waits for them after submitting the op and before launching it. One op at a time:
  // tandemd writes op e's once every rank submitted e, and this rank submits nothing after e before it read them.
  uint64_t rankRows[kPageRanks];
  uint64_t rankRowsEpoch;  // written last, with release
  uint8_t pad2[56];
};
static_assert(sizeof(CommControl) == 640 + (8 + sizeof(OpFault)) * kVerdictRing + 128);
static_assert(offsetof(CommControl, error) == 512, "the replay fault moved the words after it");
inline constexpr uint64_t kControlBytes = (sizeof(CommControl) + 4095) & ~uint64_t{4095};

// ---- the host's side ----------------------------------------------------------------------------------------------
/// Owns one rank's control page (its memfd and this process's mapping) and names every host access to it; the memory
/// ordering of each is defined in control_page.cpp, the device's in device/ordering.cuh. A default-constructed page is
/// empty (a rank on another node has none). Move-only; not thread-safe: tandemd uses a page under its backend lock,
/// libtandem under the communicator's lock (abort() excepted: see there).
class ControlPage {
 public:
  ControlPage() = default;
  /// tandemd: a fresh, zeroed page in a memfd named `name`, for the rank's client to map. @throws Error(kSystem)
  static ControlPage create(const std::string& name);
  /// libtandem: maps the page tandemd sent with the join. @throws Error(kProtocol) when `bytes` is smaller than this
  /// libtandem's layout, Error(kSystem) when the mapping fails.
  static ControlPage open(Fd fd, uint64_t bytes);

  explicit operator bool() const noexcept { return map_.data() != nullptr; }
  int fd() const noexcept { return fd_.get(); }  // valid while the page lives
  uint64_t bytes() const noexcept { return map_.size(); }
  /// The page in this process's address space, to register for device access. Its words are the protocol's: touch
  /// them only through the operations below.
  CommControl* memory() const noexcept { return reinterpret_cast<CommControl*>(map_.data()); }

  // ---- the stream words ----
  /// Whether the rank's stream reached op `epoch` (wrote ready >= epoch, cyclically).
  bool readyReached(uint64_t epoch) const noexcept;
  /// The highest epoch `done` has shown: `known` (the last value this returned, 0 at first) extended by how far the
  /// 32-bit word moved ahead of it. Done only rises, by less than 2^31 between two calls.
  uint64_t doneEpoch(uint64_t known) const noexcept;
  /// Client executor: tandemd decided op `epoch` (run it, or skip it): its verdict, then go.
  void publishVerdict(uint64_t epoch, bool run) noexcept;
  /// tandemd ran op `epoch` itself (host-staged): done = epoch.
  void publishDone(uint64_t epoch) noexcept;
  /// Client executor: every rank's rows of op `epoch` (rows[r]: rank r's; at most kPageRanks), before its verdict.
  void publishRankRows(uint64_t epoch, std::span<const uint64_t> rows) noexcept;
  /// libtandem: the rows tandemd published for op `epoch` (its first nranks entries), once it has; nullopt before.
  std::optional<std::array<uint64_t, kPageRanks>> rankRows(uint64_t epoch) const noexcept;

  // ---- abort ----
  /// Whether the abort word is set (tandemd aborted the communicator, or libtandem saw tandemd go).
  bool aborted() const noexcept;
  /// Every kernel wait of the rank sees the abort word and unwinds (its stream waits are left alone).
  void abortKernels() noexcept;
  /// Releases every wait of the rank for good: the abort word, then go and done jump to `lastEpoch` +
  /// kStreamAbortLead, past every epoch the rank can have enqueued, so each stream wait passes and the kernels behind
  /// them skip. Returns that lead. libtandem calls it from its watcher thread too (tandemd is gone then).
  uint32_t abort(uint64_t lastEpoch) noexcept;
  /// After abort: a kernel or stream that finished late may have written an older done; writes the lead again.
  void holdLead(uint32_t lead) noexcept;

  // ---- device-epoch mode (op_entry.hpp) ----
  /// libtandem: the rank captured an op into a CUDA graph, so its streams may run ops that tandemd never sees (replays).
  void markDeviceEpochs() noexcept;
  /// tandemd: whether the rank did; a rank that leaves such a communicator then aborts the others, whose replays may be
  /// waiting for it with nothing in tandemd's queues to say so.
  bool deviceEpochs() const noexcept;

  // ---- the error slot ----
  /// The report of the rank's first failed kernel wait, once the kernel published all of it; nullopt before.
  std::optional<ErrorSlot> failure() const noexcept;
  /// Op `epoch`'s data error (OpFault), once its kernels published it; nullopt if the op had none. Read it after the
  /// rank's done reached `epoch` (the kernels ran before done).
  std::optional<OpFault> fault(uint64_t epoch) const noexcept;
  /// libtandem: the data error of a replayed op (CommControl::replayFault), if one was published, and empties the slot
  /// for the next; nullopt if none. Not thread-safe (the communicator's lock).
  std::optional<OpFault> takeReplayFault() noexcept;
  /// How many replayed ops failed while the replay fault was full (only rises).
  uint64_t replayFaultsDropped() const noexcept;

 private:
  ControlPage(Fd fd, Mapping map) : fd_(std::move(fd)), map_(std::move(map)) {}
  Fd fd_;
  Mapping map_;
};

}  // namespace tandem::kernels
