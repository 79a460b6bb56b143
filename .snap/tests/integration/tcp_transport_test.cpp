// The tcp transport over real sockets on 127.0.0.x with ports chosen by the kernel: several transports in
// one process, and nodes in separate processes (fork). Data + flag ordering, many writes over several
// connections, all-to-all among three nodes, a wrong secret or protocol version refused on both sides, a
// SIGKILLed or frozen peer reported lost within its deadline, a clean shutdown seen as closed, and a connect
// deadline. Control messages: order and bytes from 0 bytes to the limit, handled only after the data written
// before them, argument checks, a lost peer, and an oversized message frame from a raw socket failing the peer.
// Rejoin: a SIGKILLed peer process restarted on the same port comes back as a new generation, in both directions.
// Every wait has a deadline and says what it waited for.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "transport/factory.hpp"
#include "transport/tcp_handshake.hpp"
#include "transport/tcp_transport.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::string hostOf(NodeIndex node) { return fmt::format("127.0.0.{}", node + 1); }

TcpConfig config(NodeIndex self, std::string secret = "test-secret", uint32_t conns = 1) {
  TcpConfig c;
  c.self = self;
  c.listenHost = hostOf(self);
  c.listenPort = 0;
  c.secret = std::move(secret);
  c.connectionsPerPeer = conns;
  c.connectTimeoutMs = 5000;
  c.heartbeatIntervalMs = 50;
  c.peerDeadlineMs = 1000;
  return c;
}

// Polls `pred` until it holds or `timeout` passes; returns whether it held.
bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

uint64_t loadAcquire(const uint64_t& word) {
  // acquire: pairs with the transport's release store of the flag (TcpTransport applyFlags).
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(word)).load(std::memory_order_acquire);
}

// Connects every transport to all others, each connect() in its own thread (they block until all are up).
// Returns the exception each one threw (empty when it connected).
std::vector<std::optional<Error>> connectAll(std::vector<std::unique_ptr<TcpTransport>>& ts) {
  std::vector<NodeAddress> nodes;
  for (std::size_t i = 0; i < ts.size(); ++i) nodes.push_back({hostOf(static_cast<NodeIndex>(i)), ts[i]->listenPort()});
  std::vector<std::optional<Error>> errors(ts.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        ts[i]->connect(nodes);
      } catch (const Error& e) {
        errors[i] = e;
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::unique_ptr<TcpTransport>> makeCluster(std::vector<TcpConfig> configs) {
  std::vector<std::unique_ptr<TcpTransport>> ts;
  for (auto& c : configs) ts.push_back(std::make_unique<TcpTransport>(std::move(c)));
  return ts;
}

void requireConnected(std::vector<std::unique_ptr<TcpTransport>>& ts) {
  const auto errors = connectAll(ts);
  for (std::size_t i = 0; i < errors.size(); ++i) {
    if (errors[i]) FAIL("node ", i, " failed to connect: ", errors[i]->what());
  }
}

// The bootstrap exchange, reduced to its essence: keys travel as bytes.
RemoteKey viaWire(const RemoteKey& key) { return RemoteKey::decode(key.encode()); }

std::size_t drainCompletions(Transport& t, std::vector<Completion>& into) {
  std::array<Completion, 64> buf{};
  const std::size_t n = t.poll(buf);
  into.insert(into.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

// ---- pipes between a test and its forked child; every read has a deadline ----
struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() { REQUIRE(::pipe(fd) == 0); }
  ~Pipe() { closeBoth(); }
  void closeBoth() {
    for (int& f : fd) {
      if (f >= 0) ::close(f);
      f = -1;
    }
  }
};

bool writeAll(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool readExact(int fd, void* data, std::size_t n, std::chrono::milliseconds timeout) {
  auto* p = static_cast<char*>(data);
  const auto deadline = Clock::now() + timeout;
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

template <typename T>
void send(int fd, const T& v) {
  if (!writeAll(fd, &v, sizeof v)) throw Error(ErrorCode::kSystem, "pipe write failed");
}
template <typename T>
T receive(int fd, std::chrono::milliseconds timeout, const char* what) {
  T v{};
  if (!readExact(fd, &v, sizeof v, timeout)) throw Error(ErrorCode::kTimeout, fmt::format("no {} from the other process within {} ms", what, timeout.count()));
  return v;
}
using KeyBytes = std::array<std::byte, RemoteKey::kWireBytes>;
KeyBytes keyBytes(const RemoteKey& k) {
  KeyBytes b{};
  const auto v = k.encode();
  std::copy(v.begin(), v.end(), b.begin());
  return b;
}

// A forked node. The body runs in the child and returns its exit status; the child never returns into doctest.
struct Child {
  pid_t pid = -1;
  template <typename Body>
  explicit Child(Body body) {
    std::fflush(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int status = 1;
      try {
        status = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child node: %s\n", e.what());
        status = 2;
      }
      std::fflush(nullptr);
      ::_exit(status);
    }
  }
  // Waits for the child to exit; SIGKILLs it at the deadline. Returns the exit status, or -signal.
  int wait(std::chrono::milliseconds timeout) {
    if (pid < 0) return 0;
    const auto deadline = Clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) break;
      if (Clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        pid = -1;
        FAIL("child node did not exit within ", timeout.count(), " ms; killed it");
        return -SIGKILL;
      }
      std::this_thread::sleep_for(1ms);
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Control messages a transport received, in the order its handler saw them.
struct Inbox {
  struct Message {
    NodeIndex from;
    std::vector<std::byte> bytes;
  };
  std::mutex mutex;
  std::vector<Message> messages;
  void install(TcpTransport& t) {
    t.setMessageHandler([this](NodeIndex from, std::span<const std::byte> payload) {
      std::lock_guard lock(mutex);
      messages.push_back({from, std::vector<std::byte>(payload.begin(), payload.end())});
    });
  }
  std::size_t size() {
    std::lock_guard lock(mutex);
    return messages.size();
  }
};

// Message i of a test: `bytes` bytes of a pattern that differs per message and per position.
std::vector<std::byte> messageBytes(std::size_t i, std::size_t bytes) {
  std::vector<std::byte> m(bytes);
  for (std::size_t k = 0; k < bytes; ++k) m[k] = static_cast<std::byte>((k * 7 + i * 31 + (k >> 10)) & 0xff);
  return m;
}

std::span<const std::byte> asBytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

ErrorCode codeOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

}  // namespace

TEST_CASE("a flag written after data is observed only with all the data, over one or three connections") {
  uint32_t conns = 1;
  SUBCASE("one connection") { conns = 1; }
  SUBCASE("three connections, data striped in 64 KiB chunks") { conns = 3; }
  std::vector<TcpConfig> cfgs{config(0, "test-secret", conns), config(1, "test-secret", conns)};
  for (auto& c : cfgs) c.chunkBytes = 64 * 1024;
  auto ts = makeCluster(std::move(cfgs));
  requireConnected(ts);
  CHECK(ts[0]->peerStatus(1).state == PeerState::kConnected);
  CHECK(ts[1]->peerStatus(0).state == PeerState::kConnected);

  constexpr std::size_t kBytes = 4 << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  for (std::size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  std::array<uint64_t, 8> flags{};
  const LocalRegion srcRegion = ts[0]->registerMemory({MemoryKind::kHost, src.data(), kBytes});
  const RemoteKey dstKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, dst.data(), kBytes})));
  const RemoteKey flagKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, flags.data(), sizeof flags})));

  ts[0]->write(1, srcRegion, 0, dstKey, 0, kBytes, /*cookie=*/11, /*signal=*/true);
  ts[0]->writeFlag(1, flagKey, 8, 1, /*cookie=*/12, /*signal=*/true);
  ts[0]->submit();
  REQUIRE_MESSAGE(waitFor([&] { return loadAcquire(flags[1]) == 1; }, 5s), "flag 1 did not arrive within 5 s");
  CHECK(std::memcmp(dst.data(), src.data(), kBytes) == 0);
  CHECK(loadAcquire(flags[0]) == 0);

  std::vector<Completion> done;
  REQUIRE_MESSAGE(waitFor([&] { drainCompletions(*ts[0], done); return done.size() >= 2; }, 5s),
                  "sender completions did not arrive within 5 s");
  CHECK(done.size() == 2);
  for (const auto& c : done) {
    CHECK(c.code == ErrorCode::kOk);
    CHECK(c.peer == 1);
  }
  CHECK(std::count_if(done.begin(), done.end(), [](auto& c) { return c.cookie == 11; }) == 1);
}

