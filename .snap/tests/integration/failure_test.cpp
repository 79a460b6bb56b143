// Failure handling: dead ranks, a dead daemon, invalid descriptors, ring overflow, aborts and timeouts.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <thread>

#include "gemm_args.hpp"
#include "harness.hpp"
#include "session.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;
using tandem::ErrorCode;
using tandem::OpDescriptor;
using tandem::OpKind;

namespace {

// Runs `body` in a forked child; the child's status code is written to the returned pipe as text.
struct Child {
  pid_t pid;
  int fd;
  std::string read(int timeoutMs) {
    std::string out;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (Clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[512];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
      if (out.find('\n') != std::string::npos) break;
    }
    return out;
  }
  void reap() {
    ::close(fd);
    ::waitpid(pid, nullptr, 0);
  }
};

Child spawn(const std::function<std::string(int outFd)>& body) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    const std::string result = body(p[1]) + "\n";
    [[maybe_unused]] ssize_t n = ::write(p[1], result.data(), result.size());
    std::_Exit(0);
  }
  ::close(p[1]);
  return {pid, p[0]};
}

void say(int fd, const std::string& s) { [[maybe_unused]] ssize_t n = ::write(fd, (s + "\n").data(), s.size() + 1); }

// One rank of an ag-gemm on the C API: join, allocate, submit, tell the parent, wait. Returns "<status> <message>".
std::string agGemmRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                       int outFd, bool submitOp) {
  tandem_session_t s;
  if (tandem_connect(socket.c_str(), &s) != TANDEM_SUCCESS) return "connect-failed";
  tandem_comm_t comm;
  if (tandem_comm_init(s, &id, nranks, rank, 10000, &comm) != TANDEM_SUCCESS) return "join-failed";
  const uint64_t m = 16, n = 8, k = 8;
  tandem_buffer_t a, b, c;
  tandem_alloc(s, tandem::rowsOf(m, rank, nranks) * k * 2, &a);
  tandem_alloc(s, n * k * 2, &b);
  tandem_alloc(s, m * n * 2, &c);
  if (!submitOp) {
    say(outFd, "joined");
    ::pause();
  }
  const auto args = agGemmArgs(TANDEM_DTYPE_BF16, m, n, k, {a, 0}, {b, 0}, {c, 0}, {nullptr, 0}, nullptr);
  tandem_op_t op;
  if (tandem_ag_gemm(comm, &args, &op) != TANDEM_SUCCESS) return std::string("submit-failed ") + tandem_last_error();
  say(outFd, "submitted");
  const auto t0 = Clock::now();
  const tandem_status_t st = tandem_wait(op, 30000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  return fmt::format("{} {} ms {}", static_cast<int>(st), ms, tandem_last_error());
}

// Raw access below the C API, to hand the daemon descriptors the client library would refuse.
struct RawRank {
  std::unique_ptr<tandem::client::Session> session;
  uint64_t comm = 0;
  explicit RawRank(const std::string& socket) : session(tandem::client::Session::connect(socket)) {}
  uint64_t join(const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank) {
    tandem::v1::Request r;
    r.mutable_join_comm()->set_unique_id(std::string(reinterpret_cast<const char*>(id.bytes), 16));
    r.mutable_join_comm()->set_nranks(nranks);
    r.mutable_join_comm()->set_rank(rank);
    r.mutable_join_comm()->set_timeout_ms(10000);
    comm = session->call(r).join_comm().comm_handle();
    return comm;
  }
  std::pair<uint64_t, tandem::Mapping> alloc(uint64_t bytes) {
    tandem::v1::Request r;
    r.mutable_allocate()->set_bytes(bytes);
    std::vector<tandem::Fd> fds;
    const uint64_t id = session->call(r, {}, &fds, 1).allocate().buffer_id();
    return {id, tandem::Mapping::shared(fds[0].get(), bytes)};
  }
  tandem::client::OpResult run(OpDescriptor d) {
    return session->wait(session->submit(d), 10000);
  }
};

}  // namespace

