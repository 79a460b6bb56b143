// The host side of tandem's CUDA use that runs without a GPU: the control page's protocol (what tandemd and libtandem
// write and read in it), the executor strategies' names and ops, and the one CUDA error check.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "tandem/common/error.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/plan_key.hpp"
#include "tandem/kernels/control_page.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/executor.hpp"
#include "tandem/kernels/gpu_ops.hpp"

namespace k = tandem::kernels;

namespace {

// A second mapping of the same memfd: what the other process (libtandem for tandemd, and back) sees.
k::ControlPage peerOf(const k::ControlPage& page) {
  return k::ControlPage::open(tandem::Fd(::dup(page.fd())), page.bytes());
}

}  // namespace

TEST_CASE("control page: a fresh page is zeroed and the peer's mapping sees every write") {
  k::ControlPage daemon = k::ControlPage::create("tandem-test-ctl");
  REQUIRE(daemon);
  CHECK(daemon.bytes() == k::kControlBytes);
  k::ControlPage client = peerOf(daemon);
  CHECK_FALSE(client.readyReached(1));
  CHECK(client.doneEpoch(0) == 0);
  CHECK_FALSE(client.failure().has_value());

  daemon.publishVerdict(1, true);
  daemon.publishVerdict(2, false);
  CHECK(client.memory()->go.value == 2);
  CHECK(client.memory()->verdict[1] == 1);
  CHECK(client.memory()->verdict[2] == (2 | k::kVerdictRejected));
  // The verdict ring wraps: epoch e lands in slot e % kVerdictRing.
  daemon.publishVerdict(k::kVerdictRing + 1, true);
  CHECK(client.memory()->verdict[1] == k::kVerdictRing + 1);

  daemon.publishDone(5);
  CHECK(client.doneEpoch(0) == 5);
  CHECK(client.doneEpoch(5) == 5);
}

TEST_CASE("control page: stream words compare cyclically, as cuStreamWaitValue32(GEQ) does") {
  k::ControlPage page = k::ControlPage::create("tandem-test-ctl");
  k::ControlPage stream = peerOf(page);
  stream.memory()->ready.value = 7;  // what the stream's WriteValue32(ready, 7) leaves
  CHECK(page.readyReached(7));
  CHECK(page.readyReached(6));
  CHECK_FALSE(page.readyReached(8));
  // Past 2^32 ops the 32-bit word wraps; epochs still compare by their low 32 bits.
  const uint64_t e = (uint64_t{1} << 32) + 3;
  stream.memory()->ready.value = 3;
  CHECK(page.readyReached(e));
  CHECK_FALSE(page.readyReached(e + 1));
  // done extends past the wrap: 0xffffffff -> 2 is 3 epochs on.
  stream.memory()->done.value = 0xffffffffu;
  const uint64_t before = page.doneEpoch(0xfffffff0u);
  CHECK(before == 0xffffffffu);
  stream.memory()->done.value = 2;
  CHECK(page.doneEpoch(before) == (uint64_t{1} << 32) + 2);
  // An older value (a late write behind an abort's lead) never moves it back.
  stream.memory()->done.value = 1;
  CHECK(page.doneEpoch((uint64_t{1} << 32) + 2) == (uint64_t{1} << 32) + 2);
}

TEST_CASE("control page: an abort releases every stream wait past the last epoch, and the lead is held") {
  k::ControlPage page = k::ControlPage::create("tandem-test-ctl");
  k::ControlPage client = peerOf(page);
  page.abortKernels();
  CHECK(client.memory()->abort == k::kAbortValue);
  CHECK(client.memory()->go.value == 0);  // kernels only: the streams are left alone

  const uint32_t lead = page.abort(41);
  CHECK(lead == 41 + k::kStreamAbortLead);
  CHECK(client.memory()->go.value == lead);
  CHECK(client.memory()->done.value == lead);
  CHECK(client.memory()->ready.value == lead);  // tandemd's own stream may wait on ready (an op launched ahead)
  // Every epoch the rank may have enqueued passes a cyclic GEQ against the lead.
  for (uint64_t e : {uint64_t{1}, uint64_t{41}, uint64_t{42}}) {
    CHECK(static_cast<int32_t>(lead - static_cast<uint32_t>(e)) >= 0);
  }
  // A kernel that finished after the abort wrote an older done: holdLead puts the lead back.
  client.memory()->done.value = 40;
  page.holdLead(lead);
  CHECK(client.memory()->done.value == lead);
  // libtandem's own abort (tandemd gone) writes the same words from its side.
  const uint32_t clientLead = client.abort(100);
  CHECK(page.memory()->done.value == 100 + k::kStreamAbortLead);
  CHECK(clientLead == 100 + k::kStreamAbortLead);
}