TEST_CASE("thousands of writes and flags keep their order across three connections") {
  std::vector<TcpConfig> cfgs{config(0, "test-secret", 3), config(1, "test-secret", 3)};
  for (auto& c : cfgs) c.chunkBytes = 4096;  // each 8 KiB write spans two connections
  auto ts = makeCluster(std::move(cfgs));
  requireConnected(ts);

  constexpr uint64_t kIters = 2000;
  constexpr std::size_t kWords = 1024;  // 8 KiB per write
  std::vector<uint64_t> src(kIters * kWords), dst(kIters * kWords, 0);
  for (uint64_t k = 0; k < kIters; ++k) std::fill_n(src.begin() + static_cast<std::ptrdiff_t>(k * kWords), kWords, k + 1);
  uint64_t flag = 0, overwriteFlag = 0, smallFlag = 0;
  std::vector<uint8_t> small(64 * 1000, 0), smallSrc(64 * 1000);
  for (std::size_t i = 0; i < smallSrc.size(); ++i) smallSrc[i] = static_cast<uint8_t>(i % 253);

  const LocalRegion srcRegion = ts[0]->registerMemory({MemoryKind::kHost, src.data(), src.size() * 8});
  const LocalRegion smallSrcRegion = ts[0]->registerMemory({MemoryKind::kHost, smallSrc.data(), smallSrc.size()});
  const RemoteKey dstKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, dst.data(), dst.size() * 8})));
  const RemoteKey flagKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &flag, 8})));
  const RemoteKey overwriteFlagKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &overwriteFlag, 8})));
  const RemoteKey smallKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, small.data(), small.size()})));
  const RemoteKey smallFlagKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &smallFlag, 8})));

  // Phase 1: iteration k writes slot k, then flag = k+1. Whenever the receiver sees flag f, slots below f must
  // hold their data in full; it reads only those (nothing is in flight to them any more).
  std::atomic<uint64_t> badSlots{0}, observations{0};
  std::thread receiver([&] {
    const auto deadline = Clock::now() + 8s;
    uint64_t checked = 0;
    while (checked < kIters && Clock::now() < deadline) {
      const uint64_t f = loadAcquire(flag);
      for (; checked < f; ++checked) {
        const auto* slot = dst.data() + checked * kWords;
        if (!std::all_of(slot, slot + kWords, [&](uint64_t w) { return w == checked + 1; })) ++badSlots;
      }
      ++observations;
    }
  });
  for (uint64_t k = 0; k < kIters; ++k) {
    ts[0]->write(1, srcRegion, k * kWords * 8, dstKey, k * kWords * 8, kWords * 8, k, false);
    ts[0]->writeFlag(1, flagKey, 0, k + 1, k, false);
    if (k % 16 == 15) ts[0]->submit();
  }
  ts[0]->submit();
  receiver.join();
  CHECK(loadAcquire(flag) == kIters);
  CHECK(badSlots.load() == 0);
  CHECK(observations.load() > 0);

  // Phase 2, write after write: 200 writes to the same 8 KiB (values 1..200), each striped over two
  // connections; the bytes must end up holding the last one.
  for (uint64_t k = 0; k < 200; ++k) ts[0]->write(1, srcRegion, k * kWords * 8, dstKey, 0, kWords * 8, k, false);
  ts[0]->writeFlag(1, overwriteFlagKey, 0, 1, 0, false);
  // Phase 3: 1000 small writes to distinct offsets, one flag after them all.
  for (uint64_t i = 0; i < 1000; ++i) ts[0]->write(1, smallSrcRegion, i * 64, smallKey, i * 64, 64, i, false);
  ts[0]->writeFlag(1, smallFlagKey, 0, 1, 0, false);
  ts[0]->submit();
  REQUIRE_MESSAGE(waitFor([&] { return loadAcquire(overwriteFlag) == 1; }, 5s), "the overwrite flag did not arrive");
  CHECK(std::all_of(dst.begin(), dst.begin() + kWords, [](uint64_t w) { return w == 200; }));
  REQUIRE_MESSAGE(waitFor([&] { return loadAcquire(smallFlag) == 1; }, 5s), "the small-writes flag did not arrive");
  CHECK(small == smallSrc);
}

TEST_CASE("a signalled completion means the source may be reused, for every chunk on every connection") {
  std::vector<TcpConfig> cfgs{config(0, "test-secret", 3), config(1, "test-secret", 3)};
  for (auto& c : cfgs) c.chunkBytes = 64 * 1024;
  auto ts = makeCluster(std::move(cfgs));
  requireConnected(ts);
  constexpr std::size_t kBytes = 8 << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0), expected(kBytes);
  for (std::size_t i = 0; i < kBytes; ++i) expected[i] = src[i] = static_cast<uint8_t>((i >> 12) ^ i);
  uint64_t flag = 0;
  const LocalRegion s = ts[0]->registerMemory({MemoryKind::kHost, src.data(), kBytes});
  const RemoteKey d = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, dst.data(), kBytes})));
  const RemoteKey f = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &flag, 8})));
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    ts[0]->write(1, s, 0, d, 0, kBytes, 100 + round, /*signal=*/true);
    ts[0]->submit();
    std::vector<Completion> done;
    REQUIRE_MESSAGE(waitFor([&] { drainCompletions(*ts[0], done); return !done.empty(); }, 5s),
                    "the signalled write did not complete within 5 s");
    CHECK(done.front().cookie == static_cast<uint64_t>(100 + round));
    std::fill(src.begin(), src.end(), uint8_t{0xee});  // reuse the source at once: nothing may still read it
    ts[0]->writeFlag(1, f, 0, static_cast<uint64_t>(round + 1), 0, false);
    ts[0]->submit();
    REQUIRE_MESSAGE(waitFor([&] { return loadAcquire(flag) == static_cast<uint64_t>(round + 1); }, 5s),
                    "flag did not arrive within 5 s");
    CHECK(dst == expected);
    src = expected;
    std::fill(dst.begin(), dst.end(), uint8_t{0});
  }
}