TEST_CASE("a rank killed mid-op: every other rank gets PEER_LOST within the deadline, and the daemon recovers") {
  Daemon d;  // default communicators.peer_lost_deadline_ms: 2000
  const tandem_unique_id_t id = tandem::uniqueId();
  const uint32_t nranks = 4;
  std::vector<Child> survivors;
  Child victim = spawn([&](int fd) { return agGemmRank(d.socket(), id, nranks, 0, fd, false); });
  for (uint32_t r = 1; r < nranks; ++r) {
    survivors.push_back(spawn([&, r](int fd) { return agGemmRank(d.socket(), id, nranks, r, fd, true); }));
  }
  REQUIRE(victim.read(15000).find("joined") != std::string::npos);
  for (auto& s : survivors) REQUIRE(s.read(15000).find("submitted") != std::string::npos);
  REQUIRE(eventually([&] { return daemonStatus(d)["total_buffers"] == 12; }));

  const auto killedAt = Clock::now();
  ::kill(victim.pid, SIGKILL);
  for (auto& s : survivors) {
    const std::string result = s.read(5000);
    INFO(result);
    CHECK(result.rfind(std::to_string(TANDEM_ERROR_PEER_LOST) + " ", 0) == 0);
    CHECK(result.find("ended") != std::string::npos);
  }
  CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count() < 2000);
  victim.reap();
  for (auto& s : survivors) s.reap();

  // The dead session's memory is gone (the survivors exited too), and new communicators work.
  CHECK(eventually([&] { return daemonStatus(d)["total_bytes"] == 0 && daemonStatus(d)["communicators"].empty(); }));
  int code = 1;
  const std::string out = d.ctl({"run", "ag-gemm", "--ranks", "2", "--m", "8", "--n", "8", "--k", "8", "--check"}, &code);
  INFO(out);
  CHECK(code == 0);
}

TEST_CASE("a rank whose connection outlives it (inherited by a forked child) is still reported lost") {
  Daemon d;
  const tandem_unique_id_t id = tandem::uniqueId();
  // The victim joins, then forks a child that inherits (and keeps) its connection, and reports the child's pid.
  Child victim = spawn([&](int fd) {
    tandem_session_t s;
    tandem_comm_t comm;
    if (tandem_connect(d.socket().c_str(), &s) != TANDEM_SUCCESS) return std::string("connect-failed");
    if (tandem_comm_init(s, &id, 2, 0, 10000, &comm) != TANDEM_SUCCESS) return std::string("join-failed");
    const pid_t holder = ::fork();
    if (holder == 0) {
      ::pause();
      std::_Exit(0);
    }
    say(fd, "joined " + std::to_string(holder));
    ::pause();
    return std::string("unreachable");
  });
  Child survivor = spawn([&](int fd) {
    tandem_session_t s;
    tandem_comm_t comm;
    if (tandem_connect(d.socket().c_str(), &s) != TANDEM_SUCCESS) return std::string("connect-failed");
    if (tandem_comm_init(s, &id, 2, 1, 10000, &comm) != TANDEM_SUCCESS) return std::string("join-failed");
    tandem_op_t op;
    if (tandem_barrier(comm, &op) != TANDEM_SUCCESS) return std::string("submit-failed");
    say(fd, "submitted");
    return fmt::format("{} {}", static_cast<int>(tandem_wait(op, 30000)), tandem_last_error());
  });
  const std::string joined = victim.read(15000);
  REQUIRE(joined.rfind("joined ", 0) == 0);
  const pid_t holder = static_cast<pid_t>(std::stol(joined.substr(7)));
  REQUIRE(survivor.read(15000).find("submitted") != std::string::npos);
  const auto killedAt = Clock::now();
  ::kill(victim.pid, SIGKILL);
  const std::string result = survivor.read(5000);
  INFO(result);
  CHECK(result.rfind(std::to_string(TANDEM_ERROR_PEER_LOST) + " ", 0) == 0);
  CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count() < 2000);
  ::kill(holder, SIGKILL);
  victim.reap();
  survivor.reap();
}

TEST_CASE("a daemon killed with SIGKILL: waits and calls return DAEMON_LOST promptly") {
  auto d = std::make_unique<Daemon>();
  const tandem_unique_id_t id = tandem::uniqueId();
  // Rank 1 joins and sleeps, so rank 0's op stays pending until the daemon dies.
  Child other = spawn([&](int fd) { return agGemmRank(d->socket(), id, 2, 1, fd, false); });
  Child waiter = spawn([&](int fd) { return agGemmRank(d->socket(), id, 2, 0, fd, true); });
  REQUIRE(other.read(15000).find("joined") != std::string::npos);
  REQUIRE(waiter.read(15000).find("submitted") != std::string::npos);
  const auto killedAt = Clock::now();
  d->signal(SIGKILL);
  const std::string result = waiter.read(5000);
  INFO(result);
  CHECK(result.rfind(std::to_string(TANDEM_ERROR_DAEMON_LOST) + " ", 0) == 0);
  CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count() < 2000);
  ::kill(other.pid, SIGKILL);
  other.reap();
  waiter.reap();

  // A later call on a session whose daemon died fails the same way, without hanging.
  auto d2 = std::make_unique<Daemon>();
  tandem_session_t s;
  REQUIRE(tandem_connect(d2->socket().c_str(), &s) == TANDEM_SUCCESS);
  d2->signal(SIGKILL);
  REQUIRE(d2->waitExit(5000) == -SIGKILL);
  tandem_buffer_t b;
  CHECK(tandem_alloc(s, 64, &b) == TANDEM_ERROR_DAEMON_LOST);
  tandem_disconnect(s);
}

