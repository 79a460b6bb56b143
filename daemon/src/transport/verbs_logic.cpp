#include "transport/verbs_logic.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string_view>
#include <tuple>

namespace tandem::daemon::transport::verbs {

namespace {
constexpr uint32_t kQpInfoMagic = 0x31505154;  // "TQP1" little-endian
constexpr uint8_t kQpInfoVersion = 1;

bool gidIsZero(const std::array<uint8_t, 16>& gid) {
  return std::all_of(gid.begin(), gid.end(), [](uint8_t b) { return b == 0; });
}
}  // namespace

// ---- QpInfo ----

std::vector<std::byte> encodeQpInfo(const QpInfo& info) {
  std::vector<std::byte> out;
  out.reserve(QpInfo::kWireBytes);
  detail::WireWriter w(out);
  w.put<uint32_t>(kQpInfoMagic);
  w.put<uint8_t>(kQpInfoVersion);
  w.put<uint8_t>(info.port);
  w.put<uint8_t>(info.mtu);
  w.put<uint8_t>(info.linkLayer);
  w.put<uint16_t>(info.lid);
  w.put<uint16_t>(0);
  w.put<uint32_t>(info.qpn);
  w.put<uint32_t>(info.psn);
  w.putBytes(std::as_bytes(std::span(info.gid)));
  w.put<uint32_t>(info.rkey);
  w.put<uint32_t>(0);
  w.put<uint64_t>(info.addr);
  return out;
}

namespace {
QpInfo readQpInfo(detail::WireReader& r) {
  if (r.get<uint32_t>() != kQpInfoMagic) fail(ErrorCode::kProtocol, "qp info: bad magic (not a tandem QpInfo)");
  const auto version = r.get<uint8_t>();
  if (version != kQpInfoVersion)
    fail(ErrorCode::kProtocol, "qp info: version {} (this node reads version {}); run the same tandem release on "
         "every node", version, kQpInfoVersion);
  QpInfo info;
  info.port = r.get<uint8_t>();
  info.mtu = r.get<uint8_t>();
  info.linkLayer = r.get<uint8_t>();
  info.lid = r.get<uint16_t>();
  if (r.get<uint16_t>() != 0) fail(ErrorCode::kProtocol, "qp info: reserved bits set");
  info.qpn = r.get<uint32_t>();
  info.psn = r.get<uint32_t>();
  const auto gid = r.getBytes(16);
  std::transform(gid.begin(), gid.end(), info.gid.begin(), [](std::byte b) { return static_cast<uint8_t>(b); });
  info.rkey = r.get<uint32_t>();
  if (r.get<uint32_t>() != 0) fail(ErrorCode::kProtocol, "qp info: reserved bits set");
  info.addr = r.get<uint64_t>();

  if (info.port == 0) fail(ErrorCode::kProtocol, "qp info: port 0 (ports are numbered from 1)");
  if (mtuBytes(info.mtu) == 0) fail(ErrorCode::kProtocol, "qp info: unknown MTU code {}", info.mtu);
  if (info.qpn == 0 || info.qpn > kMax24Bit)
    fail(ErrorCode::kProtocol, "qp info: QP number {:#x} outside the 24-bit range (and 0 is reserved)", info.qpn);
  if (info.psn > kMax24Bit) fail(ErrorCode::kProtocol, "qp info: PSN {:#x} exceeds 24 bits", info.psn);
  if (info.linkLayer == IBV_LINK_LAYER_ETHERNET) {
    if (gidIsZero(info.gid))
      fail(ErrorCode::kProtocol, "qp info: RoCE (Ethernet link layer) without a GID; set transport.verbs.gid_index "
           "to a populated entry (show_gids)");
  } else if (info.linkLayer == IBV_LINK_LAYER_INFINIBAND) {
    if (info.lid == 0 && gidIsZero(info.gid))
      fail(ErrorCode::kProtocol, "qp info: InfiniBand port with neither a LID nor a GID (is the subnet manager running?)");
  } else {
    fail(ErrorCode::kProtocol, "qp info: unknown link layer {}", info.linkLayer);
  }
  return info;
}
}  // namespace

QpInfo decodeQpInfo(std::span<const std::byte> bytes) {
  if (bytes.size() != QpInfo::kWireBytes)
    fail(ErrorCode::kProtocol, "qp info: expected {} bytes, got {}", QpInfo::kWireBytes, bytes.size());
  detail::WireReader r(bytes, "qp info");
  QpInfo info = readQpInfo(r);
  r.expectEnd();
  return info;
}

std::vector<std::byte> encodeQpInfoList(std::span<const QpInfo> infos) {
  if (infos.size() > kMaxQpInfos)
    fail(ErrorCode::kInvalidArgument, "qp info list: {} entries exceed {}", infos.size(), kMaxQpInfos);
  std::vector<std::byte> out;
  detail::WireWriter w(out);
  w.put<uint16_t>(static_cast<uint16_t>(infos.size()));
  for (const QpInfo& info : infos) w.putBytes(encodeQpInfo(info));
  return out;
}

std::vector<QpInfo> decodeQpInfoList(std::span<const std::byte> bytes) {
  detail::WireReader r(bytes, "qp info list");
  const auto count = r.get<uint16_t>();
  if (count > kMaxQpInfos) fail(ErrorCode::kProtocol, "qp info list: {} entries exceed {}", count, kMaxQpInfos);
  if (r.remaining() != std::size_t{count} * QpInfo::kWireBytes)
    fail(ErrorCode::kProtocol, "qp info list: {} entries need {} bytes, got {}", count,
         std::size_t{count} * QpInfo::kWireBytes, r.remaining());
  std::vector<QpInfo> infos;
  infos.reserve(count);
  for (uint16_t i = 0; i < count; ++i) infos.push_back(readQpInfo(r));
  r.expectEnd();
  return infos;
}

// ---- QP transitions ----

uint32_t mtuBytes(uint8_t mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
    default: return 0;
  }
}

