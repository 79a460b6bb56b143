#include "cluster.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>

#include "backend.hpp"
#include "transport/factory.hpp"

namespace tandem::daemon {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kFifoCapacity = 4096;
constexpr uint64_t kMaxCommandBytes = uint64_t{1} << 30;  // writes are cut into commands of at most this

std::string hostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

uint64_t loadAcquire(const uint64_t* word) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(word)).load(std::memory_order_acquire);
}

}  // namespace

// ---- CommLink ------------------------------------------------------------------------------------------

CommLink::CommLink(Cluster& cluster, std::vector<NodeIndex> nodes, uint64_t slotBytes, uint32_t bufferId)
    : cluster_(cluster), self_(cluster.self()), nodes_(std::move(nodes)), slotBytes_(slotBytes), bufferId_(bufferId) {
  worker_ = std::thread([q = queue_] {  // touches only the queue: `this` may be gone after any job
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(q->mutex);
        q->cv.wait(lock, [&] { return q->stop || !q->jobs.empty(); });
        if (q->jobs.empty()) return;
        job = std::move(q->jobs.front());
        q->jobs.pop_front();
      }
      job();
      job = nullptr;  // may destroy the link (its last reference), which sets stop
    }
  });
}

CommLink::~CommLink() {
  {
    std::lock_guard lock(queue_->mutex);
    queue_->stop = true;
  }
  queue_->cv.notify_all();
  // The last reference may be dropped by the work the thread itself ran.
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();
  } else if (worker_.joinable()) {
    worker_.join();
  }
  cluster_.releaseLink(*this);
}

void CommLink::post(std::function<void()> work) {
  {
    std::lock_guard lock(queue_->mutex);
    queue_->jobs.push_back(std::move(work));
  }
  queue_->cv.notify_one();
}

void CommLink::abort(ErrorCode code, const std::string& reason, uint64_t afterEpoch) {
  {
    std::lock_guard lock(mutex_);
    if (afterEpoch >= abortAfter_.load()) return;
    if (abortCode_ == ErrorCode::kOk) {
      abortCode_ = code;
      abortReason_ = reason;
    }
    abortAfter_.store(afterEpoch, std::memory_order_release);
  }
  keysCv_.notify_all();
}

void CommLink::throwIfAborted(uint64_t epoch) {
  if (!abortedFor(epoch)) return;
  std::lock_guard lock(mutex_);
  fail(abortCode_, "{}", abortReason_);
}

void CommLink::waitKeys(uint32_t timeoutMs) {
  const size_t peers = nodes_.size() - 1;
  std::unique_lock lock(mutex_);
  const bool done = keysCv_.wait_for(lock, std::chrono::milliseconds(timeoutMs),
                                     [&] { return abortedFor(currentEpoch_) || keysPublished_ >= peers; });
  if (abortedFor(currentEpoch_)) fail(abortCode_, "{}", abortReason_);
  if (!done) {
    std::string missing;
    for (NodeIndex n : nodes_) {
      if (n != self_ && !peerKeys_.contains(n)) missing += (missing.empty() ? "" : ", ") + cluster_.nodeName(n);
    }
    fail(ErrorCode::kTimeout, "multi-node communicator: no staging key from {} within {} ms; check that those "
         "daemons are running and reachable", missing, timeoutMs);
  }
}