TEST_CASE("control page: a kernel's error report is read only once it is complete") {
  k::ControlPage page = k::ControlPage::create("tandem-test-ctl");
  k::ControlPage writer = peerOf(page);  // written through another mapping, as a kernel's stores arrive
  k::ErrorSlot& e = writer.memory()->error;
  e.claimed = k::kErrorSlotWriting;
  e.code = static_cast<uint32_t>(k::WaitError::kTimeout);
  e.expected = 9;
  CHECK_FALSE(page.failure().has_value());  // claimed, fields still being written
  e.observed = 4;
  e.claimed = k::kErrorSlotReady;
  const auto f = page.failure();
  REQUIRE(f.has_value());
  CHECK(f->code == static_cast<uint32_t>(k::WaitError::kTimeout));
  CHECK(f->expected == 9);
  CHECK(f->observed == 4);
}

TEST_CASE("control page: an op's data error is read for that op only, once published") {
  k::ControlPage page = k::ControlPage::create("tandem-test-ctl");
  k::ControlPage writer = peerOf(page);
  CHECK_FALSE(page.fault(5).has_value());
  k::OpFault& f = writer.memory()->faults[5 % k::kVerdictRing];
  f.code = static_cast<uint32_t>(k::WaitError::kMoeCapacity);
  f.atFault = 1;
  f.chunk = 64;
  f.observed = 70;
  CHECK_FALSE(page.fault(5).has_value());  // fields written, epoch not yet: not published
  f.epoch = 5;
  const auto got = page.fault(5);
  REQUIRE(got.has_value());
  CHECK(got->atFault == 1);
  CHECK(got->chunk == 64);
  CHECK(got->observed == 70);
  // The ring entry's next user (epoch 5 + ring) sees no fault of its own, and the ops around 5 see none either.
  CHECK_FALSE(page.fault(5 + k::kVerdictRing).has_value());
  CHECK_FALSE(page.fault(4).has_value());
  CHECK_FALSE(page.fault(6).has_value());
  // A data error is not the rank's error slot: the communicator's failure report stays empty.
  CHECK_FALSE(page.failure().has_value());
}

TEST_CASE("control page: libtandem refuses a page smaller than its layout") {
  k::ControlPage page = k::ControlPage::create("tandem-test-ctl");
  try {
    (void)k::ControlPage::open(tandem::Fd(::dup(page.fd())), sizeof(k::CommControl) - 1);
    FAIL("a short page was accepted");
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kProtocol);
    CHECK(std::string(e.what()).find("control page") != std::string::npos);
  }
}

TEST_CASE("executor strategies: wire names round-trip, and each runs the GPU ops") {
  for (k::Executor e : {k::Executor::kClient, k::Executor::kDaemon, k::Executor::kHost}) {
    const auto back = k::executorFromName(k::executorName(e));
    REQUIRE(back.has_value());
    CHECK(*back == e);
    const tandem::OpSet ops = k::executorOps(e);
    for (tandem::OpKind kind : {tandem::OpKind::kAgGemm, tandem::OpKind::kGemmRs, tandem::OpKind::kGemmAr,
                                tandem::OpKind::kAllGather, tandem::OpKind::kNop}) {
      CHECK(ops.contains(kind));
    }
    // The MoE ops run on one node's GPUs; host staging (ranks on several nodes) has no MoE code.
    CHECK(ops.contains(tandem::OpKind::kMoeDispatchGemm) == (e != k::Executor::kHost));
    CHECK(ops.contains(tandem::OpKind::kMoeDispatchFfnCombine) == (e != k::Executor::kHost));
    CHECK(ops.contains(tandem::OpKind::kRingAttention) == (e != k::Executor::kHost));  // one node's GPUs
  }
  CHECK_FALSE(k::executorFromName("gpu").has_value());
}

