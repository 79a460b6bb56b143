// Host-only tests of the transport layer's pure logic: wire formats (keys, addresses, QpInfo), verbs QP
// attributes, work-request planning and selective signalling, rail-aligned NIC choice, the proxy FIFO's index
// arithmetic, multi-producer behaviour and command validation, and the proxy loop over a null transport. No NIC, GPU
// or network. The tcp transport's own logic (handshake, frames, peer states) is in tcp_logic_test.cpp.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "transport/proxy_fifo.hpp"
#include "transport/tcp_transport.hpp"
#include "transport/transport.hpp"
#include "transport/verbs_logic.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;
using namespace std::chrono_literals;

namespace {

std::vector<std::byte> randomBytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Every strict prefix of a valid encoding must be rejected with kProtocol, never crash or succeed.
template <typename Decode>
void checkAllTruncationsRejected(const std::vector<std::byte>& valid, Decode decode) {
  for (std::size_t n = 0; n < valid.size(); ++n) {
    CAPTURE(n);
    try {
      decode(std::span(valid).first(n));
      FAIL("a truncated encoding was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kProtocol);
    }
  }
}

ErrorCode codeOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

std::string messageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

// A FIFO region in ordinary (aligned) memory.
struct FifoMemory {
  explicit FifoMemory(uint32_t capacity) : bytes(ProxyFifoLayout::bytesFor(capacity)) {
    storage.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{128})));
    view = ProxyFifoView::format(storage.get(), bytes, capacity);
  }
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t{128}); }
  };
  uint64_t bytes;
  std::unique_ptr<std::byte, Free> storage;
  ProxyFifoView view;
};

// Reinitialises a fresh FIFO as if `start` tickets had already been pushed and consumed.
void rebase(ProxyFifoView v, uint64_t start) {
  const uint64_t cap = v.capacity();
  v.control()->head = start;
  v.control()->tail = start;
  for (uint64_t k = 0; k < cap; ++k) {
    const uint64_t prev = start - cap + k;  // the last ticket that used slot slotOf(prev)
    v.slots()[fifo::slotOf(prev, cap)].control = fifo::packControl(fifo::seqOf(prev), ProxyOpcode::kNop, 0, 0);
  }
}

}  // namespace

// =========================================================================================================
// Wire formats
// =========================================================================================================

TEST_CASE("a remote key survives encode and decode, and malformed keys are rejected") {
  const RemoteKey key{TransportKind::kVerbs, 3, 17, 0xdeadbeef, 0x7f0012345000, uint64_t{1} << 33};
  const auto bytes = key.encode();
  REQUIRE(bytes.size() == RemoteKey::kWireBytes);
  CHECK(RemoteKey::decode(bytes) == key);

  checkAllTruncationsRejected(bytes, [](auto s) { return RemoteKey::decode(s); });
  SUBCASE("trailing bytes") {
    auto longer = bytes;
    longer.push_back(std::byte{0});
    CHECK(codeOf([&] { RemoteKey::decode(longer); }) == ErrorCode::kProtocol);
  }
  SUBCASE("wrong version names both versions") {
    auto bad = bytes;
    bad[0] = std::byte{9};
    CHECK(messageOf([&] { RemoteKey::decode(bad); }).find("version 9") != std::string::npos);
  }
  SUBCASE("unknown transport kind") {
    auto bad = bytes;
    bad[1] = std::byte{77};
    CHECK(codeOf([&] { RemoteKey::decode(bad); }) == ErrorCode::kProtocol);
  }
  SUBCASE("reserved bits") {
    auto bad = bytes;
    bad[2] = std::byte{1};
    CHECK(codeOf([&] { RemoteKey::decode(bad); }) == ErrorCode::kProtocol);
  }
  SUBCASE("region id 0 and size 0 are never issued") {
    RemoteKey z = key;
    z.regionId = 0;
    CHECK(codeOf([&] { RemoteKey::decode(z.encode()); }) == ErrorCode::kProtocol);
    z = key;
    z.bytes = 0;
    CHECK(codeOf([&] { RemoteKey::decode(z.encode()); }) == ErrorCode::kProtocol);
  }
  SUBCASE("garbage never crashes") {
    std::mt19937_64 rng(1);
    for (int i = 0; i < 2000; ++i) {
      const auto g = randomBytes(rng, RemoteKey::kWireBytes);
      try {
        (void)RemoteKey::decode(g);
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kProtocol);
      }
    }
  }
}