void CommLink::waitFor(const std::function<bool()>& done, uint32_t timeoutMs, const std::string& what) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
  for (uint32_t spins = 0;; ++spins) {
    if (done()) return;
    if (abortedFor(currentEpoch_)) {
      // The abort may come from a message the peer sent after the data we wait for (a rank that finished
      // and destroyed the communicator): that data is then already here.
      if (done()) return;
      std::lock_guard lock(mutex_);
      fail(abortCode_, "{}", abortReason_);
    }
    if (spins < 1024) continue;
    if ((spins & 63) == 0 && Clock::now() > deadline) {
      fail(ErrorCode::kTimeout, "multi-node communicator: {} did not happen within {} ms (the peer daemon is alive "
           "but silent); check its log", what, timeoutMs);
    }
    if (spins < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void CommLink::waitWord(uint64_t offset, uint64_t value, uint32_t timeoutMs, const std::string& what) {
  const uint64_t* w = word(offset);
  waitFor([&] { return loadAcquire(w) >= value; }, timeoutMs, what);
}

void CommLink::exchange(uint64_t epoch, const std::function<uint64_t(NodeIndex, std::span<std::byte>)>& fill,
                        const std::function<void(NodeIndex, std::span<const std::byte>)>& receive, uint32_t timeoutMs) {
  if (epoch <= lastEpoch_) fail(ErrorCode::kInternal, "exchange epoch {} after {}", epoch, lastEpoch_);
  currentEpoch_ = epoch;
  waitKeys(timeoutMs);
  uint64_t lastTicket = 0;
  // Send: wait until the peer has read our previous payload (its inbox and our outbox are free again),
  // fill the outbox, then write it and the arrival flag through the proxy.
  for (NodeIndex p : nodes_) {
    if (p == self_) continue;
    if (lastEpoch_ != 0) {
      waitWord(consumedOffset(p), lastEpoch_, timeoutMs,
               fmt::format("{} reading the previous op's data", cluster_.nodeName(p)));
    }
    std::byte* box = mapping_.data() + outboxOffset(p);
    const uint64_t bytes = fill(p, std::span<std::byte>(box + kPayloadHeaderBytes, maxPayload()));
    if (bytes > maxPayload()) fail(ErrorCode::kInternal, "exchange payload of {} bytes overflows the outbox", bytes);
    std::memcpy(box, &epoch, 8);
    std::memcpy(box + 8, &bytes, 8);
    const uint64_t total = kPayloadHeaderBytes + bytes;
    for (uint64_t off = 0; off < total; off += kMaxCommandBytes) {
      producer_->pushWrite(static_cast<uint16_t>(p), bufferId_, outboxOffset(p) + off, bufferId_,
                           inboxOffset(self_) + off, std::min(kMaxCommandBytes, total - off));
    }
    producer_->pushFlag(static_cast<uint16_t>(p), bufferId_, arrivedOffset(self_), epoch);
  }
  // Receive in node order (fixed, so reductions over nodes are deterministic), then tell each peer its
  // payload was read.
  for (NodeIndex p : nodes_) {
    if (p == self_) continue;
    waitWord(arrivedOffset(p), epoch, timeoutMs, fmt::format("data from {} for op {}", cluster_.nodeName(p), epoch));
    const std::byte* box = mapping_.data() + inboxOffset(p);
    uint64_t gotEpoch = 0, bytes = 0;
    std::memcpy(&gotEpoch, box, 8);
    std::memcpy(&bytes, box + 8, 8);
    if (gotEpoch != epoch || bytes > maxPayload()) {
      fail(ErrorCode::kProtocol, "multi-node communicator: {} sent a payload for op {} ({} bytes) while op {} was "
           "expected; the nodes disagree about the op sequence", cluster_.nodeName(p), gotEpoch, bytes, epoch);
    }
    receive(p, std::span<const std::byte>(box + kPayloadHeaderBytes, bytes));
    // Signalled: it is the last command to p in this op, and its completion covers the earlier ones.
    lastTicket = producer_->pushFlag(static_cast<uint16_t>(p), bufferId_, consumedOffset(self_), epoch, true);
  }
  // The op completes only once the proxy has handed every command of it to the transport: the ranks may
  // destroy the communicator right after, and the peer still needs our data and flags.
  waitFor([&] { return fifo_.completed() > lastTicket; }, timeoutMs, "posting this node's transfers");
  lastEpoch_ = epoch;
  completedEpoch_.store(epoch, std::memory_order_release);
}

// ---- Cluster -------------------------------------------------------------------------------------------

Cluster::Cluster(const DaemonConfig& config, std::string backend, std::vector<GpuInfo> gpus,
                 std::shared_ptr<transport::DeviceCopier> deviceCopier)
    : config_(config), backend_(std::move(backend)), gpus_(std::move(gpus)), deviceCopier_(std::move(deviceCopier)) {
  const ClusterSection& c = config.cluster;
  if (!isMultiNode(c)) fail(ErrorCode::kInvalidConfig, "cluster.nodes lists fewer than two nodes");
  self_ = static_cast<NodeIndex>(c.nodeIndex);
  nodes_.resize(c.nodes.size());
  for (size_t i = 0; i < c.nodes.size(); ++i) {
    const NodeEndpoint e = parseNodeEndpoint(c.nodes[i]);
    addresses_.push_back({e.host, e.port});
    nodes_[i].address = c.nodes[i];
  }
  if (c.gpuExchange == GpuExchange::kOff) {
    gpuExchangeOff_ = "cluster.gpu_exchange is off";
  }
  nodes_[self_].state = NodeState::kSelf;
  nodes_[self_].hostname = hostName();
  nodes_[self_].daemonVersion = TANDEM_VERSION_STRING;
  linkUp_.assign(nodes_.size(), false);
  queued_.resize(nodes_.size());

  transport::TransportOptions to;
  to.kind = c.transport == ClusterTransport::kVerbs ? transport::TransportKind::kVerbs : transport::TransportKind::kTcp;
  to.self = self_;
  to.nodeCount = static_cast<uint32_t>(c.nodes.size());
  to.listen = addresses_[self_];
  to.secret = clusterSecret(c);
  to.connectionsPerPeer = c.connectionsPerPeer;
  to.ioThreads = 2;
  to.connectTimeoutMs = c.connectTimeoutMs;
  to.heartbeatIntervalMs = c.heartbeatIntervalMs;
  to.peerDeadlineMs = config.communicators.peerLostDeadlineMs;
  to.deviceCopier = deviceCopier_.get();
  transport_ = transport::createTransport(to);
  control_ = transport_->controlChannel();
  if (control_ == nullptr) {
    fail(ErrorCode::kInvalidConfig, "cluster.transport: the {} transport has no control channel for the daemons' "
         "messages; set cluster.transport: tcp", transport::transportKindName(transport_->kind()));
  }

  const uint64_t fifoBytes = transport::ProxyFifoLayout::bytesFor(kFifoCapacity);
  fifoFd_ = Fd::memfd("tandem-proxy-fifo", fifoBytes);
  fifoMapping_ = Mapping::shared(fifoFd_.get(), fifoBytes);
  fifo_ = transport::ProxyFifoView::format(fifoMapping_.data(), fifoBytes, kFifoCapacity);
  transport::ProxyOptions po;
  po.name = fmt::format("proxy {}", transport::transportKindName(transport_->kind()));
  proxy_ = std::make_unique<transport::Proxy>(fifo_, *transport_, po);
  proxy_->setErrorHandler([this](const transport::ProxyCommandError& e) {
    // A command the proxy refused or could not post: the link it belongs to cannot finish its op.
    const std::string reason = fmt::format("proxy: transfer to {} failed: {}",
                                           nodeName(transport::fifo::peerField(e.command.control)), e.message);
    spdlog::error("cluster: {}", reason);
    std::lock_guard lock(mutex_);
    if (auto it = links_.find(e.command.dstBuffer); it != links_.end()) it->second.link->abort(e.code, reason);
  });
}

Cluster::~Cluster() { stop(); }

std::string Cluster::nodeName(NodeIndex node) const {
  if (node >= addresses_.size()) return fmt::format("node {}", node);
  return fmt::format("node {} ({})", node, addresses_[node].toString());
}

void Cluster::start(MessageHandler onMessage, NodeLostHandler onNodeLost) {
  onMessage_ = std::move(onMessage);
  onNodeLost_ = std::move(onNodeLost);
  eventThread_ = std::thread([this] { eventLoop(); });
  control_->setMessageHandler(
      [this](NodeIndex from, std::span<const std::byte> bytes) { this->onMessage(from, bytes); });
  transport_->setPeerFailureHandler([this](NodeIndex node, const transport::PeerStatus& st) {
    nodeLost(node, st.state == transport::PeerState::kClosed ? NodeState::kClosed : NodeState::kFailed, st.reason);
  });
  control_->setPeerRejoinHandler([this](NodeIndex node) { nodeRejoined(node); });
  proxy_->start();
  spdlog::info("cluster: node {} of {} listening on {}; connecting to the others (up to {} ms)", self_, nodes_.size(),
               addresses_[self_].toString(), config_.cluster.connectTimeoutMs);
  connector_ = std::thread([this] { connectThread(); });
}

void Cluster::stop() {
  if (stopping_.exchange(true)) return;
  if (connector_.joinable()) connector_.join();
  if (proxy_) proxy_->stop();
  {
    std::lock_guard lock(eventMutex_);
    eventsStopped_ = true;
  }
  eventCv_.notify_all();
  if (eventThread_.joinable()) eventThread_.join();
  transport_.reset();  // says goodbye to the peers
  control_ = nullptr;
  std::lock_guard lock(mutex_);
  retired_.clear();
}

std::string Cluster::helloBytes() const {
  v1::PeerMessage hello;
  auto* h = hello.mutable_hello();
  h->set_protocol_version(kClusterProtocolVersion);
  h->set_daemon_version(TANDEM_VERSION_STRING);
  h->set_node_index(self_);
  h->set_hostname(hostName());
  h->set_backend(backend_);
  h->set_staging_bytes(config_.cluster.stagingBytes);
  h->set_gpu_exchange(gpuExchangeOff_.empty() ? "on" : "off");
  for (const GpuInfo& g : gpus_) {
    auto* gi = h->add_gpus();
    gi->set_uuid(g.uuid);
    gi->set_name(g.name);
    gi->set_sms(g.sms);
    gi->set_memory_bytes(g.memoryBytes);
    gi->set_pci_bus_id(g.pciBusId);
  }
  return hello.SerializeAsString();
}

void Cluster::connectThread() {
  try {
    control_->connect(addresses_);
    spdlog::info("cluster: connected to every node");
  } catch (const Error& e) {
    // Nodes not connected were reported lost by the transport, which keeps re-dialing them: they rejoin
    // (nodeRejoined) when they come up.
    spdlog::error("cluster: {}", e.what());
  }
  const std::string hello = helloBytes();
  std::lock_guard send(sendMutex_);
  for (NodeIndex n = 0; n < nodes_.size(); ++n) {
    if (n == self_ || linkUp_[n] || transport_->peerStatus(n).state != transport::PeerState::kConnected) continue;
    {
      std::lock_guard lock(mutex_);
      if (nodes_[n].state == NodeState::kConnecting) nodes_[n].state = NodeState::kConnected;
    }
    linkUpLocked(n, hello);
  }
}

void Cluster::nodeRejoined(NodeIndex node) {
  if (stopping_.load() || node >= nodes_.size() || node == self_) return;
  // Under sendMutex_, so that the hello is the first message of the new incarnation: until linkUp_ is set, send()
  // drops messages for the node (they were meant for its previous run).
  std::lock_guard send(sendMutex_);
  {
    std::lock_guard lock(mutex_);
    Node& n = nodes_[node];
    // Its hello may already have come (and found it incompatible): that verdict stands.
    if (n.state == NodeState::kFailed || n.state == NodeState::kClosed || n.state == NodeState::kConnecting) {
      n.state = NodeState::kConnected;
      n.reason.clear();
    }
  }
  spdlog::info("cluster: {} rejoined (transport generation {}); communicators that failed with it stay failed",
               nodeName(node), control_->peerGeneration(node));
  linkUpLocked(node, helloBytes());
}

void Cluster::linkUpLocked(NodeIndex node, const std::string& hello) {
  sendNow(node, hello);  // first, so the peer knows who sends what follows
  for (const std::string& m : queued_[node]) sendNow(node, m);
  queued_[node].clear();
  linkUp_[node] = true;
}

void Cluster::sendNow(NodeIndex node, const std::string& bytes) {
  try {
    control_->sendMessage(node, std::as_bytes(std::span(bytes.data(), bytes.size())));
  } catch (const Error& e) {
    // kPeerLost: the failure handler reports the node; nothing else to do here.
    spdlog::debug("cluster: message to {} dropped: {}", nodeName(node), e.what());
  }
}

void Cluster::send(NodeIndex node, const v1::PeerMessage& message) {
  if (node >= nodes_.size() || node == self_) fail(ErrorCode::kInvalidArgument, "cluster: no peer node {}", node);
  std::string bytes = message.SerializeAsString();
  std::lock_guard send(sendMutex_);
  if (linkUp_[node]) return sendNow(node, bytes);
  {
    std::lock_guard lock(mutex_);
    if (nodes_[node].state != NodeState::kConnecting) return;  // lost before it came up
  }
  queued_[node].push_back(std::move(bytes));
}

void Cluster::broadcast(const v1::PeerMessage& message) {
  for (NodeIndex n = 0; n < nodes_.size(); ++n) {
    if (n != self_) send(n, message);
  }
}

std::string Cluster::nodeProblem(NodeIndex node) const {
  std::lock_guard lock(mutex_);
  if (node >= nodes_.size()) return fmt::format("node {} is not in cluster.nodes", node);
  const Node& n = nodes_[node];
  switch (n.state) {
    case NodeState::kFailed:
    case NodeState::kClosed: return fmt::format("{} is lost: {}", nodeName(node), n.reason);
    case NodeState::kIncompatible: return fmt::format("{} is incompatible: {}", nodeName(node), n.reason);
    default: return {};
  }
}

void Cluster::postEvent(std::function<void()> event) {
  {
    std::lock_guard lock(eventMutex_);
    if (eventsStopped_) return;
    events_.push_back(std::move(event));
  }
  eventCv_.notify_one();
}

void Cluster::eventLoop() {
  for (;;) {
    std::function<void()> event;
    {
      std::unique_lock lock(eventMutex_);
      eventCv_.wait(lock, [this] { return eventsStopped_ || !events_.empty(); });
      if (eventsStopped_) return;
      event = std::move(events_.front());
      events_.pop_front();
    }
    try {
      event();
    } catch (const std::exception& e) {
      spdlog::error("cluster: handling a peer event failed: {}", e.what());
    }
  }
}

void Cluster::onMessage(NodeIndex from, std::span<const std::byte> bytes) {
  v1::PeerMessage m;
  if (!m.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return nodeLost(from, NodeState::kIncompatible, "sent a control message that does not parse; run the same tandem "
                    "release on every node");
  }
  if (m.has_hello()) return handleHello(from, m.hello());
  {
    std::lock_guard lock(mutex_);
    const Node& n = nodes_[from];
    if (!n.helloReceived || n.state == NodeState::kIncompatible) {
      spdlog::warn("cluster: dropped a message from {} ({})", nodeName(from),
                   n.helloReceived ? "incompatible" : "it came before its hello");
      return;
    }
  }
  postEvent([this, from, m = std::move(m)] { onMessage_(from, m); });
}

void Cluster::handleHello(NodeIndex from, const v1::NodeHello& h) {
  std::string problem;
  if (h.protocol_version() != kClusterProtocolVersion) {
    problem = fmt::format("it speaks cluster protocol {} (tandem {}), this node {} (tandem {}); run the same tandem "
                          "release on every node", h.protocol_version(), h.daemon_version(), kClusterProtocolVersion,
                          TANDEM_VERSION_STRING);
  } else if (h.node_index() != from) {
    problem = fmt::format("it says it is node {}; give every node the same cluster.nodes list and its own node_index",
                          h.node_index());
  } else if (h.backend() != backend_) {
    problem = fmt::format("it runs the {} backend and this node the {} backend; set daemon.backend the same on every "
                          "node", h.backend(), backend_);
  } else if (h.staging_bytes() != config_.cluster.stagingBytes) {
    problem = fmt::format("its cluster.staging_bytes is {} and this node's {}; set the same value on every node",
                          h.staging_bytes(), config_.cluster.stagingBytes);
  } else if (backend_ == "cuda" && h.gpu_exchange() != (gpuExchangeOff_.empty() ? "on" : "off")) {
    // The cpu backend has no GPU exchange: only cuda nodes must agree (every op's path depends on it).
    problem = fmt::format("its GPU exchange is {} and this node's {} ({}); set cluster.gpu_exchange the same on every "
                          "node, and run MPS on all nodes or none", h.gpu_exchange(),
                          gpuExchangeOff_.empty() ? "on" : "off",
                          gpuExchangeOff_.empty() ? "cluster.gpu_exchange on, no MPS" : gpuExchangeOff_);
  }
  {
    std::lock_guard lock(mutex_);
    Node& n = nodes_[from];
    n.helloReceived = true;
    n.hostname = h.hostname();
    n.daemonVersion = h.daemon_version();
  }
  if (!problem.empty()) return nodeLost(from, NodeState::kIncompatible, problem);
  spdlog::info("cluster: {} is up: host {}, tandem {}, {} GPU(s)", nodeName(from), h.hostname(), h.daemon_version(),
               h.gpus_size());
}

void Cluster::nodeLost(NodeIndex node, NodeState state, const std::string& reason) {
  if (state != NodeState::kIncompatible) {
    // The transport lost the node (this incarnation of it): nothing more goes to it until it rejoins and gets
    // our hello again, and its next run must send its own hello first. Runs on a transport thread holding no
    // transport lock; sendNow under sendMutex_ only queues, so this cannot deadlock.
    {
      std::lock_guard send(sendMutex_);
      linkUp_[node] = false;
      queued_[node].clear();
    }
    std::lock_guard lock(mutex_);
    Node& n = nodes_[node];
    n.helloReceived = false;
    if (n.state == NodeState::kIncompatible) {  // already reported to the engine; now it is gone as well
      n.state = state;
      n.reason = reason;
      return;
    }
  }
  {
    std::lock_guard lock(mutex_);
    Node& n = nodes_[node];
    if (n.state == NodeState::kFailed || n.state == NodeState::kClosed || n.state == NodeState::kIncompatible) return;
    n.state = state;
    n.reason = reason;
  }
  const std::string what = state == NodeState::kIncompatible ? "is incompatible" : "is lost";
  if (state == NodeState::kClosed && stopping_.load()) return;
  spdlog::error("cluster: {} {}: {}", nodeName(node), what, reason);
  postEvent([this, node, text = fmt::format("{} {}: {}", nodeName(node), what, reason)] { onNodeLost_(node, text); });
}

// ---- staging links -----------------------------------------------------------------------------------

std::shared_ptr<CommLink> Cluster::createLink(std::vector<NodeIndex> nodes) {
  std::sort(nodes.begin(), nodes.end());
  const uint64_t slot = config_.cluster.stagingBytes;
  const uint64_t bytes = CommLink::kHeaderBytes + 2 * slot * (uint64_t{nodes.back()} + 1);
  std::lock_guard lock(mutex_);
  retireExpiredLocked();
  uint32_t id;
  if (!freeIds_.empty()) {
    id = freeIds_.back();
    freeIds_.pop_back();
  } else {
    id = nextBufferId_++;
  }
  std::shared_ptr<CommLink> link(new CommLink(*this, std::move(nodes), slot, id));
  link->fd_ = Fd::memfd("tandem-staging", bytes);
  link->mapping_ = Mapping::shared(link->fd_.get(), bytes);
  link->region_ = transport_->registerMemory({transport::MemoryKind::kHost, link->mapping_.data(), bytes});
  link->fifo_ = fifo_;
  link->producer_ = std::make_unique<transport::ProxyFifoProducer>(fifo_);
  links_[id] = LinkEntry{link.get(), link->region_, bytes};
  publishTableLocked();
  return link;
}

std::vector<std::byte> Cluster::linkKey(const CommLink& link) const { return transport_->remoteKey(link.region_).encode(); }

void Cluster::setPeerKey(CommLink& link, NodeIndex peer, std::span<const std::byte> key) {
  const transport::RemoteKey k = transport::RemoteKey::decode(key);
  if (k.owner != peer || std::find(link.nodes_.begin(), link.nodes_.end(), peer) == link.nodes_.end()) {
    fail(ErrorCode::kProtocol, "{} sent a staging key owned by node {} for a communicator it is not part of",
         nodeName(peer), k.owner);
  }
  std::lock_guard lock(mutex_);
  {
    std::lock_guard l(link.mutex_);
    if (link.peerKeys_.contains(peer)) return;
    link.peerKeys_[peer] = k;
  }
  publishTableLocked();
  {
    std::lock_guard l(link.mutex_);
    ++link.keysPublished_;
  }
  link.keysCv_.notify_all();
}

void Cluster::publishTableLocked() {
  auto table = std::make_shared<transport::ProxyBufferTable>();
  for (auto& [id, e] : links_) {
    table->addLocal(id, e.region, e.bytes);
    std::lock_guard l(e.link->mutex_);
    for (auto& [peer, key] : e.link->peerKeys_) table->addRemote(id, peer, key);
  }
  proxy_->setBufferTable(std::move(table));
}

void Cluster::releaseLink(CommLink& link) {
  std::lock_guard lock(mutex_);
  links_.erase(link.bufferId_);
  publishTableLocked();
  const auto grace = std::chrono::milliseconds(std::max<uint32_t>(10000, 3 * config_.communicators.peerLostDeadlineMs));
  // The id returns to use with the region: commands the link pushed may still sit in the FIFO until then.
  retired_.push_back(Retired{link.region_, link.bufferId_, std::move(link.fd_), std::move(link.mapping_),
                             Clock::now() + grace});
  retireExpiredLocked();
}

void Cluster::retireExpiredLocked() {
  const auto now = Clock::now();
  std::erase_if(retired_, [&](Retired& r) {
    if (r.until > now) return false;
    if (transport_) transport_->deregisterMemory(r.region);
    freeIds_.push_back(r.bufferId);
    return true;
  });
}

void Cluster::fillStatus(v1::ClusterInfo& out) const {
  static constexpr const char* kStateNames[] = {"self", "connecting", "connected", "failed", "closed", "incompatible"};
  std::lock_guard lock(mutex_);
  out.set_self(self_);
  out.set_transport(transport_ ? std::string(transport::transportKindName(transport_->kind())) : "tcp");
  out.set_staging_bytes(config_.cluster.stagingBytes);
  for (NodeIndex i = 0; i < nodes_.size(); ++i) {
    auto* n = out.add_nodes();
    n->set_index(i);
    n->set_address(nodes_[i].address);
    n->set_state(kStateNames[static_cast<int>(nodes_[i].state)]);
    n->set_reason(nodes_[i].reason);
    n->set_hostname(nodes_[i].hostname);
    n->set_daemon_version(nodes_[i].daemonVersion);
  }
}

}  // namespace tandem::daemon
