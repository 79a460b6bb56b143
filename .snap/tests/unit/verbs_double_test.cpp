// tandem's use of verbs, checked against the verbs test double (tests/support/verbs_double): the RC QP state machine
// with the attribute masks tandem's builders produce, data before flag across processes, selective signalling and
// send-queue accounting, WRITE_WITH_IMM and SEND completions, and the injected faults (delayed completion, a QP error
// mid-transfer, a peer that disappears). Then the verbs transport itself over the double: control messages ordered
// after data, fragmentation, and the bootstrap's QP set-up, failure and re-connection. ctest runs this with the
// double first in LD_LIBRARY_PATH; it is no speed claim.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp_transport.hpp"
#include "transport/verbs_logic.hpp"
#include "transport/verbs_transport.hpp"
#include "verbs_double/verbs_double.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;
namespace vd = tandem::testing::verbs_double;

namespace {

using Clock = std::chrono::steady_clock;

bool waitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 2000ms) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(50us);
  }
  return true;
}

uint64_t loadAcquire(const uint64_t& word) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(word)).load(std::memory_order_acquire);
}

constexpr unsigned kRemoteAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// One device context with a PD and a CQ; QPs made on it. Plain verbs, destroyed in reverse order.
struct Hca {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  std::vector<ibv_qp*> qps;
  std::vector<ibv_mr*> mrs;

  Hca() {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr || n < 1) throw std::runtime_error("no verbs device: " + vd::notLoadedReason());
    ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    if (ctx == nullptr) throw std::runtime_error("ibv_open_device failed");
    pd = ibv_alloc_pd(ctx);
    cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
  }
  ~Hca() {
    for (ibv_qp* q : qps) ibv_destroy_qp(q);
    for (ibv_mr* m : mrs) ibv_dereg_mr(m);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
  }
  ibv_qp* qp(uint32_t sendWr = 16, uint32_t recvWr = 16, int sigAll = 0) {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.cap.max_send_wr = sendWr;
    init.cap.max_recv_wr = recvWr;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = 64;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = sigAll;
    ibv_qp* q = ibv_create_qp(pd, &init);
    if (q == nullptr) throw std::runtime_error("ibv_create_qp failed");
    qps.push_back(q);
    return q;
  }
  ibv_mr* reg(void* p, size_t n, int access = static_cast<int>(kRemoteAccess)) {
    ibv_mr* m = ibv_reg_mr(pd, p, n, access);
    if (m == nullptr) throw std::runtime_error("ibv_reg_mr failed");
    mrs.push_back(m);
    return m;
  }
  verbs::QpInfo info(ibv_qp* q) const {
    ibv_port_attr port{};
    ibv_query_port(ctx, 1, &port);
    ibv_gid gid{};
    ibv_query_gid(ctx, 1, 0, &gid);
    verbs::QpInfo i;
    i.lid = port.lid;
    i.mtu = static_cast<uint8_t>(port.active_mtu);
    i.linkLayer = port.link_layer;
    i.qpn = q->qp_num;
    i.psn = 0x1234;
    std::memcpy(i.gid.data(), gid.raw, 16);
    return i;
  }
  std::vector<ibv_wc> drain(std::size_t want, std::chrono::milliseconds timeout = 2000ms) {
    std::vector<ibv_wc> out;
    waitFor([&] {
      ibv_wc wc[8];
      const int n = ibv_poll_cq(cq, 8, wc);
      for (int i = 0; i < n; ++i) out.push_back(wc[i]);
      return out.size() >= want;
    }, timeout);
    return out;
  }
};

verbs::PathConfig path() {
  verbs::PathConfig p;
  p.activeMtu = IBV_MTU_4096;
  return p;
}

