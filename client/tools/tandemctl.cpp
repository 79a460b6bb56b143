// tandemctl: inspect and exercise a running tandemd.
//   tandemctl status [--json]       sessions, buffers, bytes, communicators, backend
//   tandemctl version               tandemctl's and tandemd's versions (tandemctl --version: tandemctl's alone)
//   tandemctl run OP --ranks N ...  spawn N rank processes and run an op end to end (--check verifies, --compare
//                                   times the NCCL + cuBLASLt baseline on GPUs); with --id and --local-ranks, only some
//                                   of them (the rest run on other nodes)
//   tandemctl new-id                a fresh communicator id for --id
//   tandemctl shutdown
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>

#include "advise.hpp"
#include "ctl.hpp"
#include "session.hpp"
#include "tandem/common/error.hpp"

using tandem::ctl::kExitFailed;
using tandem::ctl::kExitOk;
using tandem::ctl::kExitUnavailable;
using tandem::ctl::kExitUsage;

namespace {

// Sizes are non-negative integers: "-5" must not wrap to 2^64 - 5.
const CLI::Validator kCount(
    [](std::string& s) -> std::string {
      if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) {
        return "'" + s + "' is not a non-negative integer";
      }
      if (s.size() > 19) return "'" + s + "' is too large";
      return "";
    },
    "COUNT");

std::string opList() {
  std::string s;
  for (const tandem::OpSpec& op : tandem::ops()) s += (s.empty() ? "" : ", ") + std::string(op.name);
  return s;
}