TEST_CASE("a transport address survives encode and decode, and malformed addresses are rejected") {
  TransportAddress a;
  a.kind = TransportKind::kTcp;
  a.node = 2;
  a.protocolVersion = kTcpProtocolVersion;
  a.host = "127.0.0.3";
  a.port = 7102;
  a.blob = {std::byte{1}, std::byte{2}, std::byte{3}};
  const auto bytes = a.encode();
  CHECK(TransportAddress::decode(bytes) == a);
  CHECK(a.toString() == "127.0.0.3:7102 (node 2)");

  checkAllTruncationsRejected(bytes, [](auto s) { return TransportAddress::decode(s); });
  SUBCASE("trailing bytes") {
    auto longer = bytes;
    longer.push_back(std::byte{0});
    CHECK(messageOf([&] { TransportAddress::decode(longer); }).find("trailing") != std::string::npos);
  }
  SUBCASE("bad magic") {
    auto bad = bytes;
    bad[0] = std::byte{'X'};
    CHECK(codeOf([&] { TransportAddress::decode(bad); }) == ErrorCode::kProtocol);
  }
  SUBCASE("non-printable host") {
    TransportAddress b = a;
    b.host = std::string("10.0.0.1\n", 9);
    CHECK(codeOf([&] { TransportAddress::decode(b.encode()); }) == ErrorCode::kProtocol);
  }
  SUBCASE("oversized host is refused at encode") {
    TransportAddress b = a;
    b.host.assign(300, 'h');
    CHECK(codeOf([&] { (void)b.encode(); }) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("a blob length beyond the input") {
    const std::size_t lenAt = bytes.size() - a.blob.size() - 4;  // the u32 blob length
    auto bad = bytes;
    bad[lenAt] = std::byte{0x40};
    CHECK(codeOf([&] { TransportAddress::decode(bad); }) == ErrorCode::kProtocol);
  }
  SUBCASE("IPv6 hosts print in brackets") {
    TransportAddress b = a;
    b.host = "::1";
    CHECK(b.toString() == "[::1]:7102 (node 2)");
  }
}

TEST_CASE("QpInfo survives encode and decode, and malformed QpInfo is rejected") {
  verbs::QpInfo info;
  info.lid = 0x1234;
  info.port = 1;
  info.mtu = IBV_MTU_4096;
  info.linkLayer = IBV_LINK_LAYER_INFINIBAND;
  info.qpn = 0xabcdef;
  info.psn = 0x123456;
  for (uint8_t i = 0; i < 16; ++i) info.gid[i] = static_cast<uint8_t>(0xf0 + i);
  info.rkey = 0x55aa55aa;
  info.addr = 0x00007fff12345678;
  const auto bytes = verbs::encodeQpInfo(info);
  REQUIRE(bytes.size() == verbs::QpInfo::kWireBytes);
  CHECK(verbs::decodeQpInfo(bytes) == info);
  checkAllTruncationsRejected(bytes, [](auto s) { return verbs::decodeQpInfo(s); });

  auto reject = [&](auto mutate, const char* expect) {
    verbs::QpInfo bad = info;
    mutate(bad);
    const std::string msg = messageOf([&] { verbs::decodeQpInfo(verbs::encodeQpInfo(bad)); });
    CHECK_MESSAGE(msg.find(expect) != std::string::npos, msg);
  };
  reject([](auto& q) { q.qpn = 0x1000000; }, "24-bit");
  reject([](auto& q) { q.qpn = 0; }, "24-bit");
  reject([](auto& q) { q.psn = 0x1000000; }, "PSN");
  reject([](auto& q) { q.mtu = 9; }, "MTU");
  reject([](auto& q) { q.port = 0; }, "port 0");
  reject([](auto& q) { q.linkLayer = 7; }, "link layer");
  reject([](auto& q) { q.linkLayer = IBV_LINK_LAYER_ETHERNET; q.gid = {}; }, "without a GID");
  reject([](auto& q) { q.lid = 0; q.gid = {}; }, "neither a LID nor a GID");

  SUBCASE("garbage never crashes") {
    std::mt19937_64 rng(2);
    for (int i = 0; i < 2000; ++i) {
      auto g = randomBytes(rng, verbs::QpInfo::kWireBytes);
      if (i % 2 == 0) std::memcpy(g.data(), bytes.data(), 5);  // valid magic+version, garbage after
      try {
        (void)verbs::decodeQpInfo(g);
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kProtocol);
      }
    }
  }
  SUBCASE("lists round-trip and reject a count that disagrees with the length") {
    std::vector<verbs::QpInfo> infos(3, info);
    infos[1].qpn = 0x42;
    infos[2].psn = 7;
    const auto list = verbs::encodeQpInfoList(infos);
    CHECK(verbs::decodeQpInfoList(list) == infos);
    auto bad = list;
    bad[0] = std::byte{4};
    CHECK(codeOf([&] { verbs::decodeQpInfoList(bad); }) == ErrorCode::kProtocol);
    checkAllTruncationsRejected(list, [](auto s) { return verbs::decodeQpInfoList(s); });
  }
}

// =========================================================================================================
// Verbs QP attributes
// =========================================================================================================

TEST_CASE("QP attributes for INIT, RTR and RTS carry the right fields and masks") {
  verbs::PathConfig path;
  path.port = 1;
  path.gidIndex = 3;
  path.activeMtu = IBV_MTU_4096;
  verbs::QpInfo local;
  local.linkLayer = IBV_LINK_LAYER_ETHERNET;
  local.mtu = IBV_MTU_4096;
  local.gid[15] = 1;
  local.qpn = 0x11;
  verbs::QpInfo remote = local;
  remote.qpn = 0x222;
  remote.psn = 0x333;
  remote.mtu = IBV_MTU_1024;
  remote.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xa, 0xb, 0xc, 0xd};

  SUBCASE("INIT") {
    const auto t = verbs::buildInitAttr(path, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    CHECK(t.attr.qp_state == IBV_QPS_INIT);
    CHECK(t.attr.port_num == 1);
    CHECK(t.attr.pkey_index == 0);
    CHECK(t.attr.qp_access_flags == (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ));
    CHECK(t.mask == (IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
  }
  SUBCASE("RTR on RoCE uses a GRH and the smaller MTU") {
    const auto t = verbs::buildRtrAttr(path, local, remote);
    CHECK(t.attr.qp_state == IBV_QPS_RTR);
    CHECK(t.attr.path_mtu == IBV_MTU_1024);
    CHECK(t.attr.dest_qp_num == 0x222);
    CHECK(t.attr.rq_psn == 0x333);
    CHECK(t.attr.ah_attr.is_global == 1);
    CHECK(t.attr.ah_attr.grh.sgid_index == 3);
    CHECK(t.attr.ah_attr.grh.hop_limit == 255);
    CHECK(std::memcmp(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16) == 0);
    CHECK(t.attr.min_rnr_timer == 12);
    CHECK(t.attr.max_dest_rd_atomic == 1);
    CHECK(t.mask == (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
  }
  SUBCASE("RTR on InfiniBand with a LID needs no GRH") {
    local.linkLayer = remote.linkLayer = IBV_LINK_LAYER_INFINIBAND;
    remote.lid = 9;
    const auto t = verbs::buildRtrAttr(path, local, remote);
    CHECK(t.attr.ah_attr.is_global == 0);
    CHECK(t.attr.ah_attr.dlid == 9);
    CHECK(t.attr.ah_attr.port_num == 1);
  }
  SUBCASE("RTR refuses mixing InfiniBand and RoCE") {
    remote.linkLayer = IBV_LINK_LAYER_INFINIBAND;
    CHECK(codeOf([&] { (void)verbs::buildRtrAttr(path, local, remote); }) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("RTS") {
    const auto t = verbs::buildRtsAttr(path, 0x1abcdef);
    CHECK(t.attr.qp_state == IBV_QPS_RTS);
    CHECK(t.attr.sq_psn == 0xabcdef);  // masked to 24 bits
    CHECK(t.attr.timeout == 18);
    CHECK(t.attr.retry_cnt == 7);
    CHECK(t.attr.rnr_retry == 7);
    CHECK(t.attr.max_rd_atomic == 1);
    CHECK(t.mask == (IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                     IBV_QP_MAX_QP_RD_ATOMIC));
  }
  CHECK(verbs::mtuBytes(IBV_MTU_256) == 256);
  CHECK(verbs::mtuBytes(IBV_MTU_4096) == 4096);
  CHECK(verbs::mtuBytes(0) == 0);
  for (int i = 0; i < 100; ++i) CHECK(verbs::randomPsn() <= verbs::kMax24Bit);
}

// =========================================================================================================
// Work requests and signalling
// =========================================================================================================

TEST_CASE("a write is split at destination stripe boundaries and only its last WR carries the caller's signal") {
  const RemoteKey dst{TransportKind::kVerbs, 1, 5, 0x77, 0x100000, 1 << 20};
  std::vector<verbs::WorkRequestPlan> wrs;
  verbs::planWrite(0x5000, 1 << 20, 0x99, 16, dst, 64, 2500, 1000, true, 42, wrs);
  // Cuts at destination offsets 1000 and 2000: [64,1000) [1000,2000) [2000,2564).
  REQUIRE(wrs.size() == 3);
  CHECK(wrs[0].localAddr == 0x5000 + 16);
  CHECK(wrs[0].remoteAddr == 0x100000 + 64);
  CHECK(wrs[0].length == 936);
  CHECK(wrs[1].localAddr == 0x5000 + 16 + 936);
  CHECK(wrs[1].remoteAddr == 0x100000 + 1000);
  CHECK(wrs[1].length == 1000);
  CHECK(wrs[2].length == 564);
  CHECK(wrs[2].remoteAddr == 0x100000 + 2000);
  CHECK_FALSE(wrs[0].userSignal);
  CHECK_FALSE(wrs[1].userSignal);
  CHECK(wrs[2].userSignal);
  CHECK(wrs[2].cookie == 42);
  for (const auto& w : wrs) {
    CHECK(w.lkey == 0x99);
    CHECK(w.rkey == 0x77);
  }
  wrs.clear();
  verbs::planWrite(0, 1 << 20, 1, 0, dst, 0, 3000, 1000, false, 0, wrs);  // aligned: three full WRs
  CHECK(wrs.size() == 3);
  wrs.clear();
  verbs::planWrite(0, 1 << 20, 1, 0, dst, 0, 1 << 20, uint64_t{1} << 40, false, 0, wrs);  // clamp to 2^31
  CHECK(wrs.size() == 1);
  CHECK(codeOf([&] { verbs::planWrite(0, 100, 1, 90, dst, 0, 20, 1000, false, 0, wrs); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { verbs::planWrite(0, 100, 1, 0, dst, (1 << 20) - 4, 8, 1000, false, 0, wrs); }) ==
        ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { verbs::planWrite(0, 100, 1, 0, dst, UINT64_MAX - 2, 8, 1000, false, 0, wrs); }) ==
        ErrorCode::kInvalidArgument);

  const auto flag = verbs::planFlag(dst, 8, 0x1122334455667788, false, 7);
  CHECK(flag.kind == verbs::WrKind::kFlag);
  CHECK(flag.remoteAddr == 0x100008);
  CHECK(codeOf([&] { (void)verbs::planFlag(dst, 4, 1, false, 0); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { (void)verbs::planFlag(dst, 1 << 20, 1, false, 0); }) == ErrorCode::kInvalidArgument);
}

TEST_CASE("work requests encode to the right verbs opcodes and flags") {
  ibv_send_wr wr{};
  ibv_sge sge{};
  verbs::WorkRequestPlan p;
  p.kind = verbs::WrKind::kWrite;
  p.localAddr = 0x1000;
  p.lkey = 3;
  p.length = 64;
  p.remoteAddr = 0x2000;
  p.rkey = 4;
  verbs::encodeWorkRequest(p, 9, false, wr, sge);
  CHECK(wr.opcode == IBV_WR_RDMA_WRITE);
  CHECK(wr.wr_id == 9);
  CHECK(wr.send_flags == 0);
  CHECK(wr.num_sge == 1);
  CHECK(wr.sg_list == &sge);
  CHECK(sge.addr == 0x1000);
  CHECK(sge.length == 64);
  CHECK(sge.lkey == 3);
  CHECK(wr.wr.rdma.remote_addr == 0x2000);
  CHECK(wr.wr.rdma.rkey == 4);

  p.kind = verbs::WrKind::kFlag;
  p.inlineValue = 5;
  verbs::encodeWorkRequest(p, 10, true, wr, sge);
  CHECK(wr.send_flags == (IBV_SEND_SIGNALED | IBV_SEND_INLINE));
  CHECK(sge.length == 8);
  CHECK(sge.addr == reinterpret_cast<uintptr_t>(&p.inlineValue));

  p.kind = verbs::WrKind::kMarker;
  verbs::encodeWorkRequest(p, 11, false, wr, sge);
  CHECK(wr.num_sge == 0);
  CHECK((wr.send_flags & IBV_SEND_SIGNALED) != 0);

  p.kind = verbs::WrKind::kFlushRead;
  verbs::encodeWorkRequest(p, 12, false, wr, sge);
  CHECK(wr.opcode == IBV_WR_RDMA_READ);
  CHECK((wr.send_flags & IBV_SEND_SIGNALED) != 0);
}

TEST_CASE("selective signalling signals every Nth WR and never lets the send queue overflow") {
  CHECK(codeOf([] { verbs::SendQueueTracker(8, 9); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([] { verbs::SendQueueTracker(8, 0); }) == ErrorCode::kInvalidArgument);

  SUBCASE("every Nth") {
    verbs::SendQueueTracker t(64, 4);
    std::vector<bool> sig;
    for (int i = 0; i < 12; ++i) sig.push_back(t.next(false).signaled);
    CHECK(sig == std::vector<bool>{false, false, false, true, false, false, false, true, false, false, false, true});
    CHECK(t.outstanding() == 12);
    CHECK(t.complete(7) == 8);  // retires WRs 0..7
    CHECK(t.outstanding() == 4);
    CHECK(t.complete(3) == 0);  // stale
    CHECK(t.complete(99) == 0); // never posted
    CHECK_FALSE(t.hasUnsignaledTail());
    (void)t.next(false);
    CHECK(t.hasUnsignaledTail());
  }
  SUBCASE("the WR that fills the queue is signalled") {
    verbs::SendQueueTracker t(4, 4);
    CHECK_FALSE(t.next(false).signaled);
    CHECK_FALSE(t.next(false).signaled);
    CHECK_FALSE(t.next(false).signaled);
    CHECK(t.next(false).signaled);  // fills: also the 4th
    CHECK(t.room() == 0);
    CHECK(codeOf([&] { (void)t.next(false); }) == ErrorCode::kInternal);
  }
  SUBCASE("random traffic: outstanding stays within depth and a full queue always has a completion coming") {
    std::mt19937 rng(3);
    for (uint32_t depth : {1u, 2u, 7u, 32u}) {
      for (uint32_t every : {1u, depth / 2 + 1, depth}) {
        verbs::SendQueueTracker t(depth, every);
        std::deque<uint64_t> signalled;  // what the "NIC" will complete, in order
        for (int step = 0; step < 5000; ++step) {
          const bool post = (rng() % 3 != 0) && t.room() > 0;
          if (post) {
            const auto s = t.next(rng() % 10 == 0);
            if (s.signaled) signalled.push_back(s.seq);
          } else if (!signalled.empty()) {
            t.complete(signalled.front());
            signalled.pop_front();
          }
          REQUIRE(t.outstanding() <= depth);
          if (t.room() == 0) REQUIRE_FALSE(signalled.empty());
        }
      }
    }
  }
}

TEST_CASE("takeBatch respects the send-queue room and the per-post limit") {
  verbs::SendQueueTracker t(8, 4);
  std::deque<verbs::WorkRequestPlan> pending(20);
  pending[1].userSignal = true;
  std::vector<verbs::PlannedWr> batch;
  CHECK(verbs::takeBatch(pending, t, 5, batch) == 5);
  CHECK_FALSE(batch[0].signaled);
  CHECK(batch[1].signaled);  // user-signalled
  CHECK_FALSE(batch[3].signaled);  // the period counts from the last signalled WR (seq 1): seq 5 is next
  CHECK_FALSE(batch[4].signaled);
  CHECK(pending.size() == 15);
  CHECK(verbs::takeBatch(pending, t, 5, batch) == 3);  // only 3 slots left of 8
  CHECK(t.room() == 0);
  CHECK(batch.back().signaled);
  CHECK(verbs::takeBatch(pending, t, 5, batch) == 0);
  t.complete(7);
  CHECK(verbs::takeBatch(pending, t, 100, batch) == 8);
}

// =========================================================================================================
// Rail-aligned NIC choice
// =========================================================================================================

namespace {
// A DGX-H100-like node: 8 GPUs, each sharing a PCIe switch with one NIC; switches 0-3 on NUMA 0, 4-7 on 1.
std::pair<std::vector<verbs::GpuDesc>, std::vector<verbs::NicDesc>> dgxLike(int nicsPerSwitchPair = 1) {
  std::vector<verbs::GpuDesc> gpus;
  std::vector<verbs::NicDesc> nics;
  for (int s = 0; s < 8; ++s) {
    // Two switches per root complex, each on its own root port.
    const int rootBus = 0x10 * (s / 2 + 1);
    const std::string root = fmt::format("/sys/devices/pci0000:{:02x}", rootBus);
    const std::string sw = fmt::format("{}/0000:{:02x}:{:02x}.0/0000:{:02x}:00.0", root, rootBus, s % 2 + 1, 0x11 + s);
    gpus.push_back({{fmt::format("GPU-{}", s), fmt::format("{}/0000:{:02x}:00.0/0000:{:02x}:00.0", sw, 0x20 + s, 0x30 + s), s / 4}, s});
    if (nicsPerSwitchPair == 1 || s % 2 == 0)
      nics.push_back({{fmt::format("mlx5_{}", s), fmt::format("{}/0000:{:02x}:01.0/0000:{:02x}:00.0", sw, 0x20 + s, 0x40 + s), s / 4}, true, 1});
  }
  return {gpus, nics};
}
}  // namespace

TEST_CASE("each GPU gets the NIC behind its own PCIe switch, in any NIC order, the same on every node") {
  auto [gpus, nics] = dgxLike();
  std::mt19937 rng(4);
  std::shuffle(nics.begin(), nics.end(), rng);
  const auto a = verbs::chooseRailNics(gpus, nics);
  for (std::size_t g = 0; g < gpus.size(); ++g) {
    CAPTURE(g);
    CHECK(nics[a[g].nic].pci.name == fmt::format("mlx5_{}", g));
    CHECK(a[g].distance == verbs::PciDistance::kSameSwitch);
  }
  // Another node with the same topology, NICs listed in another order: the same rails.
  std::shuffle(nics.begin(), nics.end(), rng);
  const auto b = verbs::chooseRailNics(gpus, nics);
  for (std::size_t g = 0; g < gpus.size(); ++g) CHECK(nics[b[g].nic].pci.name == fmt::format("mlx5_{}", g));
}

TEST_CASE("with fewer NICs than GPUs the load is balanced and locality still wins") {
  auto [gpus, nics] = dgxLike(/*nicsPerSwitchPair=*/2);  // NICs behind switches 0, 2, 4, 6
  const auto a = verbs::chooseRailNics(gpus, nics);
  std::map<std::size_t, int> load;
  for (const auto& x : a) ++load[x.nic];
  CHECK(load.size() == 4);
  for (const auto& [nic, n] : load) CHECK(n == 2);
  CHECK(a[0].distance == verbs::PciDistance::kSameSwitch);
  CHECK(a[1].distance == verbs::PciDistance::kSameHostBridge);  // GPU 1 shares switch 0's root complex
  for (std::size_t g = 0; g < 8; ++g) CHECK(nics[a[g].nic].pci.numaNode == gpus[g].pci.numaNode);
}

TEST_CASE("inactive NICs are skipped, NUMA locality breaks ties across root complexes, and no NIC is an error") {
  auto [gpus, nics] = dgxLike();
  for (auto& n : nics) n.active = n.pci.name == "mlx5_1" || n.pci.name == "mlx5_6";
  const auto a = verbs::chooseRailNics(gpus, nics);
  CHECK(nics[a[0].nic].pci.name == "mlx5_1");  // same root complex as GPU 0
  CHECK(a[0].distance == verbs::PciDistance::kSameHostBridge);
  CHECK(nics[a[2].nic].pci.name == "mlx5_1");  // NUMA 0, other root complex
  CHECK(a[2].distance == verbs::PciDistance::kSameNuma);
  CHECK(nics[a[5].nic].pci.name == "mlx5_6");
  for (auto& n : nics) n.active = false;
  CHECK(codeOf([&] { (void)verbs::chooseRailNics(gpus, nics); }) == ErrorCode::kUnavailable);
  verbs::PciDevice x{"x", "/sys/devices/pci0000:00/0000:00:01.0", -1}, y{"y", "/sys/devices/pci0000:80/0000:80:01.0", -1};
  CHECK(verbs::pciDistance(x, y) == verbs::PciDistance::kCrossNuma);
}

// =========================================================================================================
// Proxy FIFO: layout, index arithmetic, wrap-around
// =========================================================================================================

TEST_CASE("proxy commands pack into 32 bytes and unpack to the same fields") {
  static_assert(sizeof(ProxyCommand) == 32);
  constexpr auto w = fifo::makeWrite(65535, 7, kProxyMaxOffset, 0xffffffff, 12345, 0xfedcba98, kProxyFlagSignal);
  static_assert(fifo::opcodeField(w.control) == ProxyOpcode::kWrite);
  static_assert(fifo::peerField(w.control) == 65535);
  static_assert(fifo::flagsField(w.control) == kProxyFlagSignal);
  static_assert(fifo::writeSrcOffset(w) == kProxyMaxOffset);
  static_assert(fifo::writeDstOffset(w) == 12345);
  static_assert(fifo::writeBytes(w) == 0xfedcba98);
  static_assert(w.srcBuffer == 7 && w.dstBuffer == 0xffffffff);
  constexpr auto f = fifo::makeFlag(3, 9, 4096, UINT64_MAX);
  static_assert(fifo::flagValue(f) == UINT64_MAX && fifo::flagDstOffset(f) == 4096 && f.srcBuffer == 0);
  CHECK(fifo::seqField(fifo::packControl(0xdeadbeef, ProxyOpcode::kFlag, 0, 1)) == 0xdeadbeef);
}

TEST_CASE("FIFO index arithmetic holds across 32-bit sequence and 64-bit index wrap") {
  for (uint64_t cap : std::initializer_list<uint64_t>{8, 1024}) {
    for (uint64_t t : std::initializer_list<uint64_t>{0, 7, 0xffffffff, 0x100000000, UINT64_MAX - 3}) {
      // A slot's stale sequence (one lap back) never equals the live one.
      CHECK(fifo::seqOf(t) != fifo::seqOf(t - cap));
      CHECK(fifo::slotOf(t, cap) == fifo::slotOf(t - cap, cap));
    }
    CHECK(fifo::initialSeq(3, cap) == fifo::seqOf(3 - cap));
  }
  // The pre-claim hint tolerates a tail that passed a stale head (others claimed, the consumer caught up).
  CHECK_FALSE(fifo::lacksRoom(100, 120, 1, 8));
  CHECK_FALSE(fifo::lacksRoom(100, 100, 8, 8));
  CHECK(fifo::lacksRoom(100, 100 - 1, 8, 8));
  CHECK(fifo::lacksRoom(100, 92, 1, 8));
  CHECK_FALSE(fifo::lacksRoom(100, 93, 1, 8));
  CHECK_FALSE(fifo::lacksRoom(2, UINT64_MAX - 3, 2, 8));  // used 6 across the 2^64 wrap
  CHECK(fifo::lacksRoom(2, UINT64_MAX - 3, 3, 8));
  CHECK_FALSE(fifo::lacksRoom(UINT64_MAX - 3, 2, 1, 8));  // tail ahead across the wrap
  CHECK_FALSE(fifo::looksFull(5, 0, 8));
  CHECK(fifo::looksFull(8, 0, 8));
  CHECK_FALSE(fifo::looksFull(UINT64_MAX, UINT64_MAX - 7, 8));
  CHECK(fifo::looksFull(2, UINT64_MAX - 5, 8));  // 2 - (2^64-6) = 8 across the wrap
  CHECK_FALSE(fifo::looksFull(1, UINT64_MAX - 5, 8));
}

TEST_CASE("FIFO format and attach validate the region") {
  FifoMemory m(16);
  CHECK(m.view.capacity() == 16);
  CHECK(ProxyFifoView::attach(m.storage.get(), m.bytes).capacity() == 16);
  CHECK(codeOf([&] { ProxyFifoView::format(m.storage.get(), m.bytes, 12); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ProxyFifoView::format(m.storage.get(), m.bytes, 4); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ProxyFifoView::format(m.storage.get(), m.bytes, 32); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([&] { ProxyFifoView::attach(m.storage.get(), 100); }) == ErrorCode::kProtocol);
  reinterpret_cast<ProxyFifoHeader*>(m.storage.get())->version = 99;
  CHECK(messageOf([&] { ProxyFifoView::attach(m.storage.get(), m.bytes); }).find("version 99") != std::string::npos);
  reinterpret_cast<ProxyFifoHeader*>(m.storage.get())->magic = 1;
  CHECK(codeOf([&] { ProxyFifoView::attach(m.storage.get(), m.bytes); }) == ErrorCode::kProtocol);
}

TEST_CASE("one producer: commands come out in order through many wrap-arounds, also across the 2^32 sequence wrap") {
  for (uint64_t start : std::initializer_list<uint64_t>{0, 0xffffffff - 20, UINT64_MAX - 50}) {
    CAPTURE(start);
    FifoMemory m(8);
    rebase(m.view, start);
    ProxyFifoProducer prod(m.view);
    ProxyFifoConsumer cons(m.view);
    CHECK(cons.index() == start);
    std::array<ProxyCommand, 8> out{};
    uint64_t next = 0;
    for (int round = 0; round < 40; ++round) {
      const int n = 1 + round % 8;
      for (int i = 0; i < n; ++i) {
        const uint64_t t = prod.pushWrite(1, 2, next + static_cast<uint64_t>(i), 3, 0, 64);
        CHECK(t == start + next + static_cast<uint64_t>(i));
      }
      CHECK(cons.pop(out) == static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) CHECK(fifo::writeSrcOffset(out[static_cast<std::size_t>(i)]) == next + static_cast<uint64_t>(i));
      next += static_cast<uint64_t>(n);
      cons.publishTail();
      CHECK(cons.pop(out) == 0);
    }
    CHECK(prod.fullWaits() <= 40);  // it re-read tail only when the ring looked full
    // A batch takes consecutive tickets with one claim, and comes out in order.
    std::array<ProxyCommand, 5> five{};
    for (uint64_t i = 0; i < 5; ++i) five[i] = fifo::makeFlag(1, 1, 0, 1000 + i);
    const uint64_t first = prod.pushBatch(five);
    CHECK(first == start + next);
    CHECK(cons.pop(out) == 5);
    for (uint64_t i = 0; i < 5; ++i) CHECK(fifo::flagValue(out[i]) == 1000 + i);
  }
}

TEST_CASE("a producer waits while the ring is full until the consumer publishes its index, and stop aborts the wait") {
  FifoMemory m(8);
  ProxyFifoProducer prod(m.view);
  ProxyFifoConsumer cons(m.view);
  for (int i = 0; i < 8; ++i) prod.pushFlag(1, 1, 0, static_cast<uint64_t>(i));
  std::atomic<bool> pushed{false};
  std::thread t([&] {
    ProxyFifoProducer p2(m.view);
    p2.pushFlag(1, 1, 0, 100);
    pushed = true;
  });
  std::array<ProxyCommand, 4> out{};
  CHECK(cons.pop(out) == 4);  // consumed, but not yet published: the producer must still wait
  std::this_thread::sleep_for(20ms);  // gives a wrongly eager producer time to overwrite (not a synchronisation)
  CHECK_FALSE(pushed.load());
  cons.publishTail();
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!pushed.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  CHECK_MESSAGE(pushed.load(), "producer still waiting 5 s after the consumer published its index");
  t.join();
  std::array<ProxyCommand, 8> rest{};
  REQUIRE(cons.pop(rest) == 5);
  CHECK(fifo::flagValue(rest[4]) == 100);

  SUBCASE("a batch larger than the ring is refused") {
    std::vector<ProxyCommand> many(9, fifo::makeNop());
    CHECK(codeOf([&] { prod.pushBatch(many); }) == ErrorCode::kInvalidArgument);
  }
  SUBCASE("stop") {
    for (int i = 0; i < 3; ++i) prod.pushFlag(1, 1, 0, 0);  // fill again: 8 unconsumed
    std::atomic<int> code{-1};
    std::thread w([&] {
      ProxyFifoProducer p3(m.view);
      code = static_cast<int>(codeOf([&] { p3.pushFlag(1, 1, 0, 0); }));
    });
    m.view.requestStop();
    const auto d2 = std::chrono::steady_clock::now() + 5s;
    while (code.load() < 0 && std::chrono::steady_clock::now() < d2) std::this_thread::yield();
    w.join();
    CHECK(code.load() == static_cast<int>(ErrorCode::kAborted));
  }
}

TEST_CASE("four producers and one consumer: every command is seen exactly once, in per-producer order") {
  // Producers 0 and 2 push one command at a time; 1 and 3 push batches of 1..16 with one fetch_add each.
  constexpr int kProducers = 4;
  constexpr uint64_t kPerProducer = 25000;
  FifoMemory m(64);  // small: forces thousands of wrap-arounds and full waits
  std::vector<std::thread> producers;
  std::atomic<bool> go{false};
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      ProxyFifoProducer prod(m.view);
      while (!go.load()) std::this_thread::yield();
      try {
        if (p % 2 == 0) {
          for (uint64_t i = 0; i < kPerProducer; ++i)
            prod.pushWrite(static_cast<uint16_t>(p), static_cast<uint32_t>(p + 1), i, 1, 0, 1);
        } else {
          std::array<ProxyCommand, 16> cmds{};
          for (uint64_t i = 0; i < kPerProducer;) {
            const uint64_t n = std::min<uint64_t>(1 + (i * 7) % 16, kPerProducer - i);
            for (uint64_t j = 0; j < n; ++j)
              cmds[j] = fifo::makeWrite(static_cast<uint16_t>(p), static_cast<uint32_t>(p + 1), i + j, 1, 0, 1);
            prod.pushBatch(std::span(cmds).first(n));
            i += n;
          }
        }
      } catch (const Error&) {
        // aborted by the consumer's deadline below; the missing commands fail the test
      }
    });
  }
  ProxyFifoConsumer cons(m.view);
  std::array<uint64_t, kProducers> next{};
  uint64_t total = 0, outOfOrder = 0, idle = 0;
  std::array<ProxyCommand, 32> batch{};
  go = true;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (total < kProducers * kPerProducer && std::chrono::steady_clock::now() < deadline) {
    const std::size_t n = cons.pop(batch);
    for (std::size_t i = 0; i < n; ++i) {
      const auto p = fifo::peerField(batch[i].control);
      REQUIRE(p < kProducers);
      REQUIRE(batch[i].srcBuffer == p + 1u);
      if (fifo::writeSrcOffset(batch[i]) != next[p]) ++outOfOrder;
      next[p] = fifo::writeSrcOffset(batch[i]) + 1;
    }
    total += n;
    cons.publishTail();
    idle = n == 0 ? idle + 1 : 0;
    if (idle > 64) {
      std::this_thread::sleep_for(20us);  // backoff while a preempted producer finishes its publish
    } else if (idle > 0) {
      std::this_thread::yield();
    }
  }
  if (total < kProducers * kPerProducer) m.view.requestStop();
  for (auto& t : producers) t.join();
  CHECK_MESSAGE(total == kProducers * kPerProducer, "consumer saw ", total, " commands before its 20 s deadline");
  CHECK(outOfOrder == 0);
  for (int p = 0; p < kProducers; ++p) CHECK(next[static_cast<std::size_t>(p)] == kPerProducer);
  std::array<ProxyCommand, 4> extra{};
  CHECK(cons.pop(extra) == 0);  // nothing seen twice or invented
}

// =========================================================================================================
// Command validation
// =========================================================================================================

namespace {
ProxyBufferTable sampleTable() {
  ProxyBufferTable t;
  t.addLocal(1, LocalRegion{11}, 4096);
  t.addRemote(2, 1, RemoteKey{TransportKind::kNull, 1, 21, 0, 0, 8192});
  t.addRemote(2, 2, RemoteKey{TransportKind::kNull, 2, 22, 0, 0, 100});
  return t;
}
CommandCheck check(const ProxyCommand& c, ResolvedCommand* out = nullptr) {
  static const ProxyBufferTable table = sampleTable();
  ResolvedCommand r;
  auto result = validateCommand(c, table, /*self=*/0, /*nodes=*/3, r);
  if (out) *out = r;
  return result;
}
}  // namespace

TEST_CASE("valid commands resolve to their registrations") {
  ResolvedCommand r;
  REQUIRE(check(fifo::makeWrite(1, 1, 96, 2, 4000, 4000, kProxyFlagSignal), &r).ok());
  CHECK(r.opcode == ProxyOpcode::kWrite);
  CHECK(r.peer == 1);
  CHECK(r.src.id == 11);
  CHECK(r.dst->regionId == 21);
  CHECK(r.srcOffset == 96);
  CHECK(r.dstOffset == 4000);
  CHECK(r.bytes == 4000);
  CHECK(r.signal);
  REQUIRE(check(fifo::makeFlag(2, 2, 88, 7), &r).ok());
  CHECK(r.opcode == ProxyOpcode::kFlag);
  CHECK(r.dst->regionId == 22);
  CHECK(r.value == 7);
  CHECK_FALSE(r.signal);
}

TEST_CASE("invalid commands are rejected with a reason, never a crash") {
  struct Case {
    const char* name;
    ProxyCommand cmd;
    ErrorCode code;
    const char* text;
  };
  ProxyCommand badOp = fifo::makeFlag(1, 2, 0, 0);
  badOp.control = fifo::packControl(0, static_cast<ProxyOpcode>(9), 0, 1);
  ProxyCommand badFlags = fifo::makeFlag(1, 2, 0, 0, 0x80);
  ProxyCommand flagWithSrc = fifo::makeFlag(1, 2, 0, 0);
  flagWithSrc.srcBuffer = 1;
  const Case cases[] = {
      {"unknown opcode", badOp, ErrorCode::kInvalidArgument, "unknown opcode 9"},
      {"invalid opcode 0", ProxyCommand{}, ErrorCode::kInvalidArgument, "unknown opcode 0"},
      {"unknown flag bits", badFlags, ErrorCode::kInvalidArgument, "flag bits"},
      {"peer out of range", fifo::makeWrite(3, 1, 0, 2, 0, 8), ErrorCode::kInvalidArgument, "has 3 nodes"},
      {"peer is this node", fifo::makeWrite(0, 1, 0, 2, 0, 8), ErrorCode::kInvalidArgument, "this node"},
      {"unknown remote id", fifo::makeWrite(1, 1, 0, 5, 0, 8), ErrorCode::kNotFound, "remote buffer id 5"},
      {"remote id of another peer", fifo::makeWrite(1, 1, 0, 3, 0, 8), ErrorCode::kNotFound, "remote buffer id 3"},
      {"unknown local id", fifo::makeWrite(1, 4, 0, 2, 0, 8), ErrorCode::kNotFound, "local buffer id 4"},
      {"zero bytes", fifo::makeWrite(1, 1, 0, 2, 0, 0), ErrorCode::kInvalidArgument, "0 bytes"},
      {"local out of bounds", fifo::makeWrite(1, 1, 4090, 2, 0, 8), ErrorCode::kInvalidArgument, "local buffer 1"},
      {"remote out of bounds", fifo::makeWrite(2, 1, 0, 2, 96, 8), ErrorCode::kInvalidArgument, "remote buffer 2"},
      {"offsets near 2^48 do not wrap", fifo::makeWrite(1, 1, kProxyMaxOffset, 2, 0, 4096), ErrorCode::kInvalidArgument, "local"},
      {"flag misaligned", fifo::makeFlag(1, 2, 4, 0), ErrorCode::kInvalidArgument, "aligned"},
      {"flag out of bounds", fifo::makeFlag(2, 2, 96, 0), ErrorCode::kInvalidArgument, "flag at offset 96"},
      {"flag offset huge", fifo::makeFlag(1, 2, UINT64_MAX - 7, 0), ErrorCode::kInvalidArgument, "flag"},
      {"flag with a source", flagWithSrc, ErrorCode::kInvalidArgument, "source"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const CommandCheck r = check(c.cmd);
    CHECK(r.code == c.code);
    CHECK_MESSAGE(r.message.find(c.text) != std::string::npos, r.message);
  }
  SUBCASE("random garbage") {
    std::mt19937_64 rng(5);
    int accepted = 0;
    for (int i = 0; i < 20000; ++i) {
      ProxyCommand c{rng(), static_cast<uint32_t>(rng() % 4), static_cast<uint32_t>(rng() % 4), rng() % 8192, rng() % 8192};
      if (check(c).ok()) ++accepted;
    }
    CHECK(accepted < 20000);
  }
  CHECK(codeOf([] { ProxyBufferTable().addLocal(0, LocalRegion{1}, 8); }) == ErrorCode::kInvalidArgument);
  CHECK(codeOf([] { ProxyBufferTable().addRemote(1, 2, RemoteKey{TransportKind::kNull, 3, 1, 0, 0, 8}); }) ==
        ErrorCode::kInvalidArgument);
}

// =========================================================================================================
// The proxy loop over a null transport
// =========================================================================================================

TEST_CASE("the proxy posts valid commands, reports bad ones per command, and publishes its watermarks") {
  FifoMemory m(64);
  NullTransport net(0, 3);
  Proxy proxy(m.view, net, ProxyOptions{.name = "proxy test", .maxBatch = 16});
  std::vector<ProxyCommandError> errors;
  proxy.setErrorHandler([&](const ProxyCommandError& e) { errors.push_back(e); });
  ProxyFifoProducer prod(m.view);

  SUBCASE("no table yet") {
    prod.pushWrite(1, 1, 0, 2, 0, 8);
    CHECK(proxy.runOnce() == 1);
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].code == ErrorCode::kUnavailable);
    CHECK(m.view.errors() == 1);
  }
  SUBCASE("mixed batch") {
    proxy.setBufferTable(std::make_shared<ProxyBufferTable>(sampleTable()));
    prod.pushWrite(1, 1, 0, 2, 0, 100);                  // ticket 0 ok
    prod.pushWrite(1, 9, 0, 2, 0, 100);                  // 1 unknown local
    prod.push(fifo::makeNop());                          // 2 nop
    prod.pushFlag(1, 2, 8, 5, /*signal=*/true);          // 3 ok, signalled
    prod.pushWrite(2, 1, 0, 2, 0, 1000);                 // 4 remote OOB
    CHECK(proxy.runOnce() == 5);
    CHECK(net.writes() == 1);
    CHECK(net.flags() == 1);
    CHECK(net.lastFlagValue() == 5);
    CHECK(net.submits() == 1);
    REQUIRE(errors.size() == 2);
    CHECK(errors[0].ticket == 1);
    CHECK(errors[1].ticket == 4);
    CHECK(m.view.errors() == 2);
    CHECK(m.view.completed() == 5);  // the signalled flag completed; everything consumed
    const auto s = proxy.stats();
    CHECK(s.popped == 5);
    CHECK(s.posted == 2);
    CHECK(s.rejected == 2);
    CHECK(s.completions == 1);
  }
  SUBCASE("a lost peer fails its commands with kPeerLost naming it") {
    proxy.setBufferTable(std::make_shared<ProxyBufferTable>(sampleTable()));
    net.failPeer(1, "connection reset by peer");
    prod.pushWrite(1, 1, 0, 2, 0, 100);
    prod.pushWrite(2, 1, 0, 2, 0, 10);
    CHECK(proxy.runOnce() == 2);
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].code == ErrorCode::kPeerLost);
    CHECK(errors[0].message.find("node 1") != std::string::npos);
    CHECK(errors[0].message.find("connection reset") != std::string::npos);
    CHECK(net.writes() == 1);
  }
  SUBCASE("the proxy thread drains the FIFO, pinned best-effort to NUMA node 0") {
    Proxy threaded(m.view, net, ProxyOptions{.name = "proxy thread", .numaNode = 0});
    threaded.setBufferTable(std::make_shared<ProxyBufferTable>(sampleTable()));
    threaded.start();
    for (uint64_t i = 0; i < 1000; ++i) prod.pushWrite(1, 1, 0, 2, 0, 8, /*signal=*/i == 999);
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (m.view.completed() < 1000 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    threaded.stop();
    CHECK_MESSAGE(m.view.completed() == 1000, "proxy thread did not drain 1000 commands within 5 s");
    CHECK(net.writes() == 1000);
  }
}