uint32_t randomPsn() {
  std::random_device rd;
  return rd() & kMax24Bit;
}

QpTransition buildInitAttr(const PathConfig& local, unsigned accessFlags) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;  // default partition (full membership key 0xffff sits at index 0)
  t.attr.port_num = local.port;
  t.attr.qp_access_flags = accessFlags;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition buildRtrAttr(const PathConfig& local, const QpInfo& localInfo, const QpInfo& remote) {
  if (localInfo.linkLayer != remote.linkLayer)
    fail(ErrorCode::kInvalidArgument, "verbs: local port is {} but the peer's is {}; connect NICs of the same kind "
         "(choose transport.verbs.device accordingly)",
         localInfo.linkLayer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand",
         remote.linkLayer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand");
  QpTransition t;
  ibv_qp_attr& a = t.attr;
  a.qp_state = IBV_QPS_RTR;
  // The path MTU must not exceed either port's active MTU; ibv_mtu codes are ordered by size.
  a.path_mtu = static_cast<ibv_mtu>(std::min({local.activeMtu, localInfo.mtu, remote.mtu}));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;  // we expect the peer's first packet to carry the PSN it advertised
  a.max_dest_rd_atomic = local.maxDestRdAtomic;
  a.min_rnr_timer = local.minRnrTimer;
  a.ah_attr.dlid = remote.lid;
  a.ah_attr.sl = local.serviceLevel;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.port_num = local.port;
  const bool needGrh = remote.linkLayer == IBV_LINK_LAYER_ETHERNET || (remote.lid == 0 && !gidIsZero(remote.gid));
  if (needGrh) {
    a.ah_attr.is_global = 1;
    std::copy(remote.gid.begin(), remote.gid.end(), a.ah_attr.grh.dgid.raw);
    a.ah_attr.grh.sgid_index = local.gidIndex;
    a.ah_attr.grh.hop_limit = local.hopLimit;
    a.ah_attr.grh.traffic_class = local.trafficClass;
    a.ah_attr.grh.flow_label = 0;
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
           IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition buildRtsAttr(const PathConfig& local, uint32_t localPsn) {
  QpTransition t;
  ibv_qp_attr& a = t.attr;
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = localPsn & kMax24Bit;
  a.timeout = local.timeout;
  a.retry_cnt = local.retryCount;
  a.rnr_retry = local.rnrRetry;
  a.max_rd_atomic = local.maxRdAtomic;
  t.mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

// ---- Work requests ----

void planWrite(uint64_t localBase, uint64_t localBytes, uint32_t lkey, uint64_t srcOffset, const RemoteKey& dst,
               uint64_t dstOffset, uint64_t bytes, uint64_t maxMessageBytes, bool signal, uint64_t cookie,
               std::vector<WorkRequestPlan>& out) {
  if (bytes == 0) fail(ErrorCode::kInvalidArgument, "verbs: write of 0 bytes");
  if (!detail::inBounds(srcOffset, bytes, localBytes))
    fail(ErrorCode::kInvalidArgument, "verbs: write reads [{}, +{}) of a local region of {} bytes", srcOffset, bytes,
         localBytes);
  if (!detail::inBounds(dstOffset, bytes, dst.bytes))
    fail(ErrorCode::kInvalidArgument, "verbs: write to [{}, +{}) of node {}'s region {} which has {} bytes", dstOffset,
         bytes, dst.owner, dst.regionId, dst.bytes);
  // An RDMA message carries at most 2^31 bytes (ibv_sge::length is 32-bit and ports report max_msg_sz 2^31).
  // Cuts fall on multiples of maxMsg in the destination region, so a destination stripe is a pure function of
  // the byte's offset (VerbsTransport pins each stripe to one QP: writes to the same bytes stay ordered).
  const uint64_t maxMsg = std::clamp<uint64_t>(maxMessageBytes, 1, uint64_t{1} << 31);
  uint64_t done = 0;
  while (done < bytes) {
    const uint64_t at = dstOffset + done;
    const uint64_t n = std::min(maxMsg - at % maxMsg, bytes - done);
    WorkRequestPlan p;
    p.kind = WrKind::kWrite;
    p.localAddr = localBase + srcOffset + done;
    p.lkey = lkey;
    p.length = static_cast<uint32_t>(n);
    p.remoteAddr = dst.addr + at;
    p.rkey = dst.rkey;
    done += n;
    if (done == bytes) {
      p.userSignal = signal;
      p.cookie = cookie;
    }
    out.push_back(p);
  }
}

WorkRequestPlan planFlag(const RemoteKey& dst, uint64_t dstOffset, uint64_t value, bool signal, uint64_t cookie) {
  if (dstOffset % 8 != 0) fail(ErrorCode::kInvalidArgument, "verbs: flag offset {} is not 8-byte aligned", dstOffset);
  if (!detail::inBounds(dstOffset, 8, dst.bytes))
    fail(ErrorCode::kInvalidArgument, "verbs: flag at offset {} of node {}'s region {} which has {} bytes", dstOffset,
         dst.owner, dst.regionId, dst.bytes);
  WorkRequestPlan p;
  p.kind = WrKind::kFlag;
  p.length = 8;
  p.remoteAddr = dst.addr + dstOffset;
  p.rkey = dst.rkey;
  p.inlineValue = value;
  p.userSignal = signal;
  p.cookie = cookie;
  return p;
}

void encodeWorkRequest(const WorkRequestPlan& plan, uint64_t wrId, bool signaled, ibv_send_wr& wr, ibv_sge& sge) {
  wr = ibv_send_wr{};
  sge = ibv_sge{};
  wr.wr_id = wrId;
  wr.next = nullptr;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.wr.rdma.remote_addr = plan.remoteAddr;
  wr.wr.rdma.rkey = plan.rkey;
  const auto oneSge = [&](uint64_t addr, uint32_t length, uint32_t lkey) {
    sge.addr = addr;
    sge.length = length;
    sge.lkey = lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
  };
  switch (plan.kind) {
    case WrKind::kWrite:
      wr.opcode = IBV_WR_RDMA_WRITE;
      oneSge(plan.localAddr, plan.length, plan.lkey);
      break;
    case WrKind::kFlag:
      // Inline: the HCA copies the 8 bytes at post time, so the value needs no registered, long-lived source.
      // The caller's plan (and so inlineValue) stays alive until ibv_post_send returns. The lkey is ignored.
      wr.opcode = IBV_WR_RDMA_WRITE;
      oneSge(reinterpret_cast<uintptr_t>(&plan.inlineValue), sizeof(plan.inlineValue), 0);
      wr.send_flags |= IBV_SEND_INLINE;
      break;
    case WrKind::kMarker:
      wr.opcode = IBV_WR_RDMA_WRITE;  // zero-length write: no SGE, no data, just a completion in QP order
      wr.sg_list = nullptr;
      wr.num_sge = 0;
      wr.send_flags |= IBV_SEND_SIGNALED;
      break;
    case WrKind::kSend:
      wr.opcode = IBV_WR_SEND;
      oneSge(plan.localAddr, plan.length, plan.lkey);
      break;
    case WrKind::kFlushRead:
      wr.opcode = IBV_WR_RDMA_READ;
      oneSge(plan.localAddr, plan.length, plan.lkey);
      wr.send_flags |= IBV_SEND_SIGNALED;  // the flush is only useful if we see it complete
      break;
  }
}

std::vector<std::byte> fragmentMessage(std::span<const std::byte> payload, std::size_t slotBytes,
                                       std::vector<uint32_t>& lengths) {
  if (slotBytes <= kFragmentHeaderBytes)
    fail(ErrorCode::kInvalidArgument, "verbs: receive slots of {} bytes leave no room for a message", slotBytes);
  const std::size_t room = slotBytes - kFragmentHeaderBytes;
  const std::size_t count = payload.empty() ? 1 : (payload.size() + room - 1) / room;
  std::vector<std::byte> out(count * slotBytes);
  lengths.clear();
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t at = i * room;
    const std::size_t n = std::min(room, payload.size() - std::min(at, payload.size()));
    std::byte* f = out.data() + i * slotBytes;
    f[0] = static_cast<std::byte>(i + 1 == count ? kFragmentLast : kFragmentMore);
    if (n) std::memcpy(f + kFragmentHeaderBytes, payload.data() + at, n);
    lengths.push_back(static_cast<uint32_t>(kFragmentHeaderBytes + n));
  }
  return out;
}

bool appendFragment(std::span<const std::byte> fragment, std::vector<std::byte>& assembling, std::size_t maxBytes) {
  if (fragment.size() < kFragmentHeaderBytes)
    fail(ErrorCode::kProtocol, "verbs: control message fragment of {} bytes has no header", fragment.size());
  const auto kind = static_cast<uint8_t>(fragment[0]);
  if ((kind != kFragmentMore && kind != kFragmentLast) || fragment[1] != std::byte{0} || fragment[2] != std::byte{0} ||
      fragment[3] != std::byte{0})
    fail(ErrorCode::kProtocol, "verbs: control message fragment with a bad header ({:#x})", kind);
  const auto body = fragment.subspan(kFragmentHeaderBytes);
  if (assembling.size() + body.size() > maxBytes)
    fail(ErrorCode::kProtocol, "verbs: control message over {} bytes", maxBytes);
  assembling.insert(assembling.end(), body.begin(), body.end());
  return kind == kFragmentLast;
}

SendQueueTracker::SendQueueTracker(uint32_t depth, uint32_t signalEvery) : depth_(depth), signalEvery_(signalEvery) {
  if (depth == 0 || signalEvery == 0 || signalEvery > depth)
    fail(ErrorCode::kInvalidArgument, "verbs: signal_every {} must be in [1, send queue depth {}]", signalEvery, depth);
}

SendQueueTracker::Slot SendQueueTracker::next(bool forceSignal) {
  if (room() == 0) fail(ErrorCode::kInternal, "verbs: send queue full ({} WRs outstanding)", outstanding());
  const uint64_t seq = posted_;
  const uint64_t sinceSignal = lastSignaled_ == UINT64_MAX ? seq + 1 : seq - lastSignaled_;
  // The WR that fills the queue must be signalled: otherwise nothing would ever retire the full queue.
  const bool fills = outstanding() + 1 == depth_;
  const bool signaled = forceSignal || sinceSignal >= signalEvery_ || fills;
  ++posted_;
  if (signaled) {
    lastSignaled_ = seq;
    signaledInFlight_.push_back(seq);
  }
  return Slot{seq, signaled};
}

uint64_t SendQueueTracker::complete(uint64_t seq) {
  if (seq >= posted_ || seq < retired_) return 0;
  while (!signaledInFlight_.empty() && signaledInFlight_.front() <= seq) signaledInFlight_.pop_front();
  const uint64_t before = retired_;
  retired_ = seq + 1;
  return retired_ - before;
}

std::size_t takeBatch(std::deque<WorkRequestPlan>& pending, SendQueueTracker& tracker, uint32_t maxPerPost,
                      std::vector<PlannedWr>& batch) {
  batch.clear();
  const std::size_t n = std::min<std::size_t>({pending.size(), tracker.room(), std::max<uint32_t>(maxPerPost, 1)});
  for (std::size_t i = 0; i < n; ++i) {
    const WorkRequestPlan& p = pending.front();
    const bool force = p.userSignal || p.kind == WrKind::kMarker || p.kind == WrKind::kFlushRead;
    const auto slot = tracker.next(force);
    batch.push_back(PlannedWr{p, slot.seq, slot.signaled});
    pending.pop_front();
  }
  return n;
}

// ---- Rail-aligned NIC choice ----

std::string_view pciDistanceName(PciDistance d) {
  switch (d) {
    case PciDistance::kSameSwitch: return "same PCIe switch";
    case PciDistance::kSameHostBridge: return "same host bridge";
    case PciDistance::kSameNuma: return "same NUMA node";
    case PciDistance::kCrossNuma: return "across NUMA nodes";
  }
  return "unknown";
}

namespace {
// "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:1b:00.0" -> {"pci0000:17", "0000:17:01.0", ...}
std::vector<std::string_view> pciComponents(std::string_view path) {
  constexpr std::string_view kPrefix = "/sys/devices/";
  if (path.starts_with(kPrefix)) path.remove_prefix(kPrefix.size());
  std::vector<std::string_view> parts;
  while (!path.empty()) {
    const auto slash = path.find('/');
    const auto part = path.substr(0, slash);
    if (!part.empty()) parts.push_back(part);
    if (slash == std::string_view::npos) break;
    path.remove_prefix(slash + 1);
  }
  return parts;
}
}  // namespace

PciDistance pciDistance(const PciDevice& a, const PciDevice& b) {
  const auto pa = pciComponents(a.pciPath);
  const auto pb = pciComponents(b.pciPath);
  std::size_t common = 0;
  // The last component is the device itself; only shared ancestors count.
  while (common + 1 < pa.size() && common + 1 < pb.size() && pa[common] == pb[common]) ++common;
  // common == 1: only the "pciDDDD:BB" host bridge is shared; common == 2: the same root port, which is
  // only shared below it through a switch; deeper: a switch proper. Both count as one switch.
  if (common >= 2 && pa[0].starts_with("pci")) return PciDistance::kSameSwitch;
  if (common == 1 && pa[0].starts_with("pci")) return PciDistance::kSameHostBridge;
  if (a.numaNode >= 0 && a.numaNode == b.numaNode) return PciDistance::kSameNuma;
  return PciDistance::kCrossNuma;
}

std::vector<NicAssignment> chooseRailNics(std::span<const GpuDesc> gpus, std::span<const NicDesc> nics) {
  std::vector<std::size_t> active;
  for (std::size_t i = 0; i < nics.size(); ++i) {
    if (nics[i].active) active.push_back(i);
  }
  if (active.empty())
    fail(ErrorCode::kUnavailable, "verbs: no RDMA NIC with an active port among {} found; check `ibv_devinfo` "
         "(state PORT_ACTIVE) or use transport: tcp", nics.size());
  std::vector<std::size_t> order(gpus.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return gpus[x].index < gpus[y].index; });

  std::vector<uint32_t> load(nics.size(), 0);
  std::vector<NicAssignment> result(gpus.size(), NicAssignment{0, PciDistance::kCrossNuma});
  for (std::size_t g : order) {
    std::size_t best = active.front();
    PciDistance bestDist = pciDistance(gpus[g].pci, nics[best].pci);
    for (std::size_t n : active) {
      const PciDistance d = pciDistance(gpus[g].pci, nics[n].pci);
      const auto key = std::make_tuple(d, load[n], std::string_view(nics[n].pci.name));
      const auto bestKey = std::make_tuple(bestDist, load[best], std::string_view(nics[best].pci.name));
      if (key < bestKey) {
        best = n;
        bestDist = d;
      }
    }
    ++load[best];
    result[g] = NicAssignment{best, bestDist};
  }
  return result;
}

}  // namespace tandem::daemon::transport::verbs