void toInit(ibv_qp* q) {
  auto t = verbs::buildInitAttr(path(), kRemoteAccess);
  REQUIRE(ibv_modify_qp(q, &t.attr, t.mask) == 0);
}
void toRts(ibv_qp* q, const verbs::QpInfo& local, const verbs::QpInfo& remote) {
  auto rtr = verbs::buildRtrAttr(path(), local, remote);
  REQUIRE(ibv_modify_qp(q, &rtr.attr, rtr.mask) == 0);
  auto rts = verbs::buildRtsAttr(path(), local.psn);
  REQUIRE(ibv_modify_qp(q, &rts.attr, rts.mask) == 0);
}
// Two QPs of one process connected to each other (the double routes them through its own HCA socket).
std::pair<ibv_qp*, ibv_qp*> connectedPair(Hca& h, uint32_t sendWr = 16, uint32_t recvWr = 16) {
  ibv_qp* a = h.qp(sendWr, recvWr);
  ibv_qp* b = h.qp(sendWr, recvWr);
  toInit(a);
  toInit(b);
  toRts(a, h.info(a), h.info(b));
  toRts(b, h.info(b), h.info(a));
  return {a, b};
}

int postWrite(ibv_qp* q, uint64_t id, void* src, uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey,
              unsigned flags, ibv_wr_opcode op = IBV_WR_RDMA_WRITE, uint32_t imm = 0) {
  ibv_sge sge{reinterpret_cast<uint64_t>(src), len, lkey};
  ibv_send_wr wr{};
  wr.wr_id = id;
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = op;
  wr.send_flags = flags;
  wr.imm_data = imm;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(q, &wr, &bad);
}
int postRecv(ibv_qp* q, uint64_t id, void* dst, uint32_t len, uint32_t lkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(dst), len, lkey};
  ibv_recv_wr wr{};
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(q, &wr, &bad);
}

struct FaultsCleared {
  ~FaultsCleared() { vd::setFaults(""); }
};

}  // namespace

TEST_CASE("the double is loaded in place of libibverbs") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  REQUIRE(n == 1);
  CHECK(std::string(ibv_get_device_name(list[0])) == "tandem_double0");
  ibv_free_device_list(list);
}

