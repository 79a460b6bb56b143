// tandemctl: inspect and exercise a running tandemd.
//   tandemctl status [--json]       sessions, buffers, bytes, communicators, backend
//   tandemctl version
//   tandemctl run OP --ranks N ...  spawn N rank processes and run a fused op end to end (--check verifies);
//                                   with --id and --local-ranks, only some of them (the rest run on other nodes)
//   tandemctl new-id                a fresh communicator id for --id
//   tandemctl shutdown
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "session.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.h"

using json = nlohmann::json;
using tandem::DType;
using tandem::OpKind;
namespace ref = tandem::reference;

namespace {

using Clock = std::chrono::steady_clock;

const std::map<std::string, OpKind> kOps = {
    {"ag-gemm", OpKind::kAgGemm},
    {"gemm-rs", OpKind::kGemmRs},
    {"gemm-ar", OpKind::kGemmAr},
    {"moe-dispatch-gemm", OpKind::kMoeDispatchGemm},
    {"moe-dispatch-ffn-combine", OpKind::kMoeDispatchFfnCombine},
    {"ring-attention", OpKind::kRingAttention},
    {"allgather", OpKind::kAllGather},
    {"barrier", OpKind::kNop},
};
const std::map<std::string, DType> kDtypes = {{"bf16", DType::kBF16}, {"fp16", DType::kF16}, {"fp32", DType::kF32}};

struct RunOptions {
  std::string op;
  uint32_t ranks = 1;
  ref::OpShape shape;
  std::string dtype = "bf16";
  bool check = false;
  bool json = false;
  uint32_t iters = 1;
  uint64_t seed = 1;
  uint32_t timeoutMs = 60000;
  std::string idHex;  // the communicator id every node shares (parent: --id or random; child: always given)
  std::vector<uint32_t> localRanks;  // parent: the ranks this tandemctl spawns
  // child-only
  int rank = -1;
};

// A mistake on the command line: printed with a hint and exit code 2 (like CLI11's own parse errors).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string toHex(const tandem_unique_id_t& id) {
  std::string s;
  for (uint8_t b : id.bytes) s += fmt::format("{:02x}", b);
  return s;
}