TEST_CASE("three nodes write to each other all-to-all") {
  auto ts = makeCluster({config(0), config(1), config(2)});
  requireConnected(ts);
  constexpr std::size_t kSlot = 256 * 1024;
  std::vector<std::vector<uint8_t>> src(3, std::vector<uint8_t>(kSlot)), dst(3, std::vector<uint8_t>(3 * kSlot));
  std::vector<std::array<uint64_t, 3>> flags(3, std::array<uint64_t, 3>{});
  std::vector<LocalRegion> srcRegions;
  std::vector<RemoteKey> dstKeys, flagKeys;
  for (NodeIndex n = 0; n < 3; ++n) {
    std::fill(src[n].begin(), src[n].end(), static_cast<uint8_t>(0xa0 + n));
    srcRegions.push_back(ts[n]->registerMemory({MemoryKind::kHost, src[n].data(), kSlot}));
    dstKeys.push_back(viaWire(ts[n]->remoteKey(ts[n]->registerMemory({MemoryKind::kHost, dst[n].data(), 3 * kSlot}))));
    flagKeys.push_back(viaWire(ts[n]->remoteKey(ts[n]->registerMemory({MemoryKind::kHost, flags[n].data(), 24}))));
  }
  for (NodeIndex from = 0; from < 3; ++from) {
    for (NodeIndex to = 0; to < 3; ++to) {
      if (from == to) continue;
      ts[from]->write(to, srcRegions[from], 0, dstKeys[to], from * kSlot, kSlot, 0, false);
      ts[from]->writeFlag(to, flagKeys[to], from * 8, 100 + from, 0, false);
    }
    ts[from]->submit();
  }
  for (NodeIndex to = 0; to < 3; ++to) {
    for (NodeIndex from = 0; from < 3; ++from) {
      if (from == to) continue;
      CAPTURE(from);
      CAPTURE(to);
      REQUIRE_MESSAGE(waitFor([&] { return loadAcquire(flags[to][from]) == 100 + from; }, 5s), "flag did not arrive within 5 s");
      CHECK(std::all_of(dst[to].begin() + from * kSlot, dst[to].begin() + (from + 1) * kSlot,
                        [&](uint8_t b) { return b == 0xa0 + from; }));
    }
  }
}

TEST_CASE("GPU regions are staged through host memory with the device copier") {
  // A stand-in copier: "device" memory is host memory; it counts the staging copies. Its mutex stands for the
  // device's own ordering: the test reads "device" memory through it, as a GPU kernel would see it.
  struct CountingCopier : DeviceCopier {
    std::mutex mutex;
    std::atomic<int> toHostCalls{0}, toDeviceCalls{0};
    void toHost(void* h, const void* d, uint64_t n) override {
      std::lock_guard lock(mutex);
      std::memcpy(h, d, n);
      ++toHostCalls;
    }
    void toDevice(void* d, const void* h, uint64_t n) override {
      std::lock_guard lock(mutex);
      std::memcpy(d, h, n);
      ++toDeviceCalls;
    }
    uint64_t read(const uint64_t& deviceWord) {
      std::lock_guard lock(mutex);
      return deviceWord;
    }
  } copier;
  std::vector<TcpConfig> cfgs{config(0), config(1)};
  for (auto& c : cfgs) c.deviceCopier = &copier;
  auto ts = makeCluster(std::move(cfgs));
  requireConnected(ts);
  std::vector<uint8_t> gpuSrc(100000, 0x5a), gpuDst(100000, 0);
  alignas(8) uint64_t gpuFlag = 0;
  const LocalRegion s = ts[0]->registerMemory({MemoryKind::kDevice, gpuSrc.data(), gpuSrc.size()});
  const RemoteKey d = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kDevice, gpuDst.data(), gpuDst.size()})));
  const RemoteKey f = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kDevice, &gpuFlag, 8})));
  ts[0]->write(1, s, 0, d, 0, gpuSrc.size(), 0, false);
  ts[0]->writeFlag(1, f, 0, 9, 0, false);
  ts[0]->submit();
  REQUIRE_MESSAGE(waitFor([&] { return copier.read(gpuFlag) == 9; }, 5s), "staged flag did not arrive within 5 s");
  CHECK(gpuDst == gpuSrc);
  CHECK(copier.toHostCalls.load() >= 1);
  CHECK(copier.toDeviceCalls.load() >= 2);  // data, then the flag

  TcpTransport noCopier(config(2));
  CHECK_THROWS_AS(noCopier.registerMemory({MemoryKind::kDevice, gpuDst.data(), 8}), Error);
}

TEST_CASE("bad ops fail fast with a clear error and leave the connection usable") {
  auto ts = makeCluster({config(0), config(1)});
  requireConnected(ts);
  std::vector<uint8_t> buf(4096);
  uint64_t flag = 0;
  const LocalRegion r = ts[0]->registerMemory({MemoryKind::kHost, buf.data(), buf.size()});
  const RemoteKey k = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, buf.data(), buf.size()})));
  const RemoteKey fk = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &flag, 8})));
  CHECK(codeOf([&] { ts[0]->write(1, r, 0, k, 4000, 200, 0, false); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ts[0]->write(1, r, 4000, k, 0, 200, 0, false); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ts[0]->write(1, LocalRegion{999}, 0, k, 0, 8, 0, false); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ts[0]->write(0, r, 0, k, 0, 8, 0, false); }) == ErrorCode::kInvalidArgument);  // self
  CHECK(codeOf([&] { ts[0]->write(5, r, 0, k, 0, 8, 0, false); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ts[0]->writeFlag(1, fk, 4, 1, 0, false); }) == ErrorCode::kInvalidArgument);
  RemoteKey wrongOwner = k;
  wrongOwner.owner = 0;
  CHECK(codeOf([&] { ts[0]->write(1, r, 0, wrongOwner, 0, 8, 0, false); }) == ErrorCode::kInvalidArgument);
  ts[0]->writeFlag(1, fk, 0, 3, 0, false);
  ts[0]->submit();
  CHECK_MESSAGE(waitFor([&] { return loadAcquire(flag) == 3; }, 5s), "flag after rejected ops did not arrive");
  CHECK(ts[0]->peerStatus(1).state == PeerState::kConnected);
}