TEST_CASE("RC QP state machine: tandem's attribute builders pass, while wrong masks, skipped states and bad values fail") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  Hca h;
  ibv_qp* a = h.qp();
  ibv_qp* b = h.qp();
  std::array<uint8_t, 64> buf{};
  ibv_mr* mr = h.reg(buf.data(), buf.size());
  // Posting before RTS is refused.
  CHECK(postWrite(a, 1, buf.data(), 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) == EINVAL);
  CHECK(postRecv(a, 1, buf.data(), 8, mr->lkey) == EINVAL);  // RESET has no receive queue yet

  auto init = verbs::buildInitAttr(path(), kRemoteAccess);
  SUBCASE("INIT without its access flags is refused") {
    CHECK(ibv_modify_qp(a, &init.attr, init.mask & ~IBV_QP_ACCESS_FLAGS) == EINVAL);
  }
  SUBCASE("RESET -> RTR (skipping INIT) is refused") {
    auto rtr = verbs::buildRtrAttr(path(), h.info(a), h.info(b));
    CHECK(ibv_modify_qp(a, &rtr.attr, rtr.mask) == EINVAL);
  }
  SUBCASE("INIT with a port that does not exist is refused") {
    init.attr.port_num = 2;
    CHECK(ibv_modify_qp(a, &init.attr, init.mask) == EINVAL);
  }
  SUBCASE("the whole path, then the errors of each later transition") {
    REQUIRE(ibv_modify_qp(a, &init.attr, init.mask) == 0);
    CHECK(a->state == IBV_QPS_INIT);
    CHECK(postRecv(a, 7, buf.data(), 8, mr->lkey) == 0);  // receives may be posted from INIT on
    auto rts = verbs::buildRtsAttr(path(), 1);
    CHECK(ibv_modify_qp(a, &rts.attr, rts.mask) == EINVAL);  // INIT -> RTS skips RTR
    auto rtr = verbs::buildRtrAttr(path(), h.info(a), h.info(b));
    auto bad = rtr;
    bad.attr.ah_attr.is_global = 0;  // RoCE needs a GRH
    CHECK(ibv_modify_qp(a, &bad.attr, bad.mask) == EINVAL);
    bad = rtr;
    bad.mask &= ~IBV_QP_MIN_RNR_TIMER;  // a required attribute missing
    CHECK(ibv_modify_qp(a, &bad.attr, bad.mask) == EINVAL);
    bad = rtr;
    bad.mask |= IBV_QP_SQ_PSN;  // an attribute of another transition
    CHECK(ibv_modify_qp(a, &bad.attr, bad.mask) == EINVAL);
    bad = rtr;
    bad.attr.dest_qp_num = 1u << 24;  // QPNs have 24 bits
    CHECK(ibv_modify_qp(a, &bad.attr, bad.mask) == EINVAL);
    REQUIRE(ibv_modify_qp(a, &rtr.attr, rtr.mask) == 0);
    CHECK(postWrite(a, 1, buf.data(), 8, mr->lkey, 0, 0, IBV_SEND_SIGNALED) == EINVAL);  // RTR cannot send
    auto badRts = rts;
    badRts.attr.retry_cnt = 8;  // a 3-bit field
    CHECK(ibv_modify_qp(a, &badRts.attr, badRts.mask) == EINVAL);
    REQUIRE(ibv_modify_qp(a, &rts.attr, rts.mask) == 0);
    CHECK(a->state == IBV_QPS_RTS);
    // To the error state: the posted receive flushes.
    ibv_qp_attr err{};
    err.qp_state = IBV_QPS_ERR;
    REQUIRE(ibv_modify_qp(a, &err, IBV_QP_STATE) == 0);
    const auto wcs = h.drain(1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].wr_id == 7);
    CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR);
    CHECK(ibv_modify_qp(a, &rts.attr, rts.mask) == EINVAL);  // out of ERR only through RESET
    ibv_qp_attr reset{};
    reset.qp_state = IBV_QPS_RESET;
    REQUIRE(ibv_modify_qp(a, &reset, IBV_QP_STATE) == 0);
    CHECK(ibv_modify_qp(a, &init.attr, init.mask) == 0);
  }
  // Children keep their parents: a PD with MRs and QPs cannot go.
  CHECK(ibv_dealloc_pd(h.pd) == EBUSY);
  CHECK(ibv_destroy_cq(h.cq) == EBUSY);
}

TEST_CASE("selective signalling: unsignalled WQEs hold send-queue slots until a signalled completion is polled") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  Hca h;
  auto [a, b] = connectedPair(h, 4, 4);
  std::array<uint8_t, 64> src{}, dst{};
  ibv_mr* s = h.reg(src.data(), src.size());
  ibv_mr* d = h.reg(dst.data(), dst.size());
  const auto raddr = reinterpret_cast<uint64_t>(dst.data());
  for (int i = 0; i < 4; ++i) REQUIRE(postWrite(a, 10 + i, src.data(), 8, s->lkey, raddr, d->rkey, 0) == 0);
  // Four unsignalled WQEs fill a 4-deep queue, and no completion will ever free it.
  CHECK(postWrite(a, 99, src.data(), 8, s->lkey, raddr, d->rkey, IBV_SEND_SIGNALED) == ENOMEM);
  ibv_qp* c = h.qp(4, 4);
  ibv_qp* e = h.qp(4, 4);
  toInit(c);
  toInit(e);
  toRts(c, h.info(c), h.info(e));
  toRts(e, h.info(e), h.info(c));
  // With the fourth signalled, polling its completion frees all four slots.
  for (int i = 0; i < 3; ++i) REQUIRE(postWrite(c, 20 + i, src.data(), 8, s->lkey, raddr, d->rkey, 0) == 0);
  REQUIRE(postWrite(c, 23, src.data(), 8, s->lkey, raddr, d->rkey, IBV_SEND_SIGNALED) == 0);
  CHECK(postWrite(c, 24, src.data(), 8, s->lkey, raddr, d->rkey, 0) == ENOMEM);
  const auto wcs = h.drain(1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 23);
  CHECK(wcs[0].status == IBV_WC_SUCCESS);
  CHECK(wcs[0].opcode == IBV_WC_RDMA_WRITE);
  CHECK(postWrite(c, 25, src.data(), 8, s->lkey, raddr, d->rkey, IBV_SEND_SIGNALED) == 0);
  CHECK(h.drain(1).size() == 1);
}

