// Hostile clients of the engine and the cpu backend: wakeup channels a client blocks or floods, a completion ring
// never drained, memory pulled out from under a registration, a descriptor that asks for gigabytes of scratch with
// no data, one session holding every fd, half-joined communicators, a tenant holding every cpu worker, and ops of a
// session that leaves. Each attack runs against a real tandemd; then an honest client must still run a gemm-ar in
// normal time, the daemon's fds and RSS must come back near their baseline, and SIGTERM must still stop it
// (hostile.hpp).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>

#include <thread>

#include "harness.hpp"
#include "hostile.hpp"
#include "tandem/common/descriptor.hpp"
#include "tandem/common/ring.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;
namespace pb = tandem::v1;

namespace {

// A session spoken to by hand, as a hostile client would: Hello, then the ring and both wakeup ends it was given.
struct RawSession {
  tandem::Fd socket;
  tandem::Fd ringFd, submitWake, completionWake;
  tandem::Mapping ring;
  tandem::SessionRings rings;
  uint64_t nextSeq = 1;

  explicit RawSession(const std::string& path) : socket(rawConnect(path)) {
    sendAll(socket.get(), helloFrame());
    tandem::FrameDecoder decoder(1u << 20);
    pb::Response hello;
    REQUIRE(hello.ParseFromString(tandem::recvFrame(socket.get(), decoder, 5000)));
    REQUIRE(hello.status().code() == pb::STATUS_CODE_OK);
    ringFd = decoder.takeFd();
    submitWake = decoder.takeFd();
    completionWake = decoder.takeFd();
    ring = tandem::Mapping::shared(ringFd.get(), hello.hello().ring_bytes());
    rings = tandem::SessionRings::attach(ring.data(), ring.size());
  }

  // One request, its response (fds that come with it are dropped).
  pb::Response call(pb::Request& request) {
    static uint64_t rid = 100;
    request.set_request_id(++rid);
    sendAll(socket.get(), frameOf(request));
    const auto r = readResponse(socket.get(), 5000);
    REQUIRE(r.has_value());
    return *r;
  }

  uint64_t joinAlone() {
    pb::Request j;
    auto* join = j.mutable_join_comm();
    const tandem_unique_id_t id = tandem::uniqueId();
    join->set_unique_id(std::string(reinterpret_cast<const char*>(id.bytes), sizeof id.bytes));
    join->set_nranks(1);
    join->set_rank(0);
    const pb::Response r = call(j);
    REQUIRE(r.status().code() == pb::STATUS_CODE_OK);
    return r.join_comm().comm_handle();
  }

  // Pushes a barrier on `comm` into the ring (no completion is ever read) and rings the pump.
  bool pushBarrier(uint64_t comm) {
    tandem::OpDescriptor d{};
    d.version = tandem::kDescriptorVersion;
    d.kind = tandem::OpKind::kNop;
    d.nranks = 1;
    d.seq = nextSeq++;
    d.commHandle = comm;
    bool wake = false;
    if (!rings.submission.tryPush(d, wake)) return false;
    tandem::signalEventfd(submitWake.get());
    return true;
  }
};

void setBlocking(int fd) { REQUIRE(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0); }

}  // namespace