TEST_CASE("a wrong cluster secret is refused with a clear error on both sides") {
  auto ts = makeCluster({config(0, "secret-A"), config(1, "secret-B")});
  const auto start = Clock::now();
  const auto errors = connectAll(ts);
  CHECK(Clock::now() - start < 5s);  // well before the connect deadline: refused, not timed out
  for (NodeIndex i = 0; i < 2; ++i) {
    CAPTURE(i);
    REQUIRE(errors[i].has_value());
    CHECK(errors[i]->code() == ErrorCode::kPermissionDenied);
    const std::string expected = fmt::format("tcp transport: peer {}:{} (node {}) presented a different cluster secret; "
                                             "set cluster.secret identically on every node",
                                             hostOf(1 - i), ts[1 - i]->listenPort(), 1 - i);
    CHECK_MESSAGE(std::string(errors[i]->what()) == expected, errors[i]->what());
    CHECK(ts[i]->peerStatus(1 - i).state == PeerState::kFailed);
  }
}

TEST_CASE("a different protocol version is refused with a clear error on both sides") {
  auto cfg1 = config(1);
  cfg1.protocolVersion = kTcpProtocolVersion + 1;
  auto ts = makeCluster({config(0), cfg1});
  const auto errors = connectAll(ts);
  for (NodeIndex i = 0; i < 2; ++i) {
    CAPTURE(i);
    REQUIRE(errors[i].has_value());
    CHECK(errors[i]->code() == ErrorCode::kVersionMismatch);
    CHECK_MESSAGE(std::string(errors[i]->what()).find("protocol version") != std::string::npos, errors[i]->what());
    CHECK_MESSAGE(std::string(errors[i]->what()).find("same tandem release") != std::string::npos, errors[i]->what());
  }
}

TEST_CASE("connect gives up at its deadline and says which peer is missing") {
  auto cfg0 = config(0);
  cfg0.connectTimeoutMs = 400;
  TcpTransport t(cfg0);
  TcpTransport silent(config(1));  // listens (the kernel accepts) but never runs its side of the handshake
  const auto start = Clock::now();
  try {
    t.connect({{hostOf(0), t.listenPort()}, {hostOf(1), silent.listenPort()}});
    FAIL("connect succeeded without a peer");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kTimeout);
    CHECK_MESSAGE(std::string(e.what()).find(fmt::format("{}:{} (node 1)", hostOf(1), silent.listenPort())) != std::string::npos, e.what());
  }
  CHECK(Clock::now() - start < 3s);
  CHECK(t.peerStatus(1).state == PeerState::kFailed);
}

TEST_CASE("a peer that shuts down cleanly is reported closed, and later ops fail fast") {
  auto ts = makeCluster({config(0), config(1)});
  requireConnected(ts);
  std::vector<uint8_t> buf(64);
  const LocalRegion r = ts[0]->registerMemory({MemoryKind::kHost, buf.data(), buf.size()});
  const RemoteKey k = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, buf.data(), buf.size()})));
  ts[1].reset();
  REQUIRE_MESSAGE(waitFor([&] { return ts[0]->peerStatus(1).state != PeerState::kConnected; }, 2s),
                  "node 0 did not notice node 1's shutdown within 2 s");
  const PeerStatus st = ts[0]->peerStatus(1);
  CHECK(st.state == PeerState::kClosed);
  CHECK(st.reason.find("shut its transport down") != std::string::npos);
  try {
    ts[0]->write(1, r, 0, k, 0, 8, 0, false);
    FAIL("write to a closed peer succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kPeerLost);
    CHECK(std::string(e.what()).find("(node 1)") != std::string::npos);
  }
  CHECK(codeOf([&] { ts[0]->sendMessage(1, asBytes("late")); }) == ErrorCode::kPeerLost);
}

// ---------------------------------------------------------------------------------------------------------
// Control messages
// ---------------------------------------------------------------------------------------------------------

TEST_CASE("control messages arrive in order with their bytes intact, from 0 bytes to kMaxMessageBytes") {
  std::vector<TcpConfig> cfgs{config(0, "test-secret", 2), config(1, "test-secret", 2)};
  for (auto& c : cfgs) c.ioThreads = 2;
  auto ts = makeCluster(std::move(cfgs));
  Inbox inbox0, inbox1;
  inbox0.install(*ts[0]);
  // Node 1 records each message and answers it from inside the handler (sendMessage only queues).
  ts[1]->setMessageHandler([&](NodeIndex from, std::span<const std::byte> payload) {
    {
      std::lock_guard lock(inbox1.mutex);
      inbox1.messages.push_back({from, std::vector<std::byte>(payload.begin(), payload.end())});
    }
    const std::string ack = fmt::format("ack {}", payload.size());
    ts[1]->sendMessage(from, asBytes(ack));
  });
  requireConnected(ts);

  const std::vector<std::size_t> sizes{0, 1, 1 << 20, TcpTransport::kMaxMessageBytes, 3, 0, 4096};
  for (std::size_t i = 0; i < sizes.size(); ++i) ts[0]->sendMessage(1, messageBytes(i, sizes[i]));
  REQUIRE_MESSAGE(waitFor([&] { return inbox1.size() >= sizes.size(); }, 10s),
                  "node 1 handled ", inbox1.size(), " of ", sizes.size(), " messages within 10 s");
  REQUIRE_MESSAGE(waitFor([&] { return inbox0.size() >= sizes.size(); }, 5s),
                  "node 0 got ", inbox0.size(), " of ", sizes.size(), " answers within 5 s");
  std::lock_guard lock1(inbox1.mutex);
  std::lock_guard lock0(inbox0.mutex);
  CHECK(inbox1.messages.size() == sizes.size());
  CHECK(inbox0.messages.size() == sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    CAPTURE(sizes[i]);
    CHECK(inbox1.messages[i].from == 0);
    CHECK(inbox1.messages[i].bytes.size() == sizes[i]);
    CHECK(inbox1.messages[i].bytes == messageBytes(i, sizes[i]));
    const std::string ack = fmt::format("ack {}", sizes[i]);
    CHECK(inbox0.messages[i].from == 1);
    const auto& answer = inbox0.messages[i].bytes;
    CHECK(std::string(reinterpret_cast<const char*>(answer.data()), answer.size()) == ack);
  }
  CHECK(ts[0]->peerStatus(1).state == PeerState::kConnected);
  CHECK(ts[1]->peerStatus(0).state == PeerState::kConnected);
  // Messages are not signalled ops: no completions.
  std::vector<Completion> done;
  drainCompletions(*ts[0], done);
  CHECK(done.empty());
}