TEST_CASE("WRITE_WITH_IMM and SEND complete on the responder after the data, and a SEND waits for a posted receive") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  Hca h;
  auto [a, b] = connectedPair(h);
  std::vector<uint8_t> src(4096), dst(4096, 0), inbox(256, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 1);
  ibv_mr* s = h.reg(src.data(), src.size());
  ibv_mr* d = h.reg(dst.data(), dst.size());
  ibv_mr* in = h.reg(inbox.data(), inbox.size());
  REQUIRE(postRecv(b, 500, inbox.data(), 256, in->lkey) == 0);
  REQUIRE(postWrite(a, 1, src.data(), 4096, s->lkey, reinterpret_cast<uint64_t>(dst.data()), d->rkey,
                    IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE_WITH_IMM, htonl(0xabcd)) == 0);
  auto wcs = h.drain(2);
  REQUIRE(wcs.size() == 2);
  const ibv_wc& recv = wcs[0].opcode == IBV_WC_RECV_RDMA_WITH_IMM ? wcs[0] : wcs[1];
  CHECK(recv.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
  CHECK(recv.wr_id == 500);
  CHECK(recv.byte_len == 4096);
  CHECK((recv.wc_flags & IBV_WC_WITH_IMM) != 0);
  CHECK(ntohl(recv.imm_data) == 0xabcd);
  CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);  // the data was there when the completion was

  // A SEND with no receive posted waits (RNR), then lands when one is.
  const uint64_t waitsBefore = vd::counter("rnr_waits");
  REQUIRE(postWrite(a, 2, src.data(), 100, s->lkey, 0, 0, IBV_SEND_SIGNALED, IBV_WR_SEND) == 0);
  REQUIRE(waitFor([&] { return vd::counter("rnr_waits") > waitsBefore; }));
  ibv_wc none[2];
  CHECK(ibv_poll_cq(h.cq, 2, none) == 0);
  REQUIRE(postRecv(b, 501, inbox.data(), 256, in->lkey) == 0);
  wcs = h.drain(2);
  REQUIRE(wcs.size() == 2);
  for (const auto& wc : wcs) {
    CHECK(wc.status == IBV_WC_SUCCESS);
    if (wc.wr_id == 501) {
      CHECK(wc.opcode == IBV_WC_RECV);
      CHECK(wc.byte_len == 100);
    }
  }
  CHECK(std::memcmp(src.data(), inbox.data(), 100) == 0);
}

TEST_CASE("errors a real HCA reports: a bad rkey, a write outside the MR, a SEND larger than the receive") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  Hca h;
  auto [a, b] = connectedPair(h);
  std::array<uint8_t, 64> src{}, dst{};
  ibv_mr* s = h.reg(src.data(), src.size());
  ibv_mr* d = h.reg(dst.data(), dst.size());
  const auto raddr = reinterpret_cast<uint64_t>(dst.data());
  SUBCASE("bad rkey") {
    REQUIRE(postWrite(a, 1, src.data(), 8, s->lkey, raddr, d->rkey ^ 0x100, 0) == 0);
  }
  SUBCASE("outside the MR") {
    REQUIRE(postWrite(a, 1, src.data(), 16, s->lkey, raddr + 56, d->rkey, 0) == 0);
  }
  REQUIRE(postWrite(a, 2, src.data(), 8, s->lkey, raddr, d->rkey, IBV_SEND_SIGNALED) == 0);
  const auto wcs = h.drain(2);
  REQUIRE(wcs.size() >= 2);
  CHECK(wcs[0].wr_id == 1);  // reported although unsignalled: errors always complete
  CHECK(wcs[0].status == IBV_WC_REM_ACCESS_ERR);
  CHECK(wcs[1].wr_id == 2);
  CHECK(wcs[1].status == IBV_WC_WR_FLUSH_ERR);  // the QP is in the error state: the rest flush
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  REQUIRE(ibv_query_qp(a, &attr, IBV_QP_STATE, &init) == 0);
  CHECK(attr.qp_state == IBV_QPS_ERR);
}