tandem_unique_id_t fromHex(const std::string& hex) {
  const auto bad = std::find_if_not(hex.begin(), hex.end(), [](unsigned char c) { return std::isxdigit(c) != 0; });
  if (hex.size() != 32 || bad != hex.end()) {
    throw UsageError(fmt::format(
        "--id '{}' is not a communicator id: it must be exactly 32 hex digits ({}); make one with `tandemctl new-id` "
        "and pass the same id to every node's tandemctl run",
        hex, bad != hex.end() ? fmt::format("'{}' is not a hex digit", *bad) : fmt::format("got {}", hex.size())));
  }
  tandem_unique_id_t id{};
  for (int i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return id;
}

// "0,2-3" -> {0, 2, 3}: the ranks this tandemctl runs. Sorted; every rank in 0..nranks-1, none twice, not empty.
std::vector<uint32_t> parseRankList(const std::string& spec, uint32_t nranks) {
  const std::string how = fmt::format("list the ranks this node runs, separated by commas, as ranks or ranges within "
                                      "0..{} (--ranks {}), e.g. --local-ranks 0,1 or 2-3 or 0,2-3",
                                      nranks - 1, nranks);
  auto fail = [&](const std::string& what) -> void {
    throw UsageError(fmt::format("--local-ranks '{}': {}; {}", spec, what, how));
  };
  auto trim = [](std::string t) {
    const auto b = t.find_first_not_of(" \t"), e = t.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
  };
  auto number = [&](const std::string& t, const std::string& token) -> uint32_t {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size()) {
      fail(fmt::format("'{}' is not a rank or a range", token));
    }
    if (v >= nranks) fail(fmt::format("rank {} is out of range (the communicator has ranks 0..{})", v, nranks - 1));
    return v;
  };
  if (trim(spec).empty()) fail("the list is empty");
  std::vector<bool> seen(nranks, false);
  std::vector<uint32_t> ranks;
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string token = trim(spec.substr(pos, comma - pos));
    pos = comma + 1;
    if (token.empty()) fail("it has an empty entry (two commas in a row, or one at an end)");
    const std::size_t dash = token.find('-', 1);
    const uint32_t lo = number(trim(token.substr(0, dash)), token);
    const uint32_t hi = dash == std::string::npos ? lo : number(trim(token.substr(dash + 1)), token);
    if (hi < lo) fail(fmt::format("the range {} runs backwards (write {}-{})", token, hi, lo));
    for (uint32_t r = lo; r <= hi; ++r) {
      if (seen[r]) fail(fmt::format("rank {} is listed twice", r));
      seen[r] = true;
      ranks.push_back(r);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

// {0,1,2,3,5,7,8} -> "0-3,5,7,8": runs of three or more as ranges.
std::string formatRankList(const std::vector<uint32_t>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ',';
    if (j - i >= 2) {
      s += fmt::format("{}-{}", ranks[i], ranks[j]);
    } else {
      for (std::size_t k = i; k <= j; ++k) s += fmt::format("{}{}", k > i ? "," : "", ranks[k]);
    }
    i = j + 1;
  }
  return s;
}

// "4 ranks, 2 here (2,3)"
std::string placement(const RunOptions& o) {
  return fmt::format("{} rank{}, {} here ({})", o.ranks, o.ranks == 1 ? "" : "s", o.localRanks.size(),
                     formatRankList(o.localRanks));
}

[[noreturn]] void die(tandem_status_t status, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {} ({})", what, tandem_last_error(), tandem_strerror(status)));
}

void checkC(tandem_status_t status, const std::string& what) {
  if (status != TANDEM_SUCCESS) die(status, what);
}

// Submits one descriptor's op through the public C API (so tandemctl exercises what users call).
tandem_status_t submit(tandem_comm_t comm, const tandem::OpDescriptor& d, const std::vector<tandem_tensor_t>& t,
                       tandem_op_t* op) {
  const auto dt = static_cast<tandem_dtype_t>(d.dtype);
  switch (d.kind) {
    case OpKind::kAgGemm: {
      tandem_ag_gemm_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], t[3], nullptr};
      return tandem_ag_gemm(comm, &a, op);
    }
    case OpKind::kGemmRs: {
      tandem_gemm_rs_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], nullptr};
      return tandem_gemm_rs(comm, &a, op);
    }
    case OpKind::kGemmAr: {
      tandem_gemm_ar_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], t[0], t[1], t[2], nullptr};
      return tandem_gemm_ar(comm, &a, op);
    }
    case OpKind::kMoeDispatchGemm: {
      tandem_moe_dispatch_gemm_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], d.dims[3], d.dims[4], d.dims[5],
                                        t[0], t[1], t[2], t[3], t[4], t[5], t[6], nullptr};
      return tandem_moe_dispatch_gemm(comm, &a, op);
    }
    case OpKind::kMoeDispatchFfnCombine: {
      tandem_moe_ffn_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], d.dims[3], d.dims[4],
                              t[0], t[1], t[2], t[3], t[4], t[5], nullptr};
      return tandem_moe_dispatch_ffn_combine(comm, &a, op);
    }
    case OpKind::kRingAttention: {
      tandem_ring_attention_args_t a{sizeof a, dt, d.dims[0], d.dims[1], d.dims[2], (d.flags & tandem::kFlagCausal) != 0,
                                     d.scale, t[0], t[1], t[2], t[3], nullptr, t[4],
                                     (d.flags & tandem::kFlagZigzag) != 0 ? TANDEM_ATTENTION_ZIGZAG
                                                                          : TANDEM_ATTENTION_CONTIGUOUS};
      return tandem_ring_attention(comm, &a, op);
    }
    case OpKind::kAllGather: {
      tandem_allgather_args_t a{sizeof a, t[0], t[1], d.dims[0], nullptr};
      return tandem_allgather(comm, &a, op);
    }
    case OpKind::kNop: return tandem_barrier(comm, op);
    default: return TANDEM_ERROR_UNSUPPORTED;
  }
}