TEST_CASE("a control message is handled only after the bytes and flags written before it are visible") {
  // Three connections and 64 KiB chunks: the 8 MiB write travels mostly on connections 1 and 2 while the message
  // goes on connection 0, so it usually arrives first and must wait. No submit(): sendMessage starts everything.
  // Odd rounds also store a flag between the write and the message; even rounds do not, so there the message's
  // own data counts must hold it back (a flag in front of it would hold it anyway).
  // Two io threads: data completing on one connection's thread may release a message read on another's.
  std::vector<TcpConfig> cfgs{config(0, "test-secret", 3), config(1, "test-secret", 3)};
  for (auto& c : cfgs) {
    c.chunkBytes = 64 * 1024;
    c.ioThreads = 2;
  }
  auto ts = makeCluster(std::move(cfgs));
  constexpr std::size_t kBytes = 8 << 20;
  constexpr int kRounds = 6;
  std::vector<std::vector<uint8_t>> src(kRounds, std::vector<uint8_t>(kBytes));
  for (int r = 0; r < kRounds; ++r) {
    auto& s = src[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < kBytes; ++i) s[i] = static_cast<uint8_t>(i * 13 + static_cast<std::size_t>(r) * 101 + (i >> 16));
  }
  std::vector<uint8_t> dst(kBytes, 0);
  uint64_t flag = 0;
  std::atomic<int> handled{0}, dataSeen{0}, flagSeen{0};
  // On an io thread: it counts what it saw and the test thread checks the counts. `handled` last: the test thread
  // then starts the next round, which overwrites dst.
  ts[1]->setMessageHandler([&](NodeIndex, std::span<const std::byte> payload) {
    int round = -1;
    if (payload.size() == sizeof round) std::memcpy(&round, payload.data(), sizeof round);
    if (round >= 0 && round < kRounds) {
      if (std::memcmp(dst.data(), src[static_cast<std::size_t>(round)].data(), kBytes) == 0) ++dataSeen;
      if (round % 2 == 1 && loadAcquire(flag) == static_cast<uint64_t>(round + 1)) ++flagSeen;
    }
    ++handled;
  });
  requireConnected(ts);
  std::vector<LocalRegion> srcRegions;
  for (auto& s : src) srcRegions.push_back(ts[0]->registerMemory({MemoryKind::kHost, s.data(), kBytes}));
  const RemoteKey dstKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, dst.data(), kBytes})));
  const RemoteKey flagKey = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, &flag, 8})));
  for (int r = 0; r < kRounds; ++r) {
    CAPTURE(r);
    ts[0]->write(1, srcRegions[static_cast<std::size_t>(r)], 0, dstKey, 0, kBytes, 0, false);
    if (r % 2 == 1) ts[0]->writeFlag(1, flagKey, 0, static_cast<uint64_t>(r + 1), 0, false);
    ts[0]->sendMessage(1, std::as_bytes(std::span(&r, 1)));
    // The next round overwrites dst: wait until this round's message was handled.
    REQUIRE_MESSAGE(waitFor([&] { return handled.load() == r + 1; }, 5s), "message of round ", r,
                    " not handled within 5 s");
  }
  CHECK(dataSeen.load() == kRounds);
  CHECK(flagSeen.load() == kRounds / 2);
}

TEST_CASE("sendMessage checks its arguments and leaves the connection usable") {
  auto ts = makeCluster({config(0), config(1)});
  Inbox inbox;
  inbox.install(*ts[1]);
  const std::vector<std::byte> small(8);
  CHECK(codeOf([&] { ts[0]->sendMessage(1, small); }) == ErrorCode::kUnavailable);  // before connect()
  requireConnected(ts);
  const std::vector<std::byte> oversized(TcpTransport::kMaxMessageBytes + 1);
  try {
    ts[0]->sendMessage(1, oversized);
    FAIL("an oversized message was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(std::string(e.what()).find("exceeds the 16777216-byte limit") != std::string::npos, e.what());
  }
  CHECK(codeOf([&] { ts[0]->sendMessage(0, small); }) == ErrorCode::kInvalidArgument);  // self
  CHECK(codeOf([&] { ts[0]->sendMessage(2, small); }) == ErrorCode::kInvalidArgument);
  ts[0]->sendMessage(1, messageBytes(1, 100));
  REQUIRE_MESSAGE(waitFor([&] { return inbox.size() == 1; }, 5s), "the message after the rejected ones did not arrive");
  std::lock_guard lock(inbox.mutex);
  CHECK(inbox.messages[0].bytes == messageBytes(1, 100));
  CHECK(ts[0]->peerStatus(1).state == PeerState::kConnected);
}

TEST_CASE("through the Transport interface alone: the factory's tcp transport carries a control channel, "
          "ordered after data, null has none, and verbs carries one (or names the missing RDMA device)") {
  // What the daemon's Cluster does: create by options, then use only Transport and ControlChannel.
  std::vector<std::unique_ptr<Transport>> ts;
  for (NodeIndex i = 0; i < 2; ++i) {
    TransportOptions o;
    o.kind = TransportKind::kTcp;
    o.self = i;
    o.listen = {hostOf(i), 0};
    o.secret = "test-secret";
    o.connectionsPerPeer = 2;
    o.connectTimeoutMs = 5000;
    o.heartbeatIntervalMs = 50;
    o.peerDeadlineMs = 1000;
    ts.push_back(createTransport(o));
  }
  std::vector<NodeAddress> nodes;
  for (NodeIndex i = 0; i < 2; ++i) {
    REQUIRE(ts[i]->kind() == TransportKind::kTcp);
    REQUIRE(ts[i]->controlChannel() != nullptr);
    nodes.push_back({hostOf(i), dynamic_cast<TcpTransport&>(*ts[i]).listenPort()});  // the test picks free ports
  }
  std::vector<uint8_t> dst(1 << 20), src(1 << 20);
  for (std::size_t k = 0; k < src.size(); ++k) src[k] = static_cast<uint8_t>(k * 13 + 1);
  std::atomic<bool> sawAllData{false}, handled{false};
  ts[1]->controlChannel()->setMessageHandler([&](NodeIndex from, std::span<const std::byte> payload) {
    sawAllData = from == 0 && payload.size() == 5 && dst == src;
    handled = true;
  });
  std::vector<std::thread> connecting;
  std::vector<std::optional<Error>> errors(2);
  for (NodeIndex i = 0; i < 2; ++i) {
    connecting.emplace_back([&, i] {
      try {
        ts[i]->controlChannel()->connect(nodes);
      } catch (const Error& e) {
        errors[i] = e;
      }
    });
  }
  for (auto& t : connecting) t.join();
  for (auto& e : errors) REQUIRE_MESSAGE(!e, e->what());
  CHECK(ts[0]->controlChannel()->peerGeneration(1) == 1);
  const LocalRegion s = ts[0]->registerMemory({MemoryKind::kHost, src.data(), src.size()});
  const RemoteKey d = viaWire(ts[1]->remoteKey(ts[1]->registerMemory({MemoryKind::kHost, dst.data(), dst.size()})));
  ts[0]->write(1, s, 0, d, 0, src.size(), 0, false);
  ts[0]->controlChannel()->sendMessage(1, asBytes("hello"));  // starts the write too: no submit()
  REQUIRE_MESSAGE(waitFor([&] { return handled.load(); }, 5s), "the message was not handled within 5 s");
  CHECK_MESSAGE(sawAllData.load(), "the handler ran before every byte written before the message was visible");

  NullTransport null(0, 2);
  CHECK(null.controlChannel() == nullptr);
  // verbs from cluster options: with an RDMA device (or the verbs test double) a transport with a control channel;
  // on rdma-core without one, kUnavailable saying so.
  TransportOptions verbs;
  verbs.kind = TransportKind::kVerbs;
  verbs.nodeCount = 2;
  verbs.listen = {"127.0.0.1", 0};
  verbs.secret = "factory-verbs-secret-0123456789";
  try {
    auto t = createTransport(verbs);
    CHECK(t->kind() == TransportKind::kVerbs);
    CHECK(t->controlChannel() != nullptr);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnavailable);
    CHECK_MESSAGE(std::string(e.what()).find("RDMA device") != std::string::npos, e.what());
  }
  TransportOptions nullKind;
  nullKind.kind = TransportKind::kNull;
  CHECK_THROWS_AS(createTransport(nullKind), Error);
}