TEST_CASE("delayed completions: a completion becomes visible only after the injected delay, in order") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  FaultsCleared cleared;
  Hca h;
  auto [a, b] = connectedPair(h);
  std::array<uint8_t, 64> src{}, dst{};
  ibv_mr* s = h.reg(src.data(), src.size());
  ibv_mr* d = h.reg(dst.data(), dst.size());
  vd::setFaults("delay_completions_ms=80");
  const auto posted = Clock::now();
  REQUIRE(postWrite(a, 1, src.data(), 8, s->lkey, reinterpret_cast<uint64_t>(dst.data()), d->rkey,
                    IBV_SEND_SIGNALED) == 0);
  REQUIRE(postWrite(a, 2, src.data(), 8, s->lkey, reinterpret_cast<uint64_t>(dst.data()), d->rkey,
                    IBV_SEND_SIGNALED) == 0);
  const auto wcs = h.drain(2);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - posted).count();
  REQUIRE(wcs.size() == 2);
  CHECK(wcs[0].wr_id == 1);
  CHECK(wcs[1].wr_id == 2);
  CHECK(ms >= 80);
}

TEST_CASE("a QP error injected mid-transfer fails that WQE after the earlier ones completed and flushes the rest") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  FaultsCleared cleared;
  Hca h;
  auto [a, b] = connectedPair(h);
  std::vector<uint8_t> src(1024, 7), dst(1024, 0);
  ibv_mr* s = h.reg(src.data(), src.size());
  ibv_mr* d = h.reg(dst.data(), dst.size());
  vd::setFaults("qp_error_after_writes=2");
  const auto raddr = reinterpret_cast<uint64_t>(dst.data());
  for (int i = 0; i < 4; ++i) REQUIRE(postWrite(a, i, src.data(), 256, s->lkey, raddr + 256 * i, d->rkey, 0) == 0);
  const auto wcs = h.drain(3);
  REQUIRE(wcs.size() == 3);
  CHECK(wcs[0].wr_id == 1);
  CHECK(wcs[0].status == IBV_WC_RETRY_EXC_ERR);
  CHECK(wcs[1].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(wcs[2].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(dst[0] == 7);    // the first write landed
  CHECK(dst[256] == 0);  // the failed one did not
}

TEST_CASE("across processes: data lands before the flag written after it, and a peer that disappears fails the QP") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  constexpr size_t kBytes = 1 << 20;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The responder: its QP, a buffer and a flag; it reports whether the data was whole when the flag was set.
    ::close(sv[0]);
    int rc = 1;
    try {
      Hca h;
      ibv_qp* q = h.qp();
      std::vector<uint8_t> buf(kBytes + 8, 0);
      ibv_mr* mr = h.reg(buf.data(), buf.size());
      verbs::QpInfo mine = h.info(q), theirs;
      mine.rkey = mr->rkey;
      mine.addr = reinterpret_cast<uint64_t>(buf.data());
      if (::read(sv[1], &theirs, sizeof theirs) != sizeof theirs) std::_Exit(2);
      toInit(q);
      auto rtr = verbs::buildRtrAttr(path(), mine, theirs);
      auto rts = verbs::buildRtsAttr(path(), mine.psn);
      if (ibv_modify_qp(q, &rtr.attr, rtr.mask) || ibv_modify_qp(q, &rts.attr, rts.mask)) std::_Exit(3);
      if (::write(sv[1], &mine, sizeof mine) != sizeof mine) std::_Exit(4);
      const uint64_t& flag = *reinterpret_cast<const uint64_t*>(buf.data() + kBytes);
      if (!waitFor([&] { return loadAcquire(flag) == 42; }, 5000ms)) std::_Exit(5);
      rc = 0;
      for (size_t i = 0; i < kBytes; ++i) rc |= buf[i] != static_cast<uint8_t>(i * 31 + 5);
      const char verdict = rc == 0 ? 'y' : 'n';
      if (::write(sv[1], &verdict, 1) != 1) std::_Exit(6);
      char wait;
      [[maybe_unused]] auto r = ::read(sv[1], &wait, 1);  // until the parent kills us
    } catch (...) {
      std::_Exit(7);
    }
    std::_Exit(rc);
  }
  ::close(sv[1]);
  // Kills and reaps the child unless the test already did. Never kill(-1) or kill(0): those signal every process.
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  Hca h;
  ibv_qp* q = h.qp(64, 4);
  std::vector<uint8_t> src(kBytes);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 31 + 5);
  ibv_mr* s = h.reg(src.data(), src.size());
  verbs::QpInfo mine = h.info(q), theirs;
  toInit(q);
  REQUIRE(::write(sv[0], &mine, sizeof mine) == sizeof mine);
  REQUIRE(::read(sv[0], &theirs, sizeof theirs) == sizeof theirs);
  toRts(q, mine, theirs);
  // The data in 16 unsignalled writes of 64 KiB, then an inline flag, signalled.
  constexpr uint32_t kChunk = 64 << 10;
  for (uint32_t i = 0; i < kBytes / kChunk; ++i)
    REQUIRE(postWrite(q, i, src.data() + i * kChunk, kChunk, s->lkey, theirs.addr + i * kChunk, theirs.rkey, 0) == 0);
  uint64_t flag = 42;
  REQUIRE(postWrite(q, 100, &flag, 8, 0, theirs.addr + kBytes, theirs.rkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0);
  char verdict = 0;
  REQUIRE(::read(sv[0], &verdict, 1) == 1);
  CHECK(verdict == 'y');
  auto wcs = h.drain(1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 100);
  CHECK(wcs[0].status == IBV_WC_SUCCESS);
  // The peer disappears (its process dies): the next write fails with the transport retry error.
  REQUIRE(child > 0);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  reap.pid = 0;  // reaped
  REQUIRE(postWrite(q, 200, src.data(), 64, s->lkey, theirs.addr, theirs.rkey, IBV_SEND_SIGNALED) == 0);
  wcs = h.drain(1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 200);
  CHECK(wcs[0].status == IBV_WC_RETRY_EXC_ERR);
  ::close(sv[0]);
}