// One rank: connect, join, allocate, fill, run, optionally check. Prints one JSON line on stdout.
int runRank(const RunOptions& o, const std::string& socket) {
  json result{{"rank", o.rank}, {"ok", false}};
  const auto rank = static_cast<uint32_t>(o.rank);
  try {
    tandem_session_t session;
    checkC(tandem_connect(socket.empty() ? nullptr : socket.c_str(), &session), "connect");
    if (std::string(tandem_session_backend(session)) != "cpu") {
      throw std::runtime_error(fmt::format("tandemctl run fills and checks host memory, so it drives the cpu backend; "
                                           "this tandemd runs the {} backend (use tandem_gpu_tests or allgather_bench "
                                           "there)", tandem_session_backend(session)));
    }
    const tandem_unique_id_t id = fromHex(o.idHex);
    tandem_comm_t comm;
    checkC(tandem_comm_init(session, &id, o.ranks, rank, o.timeoutMs, &comm), "comm_init");

    const tandem::OpDescriptor desc = ref::makeDescriptor(o.shape, rank, o.ranks);
    std::vector<tandem_tensor_t> tensors(tandem::kMaxOpBuffers, tandem_tensor_t{nullptr, 0});
    std::array<std::byte*, tandem::kMaxOpBuffers> slots{};
    std::vector<tandem_buffer_t> buffers;
    for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
      if (desc.bufs[i].bytes == 0) continue;
      tandem_buffer_t b;
      checkC(tandem_alloc(session, desc.bufs[i].bytes, &b), fmt::format("allocate slot {}", i));
      buffers.push_back(b);
      tensors[i] = {b, 0};
      slots[i] = static_cast<std::byte*>(tandem_buffer_ptr(b));
    }
    ref::fillInputs(desc, slots, o.seed);

    std::vector<double> micros;
    for (uint32_t it = 0; it < o.iters; ++it) {
      const auto t0 = Clock::now();
      tandem_op_t op;
      checkC(submit(comm, desc, tensors, &op), "submit");
      checkC(tandem_wait(op, o.timeoutMs), "wait");
      micros.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(micros.begin(), micros.end());
    result["p50_us"] = micros[micros.size() / 2];
    result["iters"] = o.iters;
    result["ok"] = true;

    if (o.check) {
      // Every rank's inputs are a pure function of (seed, rank, ranks): rebuild them all (also those of ranks that run
      // on other nodes) and compute the reference.
      std::vector<tandem::OpDescriptor> descs;
      std::vector<std::vector<std::vector<std::byte>>> storage(o.ranks);
      std::vector<std::array<const std::byte*, tandem::kMaxOpBuffers>> inputs(o.ranks);
      for (uint32_t r = 0; r < o.ranks; ++r) {
        descs.push_back(ref::makeDescriptor(o.shape, r, o.ranks));
        std::array<std::byte*, tandem::kMaxOpBuffers> s{};
        storage[r].resize(tandem::kMaxOpBuffers);
        for (std::size_t i = 0; i < tandem::kMaxOpBuffers; ++i) {
          storage[r][i].resize(descs[r].bufs[i].bytes);
          s[i] = descs[r].bufs[i].bytes ? storage[r][i].data() : nullptr;
          inputs[r][i] = s[i];
        }
        ref::fillInputs(descs[r], s, o.seed);
      }
      const ref::Expected expected = ref::compute(descs, inputs);
      std::array<const std::byte*, tandem::kMaxOpBuffers> mine{};
      std::copy(slots.begin(), slots.end(), mine.begin());
      const ref::Comparison cmp = ref::compareRank(desc, mine, expected[rank]);
      result["rel_error"] = cmp.relError;
      result["tolerance"] = cmp.tolerance;
      result["check"] = cmp.ok;
      if (!cmp.ok) {
        result["ok"] = false;
        result["message"] = cmp.detail;
      }
    }
    for (auto b : buffers) tandem_free(b);
    tandem_comm_destroy(comm);
    tandem_disconnect(session);
  } catch (const std::exception& e) {
    result["message"] = e.what();
  }
  std::cout << result.dump() << std::endl;
  return result["ok"].get<bool>() ? 0 : 1;
}