TEST_SUITE("hostile clients") {
  TEST_CASE("a client that blocks and floods its own wakeup channels cannot hang the daemon") {
    // Before: the completion eventfd was shared by fd; a client that saturated it and cleared O_NONBLOCK made the
    // pump block in write() under the engine lock, and only SIGKILL ended tandemd. The pump's eventfd was shared by
    // every session, so one client could also steal or delay everyone's wakeups.
    Daemon d(kFastLimits);
    const Baseline b = baseline(d);
    {
      RawSession evil(d.socket());
      const uint64_t comm = evil.joinAlone();
      // Flood what it may write, then make its ends blocking (O_NONBLOCK is per open file: only its own now).
      for (int fd : {evil.completionWake.get(), evil.submitWake.get()}) {
        const uint64_t junk = ~uint64_t{1};
        for (int i = 0; i < 100000 && ::send(fd, &junk, sizeof junk, MSG_DONTWAIT | MSG_NOSIGNAL) > 0; ++i) {
        }
        setBlocking(fd);
      }
      // Ops whose completions the daemon must post and signal while the client reads nothing.
      for (int i = 0; i < 300; ++i) evil.pushBarrier(comm);
      // While the attacker is still connected, an honest client runs at its normal speed.
      std::string error;
      const long ms = honestGemmAr(d.socket(), &error);
      INFO(error);
      CHECK(ms >= 0);
      CHECK(ms < 2000);
    }
    checkRecovered(d, b, "blocked and flooded wakeup channels");
  }

  TEST_CASE("a client that never drains its completion ring is closed at limits.max_pending_completions") {
    // Before: undelivered completions queued without bound (+349 MiB in 10 s).
    Daemon d(std::string(kFastLimits) + "  max_pending_completions: 64\nrings:\n  capacity: 64\n");
    const Baseline b = baseline(d);
    RawSession evil(d.socket());
    const uint64_t comm = evil.joinAlone();
    // 64 completions fill its ring, 64 more queue; the next one closes the session. Keep refilling the submission
    // ring until the daemon hangs up.
    bool closed = false;
    for (int round = 0; round < 200 && !closed; ++round) {
      while (evil.pushBarrier(comm)) {
      }
      closed = daemonHangsUp(evil.socket.get(), 20);
    }
    CHECK(closed);
    checkRecovered(d, b, "completion ring never drained");
  }

  TEST_CASE("a descriptor of empty tensors cannot make the cpu backend allocate gigabytes of scratch") {
    // Before: ring attention with seq 0, heads 1 and head_dim 2^26 passed validation (every tensor is 0 bytes), and
    // the cpu backend allocated and zeroed 4 GiB.
    Daemon d(kFastLimits);
    const Baseline b = baseline(d);
    {
      tandem::Session s(d.socket().c_str());
      tandem::Communicator comm(s, tandem::uniqueId(), 1, 0);
      tandem_ring_attention_args_t args{};
      args.struct_size = sizeof args;
      args.dtype = TANDEM_DTYPE_BF16;
      args.seq = 0;
      args.heads = 1;
      args.head_dim = uint64_t{1} << 26;
      tandem_op_t op;
      REQUIRE(tandem_ring_attention(comm.get(), &args, &op) == TANDEM_SUCCESS);
      CHECK(tandem_wait(op, 10000) == TANDEM_ERROR_INVALID_ARGUMENT);
      CHECK(std::string(tandem_last_error()).find("limits.max_scratch_bytes") != std::string::npos);
    }
    checkRecovered(d, b, "scratch amplification");
  }

  TEST_CASE("one session cannot hold every fd of the daemon: limits.max_fds_per_session") {
    // Before: about 1,000 small allocations of one session exhausted the daemon's 1,024 fds.
    Daemon d(std::string(kFastLimits) + "  max_fds_per_session: 16\n");
    const Baseline b = baseline(d);
    {
      tandem::Session s(d.socket().c_str());
      std::vector<tandem_buffer_t> held;
      tandem_buffer_t buf;
      tandem_status_t st = TANDEM_SUCCESS;
      for (int i = 0; i < 100 && (st = tandem_alloc(s.get(), 4096, &buf)) == TANDEM_SUCCESS; ++i) held.push_back(buf);
      CHECK(st == TANDEM_ERROR_OUT_OF_MEMORY);
      CHECK(std::string(tandem_last_error()).find("limits.max_fds_per_session") != std::string::npos);
      CHECK(held.size() == 16 - 3);  // the session's own three fds count too
      for (tandem_buffer_t h : held) CHECK(tandem_free(h) == TANDEM_SUCCESS);
      CHECK(tandem_alloc(s.get(), 4096, &buf) == TANDEM_SUCCESS);  // room again once freed
      CHECK(tandem_free(buf) == TANDEM_SUCCESS);
    }
    checkRecovered(d, b, "fds of one session");
  }

  TEST_CASE("half-joined communicators are capped per session: limits.max_joining_comms_per_session") {
    // Before: 30,000 half-joined communicators cost +1.6 GiB.
    Daemon d(std::string(kFastLimits) + "  max_joining_comms_per_session: 4\n");
    const Baseline b = baseline(d);
    {
      RawSession evil(d.socket());
      // Pipelined joins of 2-rank communicators whose second rank never comes.
      for (int i = 0; i < 5; ++i) {
        pb::Request j;
        j.set_request_id(1000 + static_cast<uint64_t>(i));
        auto* join = j.mutable_join_comm();
        const tandem_unique_id_t id = tandem::uniqueId();
        join->set_unique_id(std::string(reinterpret_cast<const char*>(id.bytes), sizeof id.bytes));
        join->set_nranks(2);
        join->set_rank(0);
        join->set_timeout_ms(60000);
        sendAll(evil.socket.get(), frameOf(j));
      }
      const auto refused = readResponse(evil.socket.get(), 5000);  // the fifth, at once; the others wait
      REQUIRE(refused.has_value());
      CHECK(refused->request_id() == 1004);
      CHECK(refused->status().code() == pb::STATUS_CODE_OUT_OF_MEMORY);
      CHECK(refused->status().message().find("limits.max_joining_comms_per_session") != std::string::npos);
    }
    checkRecovered(d, b, "half-joined communicators");
  }

  TEST_CASE("one tenant cannot hold every cpu worker: an honest small op runs beside its large ones") {
    // Before: two large fp32 ops occupied both workers, and an honest 4 KiB allgather waited for them.
    Daemon d(std::string("daemon:\n  worker_threads: 2\n") + kFastLimits);
    tandem::Session heavy(d.socket().c_str());
    // Two communicators: ops of one communicator run one at a time anyway, so a tenant needs two to take two workers.
    tandem::Communicator comm1(heavy, tandem::uniqueId(), 1, 0), comm2(heavy, tandem::uniqueId(), 1, 0);
    const uint64_t m = 1024, n = 1024, k = 1024;
    tandem::Buffer a(heavy, m * k * 4), bb(heavy, n * k * 4), c1(heavy, m * n * 4), c2(heavy, m * n * 4);
    std::memset(a.data(), 0, a.size());
    std::memset(bb.data(), 0, bb.size());
    tandem_gemm_ar_args_t big1{sizeof big1, TANDEM_DTYPE_FP32, m, n, k, a.tensor(), bb.tensor(), c1.tensor(), nullptr};
    tandem_gemm_ar_args_t big2 = big1;
    big2.c = c2.tensor();
    tandem_op_t op1, op2;
    REQUIRE(tandem_gemm_ar(comm1.get(), &big1, &op1) == TANDEM_SUCCESS);
    REQUIRE(tandem_gemm_ar(comm2.get(), &big2, &op2) == TANDEM_SUCCESS);

    tandem::Session honest(d.socket().c_str());
    tandem::Communicator honestComm(honest, tandem::uniqueId(), 1, 0);
    tandem::Buffer buf(honest, 8192);
    tandem_allgather_args_t ag{sizeof ag, {buf.get(), 0}, {buf.get(), 4096}, 4096, nullptr};
    tandem_op_t small;
    REQUIRE(tandem_allgather(honestComm.get(), &ag, &small) == TANDEM_SUCCESS);
    CHECK(tandem_wait(small, 20000) == TANDEM_SUCCESS);
    // The honest op got the second worker: neither large op had to finish first (each runs for a good part of a
    // second; the tenant's share is one worker, so its second op still waits).
    CHECK(tandem_op_status(op1, nullptr, 0) == TANDEM_IN_PROGRESS);
    CHECK(tandem_op_status(op2, nullptr, 0) == TANDEM_IN_PROGRESS);
    for (tandem_op_t op : {op1, op2}) CHECK(tandem_wait(op, 60000) == TANDEM_SUCCESS);
  }

  TEST_CASE("ops of a session that disconnects are cancelled where they have not started") {
    Daemon d(std::string("daemon:\n  worker_threads: 1\n") + kFastLimits);
    const Baseline b = baseline(d);
    {
      RawSession evil(d.socket());
      // Large fp32 gemm-ar on a single rank, queued back to back, then the client leaves: one may be running, the
      // rest must not run (the daemon would otherwise burn a core for nobody).
      pb::Request alloc;
      alloc.mutable_allocate()->set_bytes(uint64_t{3} * 1024 * 1024 * 4);
      const pb::Response r = evil.call(alloc);
      REQUIRE(r.status().code() == pb::STATUS_CODE_OK);
      const uint64_t buffer = r.allocate().buffer_id();
      // One op per communicator, so that each reaches the worker queue at once (ops of one communicator would
      // wait in the engine's per-rank queue instead, which a departing session empties already).
      constexpr uint64_t kDim = 1024;
      for (int i = 0; i < 16; ++i) {
        const uint64_t comm = evil.joinAlone();
        tandem::OpDescriptor desc{};
        desc.version = tandem::kDescriptorVersion;
        desc.kind = tandem::OpKind::kGemmAr;
        desc.dtype = tandem::DType::kF32;
        desc.nranks = 1;
        desc.seq = evil.nextSeq++;
        desc.commHandle = comm;
        desc.dims[0] = desc.dims[1] = desc.dims[2] = kDim;
        for (uint64_t s = 0; s < 3; ++s) desc.bufs[s] = {buffer, s * kDim * kDim * 4, kDim * kDim * 4};
        bool wake = false;
        REQUIRE(evil.rings.submission.tryPush(desc, wake));
      }
      tandem::signalEventfd(evil.submitWake.get());
    }
    // The 16 would keep the one worker busy for about 4 s; cancelled, the honest op gets through in its normal time.
    checkRecovered(d, b, "ops of a departed session");
  }
}
