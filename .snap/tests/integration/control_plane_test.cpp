// The control plane end to end: a real tandemd, real clients, real sockets.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>


#include "harness.hpp"
#include "session.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;

namespace {

// A raw connection that speaks bytes, for malformed input.
int rawConnect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

// Reads until EOF or the deadline; returns everything read.
std::string readUntilClosed(int fd, int timeoutMs = 5000) {
  std::string all;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return all;
    all.append(buf, static_cast<size_t>(n));
  }
  FAIL("the daemon did not close the connection within the deadline");
  return all;
}

// The daemon still serves a full client round trip.
void checkStillServes(const Daemon& d) {
  tandem::Session s(d.socket().c_str());
  tandem::Buffer b(s, 4096);
  std::memset(b.data(), 7, 4096);
  CHECK(b.size() == 4096);
}

}  // namespace

TEST_CASE("hello, allocate, register, status and disconnect free everything") {
  Daemon d;
  {
    tandem::Session s(d.socket().c_str());
    CHECK(s.backend() == "cpu");
    tandem::Buffer a(s, 1 << 20);
    std::memset(a.data(), 0xab, a.size());

    // Register memory the client already has: a memfd mapping.
    const int fd = ::memfd_create("client-mem", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(::ftruncate(fd, 8192) == 0);
    REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    void* p = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    tandem_buffer_t reg;
    REQUIRE(tandem_register(s.get(), p, 8192, fd, 0, &reg) == TANDEM_SUCCESS);

    auto st = daemonStatus(d);
    REQUIRE(st["sessions"].size() == 2);  // ours and tandemctl's
    CHECK(st["total_bytes"] == (1 << 20) + 8192);
    CHECK(st["total_buffers"] == 2);
    CHECK(st["backend"] == "cpu");

    CHECK(tandem_free(reg) == TANDEM_ERROR_INVALID_ARGUMENT);  // registered memory is deregistered, not freed
    CHECK(std::string(tandem_last_error()).find("tandem_deregister") != std::string::npos);
    CHECK(tandem_deregister(reg) == TANDEM_SUCCESS);
    CHECK(daemonStatus(d)["total_bytes"] == 1 << 20);
    ::munmap(p, 8192);
    ::close(fd);
    // The session ends with `a` still allocated: the daemon must reclaim it.
  }
  CHECK(eventually([&] { return daemonStatus(d)["sessions"].size() == 1 && daemonStatus(d)["total_bytes"] == 0; }));
}

TEST_CASE("a client that dies is reaped with its memory") {
  Daemon d;
  const pid_t child = ::fork();
  if (child == 0) {
    tandem_session_t s;
    tandem_buffer_t b;
    if (tandem_connect(d.socket().c_str(), &s) != TANDEM_SUCCESS) std::_Exit(2);
    if (tandem_alloc(s, 3 << 20, &b) != TANDEM_SUCCESS) std::_Exit(3);
    ::pause();  // killed below
    std::_Exit(0);
  }
  REQUIRE(eventually([&] { return daemonStatus(d)["total_bytes"] == 3 << 20; }));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(eventually([&] { return daemonStatus(d)["total_bytes"] == 0 && daemonStatus(d)["sessions"].size() == 1; }));
}

TEST_CASE("bad allocations get clear errors and change nothing") {
  Daemon d("limits:\n  max_buffer_bytes: 1048576\n  max_session_bytes: 2097152\n");
  tandem::Session s(d.socket().c_str());
  tandem_buffer_t b;
  CHECK(tandem_alloc(s.get(), 0, &b) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_alloc(s.get(), (1 << 20) + 1, &b) == TANDEM_ERROR_OUT_OF_MEMORY);
  CHECK(std::string(tandem_last_error()).find("limits.max_buffer_bytes") != std::string::npos);
  // Registering a range outside the fd's file.
  const int fd = ::memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(::ftruncate(fd, 4096) == 0);
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  char local[16];
  CHECK(tandem_register(s.get(), local, 8192, fd, 0, &b) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(tandem_last_error()).find("outside") != std::string::npos);
  tandem::Buffer one(s, 1 << 20), two(s, 1 << 20);
  CHECK(tandem_alloc(s.get(), 1, &b) == TANDEM_ERROR_OUT_OF_MEMORY);
  CHECK(std::string(tandem_last_error()).find("limits.max_session_bytes") != std::string::npos);
  // Registrations count against the same cap (they used to be free: 20 x 16 GiB passed a 64 GiB cap).
  CHECK(tandem_register(s.get(), local, 4096, fd, 0, &b) == TANDEM_ERROR_OUT_OF_MEMORY);
  CHECK(std::string(tandem_last_error()).find("limits.max_session_bytes") != std::string::npos);
  ::close(fd);
  CHECK(daemonStatus(d)["total_bytes"] == 2 << 20);
}

TEST_CASE("registered memory cannot be pulled out from under the daemon") {
  Daemon d;
  tandem::Session s(d.socket().c_str());
  char local[64];
  tandem_buffer_t b;
  SUBCASE("an unsealed memfd is refused, naming the seal to add") {
    const int fd = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(::ftruncate(fd, 4096) == 0);
    CHECK(tandem_register(s.get(), local, 4096, fd, 0, &b) == TANDEM_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(tandem_last_error()).find("F_SEAL_SHRINK") != std::string::npos);
    ::close(fd);
  }
  SUBCASE("a regular file is refused") {
    FILE* f = std::tmpfile();
    REQUIRE(f != nullptr);
    REQUIRE(::ftruncate(::fileno(f), 4096) == 0);
    CHECK(tandem_register(s.get(), local, 4096, ::fileno(f), 0, &b) == TANDEM_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(tandem_last_error()).find("not a memfd") != std::string::npos);
    std::fclose(f);
  }
  SUBCASE("a sealed memfd cannot be shrunk after registration, and ops on it still run") {
    const int fd = ::memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(::ftruncate(fd, 8192) == 0);
    REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    void* p = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    REQUIRE(tandem_register(s.get(), p, 8192, fd, 0, &b) == TANDEM_SUCCESS);
    CHECK(::ftruncate(fd, 0) == -1);  // the attack that used to SIGBUS tandemd
    CHECK(errno == EPERM);
    tandem_unique_id_t id;
    REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
    tandem_comm_t comm;
    REQUIRE(tandem_comm_init(s.get(), &id, 1, 0, 0, &comm) == TANDEM_SUCCESS);
    tandem_tensor_t send{b, 0}, recv{b, 4096};
    tandem_op_t op;
    std::memset(p, 0x3c, 4096);
    const tandem_allgather_args_t args{sizeof args, send, recv, 4096, nullptr};
    REQUIRE(tandem_allgather(comm, &args, &op) == TANDEM_SUCCESS);
    CHECK(tandem_wait(op, 10000) == TANDEM_SUCCESS);
    CHECK(static_cast<unsigned char*>(p)[4096 + 100] == 0x3c);
    CHECK(tandem_comm_destroy(comm) == TANDEM_SUCCESS);
    CHECK(tandem_deregister(b) == TANDEM_SUCCESS);
    ::munmap(p, 8192);
    ::close(fd);
  }
  CHECK(daemonStatus(d)["backend"] == "cpu");  // alive
}

TEST_CASE("garbage, oversized frames, wrong versions and unknown messages do not hurt other clients") {
  Daemon d("limits:\n  max_frame_bytes: 4096\n", {"--log-level", "debug"});
  tandem::Session bystander(d.socket().c_str());
  tandem::Buffer kept(bystander, 4096);
  std::memset(kept.data(), 0x5a, 4096);

  SUBCASE("garbage bytes") {
    const int fd = rawConnect(d.socket());
    const char junk[] = "\x10\x00\x00\x00this is not protobuf!";
    REQUIRE(::write(fd, junk, sizeof junk - 1) > 0);
    const std::string reply = readUntilClosed(fd);
    CHECK(reply.find("malformed") != std::string::npos);
    ::close(fd);
  }
  SUBCASE("a frame over the limit") {
    const int fd = rawConnect(d.socket());
    const unsigned char header[] = {0x00, 0x00, 0x10, 0x00};  // 1 MiB > 4096
    REQUIRE(::write(fd, header, 4) == 4);
    const std::string reply = readUntilClosed(fd);
    CHECK(reply.find("over the limit") != std::string::npos);
    ::close(fd);
  }
  SUBCASE("a wrong protocol version names both versions") {
    try {
      tandem::client::Session::connect(d.socket(), 99);
      FAIL("connect with protocol 99 succeeded");
    } catch (const tandem::Error& e) {
      CHECK(e.code() == tandem::ErrorCode::kVersionMismatch);
      CHECK(std::string(e.what()).find("version 99") != std::string::npos);
      CHECK(std::string(e.what()).find(fmt::format("version {}", tandem::kProtocolVersion)) != std::string::npos);
    }
  }
  SUBCASE("an unknown message type is refused and the session goes on") {
    auto s = tandem::client::Session::connect(d.socket());
    tandem::v1::Request empty;
    CHECK_THROWS_WITH_AS(s->call(empty), doctest::Contains("unknown or empty message type"), tandem::Error);
    tandem::v1::Request q;
    q.mutable_query_status();
    CHECK(s->call(q).status_reply().backend() == "cpu");
  }
  SUBCASE("a request before Hello") {
    const int fd = rawConnect(d.socket());
    tandem::v1::Request q;
    q.mutable_query_status();
    tandem::sendFrame(fd, q.SerializeAsString(), {}, 4096);
    CHECK(readUntilClosed(fd).find("must be Hello") != std::string::npos);
    ::close(fd);
  }
  SUBCASE("a client that disconnects mid-frame") {
    const int fd = rawConnect(d.socket());
    const unsigned char partial[] = {0x40, 0x00, 0x00, 0x00, 0x08, 0x01};
    REQUIRE(::write(fd, partial, sizeof partial) == sizeof partial);
    ::close(fd);
    CHECK(eventually([&] { return d.log().find("in the middle of a frame") != std::string::npos; }));
  }
  // Whatever happened above, the daemon serves, and the bystander's memory is intact.
  checkStillServes(d);
  const auto* bytes = kept.as<unsigned char>();
  CHECK(std::all_of(bytes, bytes + 4096, [](unsigned char c) { return c == 0x5a; }));
  CHECK(!d.exited());
}

TEST_CASE("a uid that is not allowed is refused at Hello") {
  if (::geteuid() != 0) {
    MESSAGE("not root: cannot switch uid to test the refusal; CI runs this as root");
    return;
  }
  Daemon d("access:\n  socket_mode: 0666\n");
  std::filesystem::permissions(d.dir(), std::filesystem::perms::others_exec, std::filesystem::perm_options::add);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) std::_Exit(5);
    tandem_session_t s;
    const tandem_status_t st = tandem_connect(d.socket().c_str(), &s);
    const std::string msg = std::to_string(st) + " " + tandem_last_error();
    [[maybe_unused]] ssize_t n = ::write(p[1], msg.data(), msg.size());
    std::_Exit(0);
  }
  ::close(p[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  char buf[1024] = {};
  [[maybe_unused]] ssize_t n = ::read(p[0], buf, sizeof buf - 1);
  ::close(p[0]);
  const std::string msg(buf);
  INFO("child exit status ", WIFEXITED(status) ? WEXITSTATUS(status) : -1, ", said: ", msg, "\ndaemon log:\n", d.log());
  CHECK(msg.rfind(std::to_string(TANDEM_ERROR_PERMISSION_DENIED) + " ", 0) == 0);
  CHECK(msg.find("access.allowed_uids") != std::string::npos);
  checkStillServes(d);
}

TEST_CASE("SIGTERM drains and exits cleanly, removing the socket") {
  Daemon d;
  tandem::Session s(d.socket().c_str());
  d.signal(SIGTERM);
  CHECK(d.waitExit(10000) == 0);
  CHECK(!std::filesystem::exists(d.socket()));
}

TEST_CASE("tandemctl shutdown stops the daemon") {
  Daemon d;
  int code = 1;
  d.ctl({"shutdown"}, &code);
  CHECK(code == 0);
  CHECK(d.waitExit(10000) == 0);
}

TEST_CASE("config errors exit 78 and name the key, missing hardware exits 69") {
  TempDir dir;
  const std::string bad = (dir.path() / "bad.yaml").string();
  std::ofstream(bad) << "daemon:\n  backend: cpu\nrings:\n  capacty: 64\n";
  auto r = runCommand({TANDEMD_PATH, "--foreground", "--config", bad, "--socket", (dir.path() / "s").string()});
  CHECK(r.exitCode == 78);
  CHECK(r.err.find("rings.capacty") != std::string::npos);
  CHECK(r.err.find("4:3") != std::string::npos);

  r = runCommand({TANDEMD_PATH, "--foreground", "--config", (dir.path() / "missing.yaml").string()});
  CHECK(r.exitCode == 78);

  r = runCommand({TANDEMD_PATH, "--foreground", "--backend", "cuda", "--socket", (dir.path() / "s").string()});
  CHECK(r.exitCode == 69);
  CHECK(r.err.find("backend") != std::string::npos);
}

TEST_CASE("tandemctl status --json and version talk to the daemon, and TANDEM_SOCKET works") {
  Daemon d;
  int code = 1;
  const std::string out = d.ctl({"version"}, &code);
  CHECK(code == 0);
  CHECK(out.find("tandemd") != std::string::npos);
  ::setenv("TANDEM_SOCKET", d.socket().c_str(), 1);
  const CommandResult r = runCommand({TANDEMCTL_PATH, "status"});
  ::unsetenv("TANDEM_SOCKET");
  CHECK(r.exitCode == 0);
  CHECK(r.out.find("backend cpu") != std::string::npos);
}

TEST_CASE("a second daemon on the same socket refuses to start") {
  Daemon d;
  const CommandResult r = runCommand({TANDEMD_PATH, "--foreground", "--socket", d.socket()}, 10000);
  CHECK(r.exitCode == 1);
  CHECK(r.err.find("already serves") != std::string::npos);
  checkStillServes(d);
}