// Every dtype `run` takes, as the rest of tandem prints them (dtypeName).
std::vector<std::string> dtypeNames() {
  std::vector<std::string> out;
  for (const tandem::DType t : tandem::ctl::runDtypes()) out.emplace_back(tandem::dtypeName(t));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem::ctl;
  CLI::App app{"tandemctl: inspect and exercise a running tandemd"};
  app.require_subcommand(1);
  app.footer(kExitCodesHelp);
  app.set_version_flag("-V,--version", std::string("tandemctl ") + tandem_version());
  std::string socket;
  app.add_option("-s,--socket", socket,
                 "tandemd's control socket (default: $TANDEM_SOCKET, else your own daemon's "
                 "$XDG_RUNTIME_DIR/tandem/tandemd.sock if it exists, else the system daemon's /run/tandem/tandemd.sock)");

  bool statusJson = false;
  auto* statusCmd = app.add_subcommand("status", "sessions, buffers, bytes, communicators and backend");
  statusCmd->add_flag("--json", statusJson, "machine-readable output");
  auto* versionCmd = app.add_subcommand("version", "print tandemctl's and tandemd's versions");
  auto* shutdownCmd = app.add_subcommand("shutdown", "ask tandemd to drain and exit");
  auto* newIdCmd = app.add_subcommand("new-id", "print a fresh random communicator id (32 hex digits) to pass as "
                                                "`run --id` to every node's tandemctl");

  RunOptions o;
  auto* run = app.add_subcommand(
      "run",
      "spawn N rank processes and run an op end to end on deterministic inputs. Every rank submits the op through\n"
      "libtandem; on the cuda backend buffers are GPU memory and inputs are made on the GPU. The op's sizes come\n"
      "from the options below; options an op does not take are refused.\n"
      "OPs: " + opList() + "\n"
      "Timing: each op from submission to completion (cpu: host clock; cuda: CUDA events on the rank's stream, each\n"
      "op after a tandem barrier), per iteration the slowest local rank; min, p50 and p99, TFLOP/s and bus bandwidth.\n"
      "Across nodes: each node runs its own tandemctl against its own tandemd, with the same op, shape options,\n"
      "--ranks, --seed and --id, and --local-ranks naming the ranks it runs; each checks its own ranks. E.g.:\n"
      "  id=$(tandemctl new-id)                                  # once; copy it to every node\n"
      "  node A: tandemctl run gemm-ar --ranks 4 --id $id --local-ranks 0,1 --check\n"
      "  node B: tandemctl run gemm-ar --ranks 4 --id $id --local-ranks 2-3 --check");
  run->footer(kExitCodesHelp);
  run->option_defaults()->always_capture_default();
  run->add_option("op", o.opName, "the op: " + opList())
      ->required()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            return tandem::findOp(s) != nullptr ? "" : "unknown op '" + s + "'; the ops are " + opList();
          },
          "OP"));
  run->add_option("-r,--ranks", o.ranks, "number of rank processes")->check(CLI::Range(1u, tandem::kMaxRanks));
  std::map<std::string, CLI::Option*> shapeFlags;
  for (const ShapeOption& s : shapeOptions()) {
    uint64_t* target = nullptr;
    const std::string name = s.name;
    if (name == "m") target = &o.shape.m;
    else if (name == "n") target = &o.shape.n;
    else if (name == "k") target = &o.shape.k;
    else if (name == "experts") target = &o.shape.experts;
    else if (name == "topk") target = &o.shape.topk;
    else if (name == "saved-rows") target = &o.shape.savedRows;
    else if (name == "seq") target = &o.shape.seq;
    else if (name == "heads") target = &o.shape.heads;
    else if (name == "head-dim") target = &o.shape.headDim;
    else if (name == "kv-heads") target = &o.shape.kvHeads;
    else if (name == "bytes") target = &o.shape.bytes;
    shapeFlags[name] = run->add_option("--" + name, *target, s.help)->check(kCount);
  }
  shapeFlags["causal"] =
      run->add_flag("--causal,!--no-causal", o.shape.causal, "ring attention: causal mask (default: on)");
  shapeFlags["zigzag"] = run->add_flag("--zigzag,!--contiguous", o.shape.zigzag,
                                       "ring attention: zigzag layout, rank r holding chunks r and 2n-1-r (default: "
                                       "contiguous)");
  shapeFlags["layout"] =
      run->add_option("--layout", o.shape.layout,
                      "ag-gemm, gemm-rs, gemm-ar: how A and B are stored: nt (a [m,k], b [n,k]; the forward), nn "
                      "(b [k,n]; the input gradient) or tn (a [k,m], b [k,n]; the weight gradient) (default: nt)")
          ->transform(CLI::CheckedTransformer(
              std::map<std::string, tandem::GemmOperands>{
                  {"nt", tandem::GemmOperands::kNT}, {"nn", tandem::GemmOperands::kNN}, {"tn", tandem::GemmOperands::kTN}},
              CLI::ignore_case));
  shapeFlags["dtype"] =
      run->add_option("--dtype", o.dtype,
                      "the op's dtype: bf16, fp16 or fp32; FP8 (fp8-e4m3 or fp8-e5m2) for a and b of ag-gemm, "
                      "gemm-rs and gemm-ar, with fp32 scales (see --scaling) and a bf16 or fp32 c (--out-dtype)")
          ->check(CLI::IsMember(dtypeNames()));
  shapeFlags["scaling"] =
      run->add_option("--scaling", o.scaling,
                      "FP8 GEMM inputs: tensor (one a_scale and one b_scale) or block (a_scale per 1x128 block of "
                      "op(A)'s rows, b_scale per 128x128 block of op(B))")
          ->check(CLI::IsMember({"tensor", "block"}));
  shapeFlags["out-dtype"] =
      run->add_option("--out-dtype", o.outDtype, "FP8 GEMM inputs: c's dtype")->check(CLI::IsMember({"bf16", "fp32"}));
  shapeFlags["w-dtype"] =
      run->add_option("--w-dtype", o.wDtype,
                      "moe-dispatch-gemm, moe-dispatch-ffn-combine: the expert weights' dtype, --dtype's (default) or "
                      "fp8-e4m3 (with --dtype bf16: fp32 scales per 128x128 block of each expert's weights, x "
                      "quantised to e4m3 per 1x128 block on the way)")
          ->check(CLI::IsMember({"bf16", "fp16", "fp32", "fp8-e4m3"}));
  run->add_flag("--check", o.check,
                "check every local rank's outputs: against the fp64 host reference (each rank regenerates the inputs "
                "it needs), or for large GEMMs on GPUs an fp32 GPU reference GEMM; exit 1 on a mismatch");
  run->add_flag("--compare", o.compare,
                "cuda backend: also time the unfused baseline in the same processes (NCCL + cuBLASLt, where the build "
                "has them) and print baseline/tandem");
  run->add_option("--iters", o.iters, "timed iterations per rank")->check(CLI::Range(1u, 1000000u));
  run->add_option("--warmup", o.warmup, "untimed iterations before them")->check(CLI::Range(0u, 1000000u));
  run->add_option("--seed", o.seed, "input seed (every node passes the same)");
  run->add_option("--timeout-ms", o.timeoutMs, "per-wait and rendezvous timeout")->check(CLI::Range(1u, 3600000u));
  run->add_flag("--json", o.json, "print the summary as JSON (shape, dtype, plan, machine, every rank's figures)");
  run->add_option("--id", o.idHex, "communicator id, 32 hex digits (`tandemctl new-id`), the same on every node; "
                                   "default: a fresh random one (single node)");
  std::string localRanks;
  auto* localRanksOpt = run->add_option("--local-ranks", localRanks,
                                        "the ranks this tandemctl spawns, e.g. 0,1 or 2-3 or 0,2-3 (default: all); "
                                        "the others run on other nodes; needs --id");
  run->add_option("--rank", o.rank, "internal: run as this rank")->group("");
  run->add_option("--local-index", o.localIndex, "internal: this rank's position among the node's ranks")->group("");

  tandem::ctl::addPlanCommands(app);  // advise, tune (advise.cpp)
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  ::signal(SIGPIPE, SIG_IGN);
  try {
    const std::string sock = socketFor(socket);
    if (*statusCmd) return status(sock, statusJson);
    if (const auto rc = tandem::ctl::runPlanCommands(sock)) return *rc;
    if (*versionCmd) {
      std::printf("tandemctl %s (protocol %u)\n", tandem_version(), TANDEM_PROTOCOL_VERSION);
      auto session = tandem::client::Session::connect(sock);
      tandem::v1::Request request;
      request.mutable_query_status();
      std::printf("tandemd   %s (backend %s)\n", session->call(request).status_reply().daemon_version().c_str(),
                  session->backend().c_str());
      return kExitOk;
    }
    if (*newIdCmd) {
      tandem_unique_id_t id;
      if (tandem_get_unique_id(&id) != TANDEM_SUCCESS) throw std::runtime_error(tandem_last_error());
      std::printf("%s\n", toHex(id).c_str());
      return kExitOk;
    }
    if (*shutdownCmd) {
      auto session = tandem::client::Session::connect(sock);
      tandem::v1::Request request;
      request.mutable_shutdown();
      session->call(request);
      std::printf("tandemd is shutting down\n");
      return kExitOk;
    }
    o.op = tandem::findOp(o.opName);
    o.opName = std::string(o.op->name);
    o.shape.kind = o.op->kind;
    applyDtypes(o);
    if (o.rank >= 0) return runRank(o, sock);
    for (const auto& [name, opt] : shapeFlags) {
      if (opt->count() > 0) o.given.insert(name);
    }
    checkRunOptions(o);
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
      if (tandem_get_unique_id(&id) != TANDEM_SUCCESS) throw std::runtime_error(tandem_last_error());
      o.idHex = toHex(id);
    }
    fromHex(o.idHex);  // a given --id is checked before any rank starts
    return runParent(o, sock);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "tandemctl run: %s\nRun with --help for more information.\n", e.what());
    return kExitUsage;
  } catch (const UnavailableError& e) {
    std::fprintf(stderr, "tandemctl: %s\n", e.what());
    return kExitUnavailable;
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandemctl: %s\n", e.what());
    return e.code() == tandem::ErrorCode::kUnavailable ? kExitUnavailable : kExitFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandemctl: %s\n", e.what());
    return kExitFailed;
  }
}