namespace {
// A socket that runs the dialer's side of the handshake by hand as `from` -> `to`, so a test can then send frames
// a TcpTransport never would. Returns the connected fd, or -1 when the acceptor refused the handshake.
int rawDial(const std::string& host, uint16_t port, NodeIndex from, NodeIndex to, const std::string& secret) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  REQUIRE(::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1);
  REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  // Hello: magic, version, from, to, connection index, connection count, reserved, nonce (little-endian).
  std::array<std::byte, 48> hello{};
  const uint64_t magic = 0x3150435444464e54ull;
  const std::array<uint32_t, 6> fields{kTcpProtocolVersion, from, to, 0, 1, 0};
  std::memcpy(hello.data(), &magic, 8);
  std::memcpy(hello.data() + 8, fields.data(), sizeof fields);
  REQUIRE(writeAll(fd, hello.data(), hello.size()));
  std::array<std::byte, 72> reply{};
  REQUIRE(readExact(fd, reply.data(), reply.size(), 5s));
  uint32_t status = 0;
  std::memcpy(&status, reply.data() + 12, 4);
  if (status != 0) {
    ::close(fd);
    return -1;
  }
  std::vector<std::byte> macInput;
  const std::string label = "tandem-tcp dialer";
  for (char c : label) macInput.push_back(static_cast<std::byte>(c));
  macInput.insert(macInput.end(), hello.begin(), hello.end());
  macInput.insert(macInput.end(), reply.begin(), reply.begin() + 40);
  const auto mac = tcp::hmacSha256(asBytes(secret), macInput);
  REQUIRE(writeAll(fd, mac.data(), mac.size()));
  std::array<std::byte, 8> result{};
  REQUIRE(readExact(fd, result.data(), result.size(), 5s));
  std::memcpy(&status, result.data(), 4);
  REQUIRE(status == 0);
  return fd;
}
}  // namespace

TEST_CASE("a control message frame longer than kMaxMessageBytes is a malformed frame that fails the peer") {
  TcpTransport t(config(0));
  // Node 1's listed address accepts TCP connections (the kernel does) but never answers: only our raw dialer
  // speaks for node 1.
  TcpTransport silent(config(1));
  std::optional<Error> connectError;
  std::thread connecting([&] {
    try {
      t.connect({{hostOf(0), t.listenPort()}, {hostOf(1), silent.listenPort()}});
    } catch (const Error& e) {
      connectError = e;
    }
  });
  REQUIRE(waitFor([&] { return t.nodeCount() == 2; }, 2s));
  const int fd = rawDial(hostOf(0), t.listenPort(), 1, 0, "test-secret");
  REQUIRE(fd >= 0);
  struct Header {
    uint8_t type, reserved[3];
    uint32_t regionId;
    uint64_t offset, length, value;
  } h{5, {0, 0, 0}, 0, 0, 8 + TcpTransport::kMaxMessageBytes + 1, TcpTransport::kMaxMessageBytes + 1};
  static_assert(sizeof h == 32);
  REQUIRE(writeAll(fd, &h, sizeof h));
  const bool failed = waitFor([&] { return t.peerStatus(1).state == PeerState::kFailed; }, 3s);
  connecting.join();
  ::close(fd);
  REQUIRE_MESSAGE(failed, "the peer that sent an oversized message frame was not failed within 3 s");
  const std::string reason = t.peerStatus(1).reason;
  CHECK_MESSAGE(reason.find("malformed frame") != std::string::npos, reason);
  CHECK_MESSAGE(reason.find("control message of 16777217 bytes (limit 16777216)") != std::string::npos, reason);
  CHECK(connectError.has_value());  // connect() reports the peer it could not bring up
}

// ---------------------------------------------------------------------------------------------------------
// Separate processes
// ---------------------------------------------------------------------------------------------------------

TEST_CASE("two processes exchange data and flags in both directions") {
  // Bootstrap over pipes: ports, then keys. The child (node 1) receives 1 MiB + flag, checks it, and answers
  // with its own write + flag into the parent's region.
  Pipe toParent, toChild;
  constexpr std::size_t kBytes = 1 << 20;
  Child child([&] {
    toParent.fd[0] = (::close(toParent.fd[0]), -1);
    toChild.fd[1] = (::close(toChild.fd[1]), -1);
    std::vector<uint8_t> dst(kBytes, 0), answer(4096, 0x77);
    uint64_t flag = 0;
    TcpTransport t(config(1));
    send(toParent.fd[1], t.listenPort());
    const auto parentPort = receive<uint16_t>(toChild.fd[0], 5s, "parent port");
    t.connect({{hostOf(0), parentPort}, {hostOf(1), t.listenPort()}});
    const LocalRegion answerRegion = t.registerMemory({MemoryKind::kHost, answer.data(), answer.size()});
    send(toParent.fd[1], keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, dst.data(), kBytes}))));
    send(toParent.fd[1], keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, &flag, 8}))));
    const auto parentData = RemoteKey::decode(receive<KeyBytes>(toChild.fd[0], 5s, "parent data key"));
    const auto parentFlag = RemoteKey::decode(receive<KeyBytes>(toChild.fd[0], 5s, "parent flag key"));
    if (!waitFor([&] { return loadAcquire(flag) == 42; }, 5s)) return 10;
    for (std::size_t i = 0; i < kBytes; ++i) {
      if (dst[i] != static_cast<uint8_t>(i ^ (i >> 8))) return 11;
    }
    t.write(0, answerRegion, 0, parentData, 0, answer.size(), 0, false);
    t.writeFlag(0, parentFlag, 0, 43, 0, false);
    t.submit();
    // Stay up until the parent has seen the answer (it closes the pipe), then shut down cleanly.
    char c;
    (void)readExact(toChild.fd[0], &c, 1, 5s);
    return 0;
  });
  toParent.fd[1] = (::close(toParent.fd[1]), -1);
  toChild.fd[0] = (::close(toChild.fd[0]), -1);

  std::vector<uint8_t> src(kBytes), back(4096, 0);
  for (std::size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i ^ (i >> 8));
  uint64_t backFlag = 0;
  TcpTransport t(config(0));
  const auto childPort = receive<uint16_t>(toParent.fd[0], 5s, "child port");
  send(toChild.fd[1], t.listenPort());
  t.connect({{hostOf(0), t.listenPort()}, {hostOf(1), childPort}});
  const LocalRegion srcRegion = t.registerMemory({MemoryKind::kHost, src.data(), kBytes});
  send(toChild.fd[1], keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, back.data(), back.size()}))));
  send(toChild.fd[1], keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, &backFlag, 8}))));
  const auto dataKey = RemoteKey::decode(receive<KeyBytes>(toParent.fd[0], 5s, "child data key"));
  const auto flagKey = RemoteKey::decode(receive<KeyBytes>(toParent.fd[0], 5s, "child flag key"));
  t.write(1, srcRegion, 0, dataKey, 0, kBytes, 0, false);
  t.writeFlag(1, flagKey, 0, 42, 0, false);
  t.submit();
  CHECK_MESSAGE(waitFor([&] { return loadAcquire(backFlag) == 43; }, 5s), "the child's answer did not arrive within 5 s");
  CHECK(std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0x77; }));
  toChild.closeBoth();  // lets the child exit
  CHECK(child.wait(5s) == 0);
  CHECK_MESSAGE(waitFor([&] { return t.peerStatus(1).state == PeerState::kClosed; }, 2s), "child's Goodbye not seen");
}