std::vector<std::string> shapeArgs(const RunOptions& o) {
  const auto& s = o.shape;
  return {"--ranks", std::to_string(o.ranks), "--m", std::to_string(s.m), "--n", std::to_string(s.n),
          "--k", std::to_string(s.k), "--experts", std::to_string(s.experts), "--topk", std::to_string(s.topk),
          "--seq", std::to_string(s.seq), "--heads", std::to_string(s.heads), "--head-dim", std::to_string(s.headDim),
          "--bytes", std::to_string(s.bytes), "--dtype", o.dtype, "--iters", std::to_string(o.iters),
          "--seed", std::to_string(o.seed), "--timeout-ms", std::to_string(o.timeoutMs),
          s.causal ? "--causal" : "--no-causal"};
}

// Parent: spawns this node's ranks, shows progress, gathers their JSON lines, summarises.
int runParent(const RunOptions& o, const std::string& socket) {
  struct Child {
    pid_t pid;
    int fd;
    std::string out;
    bool done = false;
  };
  std::vector<Child> children;
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) throw std::runtime_error("cannot find /proc/self/exe");
  self[len] = '\0';
  for (uint32_t r : o.localRanks) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    std::vector<std::string> args = {self};
    if (!socket.empty()) args.insert(args.end(), {"--socket", socket});
    args.insert(args.end(), {"run", o.op, "--rank", std::to_string(r), "--id", o.idHex});
    for (auto& a : shapeArgs(o)) args.push_back(a);
    if (o.check) args.push_back("--check");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(p[1], STDOUT_FILENO);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(self, argv.data());
      std::_Exit(127);
    }
    ::close(p[1]);
    children.push_back({pid, p[0], "", false});
  }
  const auto start = Clock::now();
  auto lastProgress = start;
  size_t finished = 0;
  const bool allHere = o.localRanks.size() == o.ranks;
  if (!o.json) {
    std::printf("tandemctl run %s: %s, dtype %s, %u iteration(s)%s\n", o.op.c_str(), placement(o).c_str(),
                o.dtype.c_str(), o.iters, o.check ? ", checking against the fp64 reference" : "");
    if (!allHere) {
      std::printf("  communicator %s; the other ranks join through other nodes' tandemctl run with the same --id\n",
                  o.idHex.c_str());
    }
  }
  while (finished < children.size()) {
    std::vector<pollfd> fds;
    for (auto& c : children) fds.push_back({c.done ? -1 : c.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 500);
    for (std::size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (c.done || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t n = ::read(c.fd, buf, sizeof buf);
      if (n > 0) {
        c.out.append(buf, static_cast<size_t>(n));
        continue;
      }
      c.done = true;
      ++finished;
      if (!o.json) std::printf("  rank %u finished (%zu/%zu)\n", o.localRanks[i], finished, children.size());
    }
    if (Clock::now() - lastProgress > std::chrono::seconds(2) && finished < children.size()) {
      lastProgress = Clock::now();
      if (!o.json) {
        std::printf("  waiting for %zu rank(s), %.0f s elapsed\n", children.size() - finished,
                    std::chrono::duration<double>(Clock::now() - start).count());
      }
    }
    std::fflush(stdout);
  }
  bool allOk = true;
  json summary{{"op", o.op},       {"ranks", o.ranks},           {"local_ranks", o.localRanks}, {"id", o.idHex},
               {"dtype", o.dtype}, {"check", o.check}, {"results", json::array()}};
  for (std::size_t i = 0; i < children.size(); ++i) {
    int status = 0;
    ::waitpid(children[i].pid, &status, 0);
    ::close(children[i].fd);
    json r;
    try {
      r = json::parse(children[i].out);
    } catch (...) {
      r = {{"rank", o.localRanks[i]},
           {"ok", false},
           {"message", fmt::format("rank process exited with status {} without a result",
                                   WIFEXITED(status) ? WEXITSTATUS(status) : -1)}};
    }
    allOk = allOk && r.value("ok", false);
    summary["results"].push_back(r);
  }
  summary["ok"] = allOk;
  if (o.json) {
    std::cout << summary.dump(2) << std::endl;
  } else {
    std::printf("%-6s %-6s %-12s %-10s %-10s %s\n", "rank", "ok", "rel_error", "tolerance", "p50_us", "message");
    for (auto& r : summary["results"]) {
      std::printf("%-6d %-6s %-12.3e %-10.1e %-10.1f %s\n", r.value("rank", -1), r.value("ok", false) ? "yes" : "NO",
                  r.value("rel_error", 0.0), r.value("tolerance", 0.0), r.value("p50_us", 0.0),
                  r.value("message", std::string()).c_str());
    }
    std::printf("%s: %s on %s: %s%s\n", allOk ? "PASS" : "FAIL", o.op.c_str(), placement(o).c_str(),
                o.check ? (allOk ? "matches the reference" : "did not match or failed") : "ran (no --check)",
                allHere ? "" : " (each node checks its own ranks)");
  }
  return allOk ? 0 : 1;
}

int status(const std::string& socket, bool asJson) {
  auto session = tandem::client::Session::connect(socket.empty() ? tandem::defaultSocketPath(true) : socket);
  tandem::v1::Request request;
  request.mutable_query_status();
  const auto r = session->call(request).status_reply();
  if (asJson) {
    json j{{"daemon_version", r.daemon_version()}, {"backend", r.backend()}, {"executor", r.executor()},
           {"uptime_ms", r.uptime_ms()}, {"socket", r.socket_path()}, {"total_bytes", r.total_bytes()},
           {"total_buffers", r.total_buffers()}, {"sessions", json::array()}, {"communicators", json::array()}};
    for (const auto& s : r.sessions()) {
      j["sessions"].push_back({{"id", s.session_id()}, {"pid", s.pid()}, {"uid", s.uid()}, {"buffers", s.buffers()},
                               {"bytes", s.bytes()}, {"communicators", s.communicators()},
                               {"ops_completed", s.ops_completed()}});
    }
    for (const auto& c : r.communicators()) {
      j["communicators"].push_back({{"handle", c.comm_handle()}, {"nranks", c.nranks()}, {"joined", c.joined()},
                                    {"state", c.state()}, {"ops_completed", c.ops_completed()},
                                    {"local_ranks", c.local_ranks()}, {"nodes", c.nodes()}, {"reason", c.reason()}});
    }
    if (r.has_cluster()) {
      const auto& cl = r.cluster();
      json nodes = json::array();
      for (const auto& n : cl.nodes()) {
        nodes.push_back({{"index", n.index()}, {"address", n.address()}, {"state", n.state()}, {"reason", n.reason()},
                         {"hostname", n.hostname()}, {"daemon_version", n.daemon_version()}});
      }
      j["cluster"] = {{"self", cl.self()}, {"transport", cl.transport()}, {"staging_bytes", cl.staging_bytes()},
                      {"nodes", nodes}};
    }
    j["gpus"] = json::array();
    for (const auto& g : r.gpus()) {
      json peers = json::array();
      for (const auto& p : g.peers()) peers.push_back({{"uuid", p.uuid()}, {"nvlinks", p.nvlinks()}, {"p2p", p.p2p()}});
      j["gpus"].push_back({{"uuid", g.uuid()}, {"name", g.name()}, {"sms", g.sms()}, {"memory_bytes", g.memory_bytes()},
                           {"pci_bus_id", g.pci_bus_id()}, {"compute_capability", g.compute_capability()},
                           {"mps", g.mps()}, {"peers", peers}});
    }
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::printf("tandemd %s  backend %s  executor %s  up %.1f s  socket %s\n", r.daemon_version().c_str(),
              r.backend().c_str(), r.executor().c_str(), static_cast<double>(r.uptime_ms()) / 1000.0,
              r.socket_path().c_str());
  if (r.gpus_size() > 0) std::printf("gpus: %d\n", r.gpus_size());
  for (const auto& g : r.gpus()) {
    std::printf("  %s  %s  %u SMs  %.1f GiB  cc %s  pci %s  MPS %s\n", g.uuid().c_str(), g.name().c_str(), g.sms(),
                static_cast<double>(g.memory_bytes()) / (1u << 30), g.compute_capability().c_str(),
                g.pci_bus_id().c_str(), g.mps() ? "yes" : "no");
    for (const auto& p : g.peers()) {
      std::printf("    peer %s  NVLink x%u  p2p %s\n", p.uuid().c_str(), p.nvlinks(), p.p2p() ? "on" : "off");
    }
  }
  std::printf("sessions: %d (this one included)  buffers: %u  bytes: %lu\n", r.sessions_size(), r.total_buffers(),
              static_cast<unsigned long>(r.total_bytes()));
  for (const auto& s : r.sessions()) {
    std::printf("  session %-4lu pid %-7u uid %-6u buffers %-4u bytes %-12lu comms %-3u ops %lu\n",
                static_cast<unsigned long>(s.session_id()), s.pid(), s.uid(), s.buffers(),
                static_cast<unsigned long>(s.bytes()), s.communicators(), static_cast<unsigned long>(s.ops_completed()));
  }
  if (r.has_cluster()) {
    const auto& cl = r.cluster();
    std::printf("cluster: this is node %u of %d (transport %s, staging %lu bytes per peer)\n", cl.self(),
                cl.nodes_size(), cl.transport().c_str(), static_cast<unsigned long>(cl.staging_bytes()));
    for (const auto& n : cl.nodes()) {
      std::printf("  node %-3u %-24s %-12s %s%s%s\n", n.index(), n.address().c_str(), n.state().c_str(),
                  n.hostname().c_str(), n.reason().empty() ? "" : "  ", n.reason().c_str());
    }
  }
  std::printf("communicators: %d\n", r.communicators_size());
  for (const auto& c : r.communicators()) {
    std::string nodes;
    for (uint32_t n : c.nodes()) nodes += fmt::format("{}{}", nodes.empty() ? "  nodes " : ",", n);
    std::printf("  comm %-4lu ranks %u/%u (%u here)  state %-10s ops %lu%s%s%s\n",
                static_cast<unsigned long>(c.comm_handle()), c.joined(), c.nranks(), c.local_ranks(),
                c.state().c_str(), static_cast<unsigned long>(c.ops_completed()), nodes.c_str(),
                c.reason().empty() ? "" : "  ", c.reason().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandemctl: inspect and exercise a running tandemd"};
  app.require_subcommand(1);
  std::string socket;
  app.add_option("-s,--socket", socket, "tandemd's control socket (default: $TANDEM_SOCKET, then the daemon's default)");

  bool statusJson = false;
  auto* statusCmd = app.add_subcommand("status", "sessions, buffers, bytes, communicators and backend");
  statusCmd->add_flag("--json", statusJson, "machine-readable output");
  auto* versionCmd = app.add_subcommand("version", "print tandemctl's and tandemd's versions");
  auto* shutdownCmd = app.add_subcommand("shutdown", "ask tandemd to drain and exit");
  auto* newIdCmd = app.add_subcommand("new-id", "print a fresh random communicator id (32 hex digits) to pass as "
                                                "`run --id` to every node's tandemctl");

  RunOptions o;
  std::string opList;
  for (auto& [name, kind] : kOps) opList += (opList.empty() ? "" : ", ") + name;
  auto* run = app.add_subcommand(
      "run",
      "spawn N rank processes and run a fused op end to end with random inputs.\n"
      "OPs: " + opList + "\n"
      "Across nodes: each node runs its own tandemctl against its own tandemd, with the same op, shape options,\n"
      "--ranks, --seed and --id, and --local-ranks naming the ranks it runs; each checks its own ranks. E.g.:\n"
      "  id=$(tandemctl new-id)                                  # once; copy it to every node\n"
      "  node A: tandemctl run gemm-ar --ranks 4 --id $id --local-ranks 0,1 --check\n"
      "  node B: tandemctl run gemm-ar --ranks 4 --id $id --local-ranks 2-3 --check");
  run->add_option("op", o.op, "the op: " + opList)->required()->check(CLI::IsMember(kOps));
  run->add_option("-r,--ranks", o.ranks, "number of rank processes (1..64)")->check(CLI::Range(1, 64));
  run->add_option("--m", o.shape.m, "GEMM rows M (ag-gemm, gemm-rs, gemm-ar); tokens per rank (moe-*)");
  run->add_option("--n", o.shape.n, "GEMM N; n_out (moe-dispatch-gemm); ffn size (moe-dispatch-ffn-combine)");
  run->add_option("--k", o.shape.k, "GEMM K (total, split over ranks for gemm-rs/gemm-ar); hidden size (moe-*)");
  run->add_option("--experts", o.shape.experts, "MoE experts in total (a multiple of --ranks)");
  run->add_option("--topk", o.shape.topk, "MoE experts per token");
  run->add_option("--seq", o.shape.seq, "ring attention: total sequence length, split over ranks");
  run->add_option("--heads", o.shape.heads, "ring attention: heads");
  run->add_option("--head-dim", o.shape.headDim, "ring attention: head dimension");
  run->add_option("--bytes", o.shape.bytes, "allgather: bytes per rank");
  run->add_flag("--causal,!--no-causal", o.shape.causal, "ring attention: causal mask (default on)");
  run->add_option("--dtype", o.dtype, "bf16 | fp16 | fp32")->check(CLI::IsMember(kDtypes));
  run->add_flag("--check", o.check, "verify every rank's output against the fp64 reference; exit 1 on mismatch");
  run->add_option("--iters", o.iters, "iterations per rank (reports the median latency)")->check(CLI::Range(1, 1000000));
  run->add_option("--seed", o.seed, "input seed");
  run->add_option("--timeout-ms", o.timeoutMs, "per-wait and rendezvous timeout");
  bool runJson = false;
  run->add_flag("--json", runJson, "print the summary as JSON");
  run->add_option("--id", o.idHex, "communicator id, 32 hex digits (`tandemctl new-id`), the same on every node; "
                                   "default: a fresh random one (single node)");
  std::string localRanks;
  auto* localRanksOpt = run->add_option("--local-ranks", localRanks,
                                        "the ranks this tandemctl spawns, e.g. 0,1 or 2-3 or 0,2-3 (default: all); "
                                        "the others run on other nodes; needs --id");
  run->add_option("--rank", o.rank, "internal: run as this rank")->group("");

  CLI11_PARSE(app, argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  try {
    if (*statusCmd) return status(socket, statusJson);
    if (*versionCmd) {
      std::printf("tandemctl %s (protocol %u)\n", tandem_version(), TANDEM_PROTOCOL_VERSION);
      auto session = tandem::client::Session::connect(socket.empty() ? tandem::defaultSocketPath(true) : socket);
      tandem::v1::Request request;
      request.mutable_query_status();
      std::printf("tandemd   %s (backend %s)\n", session->call(request).status_reply().daemon_version().c_str(),
                  session->backend().c_str());
      return 0;
    }
    if (*newIdCmd) {
      tandem_unique_id_t id;
      checkC(tandem_get_unique_id(&id), "unique id");
      std::printf("%s\n", toHex(id).c_str());
      return 0;
    }
    if (*shutdownCmd) {
      auto session = tandem::client::Session::connect(socket.empty() ? tandem::defaultSocketPath(true) : socket);
      tandem::v1::Request request;
      request.mutable_shutdown();
      session->call(request);
      std::printf("tandemd is shutting down\n");
      return 0;
    }
    o.json = runJson;
    o.shape.kind = kOps.at(o.op);
    o.shape.dtype = kDtypes.at(o.dtype);
    if (o.rank >= 0) return runRank(o, socket);
    if (localRanksOpt->count() > 0) {
      if (o.idHex.empty()) {
        throw UsageError("--local-ranks needs --id: the nodes' tandemctl runs join one communicator only if they all "
                         "pass the same id; make one with `tandemctl new-id` and pass it as --id on every node");
      }
      o.localRanks = parseRankList(localRanks, o.ranks);
    } else {
      for (uint32_t r = 0; r < o.ranks; ++r) o.localRanks.push_back(r);
    }
    if (o.idHex.empty()) {
      tandem_unique_id_t id;
      checkC(tandem_get_unique_id(&id), "unique id");
      o.idHex = toHex(id);
    }
    fromHex(o.idHex);  // validates a given --id before any rank starts
    return runParent(o, socket);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tandemctl run: %s\nRun with --help for more information.\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandemctl: %s\n", e.what());
    return 1;
  }
}
