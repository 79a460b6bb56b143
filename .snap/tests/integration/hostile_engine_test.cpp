// Hostile clients of the engine and the cpu backend: wakeup channels a client blocks or floods, a completion ring
// never drained, memory pulled out from under a registration, a descriptor that asks for gigabytes of scratch with
// no data, one session holding every fd, half-joined communicators, a tenant holding every cpu worker, and ops of a
// session that leaves. Each attack runs against a real tandemd; then an honest client must still run a gemm-ar in
// normal time, the daemon's fds and RSS must come back near their baseline, and SIGTERM must still stop it
// (hostile.hpp).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>

#include <cstdio>
#include <thread>

#include "gemm_args.hpp"
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

  // The first GPU's UUID from QueryStatus: the cuda backend needs each rank's GPU to join ("" on cpu).
  std::string firstGpu() {
    pb::Request q;
    q.mutable_query_status();
    const pb::Response r = call(q);
    return r.status_reply().gpus_size() > 0 ? r.status_reply().gpus(0).uuid() : std::string();
  }

  pb::Request joinRequest(uint32_t nranks, const std::string& device, uint32_t timeoutMs = 0) {
    pb::Request j;
    auto* join = j.mutable_join_comm();
    const tandem_unique_id_t id = tandem::uniqueId();
    join->set_unique_id(std::string(reinterpret_cast<const char*>(id.bytes), sizeof id.bytes));
    join->set_nranks(nranks);
    join->set_rank(0);
    join->set_timeout_ms(timeoutMs);
    join->set_device_uuid(device);
    return j;
  }

  uint64_t joinAlone(const std::string& device = {}) {
    pb::Request j = joinRequest(1, device);
    const pb::Response r = call(j);
    INFO(r.status().message());
    REQUIRE(r.status().code() == pb::STATUS_CODE_OK);
    return r.join_comm().comm_handle();
  }

  bool push(tandem::OpDescriptor d) {
    d.version = tandem::kDescriptorVersion;
    d.seq = nextSeq++;
    bool wake = false;
    if (!rings.submission.tryPush(d, wake)) return false;
    tandem::signalEventfd(submitWake.get());
    return true;
  }

  // Pushes a barrier on `comm` into the ring (no completion is ever read) and rings the pump.
  bool pushBarrier(uint64_t comm) {
    tandem::OpDescriptor d{};
    d.kind = tandem::OpKind::kNop;
    d.nranks = 1;
    d.commHandle = comm;
    return push(d);
  }

  // The completion of op `seq` within timeoutMs (earlier ones are dropped); nullopt if none came.
  std::optional<tandem::Completion> completionOf(uint64_t seq, int timeoutMs) {
    std::optional<tandem::Completion> found;
    eventually(
        [&] {
          tandem::Completion c;
          while (rings.completion.tryPop(c) == decltype(rings.completion)::Pop::kItem) {
            // The op's own record, not the continuations of a long message after it.
            if (c.seq == seq && c.status != tandem::kCompletionContinues && !found) found = c;
          }
          return found.has_value();
        },
        timeoutMs);
    return found;
  }
};

// Where the cuda backend would wait for a client's stream (which a raw client has none of), the flood uses ops that
// admission refuses (no such communicator): their completions are posted and signalled at once all the same.
constexpr uint64_t kNoComm = 0;

uint64_t floodComm(RawSession& s) { return onCuda() ? kNoComm : s.joinAlone(); }

void setBlocking(int fd) { REQUIRE(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0); }

}  // namespace