// ---- the verbs transport over the double ----

namespace {

VerbsConfig transportConfig(NodeIndex self, uint32_t qps) {
  VerbsConfig c;
  c.self = self;
  c.nodeCount = 2;
  c.qpsPerPeer = qps;
  c.stripeBytes = 64 << 10;
  c.recvSlots = 4;
  c.recvSlotBytes = 4096;
  return c;
}

void connectByHand(VerbsTransport& a, VerbsTransport& b) {
  const auto fromA = a.localQpInfo(1);
  const auto fromB = b.localQpInfo(0);
  a.connectPeer(1, fromB);
  b.connectPeer(0, fromA);
}

std::span<const std::byte> bytesOf(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// Collects completions of a transport by polling it, as the proxy does.
std::vector<Completion> pollUntil(Transport& t, std::size_t want, std::chrono::milliseconds timeout = 3000ms) {
  std::vector<Completion> got;
  waitFor([&] {
    std::array<Completion, 16> buf{};
    const auto n = t.poll(buf);
    got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
    return got.size() >= want;
  }, timeout);
  return got;
}

}  // namespace

TEST_CASE("verbs transport: a control message arrives after the data written before it, on one QP or several") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  uint32_t qps = 1;
  SUBCASE("one QP") { qps = 1; }
  SUBCASE("three QPs") { qps = 3; }
  VerbsTransport a(transportConfig(0, qps)), b(transportConfig(1, qps));
  connectByHand(a, b);
  constexpr std::size_t kBytes = 1 << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
  for (std::size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 3 + 11);
  const LocalRegion s = a.registerMemory({MemoryKind::kHost, src.data(), kBytes});
  const RemoteKey d = b.remoteKey(b.registerMemory({MemoryKind::kHost, dst.data(), kBytes}));
  std::mutex m;
  std::vector<std::string> received;
  bool wholeWhenReceived = true;
  b.setMessageHandler([&](NodeIndex from, std::span<const std::byte> payload) {
    std::lock_guard lock(m);
    CHECK(from == 0);
    if (received.empty()) wholeWhenReceived = std::memcmp(src.data(), dst.data(), kBytes) == 0;
    received.emplace_back(reinterpret_cast<const char*>(payload.data()), payload.size());
  });
  a.write(1, s, 0, d, 0, kBytes, 1, true);
  a.submit();
  // Messages start at once; one of them is larger than a receive slot, so it travels in fragments.
  const std::string big(10000, 'x');
  a.sendMessage(1, bytesOf("first"));
  a.sendMessage(1, bytesOf(big));
  a.sendMessage(1, {});
  REQUIRE(waitFor([&] {
    pollUntil(a, 0, 0ms);  // the proxy's polling releases what waits for the other QPs' markers
    std::lock_guard lock(m);
    return received.size() == 3;
  }, 3000ms));
  std::lock_guard lock(m);
  CHECK(wholeWhenReceived);
  CHECK(received[0] == "first");
  CHECK(received[1] == big);
  CHECK(received[2].empty());
}