namespace {
// Forks node 1, which connects and then idles until killed. Returns the parent's connected transport.
std::unique_ptr<TcpTransport> connectToIdleChild(std::unique_ptr<Child>& child, uint32_t peerDeadlineMs) {
  Pipe toParent, toChild;
  child = std::make_unique<Child>([&] {
    ::close(toParent.fd[0]);
    ::close(toChild.fd[1]);
    auto cfg = config(1);
    cfg.peerDeadlineMs = peerDeadlineMs;
    TcpTransport t(cfg);
    send(toParent.fd[1], t.listenPort());
    const auto parentPort = receive<uint16_t>(toChild.fd[0], 5s, "parent port");
    t.connect({{hostOf(0), parentPort}, {hostOf(1), t.listenPort()}});
    send(toParent.fd[1], uint8_t{1});
    std::this_thread::sleep_for(20s);  // idle, connected: the test kills or freezes us long before this ends
    return 0;
  });
  ::close(toParent.fd[1]);
  toParent.fd[1] = -1;
  ::close(toChild.fd[0]);
  toChild.fd[0] = -1;
  auto cfg = config(0);
  cfg.peerDeadlineMs = peerDeadlineMs;
  auto t = std::make_unique<TcpTransport>(cfg);
  const auto childPort = receive<uint16_t>(toParent.fd[0], 5s, "child port");
  send(toChild.fd[1], t->listenPort());
  t->connect({{hostOf(0), t->listenPort()}, {hostOf(1), childPort}});
  (void)receive<uint8_t>(toParent.fd[0], 5s, "child connected");
  return t;
}
}  // namespace

TEST_CASE("a peer process that is SIGKILLed is reported lost within the deadline") {
  std::unique_ptr<Child> child;
  auto t = connectToIdleChild(child, /*peerDeadlineMs=*/1000);
  std::atomic<int> handlerCalls{0};
  t->setPeerFailureHandler([&](NodeIndex n, const PeerStatus& s) {
    if (n == 1 && s.state == PeerState::kFailed) ++handlerCalls;
  });
  std::vector<uint8_t> buf(64);
  const LocalRegion r = t->registerMemory({MemoryKind::kHost, buf.data(), buf.size()});
  const RemoteKey fake{TransportKind::kTcp, 1, 1, 0, 0, 64};
  REQUIRE(t->peerStatus(1).state == PeerState::kConnected);

  ::kill(child->pid, SIGKILL);
  const auto killedAt = Clock::now();
  REQUIRE_MESSAGE(waitFor([&] { return t->peerStatus(1).state == PeerState::kFailed; }, 1000ms),
                  "the SIGKILLed peer was not reported lost within its 1000 ms deadline");
  const auto detectMs = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count();
  MESSAGE("SIGKILLed peer detected after ", detectMs, " ms: ", t->peerStatus(1).reason);
  // The handler runs on the transport's thread just after the state changes: wait for it, then check it ran once.
  CHECK(waitFor([&] { return handlerCalls.load() >= 1; }, 1000ms));
  CHECK(handlerCalls.load() == 1);
  try {
    t->write(1, r, 0, fake, 0, 8, 0, true);
    FAIL("write to a lost peer succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kPeerLost);
    CHECK_MESSAGE(std::string(e.what()).find("(node 1) lost") != std::string::npos, e.what());
  }
  try {
    t->sendMessage(1, asBytes("are you there?"));
    FAIL("sendMessage to a lost peer succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kPeerLost);
    CHECK_MESSAGE(std::string(e.what()).find("(node 1) lost") != std::string::npos, e.what());
    CHECK_MESSAGE(std::string(e.what()).find(t->peerStatus(1).reason) != std::string::npos, e.what());
  }
  CHECK(child->wait(2s) == -SIGKILL);
}

TEST_CASE("a frozen peer process (SIGSTOP) is reported lost by the heartbeat deadline") {
  std::unique_ptr<Child> child;
  auto t = connectToIdleChild(child, /*peerDeadlineMs=*/400);
  ::kill(child->pid, SIGSTOP);
  const auto stoppedAt = Clock::now();
  REQUIRE_MESSAGE(waitFor([&] { return t->peerStatus(1).state == PeerState::kFailed; }, 2000ms),
                  "the frozen peer was not reported lost within 2000 ms (deadline 400 ms)");
  const auto detectMs = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - stoppedAt).count();
  MESSAGE("frozen peer detected after ", detectMs, " ms: ", t->peerStatus(1).reason);
  CHECK(detectMs >= 300);  // it was silence that did it, not an EOF
  CHECK(detectMs < 400 + 3 * 50 + 500);  // deadline + heartbeat ticks + scheduling slack
  CHECK(t->peerStatus(1).reason.find("deadline 400 ms") != std::string::npos);
  ::kill(child->pid, SIGKILL);
  ::kill(child->pid, SIGCONT);
  CHECK(child->wait(2s) == -SIGKILL);
}

namespace {
// Node 1 of the rejoin test, one incarnation: binds `port` (0: any), connects to the parent, exchanges keys,
// waits for the parent's data + flag `v`, answers with its own data + flag `v` and a message, then idles until
// the parent closes the pipe (or kills it).
int rejoinChild(int in, int out, uint64_t v) {
  // The port to bind (0 for any), then the parent's port.
  const auto port = receive<uint16_t>(in, 20s, "port to bind");
  auto cfg = config(1, "test-secret", 3);  // three connections: every one of them must come back
  cfg.listenPort = port;
  TcpTransport t(cfg);
  send(out, t.listenPort());
  const auto parentPort = receive<uint16_t>(in, 5s, "parent port");
  t.connect({{hostOf(0), parentPort}, {hostOf(1), t.listenPort()}});
  std::vector<uint8_t> dst(4096, 0), answer(4096, static_cast<uint8_t>(0x50 + v));
  uint64_t flag = 0;
  const LocalRegion answerRegion = t.registerMemory({MemoryKind::kHost, answer.data(), answer.size()});
  send(out, keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, dst.data(), dst.size()}))));
  send(out, keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, &flag, 8}))));
  const auto parentData = RemoteKey::decode(receive<KeyBytes>(in, 5s, "parent data key"));
  const auto parentFlag = RemoteKey::decode(receive<KeyBytes>(in, 5s, "parent flag key"));
  if (!waitFor([&] { return loadAcquire(flag) == v; }, 5s)) return 10;
  if (!std::all_of(dst.begin(), dst.end(), [&](uint8_t b) { return b == static_cast<uint8_t>(0x30 + v); })) return 11;
  t.write(0, answerRegion, 0, parentData, 0, answer.size(), 0, false);
  t.writeFlag(0, parentFlag, 0, v, 0, false);
  const std::string text = fmt::format("incarnation {}", v);
  t.sendMessage(0, asBytes(text));
  t.submit();
  char c;
  (void)readExact(in, &c, 1, 20s);
  return 0;
}
}  // namespace

