// The host's side of the control page protocol (control_page.hpp): every access of its words, with the ordering each
// needs. The device's side is in allgather.cu, persistent.cu and the fused GEMMs' waits (device/ordering.cuh).
#include "tandem/kernels/control_page.hpp"

#include <fmt/format.h>

#include "tandem/common/error.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/host_ordering.hpp"

namespace tandem::kernels {
static_assert(kPageRanks == kMaxLocalRanks, "the control page's rank rows must cover every rank of a node");
namespace {

// Stream words compare cyclically, as cuStreamWaitValue32(GEQ) does.
bool cyclicGeq(uint32_t value, uint64_t epoch) {
  return static_cast<int32_t>(value - static_cast<uint32_t>(epoch)) >= 0;
}

}  // namespace

ControlPage ControlPage::create(const std::string& name) {
  Fd fd = Fd::memfd(name, kControlBytes);  // zero-filled: every word starts at 0
  Mapping map = Mapping::shared(fd.get(), kControlBytes);
  return ControlPage(std::move(fd), std::move(map));
}

ControlPage ControlPage::open(Fd fd, uint64_t bytes) {
  if (bytes < sizeof(CommControl)) {
    fail(ErrorCode::kProtocol, "tandemd sent a {}-byte control page; this libtandem needs {}", bytes,
         sizeof(CommControl));
  }
  Mapping map = Mapping::shared(fd.get(), bytes);
  return ControlPage(std::move(fd), std::move(map));
}

bool ControlPage::readyReached(uint64_t epoch) const noexcept {
  // acquire: pairs with the stream's WriteValue32(ready) (the stream's earlier work, e.g. the op's inputs, is done).
  return cyclicGeq(ldAcquire(memory()->ready.value), epoch);
}

uint64_t ControlPage::doneEpoch(uint64_t known) const noexcept {
  // acquire: pairs with the release that wrote done (a kernel's stReleaseSysU32, the stream's WriteValue32, or
  // publishDone): the op's outputs and its error slot are visible once done shows it.
  const uint32_t done = ldAcquire(memory()->done.value);
  const auto ahead = static_cast<int32_t>(done - static_cast<uint32_t>(known));
  return ahead > 0 ? known + static_cast<uint64_t>(ahead) : known;
}

void ControlPage::publishVerdict(uint64_t epoch, bool run) noexcept {
  CommControl* c = memory();
  // release: the verdict before go; the kernel reads it after the stream's WaitValue(go) passed (or polls it with an
  // acquire load: AllGather's opGate).
  stRelease(c->verdict[epoch % kVerdictRing], run ? epoch : (epoch | kVerdictRejected));
  stRelease(c->go.value, static_cast<uint32_t>(epoch));  // release: pairs with the stream's WaitValue32(go)
}

void ControlPage::publishDone(uint64_t epoch) noexcept {
  // release: the op's outputs (copied to the GPU and synchronised before) precede done; pairs with the stream's
  // WaitValue32(done).
  stRelease(memory()->done.value, static_cast<uint32_t>(epoch));
}

void ControlPage::publishRankRows(uint64_t epoch, std::span<const uint64_t> rows) noexcept {
  CommControl* c = memory();
  // Relaxed would do for the rows (the epoch's release orders them); stRelease is the one store this header names.
  for (std::size_t r = 0; r < rows.size() && r < kPageRanks; ++r) stRelease(c->rankRows[r], rows[r]);
  stRelease(c->rankRowsEpoch, epoch);  // release: the rows before their epoch; pairs with rankRows' acquire
}

std::optional<std::array<uint64_t, kPageRanks>> ControlPage::rankRows(uint64_t epoch) const noexcept {
  const CommControl* c = memory();
  // acquire: pairs with publishRankRows' release of the epoch, after the rows.
  if (ldAcquire(c->rankRowsEpoch) != epoch) return std::nullopt;
  std::array<uint64_t, kPageRanks> rows{};
  for (uint32_t r = 0; r < kPageRanks; ++r) rows[r] = ldAcquire(c->rankRows[r]);
  return rows;
}

bool ControlPage::aborted() const noexcept {
  return ldAcquire(memory()->abort) != 0;  // acquire: pairs with abortKernels' release
}

void ControlPage::abortKernels() noexcept {
  stRelease(memory()->abort, kAbortValue);  // release: pairs with the kernels' relaxed polls of the abort word
}

uint32_t ControlPage::abort(uint64_t lastEpoch) noexcept {
  CommControl* c = memory();
  // Kernels first (every wait polls the abort word), then the streams: go, ready and done jump far ahead (cyclically)
  // of every epoch this rank can have enqueued, so each WaitValue passes and the kernels behind them find the abort word
  // set. ready: tandemd's executor stream may wait on it (an op launched ahead of its gang, daemon_executor.cpp).
  abortKernels();
  const auto lead = static_cast<uint32_t>(lastEpoch + kStreamAbortLead);
  stRelease(c->go.value, lead);
  stRelease(c->ready.value, lead);
  stRelease(c->done.value, lead);
  return lead;
}

void ControlPage::holdLead(uint32_t lead) noexcept {
  uint32_t& done = memory()->done.value;
  if (ldAcquire(done) != lead) stRelease(done, lead);
}

void ControlPage::markDeviceEpochs() noexcept {
  stRelease(memory()->deviceEpochs, uint64_t{1});  // release: nothing to publish but the word; pairs with deviceEpochs()
}

bool ControlPage::deviceEpochs() const noexcept { return ldAcquire(memory()->deviceEpochs) != 0; }

std::optional<ErrorSlot> ControlPage::failure() const noexcept {
  const ErrorSlot& e = memory()->error;
  // acquire: pairs with the kernel's stReleaseSysU32 of `claimed` after it wrote the other fields.
  if (ldAcquire(e.claimed) != kErrorSlotReady) return std::nullopt;
  return e;
}

std::optional<OpFault> ControlPage::fault(uint64_t epoch) const noexcept {
  const OpFault& f = memory()->faults[epoch % kVerdictRing];
  // acquire: pairs with the kernel's stReleaseSys of `epoch` after it wrote the other fields (moe.cu reportMoeError).
  if (ldAcquire(f.epoch) != epoch) return std::nullopt;
  return f;
}

std::optional<OpFault> ControlPage::takeReplayFault() noexcept {
  OpFault& f = memory()->replayFault;
  // acquire: pairs with reportMoeError's stReleaseSys of `epoch` after the fields (moe.cu).
  if (ldAcquire(f.epoch) == 0) return std::nullopt;
  const OpFault out = f;  // no kernel writes the slot while `epoch` is non-zero
  // release: the reads above happen before a kernel sees the slot empty and writes it again; pairs with
  // reportMoeError's ldAcquireSys of `epoch`.
  stRelease(f.epoch, uint64_t{0});
  return out;
}

uint64_t ControlPage::replayFaultsDropped() const noexcept {
  // A count the kernels bump; no other word depends on it (host_ordering.hpp has no relaxed load).
  return ldAcquire(memory()->replayFaultsDropped);
}

}  // namespace tandem::kernels