TEST_CASE("invalid descriptors are rejected, name the field, and write nothing") {
  Daemon d;
  RawRank me(d.socket());
  me.join(tandem::uniqueId(), 1, 0);
  RawRank stranger(d.socket());
  auto [strangerBuf, strangerMap] = stranger.alloc(4096);

  tandem::reference::OpShape shape;
  shape.kind = OpKind::kAgGemm;
  shape.dtype = tandem::DType::kF32;
  shape.m = 4, shape.n = 4, shape.k = 4;
  OpDescriptor good = tandem::reference::makeDescriptor(shape, 0, 1);
  good.commHandle = me.comm;
  std::vector<std::pair<uint64_t, tandem::Mapping>> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(me.alloc(64));
    good.bufs[i].bufferId = bufs.back().first;
  }
  good.bufs[3] = {};  // no gathered A
  std::memset(bufs[2].second.data(), 0x77, 64);
  CHECK(me.run(good).code == ErrorCode::kOk);  // the baseline is valid
  std::memset(bufs[2].second.data(), 0x77, 64);

  auto expectRejected = [&](OpDescriptor desc, ErrorCode code, const char* mentions) {
    const auto r = me.run(desc);
    CAPTURE(mentions);
    INFO(r.message);
    CHECK(r.code == code);
    CHECK(r.message.find(mentions) != std::string::npos);
    const auto* out = reinterpret_cast<const unsigned char*>(bufs[2].second.data());
    CHECK(std::all_of(out, out + 64, [](unsigned char c) { return c == 0x77; }));
  };
  OpDescriptor bad = good;
  bad.bufs[2].bufferId = 999999;
  expectRejected(bad, ErrorCode::kInvalidArgument, "not a buffer of this session");
  bad = good;
  bad.bufs[2].bufferId = strangerBuf;
  expectRejected(bad, ErrorCode::kInvalidArgument, "not a buffer of this session");
  bad = good;
  bad.bufs[2].offset = 16;  // 64 bytes from offset 16 overflow the 64-byte buffer
  expectRejected(bad, ErrorCode::kInvalidArgument, "holds 64 bytes");
  bad = good;
  bad.dims[1] = 5;  // shape no longer matches the claimed extents
  expectRejected(bad, ErrorCode::kInvalidArgument, "b");
  bad = good;
  bad.dtype = tandem::DType::kI32;
  expectRejected(bad, ErrorCode::kInvalidArgument, "int32");
  bad = good;
  bad.rank = 1;
  expectRejected(bad, ErrorCode::kInvalidArgument, "rank");
  bad = good;
  bad.nranks = 2;
  expectRejected(bad, ErrorCode::kInvalidArgument, "nranks");
  bad = good;
  bad.kind = static_cast<OpKind>(99);
  expectRejected(bad, ErrorCode::kInvalidArgument, "kind");
  bad = good;
  bad.version = 7;
  expectRejected(bad, ErrorCode::kInvalidArgument, "version");
  bad = good;
  bad.commHandle = 424242;
  expectRejected(bad, ErrorCode::kNotFound, "communicator handle");

  // A destroyed communicator.
  tandem::v1::Request destroy;
  destroy.mutable_destroy_comm()->set_comm_handle(me.comm);
  me.session->call(destroy);
  expectRejected(good, ErrorCode::kNotFound, "communicator handle");

  // The daemon kept serving throughout.
  CHECK(!d.exited());
}

TEST_CASE("a bad descriptor on one rank fails the collective on every rank, and they stay in step") {
  Daemon d;
  const tandem_unique_id_t id = tandem::uniqueId();
  RawRank r0(d.socket()), r1(d.socket());
  std::thread j([&] { r1.join(id, 2, 1); });
  r0.join(id, 2, 0);
  j.join();
  OpDescriptor barrier{};
  barrier.version = tandem::kDescriptorVersion;
  barrier.kind = OpKind::kNop;
  barrier.nranks = 2;
  OpDescriptor b0 = barrier, b1 = barrier;
  b0.commHandle = r0.comm, b0.rank = 0;
  b1.commHandle = r1.comm, b1.rank = 1;
  OpDescriptor broken = b1;
  broken.dims[0] = 5;  // nop takes no dims
  const uint64_t s0 = r0.session->submit(b0), s1 = r1.session->submit(broken);
  const auto e0 = r0.session->wait(s0, 10000), e1 = r1.session->wait(s1, 10000);
  CHECK(e0.code == ErrorCode::kInvalidArgument);
  CHECK(e0.message.find("another rank") != std::string::npos);
  CHECK(e1.code == ErrorCode::kInvalidArgument);
  // The next pair of barriers matches up and succeeds.
  const uint64_t n0 = r0.session->submit(b0), n1 = r1.session->submit(b1);
  CHECK(r0.session->wait(n0, 10000).code == ErrorCode::kOk);
  CHECK(r1.session->wait(n1, 10000).code == ErrorCode::kOk);
}