TEST_CASE("verbs transport: an injected QP error fails the peer, its signalled ops complete with kPeerLost") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  FaultsCleared cleared;
  VerbsTransport a(transportConfig(0, 1)), b(transportConfig(1, 1));
  connectByHand(a, b);
  std::atomic<int> failures{0};
  a.setPeerFailureHandler([&](NodeIndex peer, const PeerStatus& st) {
    CHECK(peer == 1);
    CHECK(st.state == PeerState::kFailed);
    failures.fetch_add(1);
  });
  std::vector<uint8_t> src(8192, 1), dst(8192, 0);
  const LocalRegion s = a.registerMemory({MemoryKind::kHost, src.data(), src.size()});
  const RemoteKey d = b.remoteKey(b.registerMemory({MemoryKind::kHost, dst.data(), dst.size()}));
  vd::setFaults("qp_error_after_writes=2");
  a.write(1, s, 0, d, 0, 4096, 1, true);
  a.write(1, s, 4096, d, 4096, 4096, 2, true);
  a.submit();
  const auto done = pollUntil(a, 2);
  REQUIRE(done.size() == 2);
  CHECK(done[0].cookie == 1);
  CHECK(done[0].code == ErrorCode::kOk);
  CHECK(done[1].cookie == 2);
  CHECK(done[1].code == ErrorCode::kPeerLost);
  CHECK(a.peerStatus(1).state == PeerState::kFailed);
  CHECK_MESSAGE(a.peerStatus(1).reason.find("transport retry counter exceeded") != std::string::npos,
                a.peerStatus(1).reason);
  CHECK(waitFor([&] { return failures.load() == 1; }));
  CHECK_THROWS_AS(a.write(1, s, 0, d, 0, 8, 3, true), Error);
  CHECK_THROWS_AS(a.sendMessage(1, {}), Error);
}