TEST_CASE("both GPU executors run every op of the table, each through its entry in gpu_ops.cpp") {
  for (const tandem::OpSpec& op : tandem::ops()) {
    CAPTURE(op.name);
    const k::GpuOp* entry = k::findGpuOp(op.kind);
    if (!op.cudaPending.empty()) {
      // An op the table marks as not on GPUs yet (OpSpec::cudaPending): no entry, and the refusal quotes the reason.
      MESSAGE(op.name, " is not on the cuda backend yet: ", op.cudaPending);
      CHECK_MESSAGE(entry == nullptr, op.name, " has an entry in kernels/gpu_ops.cpp: remove its cudaPending from the "
                                               "op table (common/src/op_spec.cpp)");
      CHECK_FALSE(k::executorOps(k::Executor::kClient).contains(op.kind));
      CHECK_FALSE(k::executorOps(k::Executor::kDaemon).contains(op.kind));
      const std::string refusal =
          tandem::unsupportedOpMessage("cuda", k::executorOps(k::Executor::kClient), op.kind);
      CHECK(refusal.find(std::string(op.cudaPending)) != std::string::npos);
      continue;
    }
    REQUIRE_MESSAGE(entry != nullptr, "the cuda backend has no entry for ", op.name,
                    " (kernels/gpu_ops.cpp): neither the client nor the daemon executor runs it; implement it, or "
                    "say why not yet with the op table's cudaPending");
    CHECK(k::executorOps(k::Executor::kDaemon).contains(op.kind));
    if (entry->clientPending != nullptr) {
      // The daemon executor runs it, the client executor not yet (GpuOp::clientPending): refused, quoting the reason.
      MESSAGE(op.name, " does not run with the client executor yet: ", entry->clientPending);
      CHECK(std::string_view(entry->clientPending).size() > 20);
      CHECK(entry->daemonRun == k::DaemonRun::kLaunchMapped);  // the only daemon route that needs no client launch
      CHECK_FALSE(k::executorOps(k::Executor::kClient).contains(op.kind));
      const std::string refusal = k::executorRefusal(k::Executor::kClient, op.kind);
      CHECK(refusal.find(entry->clientPending) != std::string::npos);
    } else {
      CHECK(k::executorOps(k::Executor::kClient).contains(op.kind));
      CHECK(k::executorRefusal(k::Executor::kClient, op.kind).find("With the client executor") == std::string::npos);
    }
    // An op with kernels either reads tandemd's verdict in them (the table's readsVerdict) or is aborted when rejected
    // (client_gate.cpp); a kernel that waits for go itself must read the verdict.
    if (entry->kernelWaitsForGo) CHECK(op.readsVerdict);
    if (entry->launch == nullptr) {
      CHECK(entry->daemonRun == k::DaemonRun::kWorkItem);  // no kernel: the daemon completes it (a barrier)
      CHECK(op.slotCount == 0);
    } else {
      CHECK((entry->preload != nullptr));  // never loaded lazily behind a waiting stream
      CHECK(op.deviceError == tandem::ErrorCode::kTimeout);  // its kernels wait on peers' flags with a deadline
    }
    if (entry->daemonRun == k::DaemonRun::kLaunchMapped) CHECK((entry->launchMapped != nullptr));
    CHECK(entry->fusedGemm == tandem::plannedOp(op.kind));
  }
}

TEST_CASE("checkCuda: success passes, an error throws Error(kCuda) naming what failed and the CUDA error") {
  CHECK_NOTHROW(k::checkCuda(cudaSuccess, "nothing {}", 1));
  CHECK_NOTHROW(k::checkCuda(CUDA_SUCCESS, "nothing"));
  try {
    k::checkCuda(cudaErrorInvalidValue, "cudaMalloc({} bytes) on GPU {}", 64, 3);
    FAIL("no throw");
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kCuda);
    const std::string what = e.what();
    CHECK(what.rfind("cudaMalloc(64 bytes) on GPU 3: cudaErrorInvalidValue", 0) == 0);
  }
}

TEST_CASE("control page: a replay's data error is taken once, and later ones while it is held only count") {
  k::ControlPage client = k::ControlPage::create("tandem-test-ctl");
  k::ControlPage kernels = peerOf(client);  // the replay's kernels write through the registration
  CHECK_FALSE(client.takeReplayFault().has_value());
  CHECK(client.replayFaultsDropped() == 0);
  k::OpFault& f = kernels.memory()->replayFault;
  f.code = static_cast<uint32_t>(k::WaitError::kMoeRouting);
  f.atFault = 1;
  f.chunk = 3;
  f.op = static_cast<uint32_t>(tandem::OpKind::kMoeDispatchGemm);
  f.observed = 99;
  CHECK_FALSE(client.takeReplayFault().has_value());  // fields written, epoch not yet: not published
  f.epoch = 7;
  const auto got = client.takeReplayFault();
  REQUIRE(got.has_value());
  CHECK(got->atFault == 1);
  CHECK(got->chunk == 3);
  CHECK(got->observed == 99);
  CHECK(f.epoch == 0);  // emptied: the next failed replay may report into it
  CHECK_FALSE(client.takeReplayFault().has_value());
  kernels.memory()->replayFaultsDropped = 2;
  CHECK(client.replayFaultsDropped() == 2);
  // Neither the communicator's failure report nor tandemd's per-op faults hold it.
  CHECK_FALSE(client.failure().has_value());
  CHECK_FALSE(client.fault(7).has_value());
}