TEST_CASE("a full submission ring pushes back with RING_FULL and loses nothing") {
  Daemon d("rings:\n  capacity: 8\n");
  ::setenv("TANDEM_SUBMIT_TIMEOUT_MS", "200", 1);
  tandem::Session s0(d.socket().c_str()), s1(d.socket().c_str());
  ::unsetenv("TANDEM_SUBMIT_TIMEOUT_MS");
  const tandem_unique_id_t id = tandem::uniqueId();
  std::unique_ptr<tandem::Communicator> c1;
  std::thread j([&] { c1 = std::make_unique<tandem::Communicator>(s1, id, 2, 1, 10000); });
  tandem::Communicator c0(s0, id, 2, 0, 10000);
  j.join();
  // Rank 0 races ahead with barriers that rank 1 has not reached.
  std::vector<tandem_op_t> ops;
  tandem_status_t st = TANDEM_SUCCESS;
  while (ops.size() < 1000) {
    tandem_op_t op;
    st = tandem_barrier(c0.get(), &op);
    if (st != TANDEM_SUCCESS) break;
    ops.push_back(op);
  }
  CHECK(st == TANDEM_ERROR_RING_FULL);
  CHECK(std::string(tandem_last_error()).find("nothing was submitted") != std::string::npos);
  CHECK(ops.size() >= 8);
  CHECK(ops.size() <= 16);  // ring capacity plus what the daemon holds per session
  // Rank 1 catches up: every accepted op completes.
  std::vector<tandem_op_t> theirs(ops.size());
  for (auto& op : theirs) {
    REQUIRE(tandem_barrier(c1->get(), &op) == TANDEM_SUCCESS);
  }
  for (auto& op : ops) CHECK(tandem_wait(op, 10000) == TANDEM_SUCCESS);
  for (auto& op : theirs) CHECK(tandem_wait(op, 10000) == TANDEM_SUCCESS);
}

TEST_CASE("abort, destroy and join timeouts end communicators with clear errors") {
  Daemon d;
  tandem::Session s0(d.socket().c_str()), s1(d.socket().c_str());
  SUBCASE("join timeout") {
    const tandem_unique_id_t id = tandem::uniqueId();
    tandem_comm_t comm;
    CHECK(tandem_comm_init(s0.get(), &id, 2, 0, 200, &comm) == TANDEM_ERROR_TIMEOUT);
    CHECK(std::string(tandem_last_error()).find("1 of 2 ranks") != std::string::npos);
  }
  SUBCASE("abort fails pending ops with ABORTED") {
    const tandem_unique_id_t id = tandem::uniqueId();
    std::unique_ptr<tandem::Communicator> c1;
    std::thread j([&] { c1 = std::make_unique<tandem::Communicator>(s1, id, 2, 1, 10000); });
    tandem::Communicator c0(s0, id, 2, 0, 10000);
    j.join();
    tandem_op_t op;
    REQUIRE(tandem_barrier(c0.get(), &op) == TANDEM_SUCCESS);
    c1->abort();
    CHECK(tandem_wait(op, 5000) == TANDEM_ERROR_ABORTED);
    REQUIRE(tandem_barrier(c0.get(), &op) == TANDEM_SUCCESS);
    CHECK(tandem_wait(op, 5000) == TANDEM_ERROR_ABORTED);
  }
  SUBCASE("destroy by one rank: the other gets PEER_LOST") {
    const tandem_unique_id_t id = tandem::uniqueId();
    tandem_comm_t c1 = nullptr;
    std::thread j([&] { REQUIRE(tandem_comm_init(s1.get(), &id, 2, 1, 10000, &c1) == TANDEM_SUCCESS); });
    tandem::Communicator c0(s0, id, 2, 0, 10000);
    j.join();
    REQUIRE(tandem_comm_destroy(c1) == TANDEM_SUCCESS);
    tandem_op_t op;
    REQUIRE(tandem_barrier(c0.get(), &op) == TANDEM_SUCCESS);
    CHECK(tandem_wait(op, 5000) == TANDEM_ERROR_PEER_LOST);
    CHECK(std::string(tandem_last_error()).find("destroyed") != std::string::npos);
  }
  SUBCASE("bad ranks and sizes at join") {
    const tandem_unique_id_t id = tandem::uniqueId();
    tandem_comm_t comm;
    CHECK(tandem_comm_init(s0.get(), &id, 65, 0, 100, &comm) == TANDEM_ERROR_INVALID_ARGUMENT);
    CHECK(tandem_comm_init(s0.get(), &id, 2, 2, 100, &comm) == TANDEM_ERROR_INVALID_ARGUMENT);
  }
}
