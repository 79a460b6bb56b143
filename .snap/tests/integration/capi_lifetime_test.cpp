// The C API's lifetimes across tandem_disconnect, against a real tandemd: a session closed with live buffers,
// registrations and communicators releases all of them (here and in the daemon), and every later call on their
// handles, or on its ops, fails with the reason instead of touching released memory. scripts/test.sh also runs this
// under AddressSanitizer (label asan), which turns any use after free into a crash and any handle that freeing does
// not release into a leak report.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <fstream>
#include <future>
#include <optional>
#include <thread>

#include "gemm_args.hpp"
#include "harness.hpp"
#include "tandem/tandem.hpp"

using namespace tandem::testing;

namespace {

// Mappings of tandemd's memory in this process: session rings and cpu buffers are memfds named "tandem-...".
int daemonMappings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find("/memfd:tandem-") != std::string::npos;
  return n;
}

// Whether [p, p + bytes) is mapped in this process (mincore fails with ENOMEM on an unmapped page).
bool mapped(const void* p, size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  std::vector<unsigned char> vec((bytes + page - 1) / page + 1);
  return ::mincore(reinterpret_cast<void*>(base), bytes, vec.data()) == 0;
}

bool lastErrorHas(const std::string& needle) {
  const std::string msg = tandem_last_error();
  if (msg.find(needle) != std::string::npos) return true;
  MESSAGE("tandem_last_error: '" << msg << "' lacks '" << needle << "'");
  return false;
}

constexpr const char* kClosed = "belongs to a session that tandem_disconnect closed";

// Two sessions in this process join one 2-rank communicator (rank 0 on `s0`, rank 1 on `s1`).
std::pair<tandem_comm_t, tandem_comm_t> joinPair(tandem_session_t s0, tandem_session_t s1) {
  const tandem_unique_id_t id = tandem::uniqueId();
  tandem_comm_t c0 = nullptr, c1 = nullptr;
  tandem_status_t st1 = TANDEM_ERROR_INTERNAL;
  std::thread other([&] { st1 = tandem_comm_init(s1, &id, 2, 1, 10000, &c1); });
  const tandem_status_t st0 = tandem_comm_init(s0, &id, 2, 0, 10000, &c0);
  other.join();
  REQUIRE(st0 == TANDEM_SUCCESS);
  REQUIRE(st1 == TANDEM_SUCCESS);
  return {c0, c1};
}

// The status counters of the daemon's session `pid`-less view: buffers and bytes over all sessions.
struct Totals {
  uint64_t sessions, buffers, bytes, comms;
};
Totals totals(const Daemon& d) {
  const auto st = daemonStatus(d);
  return {st["sessions"].size(), st["total_buffers"].get<uint64_t>(), st["total_bytes"].get<uint64_t>(),
          st["communicators"].size()};
}

}  // namespace