TEST_CASE("verbs transport with its bootstrap: QPs come up through the handshake, and a QP error re-connects them as a new incarnation") {
  REQUIRE_MESSAGE(vd::loaded(), vd::notLoadedReason());
  FaultsCleared cleared;
  auto config = [](NodeIndex self, uint16_t port) {
    VerbsConfig c = transportConfig(self, 2);
    c.bootstrap.enabled = true;
    c.bootstrap.listenHost = "127.0.0.1";
    c.bootstrap.listenPort = port;
    c.bootstrap.secret = "verbs-double-test-secret-0123456789";
    c.bootstrap.connectTimeoutMs = 5000;
    c.bootstrap.heartbeatIntervalMs = 50;
    c.bootstrap.peerDeadlineMs = 1000;
    return c;
  };
  VerbsTransport a(config(0, 0)), b(config(1, 0));  // port 0: each bootstrap binds a free port
  std::mutex m;
  std::vector<std::string> atB;
  std::atomic<int> rejoinsA{0}, rejoinsB{0}, lostA{0}, lostB{0};
  b.setMessageHandler([&](NodeIndex, std::span<const std::byte> p) {
    std::lock_guard lock(m);
    atB.emplace_back(reinterpret_cast<const char*>(p.data()), p.size());
  });
  a.setMessageHandler([](NodeIndex, std::span<const std::byte>) {});
  a.setPeerRejoinHandler([&](NodeIndex) { rejoinsA.fetch_add(1); });
  b.setPeerRejoinHandler([&](NodeIndex) { rejoinsB.fetch_add(1); });
  a.setPeerFailureHandler([&](NodeIndex, const PeerStatus&) { lostA.fetch_add(1); });
  std::string lostBReason;
  b.setPeerFailureHandler([&](NodeIndex, const PeerStatus& st) {
    std::lock_guard lock(m);
    lostBReason = st.reason;
    lostB.fetch_add(1);
  });
  const std::vector<NodeAddress> nodes = {{"127.0.0.1", a.bootstrapPort()}, {"127.0.0.1", b.bootstrapPort()}};
  std::thread tb([&] { b.connect(nodes); });
  a.connect(nodes);
  tb.join();
  REQUIRE(a.peerStatus(1).state == PeerState::kConnected);
  REQUIRE(waitFor([&] { return b.peerStatus(0).state == PeerState::kConnected; }));
  CHECK(a.peerGeneration(1) == 1);
  a.sendMessage(1, bytesOf("hello"));
  REQUIRE(waitFor([&] {
    std::lock_guard lock(m);
    return atB.size() == 1;
  }));

  // A QP error on node 0's side: both sides lose the peer, the leader (node 0) offers new QPs, both come back.
  std::vector<uint8_t> src(4096, 3), dst(4096, 0);
  const LocalRegion s = a.registerMemory({MemoryKind::kHost, src.data(), src.size()});
  const RemoteKey d = b.remoteKey(b.registerMemory({MemoryKind::kHost, dst.data(), dst.size()}));
  vd::setFaults("qp_error_after_writes=1");
  a.write(1, s, 0, d, 0, 4096, 7, true);
  a.submit();
  const auto done = pollUntil(a, 1);
  REQUIRE(done.size() == 1);
  CHECK(done[0].code == ErrorCode::kPeerLost);
  REQUIRE(waitFor([&] { return lostA.load() == 1 && lostB.load() == 1; }, 3000ms));
  {
    std::lock_guard lock(m);  // node 1 learnt it from node 0's Down: no QP of its own failed
    CHECK_MESSAGE(lostBReason.find("node 0 lost its queue pairs") != std::string::npos, lostBReason);
  }
  REQUIRE(waitFor([&] {
    return a.peerStatus(1).state == PeerState::kConnected && b.peerStatus(0).state == PeerState::kConnected &&
           rejoinsA.load() == 1 && rejoinsB.load() == 1;
  }, 3000ms));
  CHECK(a.peerGeneration(1) == 2);
  CHECK(b.peerGeneration(0) == 2);
  // The new incarnation carries data and messages.
  a.write(1, s, 0, d, 0, 4096, 8, true);
  a.submit();
  const auto again = pollUntil(a, 1);
  REQUIRE(again.size() == 1);
  CHECK(again[0].code == ErrorCode::kOk);
  CHECK(dst[100] == 3);
  a.sendMessage(1, bytesOf("again"));
  REQUIRE(waitFor([&] {
    std::lock_guard lock(m);
    return atB.size() == 2;
  }));
  std::lock_guard lock(m);
  CHECK(atB[1] == "again");
}