TEST_CASE("a SIGKILLed peer process that restarts on the same port rejoins as a new generation") {
  // Both incarnations of node 1 are forked before this process starts any transport thread; the second one
  // waits for its port.
  Pipe toParentA, toChildA, toParentB, toChildB;
  Child first([&] {
    ::close(toParentA.fd[0]);
    ::close(toChildA.fd[1]);
    return rejoinChild(toChildA.fd[0], toParentA.fd[1], 1);
  });
  Child second([&] {
    ::close(toParentB.fd[0]);
    ::close(toChildB.fd[1]);
    return rejoinChild(toChildB.fd[0], toParentB.fd[1], 2);
  });
  for (Pipe* p : {&toParentA, &toParentB}) p->fd[1] = (::close(p->fd[1]), -1);
  for (Pipe* p : {&toChildA, &toChildB}) p->fd[0] = (::close(p->fd[0]), -1);

  std::vector<uint8_t> src(4096), back(4096, 0);
  uint64_t backFlag = 0;
  TcpTransport t(config(0, "test-secret", 3));
  Inbox inbox;
  inbox.install(t);
  std::atomic<int> rejoins{0}, failures{0};
  t.setPeerRejoinHandler([&](NodeIndex n) {
    if (n == 1) ++rejoins;
  });
  t.setPeerFailureHandler([&](NodeIndex n, const PeerStatus&) {
    if (n == 1) ++failures;
  });
  const LocalRegion srcRegion = t.registerMemory({MemoryKind::kHost, src.data(), src.size()});
  const KeyBytes backKey = keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, back.data(), back.size()})));
  const KeyBytes backFlagKey = keyBytes(t.remoteKey(t.registerMemory({MemoryKind::kHost, &backFlag, 8})));
  uint16_t childPort = 0;

  // One round with incarnation v: keys both ways, our data + flag v, its data + flag v + a message.
  auto round = [&](Pipe& toChild, Pipe& toParent, uint64_t v) {
    const auto dataKey = RemoteKey::decode(receive<KeyBytes>(toParent.fd[0], 10s, "child data key"));
    const auto flagKey = RemoteKey::decode(receive<KeyBytes>(toParent.fd[0], 5s, "child flag key"));
    send(toChild.fd[1], backKey);
    send(toChild.fd[1], backFlagKey);
    std::fill(src.begin(), src.end(), static_cast<uint8_t>(0x30 + v));
    t.write(1, srcRegion, 0, dataKey, 0, src.size(), 0, false);
    t.writeFlag(1, flagKey, 0, v, 0, false);
    t.submit();
    CHECK_MESSAGE(waitFor([&] { return loadAcquire(backFlag) == v; }, 5s), "incarnation ", v, "'s answer did not arrive");
    CHECK(std::all_of(back.begin(), back.end(), [&](uint8_t b) { return b == static_cast<uint8_t>(0x50 + v); }));
    CHECK_MESSAGE(waitFor([&] { return inbox.size() >= v; }, 5s), "incarnation ", v, "'s message did not arrive");
  };

  // Incarnation 1.
  send(toChildA.fd[1], uint16_t{0});
  childPort = receive<uint16_t>(toParentA.fd[0], 5s, "child port");
  send(toChildA.fd[1], t.listenPort());
  t.connect({{hostOf(0), t.listenPort()}, {hostOf(1), childPort}});
  CHECK(t.peerGeneration(1) == 1);
  round(toChildA, toParentA, 1);

  // Kill it: lost, ops fail fast, and nothing queued for it survives.
  ::kill(first.pid, SIGKILL);
  REQUIRE_MESSAGE(waitFor([&] { return t.peerStatus(1).state == PeerState::kFailed; }, 2s), "the kill was not noticed");
  CHECK(first.wait(2s) == -SIGKILL);
  CHECK(codeOf([&] { t.sendMessage(1, asBytes("lost")); }) == ErrorCode::kPeerLost);
  CHECK(t.peerGeneration(1) == 1);
  CHECK(rejoins.load() == 0);

  // Incarnation 2 on the same port: it rejoins by itself (our transport re-dials it and accepts its handshakes).
  const auto restartedAt = Clock::now();
  send(toChildB.fd[1], childPort);
  REQUIRE(receive<uint16_t>(toParentB.fd[0], 5s, "restarted child port") == childPort);
  send(toChildB.fd[1], t.listenPort());
  REQUIRE_MESSAGE(waitFor([&] { return t.peerStatus(1).state == PeerState::kConnected; }, 5s),
                  "the restarted peer did not rejoin within 5 s: ", t.peerStatus(1).reason);
  MESSAGE("rejoined after ", std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - restartedAt).count(),
          " ms");
  CHECK(t.peerGeneration(1) == 2);
  CHECK(t.peerStatus(1).reason.empty());
  CHECK(waitFor([&] { return rejoins.load() == 1; }, 1s));
  round(toChildB, toParentB, 2);
  {
    std::lock_guard lock(inbox.mutex);
    REQUIRE(inbox.messages.size() == 2);
    for (uint64_t v = 1; v <= 2; ++v) {
      const std::string text = fmt::format("incarnation {}", v);
      const auto& m = inbox.messages[v - 1];
      CHECK(m.from == 1);
      CHECK(std::string(reinterpret_cast<const char*>(m.bytes.data()), m.bytes.size()) == text);
    }
  }
  CHECK(failures.load() == 1);
  toChildB.closeBoth();  // lets it exit cleanly
  CHECK(second.wait(5s) == 0);
  CHECK(waitFor([&] { return t.peerStatus(1).state == PeerState::kClosed; }, 2s));
}