TEST_CASE("tandem_disconnect with live buffers and communicators releases them, and later calls fail with the reason") {
  Daemon d;
  // The peer: a second session whose rank shares a communicator with ours, to see the daemon end it.
  tandem_session_t peer = nullptr;
  REQUIRE(tandem_connect(d.socket().c_str(), &peer) == TANDEM_SUCCESS);
  const int before = daemonMappings();

  tandem_session_t s = nullptr;
  REQUIRE(tandem_connect(d.socket().c_str(), &s) == TANDEM_SUCCESS);
  tandem_buffer_t a = nullptr, b = nullptr, c = nullptr, reg = nullptr;
  REQUIRE(tandem_alloc(s, 64 * 16 * 4, &a) == TANDEM_SUCCESS);
  REQUIRE(tandem_alloc(s, 8 * 16 * 4, &b) == TANDEM_SUCCESS);
  REQUIRE(tandem_alloc(s, 64 * 8 * 4, &c) == TANDEM_SUCCESS);
  // A registration of our own memfd memory: disconnect must leave the caller's memory alone.
  const int fd = ::memfd_create("capi-lifetime", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);  // tandemd maps only memfds that cannot shrink under it
  void* own = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(own != MAP_FAILED);
  REQUIRE(tandem_register(s, own, 8192, fd, 0, &reg) == TANDEM_SUCCESS);

  tandem_comm_t solo = nullptr;  // a 1-rank communicator, and one shared with the peer
  const tandem_unique_id_t soloId = tandem::uniqueId();
  REQUIRE(tandem_comm_init(s, &soloId, 1, 0, 10000, &solo) == TANDEM_SUCCESS);
  const auto [shared, peerComm] = joinPair(s, peer);

  // An op that completed and one still pending (the peer has not reached its barrier).
  const auto gemm = agGemmArgs(TANDEM_DTYPE_FP32, 64, 8, 16, {a, 0}, {b, 0}, {c, 0}, {nullptr, 0}, nullptr);
  tandem_op_t done{}, pending{};
  REQUIRE(tandem_ag_gemm(solo, &gemm, &done) == TANDEM_SUCCESS);
  REQUIRE(tandem_wait(done, 10000) == TANDEM_SUCCESS);
  REQUIRE(tandem_barrier(shared, &pending) == TANDEM_SUCCESS);
  CHECK(tandem_op_status(pending, nullptr, 0) == TANDEM_IN_PROGRESS);

  void* aPtr = tandem_buffer_ptr(a);
  REQUIRE(aPtr != nullptr);
  std::memset(aPtr, 0x5a, tandem_buffer_size(a));
  CHECK(daemonMappings() == before + 4);  // rings, a, b, c
  Totals t = totals(d);
  CHECK(t.buffers == 4);
  CHECK(t.comms == 2);

  REQUIRE(tandem_disconnect(s) == TANDEM_SUCCESS);

  // Here: every mapping of the session is gone, the caller's registered memory is not.
  CHECK(daemonMappings() == before);
  CHECK_FALSE(mapped(aPtr, 4096));
  CHECK(mapped(own, 8192));
  static_cast<char*>(own)[0] = 1;

  // In the daemon: the session ended, its memory is free, the solo communicator is gone and the peer's rank of the
  // shared one sees its partner lost (its barrier fails instead of waiting forever).
  CHECK(eventually([&] {
    t = totals(d);
    return t.sessions == 2 && t.buffers == 0 && t.bytes == 0;  // the peer's and tandemctl's
  }));
  tandem_op_t peerOp{};
  REQUIRE(tandem_barrier(peerComm, &peerOp) == TANDEM_SUCCESS);
  CHECK(tandem_wait(peerOp, 10000) == TANDEM_ERROR_PEER_LOST);

  // Buffers: the accessors return nothing and say why.
  CHECK(tandem_buffer_ptr(a) == nullptr);
  CHECK(lastErrorHas(kClosed));
  CHECK(lastErrorHas("tandem_free"));
  CHECK(tandem_buffer_size(b) == 0);
  CHECK(lastErrorHas("tandem_buffer_size: this buffer " + std::string(kClosed)));
  CHECK(tandem_buffer_ptr(reg) == nullptr);

  // Communicators: every op, abort and accessor fails before anything is submitted.
  CHECK(tandem_ag_gemm(solo, &gemm, &done) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_ag_gemm: this communicator " + std::string(kClosed)));
  CHECK(lastErrorHas("tandem_comm_destroy"));
  const auto ar = gemmArgs<tandem_gemm_ar_args_t>(TANDEM_DTYPE_FP32, 64, 8, 16, {a, 0}, {b, 0}, {c, 0}, nullptr);
  CHECK(tandem_gemm_ar(shared, &ar, &done) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas(kClosed));
  const tandem_allgather_args_t ag{sizeof ag, {a, 0}, {c, 0}, 64, nullptr};
  CHECK(tandem_allgather(shared, &ag, &done) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas(kClosed));
  const tandem_barrier_args_t bar{sizeof bar, nullptr};
  CHECK(tandem_barrier_stream(solo, &bar, &done) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_barrier(shared, &done) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_comm_abort(shared) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_comm_abort: this communicator " + std::string(kClosed)));
  CHECK(tandem_comm_rank(solo) == 0);
  CHECK(lastErrorHas(kClosed));
  CHECK(tandem_comm_nranks(shared) == 0);
  CHECK(lastErrorHas(kClosed));

  // Ops: finished or not, their outcome is gone with the session.
  CHECK(tandem_wait(done, 1000) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_wait: this op belongs to a session that tandem_disconnect closed"));
  char message[64] = "untouched";
  CHECK(tandem_op_status(pending, message, sizeof message) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_op_status: this op"));
  CHECK(std::string(message) == "untouched");
  tandem_op_t never{};
  CHECK(tandem_wait(never, 0) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("was it submitted"));

  // Freeing: each call fails with the reason and frees the handle itself (the ASan run reports a leak otherwise).
  CHECK(tandem_free(reg) == TANDEM_ERROR_INVALID_ARGUMENT);  // still the wrong call for a registration: kept
  CHECK(lastErrorHas("tandem_deregister"));
  CHECK(tandem_deregister(reg) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_deregister: this buffer " + std::string(kClosed)));
  CHECK(tandem_free(a) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_free: this buffer " + std::string(kClosed)));
  CHECK(tandem_free(b) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_free(c) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_comm_destroy(solo) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("tandem_comm_destroy: this communicator " + std::string(kClosed)));
  CHECK(tandem_comm_destroy(shared) == TANDEM_ERROR_INVALID_ARGUMENT);

  // The peer is unaffected: its session still allocates, and it cleans up as usual.
  tandem_buffer_t p = nullptr;
  REQUIRE(tandem_alloc(peer, 4096, &p) == TANDEM_SUCCESS);
  CHECK(tandem_free(p) == TANDEM_SUCCESS);
  CHECK(tandem_comm_destroy(peerComm) == TANDEM_SUCCESS);
  CHECK(tandem_disconnect(peer) == TANDEM_SUCCESS);
  CHECK(eventually([&] {
    t = totals(d);
    return t.sessions == 1 && t.buffers == 0 && t.comms == 0;  // tandemctl's own
  }));
  ::munmap(own, 8192);
  ::close(fd);
}

TEST_CASE("C++: Buffer and Communicator may outlive their Session, and close() twice is harmless") {
  Daemon d;
  const int before = daemonMappings();
  std::optional<tandem::Buffer> buffer;
  std::optional<tandem::Communicator> comm;
  {
    tandem::Session s(d.socket().c_str());
    buffer.emplace(s, 1 << 20);
    comm.emplace(s, tandem::uniqueId(), 1, 0, 10000);
    std::memset(buffer->data(), 1, buffer->size());
    CHECK(comm->nranks() == 1);
    s.close();
    s.close();  // and the destructor a third time
    CHECK(s.get() == nullptr);
  }
  CHECK(daemonMappings() == before);
  CHECK(buffer->data() == nullptr);
  CHECK(buffer->size() == 0);
  try {
    comm->abort();
    FAIL("abort on a communicator of a closed session succeeded");
  } catch (const tandem::Exception& e) {
    CHECK(e.status() == TANDEM_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(e.what()).find(kClosed) != std::string::npos);
  }
  buffer.reset();  // tandem_free on a closed session: frees the handle, no crash
  comm.reset();
  CHECK(eventually([&] { return totals(d).buffers == 0 && totals(d).sessions == 1; }));
}

TEST_CASE("tandem_disconnect returns promptly while another thread waits, and that wait fails with the reason") {
  Daemon d;
  tandem_session_t s = nullptr, peer = nullptr;
  REQUIRE(tandem_connect(d.socket().c_str(), &s) == TANDEM_SUCCESS);
  REQUIRE(tandem_connect(d.socket().c_str(), &peer) == TANDEM_SUCCESS);
  const auto [mine, theirs] = joinPair(s, peer);
  tandem_op_t op{};
  REQUIRE(tandem_barrier(mine, &op) == TANDEM_SUCCESS);  // the peer never joins it: the op stays pending

  // A wait with no deadline, and (on a second thread) a rendezvous no other rank will join: both hold the session.
  auto waiter = std::async(std::launch::async, [op] {
    const tandem_status_t st = tandem_wait(op, -1);
    return std::make_pair(st, std::string(tandem_last_error()));
  });
  const tandem_unique_id_t lonelyId = tandem::uniqueId();
  auto joiner = std::async(std::launch::async, [&] {
    tandem_comm_t never = nullptr;
    const tandem_status_t st = tandem_comm_init(s, &lonelyId, 2, 0, 60000, &never);
    return std::make_pair(st, std::string(tandem_last_error()));
  });
  // The joiner uses the session handle, which tandem_disconnect frees: disconnect only once it is inside the call
  // (the daemon lists its half-joined communicator).
  REQUIRE(eventually([&] {
    const auto st = daemonStatus(d);
    for (const auto& c : st["communicators"]) {
      if (c["nranks"] == 2 && c["joined"] == 1) return true;
    }
    return false;
  }, 10000));
  const auto start = Clock::now();
  REQUIRE(tandem_disconnect(s) == TANDEM_SUCCESS);
  CHECK(Clock::now() - start < std::chrono::seconds(5));  // not the joiner's 60 s deadline

  REQUIRE(waiter.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  REQUIRE(joiner.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  const auto [waitStatus, waitMessage] = waiter.get();
  CHECK(waitStatus == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(waitMessage.find("tandem_wait") != std::string::npos);
  CHECK(waitMessage.find("tandem_disconnect") != std::string::npos);  // "closed ... in flight", or closed before
  const auto [joinStatus, joinMessage] = joiner.get();
  CHECK(joinStatus == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(joinMessage.find("tandem_comm_init: tandem_disconnect closed the session while this call was in flight") !=
        std::string::npos);

  CHECK(tandem_comm_destroy(mine) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(tandem_comm_destroy(theirs) == TANDEM_SUCCESS);
  CHECK(tandem_disconnect(peer) == TANDEM_SUCCESS);
  CHECK(eventually([&] { return totals(d).sessions == 1 && totals(d).comms == 0; }));
}

TEST_CASE("version: the header, tandem_get_version and tandem_version agree") {
  int major = -1, minor = -1, patch = -1;
  CHECK(tandem_get_version(&major, &minor, &patch) == TANDEM_VERSION_CODE);
  CHECK(tandem_get_version(nullptr, nullptr, nullptr) == TANDEM_VERSION_CODE);
  CHECK(TANDEM_VERSION_CODE == major * 10000 + minor * 100 + patch);
  CHECK(fmt::format("{}.{}.{}", major, minor, patch) == tandem_version());
  CHECK(tandem::libraryVersionCode() == TANDEM_VERSION_CODE);
}

TEST_CASE("allgather and barrier_stream check their argument structs") {
  Daemon d;
  tandem::Session s(d.socket().c_str());
  tandem::Communicator comm(s, tandem::uniqueId(), 1, 0, 10000);
  tandem::Buffer send(s, 64), recv(s, 64);
  tandem_op_t op{};
  tandem_allgather_args_t ag{0, send.tensor(), recv.tensor(), 64, nullptr};
  CHECK(tandem_allgather(comm.get(), &ag, &op) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("sizeof(tandem_allgather_args_t)"));
  CHECK(tandem_allgather(comm.get(), nullptr, &op) == TANDEM_ERROR_INVALID_ARGUMENT);
  tandem_barrier_args_t bar{sizeof bar - 1, nullptr};
  CHECK(tandem_barrier_stream(comm.get(), &bar, &op) == TANDEM_ERROR_INVALID_ARGUMENT);
  CHECK(lastErrorHas("sizeof(tandem_barrier_args_t)"));
  // Well formed, they run.
  std::memset(send.data(), 0x33, 64);
  ag.struct_size = sizeof ag;
  REQUIRE(tandem_allgather(comm.get(), &ag, &op) == TANDEM_SUCCESS);
  CHECK(tandem_wait(op, 10000) == TANDEM_SUCCESS);
  CHECK(std::memcmp(send.data(), recv.data(), 64) == 0);
  bar.struct_size = sizeof bar;
  REQUIRE(tandem_barrier_stream(comm.get(), &bar, &op) == TANDEM_SUCCESS);
  CHECK(tandem_wait(op, 10000) == TANDEM_SUCCESS);
}
