// tandemctl's parts: the command line (tandemctl.cpp), the up-front checks of `run` against the op table (run_args.cpp),
// the parent that spawns and supervises the rank processes (run_parent.cpp), one rank (run_rank.cpp) on host memory
// (run_cpu.cpp) or on a GPU (run_cuda.cu), the inputs every rank can regenerate (inputs.hpp), the per-op figures of
// merit (op_metrics.hpp) and `status` (status.cpp).
#pragma once

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/reference.hpp"
#include "tandem/tandem.h"

namespace tandem::ctl {

// tandemctl's exit codes, one scheme for every subcommand (printed by --help).
inline constexpr int kExitOk = 0;            // done; with --check, every local rank matched
inline constexpr int kExitFailed = 1;        // an op, a rank or a check failed (the table says which and why)
inline constexpr int kExitUsage = 2;         // a command-line mistake; nothing was started
inline constexpr int kExitUnavailable = 69;  // tandemd cannot be reached or refused the connection (EX_UNAVAILABLE)
// 128 + N: tandemctl was stopped by signal N (its rank processes are stopped with it).
inline constexpr const char* kExitCodesHelp =
    "Exit codes: 0 done (with --check: every rank matched), 1 an op, rank or check failed, 2 a command-line "
    "mistake (nothing started), 69 tandemd unreachable or the connection refused, 128+N stopped by signal N.";

// A mistake on the command line: one message naming the flag, exit code 2, nothing started.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// tandemd could not be reached (exit 69).
struct UnavailableError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RunOptions {
  const OpSpec* op = nullptr;
  std::string opName;
  uint32_t ranks = 1;
  reference::OpShape shape;
  std::string dtype = "bf16";
  // FP8 inputs of the GEMM ops (OpSpec::fp8) and FP8 expert weights of the MoE ops (OpSpec::fp8Weights); shape holds
  // what they mean (blockScale, outDtype, weightDtype), these the names as given, for messages and the rank processes.
  std::string scaling = "tensor";  // --scaling: tensor | block
  std::string outDtype = "bf16";   // --out-dtype: c's dtype with FP8 inputs
  std::string wDtype;              // --w-dtype: empty = --dtype's
  bool check = false;
  bool compare = false;
  bool json = false;
  uint32_t iters = 1;
  uint32_t warmup = 0;
  uint64_t seed = 1;
  uint32_t timeoutMs = 60000;
  std::string idHex;                 // the communicator id every node shares (parent: --id or random)
  std::vector<uint32_t> localRanks;  // the ranks this tandemctl spawns
  std::set<std::string> given;       // the shape options given on the command line ("m", "topk", ...)
  int rank = -1;                     // >= 0: run as this rank (a child of the parent)
  uint32_t localIndex = 0;           // a child's position among its node's local ranks (picks its GPU)
};

// The shape options `tandemctl run` has, in --help order, with what each sets.
struct ShapeOption {
  const char* name;  // "m" for --m
  const char* help;
};
const std::vector<ShapeOption>& shapeOptions();

std::string toHex(const tandem_unique_id_t& id);
// Throws UsageError unless `hex` is 32 hex digits.
tandem_unique_id_t fromHex(const std::string& hex);
// "0,2-3" -> {0, 2, 3}. Throws UsageError naming --local-ranks.
std::vector<uint32_t> parseRankList(const std::string& spec, uint32_t nranks);
std::string formatRankList(const std::vector<uint32_t>& ranks);
// "4 ranks, 2 here (2,3)"
std::string placement(const RunOptions& o);

// The --dtype values `tandemctl run` takes, as dtypeName() prints them ("bf16", "fp8-e4m3", ...).
const std::vector<DType>& runDtypes();
// Sets o.shape's dtype, outDtype, blockScale and weightDtype from the names parsed into `o`.
void applyDtypes(RunOptions& o);

// Every check that needs no daemon, against the op table: options that do not apply to the op, FP8 options where the
// op or --dtype takes none, sizes of 0 where the op needs at least 1, a split dim smaller than --ranks, the op's own
// rules (MoE: experts divisible by ranks, topk <= experts) and the 2^40-byte tensor cap, for every rank's descriptor.
// Throws UsageError naming the flag.
void checkRunOptions(const RunOptions& o);
// The arguments a rank process gets after `run OP`: the options that apply to the op, and the run's settings.
std::vector<std::string> rankArgs(const RunOptions& o);

// The socket a client uses: --socket, else $TANDEM_SOCKET, else the per-user socket if it exists, else the system
// one (tandem::clientSocketPath()).
std::string socketFor(const std::string& flag);

int runParent(const RunOptions& o, const std::string& socket);
int runRank(const RunOptions& o, const std::string& socket);
int status(const std::string& socket, bool asJson);

}  // namespace tandem::ctl