// Attacks that reach paths every backend shares (wakeups, completions, admission, registration, fds, rendezvous).
// TANDEM_HOSTILE_BACKEND=cuda runs them against a cuda tandemd (`scripts/gpu-check.sh hostile`).
TEST_SUITE("hostile clients (any backend)") {
  TEST_CASE("a client that blocks and floods its own wakeup channels cannot hang the daemon") {
    // Before: the completion eventfd was shared by fd; a client that saturated it and cleared O_NONBLOCK made the
    // pump block in write() under the engine lock, and only SIGKILL ended tandemd. The pump's eventfd was shared by
    // every session, so one client could also steal or delay everyone's wakeups.
    Daemon d(backendYaml() + kFastLimits, {}, hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    {
      RawSession evil(d.socket());
      const uint64_t comm = floodComm(evil);
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
      const long ms = honestOp(d.socket(), hostileBackend(), &error);
      INFO(error);
      CHECK(ms >= 0);
      CHECK(ms < std::max<long>(2000, 3 * b.honestMs));
    }
    checkRecovered(d, b, "blocked and flooded wakeup channels");
  }

  TEST_CASE("a client that never drains its completion ring is closed at limits.max_pending_completions") {
    // Before: undelivered completions queued without bound (+349 MiB in 10 s).
    Daemon d(backendYaml() + kFastLimits + "  max_pending_completions: 64\nrings:\n  capacity: 64\n", {},
             hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    RawSession evil(d.socket());
    const uint64_t comm = floodComm(evil);
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

  TEST_CASE("descriptors with huge shapes are refused, whatever their dims multiply to") {
    // Shapes whose extents overflow 64 bits or ask for gigabytes of work with no data: each must complete with an
    // error (validation, the backend's op set or its scratch cap), never run, allocate or crash.
    Daemon d(backendYaml() + kFastLimits, {}, hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    {
      RawSession evil(d.socket());
      const std::string device = evil.firstGpu();
      constexpr uint64_t kHuge = uint64_t{1} << 40, kTop = uint64_t{1} << 63;
      struct Shape {
        const char* what;
        tandem::OpKind kind;
        std::array<uint64_t, 3> dims;
      };
      const Shape shapes[] = {
          {"gemm-ar 2^40 cubed", tandem::OpKind::kGemmAr, {kHuge, kHuge, kHuge}},
          {"gemm-rs m*k wrapping to 0", tandem::OpKind::kGemmRs, {kTop, 2, 1}},
          {"ag-gemm 2^63 rows", tandem::OpKind::kAgGemm, {kTop, 1, 1}},
          {"allgather 2^62 bytes", tandem::OpKind::kAllGather, {uint64_t{1} << 62, 0, 0}},
          {"ring attention of empty tensors, head_dim 2^26", tandem::OpKind::kRingAttention, {0, 1, uint64_t{1} << 26}},
          {"ring attention 2^32 x 2^32", tandem::OpKind::kRingAttention, {uint64_t{1} << 32, uint64_t{1} << 32, 128}},
      };
      for (const Shape& shape : shapes) {
        CAPTURE(shape.what);
        tandem::OpDescriptor desc{};
        desc.kind = shape.kind;
        desc.dtype = tandem::DType::kBF16;
        desc.nranks = 1;
        // A communicator per shape: on cuda a refused fused GEMM aborts its communicator (its stream cannot skip
        // the op), which would answer every later shape with that abort instead of its own check.
        desc.commHandle = evil.joinAlone(device);
        for (std::size_t i = 0; i < 3; ++i) desc.dims[i] = shape.dims[i];
        const uint64_t seq = evil.nextSeq;
        REQUIRE(evil.push(desc));
        const auto c = evil.completionOf(seq, 5000);
        REQUIRE(c.has_value());
        const std::string message(c->message, std::min<std::size_t>(c->messageLen, sizeof c->message));
        MESSAGE(std::string(shape.what) << ": status " << c->status << ": " << message);
        CHECK(c->status != TANDEM_SUCCESS);
        CHECK(!message.empty());
      }
    }
    checkRecovered(d, b, "huge shapes");
  }

  TEST_CASE("registrations of fds that are not the backend's memory are refused: unsealed, shrunk, files, pipes") {
    // Before: a registered memfd shrunk after registration killed tandemd with SIGBUS, and regular files were
    // accepted. Each fd goes in as a host memfd and as a cuMem fd (the cuda backend imports those), raw, as a
    // hostile client would send it.
    Daemon d(backendYaml() + kFastLimits, {}, hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    {
      RawSession evil(d.socket());
      const std::string device = evil.firstGpu();
      constexpr uint64_t kBytes = 1 << 16;
      struct Candidate {
        const char* what;
        tandem::Fd fd;
      };
      std::vector<Candidate> fds;
      {
        tandem::Fd unsealed(::memfd_create("hostile-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
        REQUIRE(::ftruncate(unsealed.get(), kBytes) == 0);
        fds.push_back({"an unsealed memfd", std::move(unsealed)});
        tandem::Fd shrunk(::memfd_create("hostile-shrunk", MFD_CLOEXEC | MFD_ALLOW_SEALING));
        REQUIRE(::ftruncate(shrunk.get(), kBytes) == 0);
        REQUIRE(::ftruncate(shrunk.get(), 0) == 0);
        fds.push_back({"a memfd shrunk to 0 bytes", std::move(shrunk)});
        FILE* f = std::tmpfile();
        REQUIRE(f != nullptr);
        REQUIRE(::ftruncate(::fileno(f), kBytes) == 0);
        fds.push_back({"a regular file", tandem::Fd(::dup(::fileno(f)))});
        std::fclose(f);
        int p[2];
        REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
        ::close(p[1]);
        fds.push_back({"a pipe", tandem::Fd(p[0])});
      }
      uint64_t requestId = 5000;
      for (const auto& candidate : fds) {
        for (const auto kind : {pb::REGISTER_KIND_MEMFD, pb::REGISTER_KIND_CUDA_FD}) {
          CAPTURE(candidate.what);
          CAPTURE(pb::RegisterKind_Name(kind));
          pb::Request reg;
          reg.set_request_id(++requestId);
          reg.mutable_register_buffer()->set_kind(kind);
          reg.mutable_register_buffer()->set_bytes(kBytes);
          reg.mutable_register_buffer()->set_device_uuid(device);
          REQUIRE(sendWithFds(evil.socket.get(), frameOf(reg), {candidate.fd.get()}));
          const auto r = readResponse(evil.socket.get(), 10000);
          REQUIRE(r.has_value());
          MESSAGE(std::string(candidate.what) << " as " << pb::RegisterKind_Name(kind) << ": "
                                              << r->status().message());
          CHECK(r->status().code() != pb::STATUS_CODE_OK);
          if (!onCuda() && kind == pb::REGISTER_KIND_MEMFD && std::string(candidate.what) == "an unsealed memfd") {
            CHECK(r->status().message().find("F_SEAL_SHRINK") != std::string::npos);
          }
        }
      }
      // The connection is still served.
      pb::Request q;
      q.mutable_query_status();
      CHECK(evil.call(q).status().code() == pb::STATUS_CODE_OK);
    }
    checkRecovered(d, b, "registrations of unsealed, shrunk, file and pipe fds");
  }

  TEST_CASE("one session cannot hold every fd of the daemon: limits.max_fds_per_session") {
    // Before: about 1,000 small allocations of one session exhausted the daemon's 1,024 fds.
    Daemon d(backendYaml() + kFastLimits + "  max_fds_per_session: 16\n", {}, hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    // In a child: with the cuda backend, tandem_alloc initialises CUDA, which the test process must not.
    const std::string outcome = inChild([&]() -> std::string {
      if (onCuda() && cudaSetDeviceZero() != 0) return "cudaSetDevice(0) failed";
      tandem::Session s(d.socket().c_str());
      std::vector<tandem_buffer_t> held;
      tandem_buffer_t buf;
      tandem_status_t st = TANDEM_SUCCESS;
      for (int i = 0; i < 100 && (st = tandem_alloc(s.get(), 4096, &buf)) == TANDEM_SUCCESS; ++i) held.push_back(buf);
      const std::string message = tandem_last_error();
      std::string out = fmt::format("{} {} | {}", static_cast<int>(st), held.size(), message);
      for (tandem_buffer_t h : held) {
        if (tandem_free(h) != TANDEM_SUCCESS) return "tandem_free failed: " + std::string(tandem_last_error());
      }
      // Room again once freed.
      if (tandem_alloc(s.get(), 4096, &buf) != TANDEM_SUCCESS) return "no room after freeing: " + out;
      tandem_free(buf);
      return out;
    });
    INFO(outcome);
    // Refused once the session's own three fds and 13 buffers' fds reach the cap, naming it.
    CHECK(outcome.rfind(fmt::format("{} {} | ", static_cast<int>(TANDEM_ERROR_OUT_OF_MEMORY), 16 - 3), 0) == 0);
    CHECK(outcome.find("limits.max_fds_per_session") != std::string::npos);
    checkRecovered(d, b, "fds of one session");
  }

  TEST_CASE("half-joined communicators are capped per session: limits.max_joining_comms_per_session") {
    // Before: 30,000 half-joined communicators cost +1.6 GiB.
    Daemon d(backendYaml() + kFastLimits + "  max_joining_comms_per_session: 4\n", {}, hostileBackend());
    INFO("tandemd log (on failure):\n" << d.log());
    const Baseline b = baseline(d, hostileBackend());
    {
      RawSession evil(d.socket());
      const std::string device = evil.firstGpu();
      // Pipelined joins of 2-rank communicators whose second rank never comes.
      for (int i = 0; i < 5; ++i) {
        pb::Request j = evil.joinRequest(2, device, 60000);
        j.set_request_id(1000 + static_cast<uint64_t>(i));
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

}

// The cpu backend's own bounds: scratch, its worker share, cancelling a departed session's queued ops.
TEST_SUITE("hostile clients") {
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

  TEST_CASE("one tenant cannot hold every cpu worker: an honest small op runs beside its large ones") {
    // Before: two large fp32 ops occupied both workers, and an honest 4 KiB allgather waited for them.
    Daemon d(std::string("daemon:\n  worker_threads: 2\n") + kFastLimits);
    tandem::Session heavy(d.socket().c_str());
    // Two communicators: ops of one communicator run one at a time anyway, so a tenant needs two to take two workers.
    tandem::Communicator comm1(heavy, tandem::uniqueId(), 1, 0), comm2(heavy, tandem::uniqueId(), 1, 0);
    const uint64_t m = kBusyGemmDim, n = kBusyGemmDim, k = kBusyGemmDim;
    tandem::Buffer a(heavy, m * k * 4), bb(heavy, n * k * 4), c1(heavy, m * n * 4), c2(heavy, m * n * 4);
    std::memset(a.data(), 0, a.size());
    std::memset(bb.data(), 0, bb.size());
    const auto big1 =
        gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_FP32, m, n, k, a.tensor(), bb.tensor(), c1.tensor(), nullptr);
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
      alloc.mutable_allocate()->set_bytes(3 * kBusyGemmDim * kBusyGemmDim * 4);
      const pb::Response r = evil.call(alloc);
      REQUIRE(r.status().code() == pb::STATUS_CODE_OK);
      const uint64_t buffer = r.allocate().buffer_id();
      // One op per communicator, so that each reaches the worker queue at once (ops of one communicator would
      // wait in the engine's per-rank queue instead, which a departing session empties already).
      constexpr uint64_t kDim = kBusyGemmDim;
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
