#!/usr/bin/env bash
# shellcheck disable=SC2317,SC2016  # steps are called by name; bash -c scripts expand their own arguments
# Every check that needs a GPU, from one entry point: named steps, one build tree (build-gpu/, Release), one MPS
# helper, and a time limit per step inside a budget for the whole run, so that a run always ends inside one device
# command (600 s) and says what it did not get to.
#
#   scripts/gpu-check.sh STEP[:SECONDS]...     run these steps in this order (SECONDS: this step's limit)
#   scripts/gpu-check.sh --list                the step names
#   scripts/gpu-check.sh --help                what each step runs
#
# Name `build` first: the other steps run what is already built in build-gpu/ and skip what is not.
# Each step prints one line, also kept in $OUT/summary.txt:
#   PASS|FAIL|SKIP  STEP  SECONDS s  (why, for FAIL and SKIP)
# and each command a step runs has its own log in $OUT (STEP.PART.log); JSON results land there too.
# A step whose precondition is missing (no CUDA device, fewer than two, no MPS, not built) is SKIP with the reason;
# a step that would start with less than 10 s of the budget left is SKIP; a command cut off by its limit is FAIL.
# PASS means every part of the step ran and passed; a step some of whose parts skipped is SKIP, with the count.
# Exit status: 0 when no step failed, 1 when one did, 2 for a usage error.
#
# Environment (all optional):
#   OUT                   where logs, JSON and summary.txt go (default: build-gpu/gpu-check/)
#   BUILD_DIR             the build tree (default: build-gpu/)
#   GPU_CHECK_BUDGET_S    the whole run ends within this many seconds (default 570: a 600 s command, and MPS's stop)
#   GPU_CHECK_BASE_SRC    the older tree the `regress` step compares against
#   TANDEM_OP_TIMEOUT_MS  every kernel wait's deadline (default here 15000: a wedged kernel fails its op, not the run)
#   TANDEM_LOG            libtandem's log level (default here debug: each rank prints the plan a fused GEMM ran)
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
B=$BUILD
BUDGET=${GPU_CHECK_BUDGET_S:-570}

# ---- the steps: name, default limit (s), what it needs, the targets it runs, what it does ----
STEPS=()
declare -A LIMIT NEEDS TARGETS HELP
def() { STEPS+=("$1"); LIMIT[$1]=$2; NEEDS[$1]=$3; TARGETS[$1]=$4; HELP[$1]=$5; }
def build 300 gpu "" \
  "configure build-gpu/ (Release, tests and benchmarks) when it is new, then build what the other steps named in
   this run need (every target when build is named alone or with ctest-gpu); ptxas spill and local-memory
   warnings into build-warnings.txt"
def ctest-gpu 420 gpu all \
  "ctest -L gpu -LE mps (no MPS): every GPU test executable (fused GEMMs at 1-4 ranks, allgather, MoE, grouped
   GEMM, attention core, ring attention, proxy, span exchange, the two-node cases over tcp and the verbs double,
   the failure cases)"
def mps 200 mps "tandem_gpu_tests tandem_moe_gpu_tests tandem_ring_attention_gpu_tests tandem_ring_attention_bwd_gpu_tests
   tandem_span_exchange_gpu_tests tandem_proxy_gpu_tests" \
  "under a private MPS server: ctest -L mps (the daemon-executor cases: fused GEMMs, allgather, barriers, MoE,
   ring attention and its backward, two nodes), then the span exchange pieces and the proxy test (in-process, no tandemd)"
def hostile 150 gpu "tandemd tandem_hostile_tests" \
  "the hostile-client attacks against a tandemd on the cuda backend (TANDEM_HOSTILE_BACKEND=cuda), each followed
   by an honest 2-rank allgather on GPU memory; fds and RSS back near their baseline; SIGTERM obeyed"
def ctl 150 gpu "tandemd tandemctl" \
  "tandemctl run on a private cuda-backend tandemd: the argument checks (exit 2), then ag-gemm, gemm-rs, gemm-ar
   and allgather at 1 rank (8192^3) and 2 ranks sharing the GPU, with --check and --compare (NCCL + cuBLASLt)"
def python 180 gpu "tandem tandemd tandemctl tandem_py_fastcall" \
  "the Python package on the cuda backend: ctest -R ^python_gpu_ (tests/python/gpu_run.py at 1 rank: every op,
   attention, registration cache, hot path, torch.compile, CUDA graphs; at 2 ranks under torchrun; DLPack into
   CuPy; JAX), then the README's torchrun example, pip-installed into a venv over the machine's PyTorch"
def bench-python 60 gpu "tandem tandemd tandem_py_fastcall" \
  "python/bench/overhead.py: the package's per-call overhead against the C ABI (and pybind11 where installed),
   with the C fast path, then with ctypes alone (TANDEM_NO_FASTCALL=1)"
def attention 170 gpu "tandem_attention_core_tests attention_bench tandemd tandemctl tandem_ring_attention_gpu_tests
   tandem_ring_attention_bwd_gpu_tests" \
  "the attention core's GPU test; bench/attention_vs_sdpa.py --run: attention_bench against torch SDPA (cuDNN,
   flash) shape by shape (16 heads, head_dim 128, seq 4K-32K, causal and not); the ring attention tests"
def moe 220 gpu "tandemd tandemctl tandem_grouped_gemm_tests tandem_moe_gpu_tests moe_bench grouped_gemm_bench" \
  "the grouped GEMM test; the MoE GPU tests one case at a time (client executor, capacity overflow, bad expert
   id, refusals); moe_bench against bench/moe_baseline.py (PyTorch) on the same routings; grouped_gemm_bench
   against bench/grouped_mm_baseline.py on the same expert counts"
def xnode 260 gpu "tandemd tandemctl tandem_gpu_tests tandem_span_exchange_gpu_tests" \
  "the GPU-issued exchange across nodes (two tandemds sharing the GPU over tcp loopback), one case at a time: the
   span exchange pieces; the GPU path at 1 and 2 ranks per node; every path against the fp64 reference;
   gpu_exchange off bitwise equal to on; a rank killed before the first exchange and while the GPU waits; a
   tandemd killed (then restarted) and a hung node while the GPU waits"
def verbs 130 gpu "tandemd tandemctl tandem_gpu_tests tandem_verbs_double tandem_verbs_cluster_tests" \
  "two nodes over verbs on the verbs test double: the GPU-issued exchange at 1 and 2 ranks per node (GPU regions
   registered through dma-buf), then the CPU verbs cluster tests on the double with this build's tandemd"
def proxy 120 gpu "tandem_proxy_gpu_tests proxy_push_bench" \
  "the proxy FIFO: tandem_proxy_gpu_tests with every assertion's values and each case's time, then
   proxy_push_bench (commands/s from 1 warp to 132 CTAs; the push -> proxy -> completed round trip)"
def bench-gemm 160 gpu "gemm_bench" \
  "gemm_bench --no-sweep: the GEMM core against cuBLASLt (JSON)"
def bench-fused 180 gpu "tandemd tandem fused_e2e_bench gemm_rs_one_rank_bench" \
  "the fused ops at one rank: fused_e2e_bench --ranks 1 (client executor, through libtandem and a private
   tandemd, against cuBLASLt + NCCL); gemm_rs_one_rank_bench: gemm-rs and gemm-ar forced fused against the GEMM
   alone at 8192^3 and 16384x14336x8192, the edge shapes (bitwise equal to the GEMM core), two ranks sharing the
   GPU with the early-peer candidates"
def bench-comm 200 gpu "tandemd allgather_bench roundtrip_bench" \
  "allgather_bench --ranks 2 (client executor) and the empty-op round trip (roundtrip_bench, client executor, 1
   and 2 ranks)"
def bench-span 130 gpu "tandemd span_bench" \
  "span_bench (two tandemds sharing the GPU, tcp loopback, N = K = 8192): the GPU-issued and the staged path
   against one node, then the GPU path with its region in GPU memory (TANDEM_GPU_REGION=device) and with its
   waits in the kernels (TANDEM_SPAN_WAIT=kernel)"
def bench-daemon 200 mps "tandemd tandem allgather_bench roundtrip_bench fused_e2e_bench span_bench" \
  "under a private MPS server: roundtrip_bench (daemon executor at 1 and 2 ranks, client executor at 2),
   allgather_bench --ranks 2 --executor daemon, fused_e2e_bench --ranks 1 with the client and the daemon
   executor, span_bench at M=1024 (GPU path vs staged)"
def advise 120 mps "tandemd tandemctl" \
  "under a private MPS server, a private tandemd (executor daemon): tandemctl advise ag-gemm,gemm-rs,gemm-ar at
   three shapes with --save, tandemctl status; then plans.autotune: on-first-use on a fresh plan table"
def bench-2gpu 400 gpu2 "ag_gemm_bench gemm_rs_bench" \
  "two GPUs or more: ag_gemm_bench and gemm_rs_bench (the fused kernels against NCCL + cuBLASLt, one process
   driving both GPUs)"
def sass 60 cuobjdump "tandem_kernels tandem_attention" \
  "no GPU needed, only built objects: registers, stack and local memory of every kernel (cuobjdump -res-usage) and
   the wgmma loops' WARPSYNC / R2UR counts (scripts/lib/sass_loop_counts.py) in the GEMM and attention objects"
def regress 360 gpu "tandemd tandem gemm_bench roundtrip_bench fused_e2e_bench" \
  "against an older tree in GPU_CHECK_BASE_SRC (a \`git archive\` of the older commit, untracked so that it
   travels with this one): builds it in GPU_CHECK_BASE_SRC/build-base, then gemm_bench --no-sweep,
   roundtrip_bench (client executor, 1 rank) and fused_e2e_bench --ranks 1 on both, the older first in each pair"

usage() {
  sed -n '3,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo "Steps (default limit in seconds; what they need besides the build):"
  local s
  for s in "${STEPS[@]}"; do
    printf '  %-13s %4s s  %s\n' "$s" "${LIMIT[$s]}" "$(echo "${NEEDS[$s]}" | sed 's/^gpu2$/two GPUs/;
      s/^gpu$/a GPU/; s/^mps$/a GPU and nvidia-cuda-mps-control/; s/^cuobjdump$/cuobjdump/')"
    echo "${HELP[$s]}" | sed 's/^ */      /'
  done
  echo "Example, one GPU, one 600 s command: scripts/gpu-check.sh build ctest-gpu bench-fused"
}

# ---- arguments ----
[ $# -eq 0 ] && { usage >&2; exit 2; }
RUN=() RUN_LIMIT=()
for a in "$@"; do
  case $a in
    -h|--help) usage; exit 0 ;;
    --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
  esac
  name=${a%%:*} lim=""
  [ -n "$name" ] && lim=${LIMIT[$name]:-}
  [[ $a == *:* ]] && lim=${a#*:}
  if [ -z "$name" ] || [ -z "${NEEDS[$name]+x}" ] || ! [[ $lim =~ ^[0-9]+$ ]]; then
    echo "gpu-check: unknown step or limit '$a'; the steps are: ${STEPS[*]} (--help says what each runs)" >&2
    exit 2
  fi
  RUN+=("$name") RUN_LIMIT+=("$lim")
done

# What `build` builds: the targets of the other steps named, or everything.
BUILD_ALL=1 BUILD_TARGETS=""
for s in "${RUN[@]}"; do
  [ "$s" = build ] && continue
  [ "${TARGETS[$s]}" = all ] && { BUILD_ALL=1; BUILD_TARGETS=""; break; }
  BUILD_ALL=0 BUILD_TARGETS="$BUILD_TARGETS ${TARGETS[$s]}"
done

# ---- the run's environment ----
OUT=${OUT:-$BUILD/gpu-check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
TMP=$(mktemp -d /tmp/tandem-gpu-check-XXXXXX)
DEADLINE=$((SECONDS + BUDGET))
# NVLink multicast stays off on these machines; keep it off in every child too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-15000}
export TANDEM_LOG=${TANDEM_LOG:-debug}
exec > >(tee "$OUT/gpu-check.log") 2>&1
TEE_PID=$!

GPUS=0 NO_GPU="no CUDA device: nvidia-smi is not installed"
if command -v nvidia-smi > /dev/null; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  NO_GPU="no CUDA device: nvidia-smi -L lists none"
fi
{
  date -u
  echo "commit $(git rev-parse HEAD 2>/dev/null || cat COMMIT 2>/dev/null)"
  git status --short 2>/dev/null | head -40
  echo "cores $(nproc), GPUs $GPUS"
  nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.used --format=csv
} > "$OUT/machine.txt" 2>&1

# ---- MPS and private tandemd helpers (stopped at exit whatever happens) ----
MPS_DIR=$TMP/mps DAEMON_PID="" SOCK=""
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 20 nvidia-cuda-mps-control -d; then
    sleep 1
    echo "  MPS started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    return 0
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  FAILS+=("MPS did not start")
  return 1
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  # quit waits for MPS clients: never let it hold the run.
  echo quit | timeout 20 nvidia-cuda-mps-control > /dev/null 2>&1 || echo "  MPS quit did not finish within 20 s"
  local _
  for _ in $(seq 50); do [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break; sleep 0.1; done
  tail -n 40 "$CUDA_MPS_LOG_DIRECTORY/control.log" > "$OUT/mps-control.log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  echo "  MPS stopped"
}
daemon_start() { # NAME CONFIG-YAML: a private tandemd on $SOCK, its log in $OUT/STEP.NAME.log
  local yaml=$TMP/$1.yaml
  printf '%s\n' "$2" > "$yaml"
  SOCK=$TMP/$1.sock
  rm -f "$SOCK"
  "$B/daemon/tandemd" --foreground --config "$yaml" --socket "$SOCK" > "$OUT/$STEP.$1.log" 2>&1 &
  DAEMON_PID=$!
  local _
  for _ in $(seq 300); do
    [ -S "$SOCK" ] && return 0
    kill -0 "$DAEMON_PID" 2>/dev/null || break
    sleep 0.1
  done
  FAILS+=("tandemd did not start (log $STEP.$1.log)")
  tail -n 20 "$OUT/$STEP.$1.log"
  daemon_stop
  return 1
}
daemon_stop() {
  [ -n "$DAEMON_PID" ] || return 0
  kill "$DAEMON_PID" 2>/dev/null
  local _
  for _ in $(seq 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$DAEMON_PID" 2>/dev/null
  wait "$DAEMON_PID" 2>/dev/null
  DAEMON_PID=""
}
cleanup() {
  daemon_stop
  mps_stop
  rm -rf "$TMP"
  exec > /dev/null 2>&1
  wait "$TEE_PID"  # the console copy is complete before the run ends
}
trap cleanup EXIT
trap 'echo "gpu-check: interrupted"; exit 143' TERM INT

# ---- running a step and its parts ----
# part NAME CAP [VAR=VALUE...] CMD...: one command of the current step under `timeout` (its whole process group), at
# most CAP seconds and never past the step's limit; output in $OUT/STEP.NAME.log ($LOG). Exit 77 means skipped (a
# test binary without its hardware). Prints one line; returns the command's status.
part() {
  local name=$1 cap=$2 vars=()
  shift 2
  while [[ $1 == [A-Z_]*=* ]]; do vars+=("$1"); shift; done
  LOG=$OUT/$STEP.$name.log
  if [[ $1 == */* ]] && ! built "$1" "$name"; then return 77; fi
  local t=$((STEP_END - SECONDS))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 3 ]; then
    LATE+=("$name")
    echo "  late $name: not run, the step's limit is spent"
    return 124
  fi
  local s=$SECONDS rc
  timeout -k 5 "$t" env ${vars[@]+"${vars[@]}"} "$@" > "$LOG" 2>&1
  rc=$?
  local what why=""
  case $rc in
    0) what=ok RAN=$((RAN + 1)) ;;
    77) what=skip why=$(grep -m1 -i 'skip' "$LOG" | cut -c1-160) SKIPPED=$((SKIPPED + 1)); SKIPS+=("$name: $why") ;;
    124|137) what=FAIL why="timed out after $t s"; FAILS+=("$name timed out") ;;
    *) what=FAIL why="exit $rc"; FAILS+=("$name exit $rc") ;;
  esac
  # doctest's and ctest's totals, where the command is a test
  why=$(echo "$why $(grep -E '^\[doctest\] test cases:|tests passed' "$LOG" | tail -n 1)" | tr -s ' ' | sed 's/^ //; s/ $//')
  echo "  $what $name ($((SECONDS - s)) s)${why:+: $why}"
  return "$rc"
}
# built BIN [PART]: true when BIN is built; else the part (PART, or the next) counts as skipped, not built.
built() {
  [ -x "$1" ] && return 0
  [[ " ${NOT_BUILT[*]} " == *" ${1#"$B"/} "* ]] || NOT_BUILT+=("${1#"$B"/}")
  SKIPPED=$((SKIPPED + 1))
  echo "  skip ${2:-}${2:+: }${1#"$B"/} is not built"
  return 1
}
# show PATTERN [MAX]: the lines of the last part's log that matter, on the console.
show() { grep -E "$1" "$LOG" 2>/dev/null | cut -c1-300 | head -n "${2:-30}" | sed 's/^/    /'; }
needs_bins() { # the step is SKIP unless these are built
  local f miss=()
  for f in "$@"; do [ -x "$f" ] || miss+=("${f#"$B"/}"); done
  [ ${#miss[@]} -eq 0 ] && return 0
  STEP_SKIP="not built: ${miss[*]} (name the build step first)"
  return 1
}

result() { # WORD SECONDS [WHY]
  printf '%-4s  %-12s %4d s%s\n' "$1" "$STEP" "$2" "${3:+  ($3)}" | tee -a "$SUMMARY"
}
join() { local IFS=$'\x1f'; local j="$*"; echo "${j//$'\x1f'/; }"; }
STATUS=0
run_step() { # NAME LIMIT
  STEP=$1
  local limit=$2 left=$((DEADLINE - SECONDS)) why=""
  case ${NEEDS[$STEP]} in
    gpu) [ "$GPUS" -ge 1 ] || why=$NO_GPU ;;
    gpu2) [ "$GPUS" -ge 2 ] || why="needs two GPUs, $GPUS visible" ;;
    mps) if [ "$GPUS" -lt 1 ]; then why=$NO_GPU
         elif ! command -v nvidia-cuda-mps-control > /dev/null; then why="nvidia-cuda-mps-control is not installed"; fi ;;
    cuobjdump) command -v cuobjdump > /dev/null || why="cuobjdump is not installed" ;;
  esac
  if [ -n "$why" ]; then result SKIP 0 "$why"; return; fi
  if [ "$limit" -lt 10 ]; then result SKIP 0 "a limit of $limit s is under the 10 s a step needs"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then result SKIP 0 "budget: $left s left of GPU_CHECK_BUDGET_S=$BUDGET"; return; fi
  echo "== $STEP (limit $limit s, $((SECONDS - DEADLINE + BUDGET)) s into the run)"
  STEP_END=$((SECONDS + limit)) FAILS=() SKIPS=() NOT_BUILT=() LATE=() RAN=0 SKIPPED=0 STEP_SKIP=""
  local s=$SECONDS
  "step_${STEP//-/_}"
  daemon_stop
  mps_stop
  local t=$((SECONDS - s))
  if [ ${#FAILS[@]} -gt 0 ]; then result FAIL "$t" "$(join "${FAILS[@]}")"; STATUS=1
  elif [ ${#LATE[@]} -gt 0 ]; then result FAIL "$t" "out of time before: ${LATE[*]}"; STATUS=1
  elif [ -n "$STEP_SKIP" ]; then result SKIP "$t" "$STEP_SKIP"
  elif [ "$SKIPPED" -gt 0 ]; then  # PASS only when every part ran
    [ ${#NOT_BUILT[@]} -gt 0 ] && SKIPS+=("not built: ${NOT_BUILT[*]}")
    result SKIP "$t" "$RAN of $((RAN + SKIPPED)) parts ran and passed; $(join "${SKIPS[@]}")"
  else result PASS "$t"
  fi
}

# ---- the steps ----
step_build() {
  if [ ! -f "$B/build.ninja" ]; then
    part configure 120 cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=ON \
      -DTANDEM_BUILD_BENCH=ON || { show 'Error|error' 20; return; }
  fi
  local want=(all) missing=() t known
  if [ "$BUILD_ALL" = 0 ]; then
    want=()
    known=$(ninja -C "$B" -t targets all 2>/dev/null | sed 's/:.*//')
    # shellcheck disable=SC2086  # a list of target names
    for t in $(printf '%s\n' $BUILD_TARGETS | sort -u); do
      if grep -qx "$t" <<< "$known"; then want+=("$t"); else missing+=("$t"); fi
    done
    # Targets that need what this machine lacks (NCCL for the baselines, Python.h for the fast path) are not defined.
    [ ${#missing[@]} -gt 0 ] && echo "  not defined in this configuration (see CMakeCache.txt): ${missing[*]}"
  fi
  echo "  targets: ${want[*]}"
  part compile 100000 cmake --build "$B" -j "$(nproc)" --target "${want[@]}" -- -k 0 || show 'error|FAILED' 40
  grep -E "Local memory used|Registers are spilled|Potential Performance Loss" "$LOG" | sort -u \
    > "$OUT/build-warnings.txt"
  echo "  ptxas warnings: $(wc -l < "$OUT/build-warnings.txt") (build-warnings.txt)"
}

step_ctest_gpu() {
  needs_bins "$B/tests/gpu/tandem_gpu_tests" || return
  # The mps entries (the daemon-executor cases) are the mps step's: without MPS they could only skip.
  part ctest 100000 ctest --test-dir "$B" -L gpu -LE '^mps$' --no-tests=error --output-on-failure \
    --timeout $((STEP_END - SECONDS))
  show '^ *[0-9]+/[0-9]+ Test|tests passed|SKIPPED' 40
}

step_mps() {
  needs_bins "$B/tests/gpu/tandem_gpu_tests" || return
  mps_start || return
  local t=$((STEP_END - SECONDS - 50))  # the two in-process tests after it take up to 50 s
  [ "$t" -lt 10 ] && t=10
  part ctest-mps "$t" ctest --test-dir "$B" -L '^mps$' --no-tests=error --output-on-failure --timeout "$t"
  show '^ *[0-9]+/[0-9]+ Test|tests passed|SKIPPED' 20
  part span-exchange 25 "$B/tests/gpu/tandem_span_exchange_gpu_tests" -d
  part proxy 25 "$B/tests/gpu/tandem_proxy_gpu_tests" -d
}

step_hostile() {
  # -ts: the attacks that follow TANDEM_HOSTILE_BACKEND; -s: every case's measurements, not only failures.
  part attacks 100000 TANDEM_HOSTILE_BACKEND=cuda "$B/tests/integration/tandem_hostile_tests" \
    "-ts=hostile clients (any backend)" -s
  show 'honest op .* before|status [0-9-]+:|ERROR|FATAL' 40
}

step_ctl() {
  needs_bins "$B/daemon/tandemd" "$B/client/tandemctl" || return
  daemon_start tandemd "$(printf 'daemon:\n  backend: cuda\n  executor: client')" || return
  local ctl=("$B/client/tandemctl" --socket "$SOCK") r
  ctl_run() { # NAME CAP OP ARGS...: tandemctl run OP ARGS
    local name=$1 cap=$2
    shift 2
    part "$name" "$cap" "${ctl[@]}" run "$@"
    show '^(PASS|FAIL)|TFLOP|GB/s|baseline|plan|tandemctl run:|error' 8
  }
  # The argument checks take no time: exit 2 with one message naming the flag, no rank started.
  for r in "bad-m ag-gemm --m -5" "bad-topk moe-dispatch-gemm --topk 9" "bad-experts moe-dispatch-gemm --ranks 3 --experts 8"; do
    LOG=$OUT/$STEP.${r%% *}.log
    # shellcheck disable=SC2086
    timeout 5 "${ctl[@]}" run ${r#* } > "$LOG" 2>&1
    if [ $? -eq 2 ]; then echo "  ok ${r%% *} (exit 2)"; RAN=$((RAN + 1)); else FAILS+=("${r%% *}: not exit 2"); echo "  FAIL ${r%% *}"; fi
  done
  # Large shapes are checked by the fp32 GPU reference GEMM, a small one on the host (fp64); NCCL + cuBLASLt timed
  # beside tandem (two ranks on one GPU: --compare says why it has no baseline).
  local big=(--m 8192 --n 8192 --k 8192 --check --compare --iters 10 --warmup 3 --json)
  ctl_run ag-gemm-1r 20 ag-gemm --ranks 1 "${big[@]}"
  ctl_run gemm-rs-1r 20 gemm-rs --ranks 1 "${big[@]}"
  ctl_run gemm-ar-1r 20 gemm-ar --ranks 1 "${big[@]}"
  ctl_run allgather-1r 15 allgather --ranks 1 --bytes 16777216 --check --compare --iters 20 --warmup 3
  ctl_run ag-gemm-2r 20 ag-gemm --ranks 2 --m 4096 --n 4096 --k 4096 --check --compare --iters 5 --warmup 1
  ctl_run gemm-rs-2r 20 gemm-rs --ranks 2 --m 1024 --n 1024 --k 2048 --check --compare --iters 5 --warmup 1
  ctl_run gemm-ar-2r 20 gemm-ar --ranks 2 --m 1024 --n 1024 --k 2048 --check --compare --iters 5 --warmup 1
  ctl_run allgather-2r 15 allgather --ranks 2 --bytes 16777216 --check --compare --iters 10 --warmup 2 --json
  ctl_run ag-gemm-1r-small 15 ag-gemm --ranks 1 --m 512 --n 512 --k 512 --check --compare --iters 20 --warmup 3
}

# The package from the source tree, its C module from this build (else the ctypes path), on a private tandemd.
python_env() {
  needs_bins "$B/daemon/tandemd" "$B/client/libtandem.so" || return 1
  daemon_start tandemd "$(printf 'daemon:\n  backend: cuda\n  executor: client')" || return 1
  local fast=$B/tests/python/fastcall
  [ -d "$fast" ] || echo "  no _tandem_fastcall in $fast: the package takes the ctypes path"
  PYENV=(PYTHONPATH="$ROOT/python:$fast:$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}"
         TANDEM_LIBRARY="$B/client/libtandem.so" TANDEM_SOCKET="$SOCK")
}
step_python() {
  needs_bins "$B/daemon/tandemd" "$B/client/libtandem.so" || return
  part ctest 120 ctest --test-dir "$B" -R '^python_gpu_' --no-tests=error --output-on-failure --timeout 100
  show '^ *[0-9]+/[0-9]+ Test|tests passed|PASS|FAIL' 30
  daemon_start tandemd "$(printf 'daemon:\n  backend: cuda\n  executor: client')" || return
  # The README's example as a user runs it: a venv over the machine's PyTorch, `pip install ./python`, torchrun from
  # the repository root, with none of this script's Python settings.
  part readme 45 TANDEM_BUILD_DIR="$B" TANDEM_SOCKET="$SOCK" VENV="$TMP/venv" bash -c '
    set -e
    python3 -m venv --system-site-packages "$VENV" || python3 -m venv --without-pip --system-site-packages "$VENV"
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
      # A venv sees the system site-packages but not, e.g., a user site: point it at the machine'\''s torch.
      tdir=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
      echo "$tdir" > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")/machine-torch.pth"
    fi
    pip=("$VENV/bin/python" -m pip)
    "${pip[@]}" --version > /dev/null 2>&1 || pip=(python3 -m pip --python "$VENV/bin/python")
    "${pip[@]}" install --no-build-isolation ./python
    run=("$VENV/bin/python" -m torch.distributed.run)
    [ -x "$VENV/bin/torchrun" ] && run=("$VENV/bin/torchrun")
    "${run[@]}" --nproc-per-node 2 python/examples/torchrun_example.py | tee "$VENV/readme.out"
    [ "$(grep -c ": OK" "$VENV/readme.out")" -eq 2 ]'
  show ': OK|Error|error:' 10
}

step_bench_python() {
  python_env || return
  part bench-build 30 python/bench/build.sh "$B/client/libtandem.so" "$TMP/overhead" python3 || return
  local pp=PYTHONPATH="$TMP/overhead:${PYENV[0]#PYTHONPATH=}"
  part overhead 25 "${PYENV[@]}" "$pp" python3 python/bench/overhead.py "$TMP/overhead/overhead_baseline"
  show ' us|Error' 30
  part overhead-ctypes 25 "${PYENV[@]}" "$pp" TANDEM_NO_FASTCALL=1 python3 python/bench/overhead.py \
    "$TMP/overhead/overhead_baseline"
  show ' us|Error' 30
}

step_attention() {
  part core 45 "$B/tests/gpu/tandem_attention_core_tests"
  show 'ERROR|FAILED|SKIPPED' 20
  built "$B/bench/attention_bench" vs-sdpa &&
    part vs-sdpa 80 python3 bench/attention_vs_sdpa.py --run "$B/bench/attention_bench" --rounds 2 \
    --out "$OUT/attention-vs-sdpa" --bench-timeout 30
  show '^SHAPE|^\||Error|Traceback' 40
  part ring 40 TANDEM_OP_TIMEOUT_MS=20000 "$B/tests/gpu/tandem_ring_attention_gpu_tests" -tc='*client executor*'
  show 'ERROR|FAIL' 10
  # The backward's client executor refuses it (its daemon executor cases run in the mps step).
  part ring-bwd-refusal 20 "$B/tests/gpu/tandem_ring_attention_bwd_gpu_tests" -tc='*client executor*'
  show 'ERROR|FAIL' 10
}

step_moe() {
  part grouped-gemm-test 40 "$B/tests/gpu/tandem_grouped_gemm_tests"
  local tc n=0
  # One case per process, each under its own limit, so that one hang costs only that case.
  for tc in "moe-dispatch-gemm? client executor*:50" "moe-dispatch-ffn-combine? client executor*:55" \
            "*capacity overflow*:15" "*bad expert id*:15" "*refused before submission*:15"; do
    n=$((n + 1))
    part "case$n" "${tc##*:}" "$B/tests/gpu/tandem_moe_gpu_tests" --duration=true "--test-case=${tc%:*}"
    show 'ERROR|FATAL' 10
  done
  mkdir -p "$TMP/routing"
  # The forward on DeepSeek-V3's experts only (its full run, backward and Mixtral included, takes minutes).
  part moe-bench 30 "$B/bench/moe_bench" --iters 30 --models deepseek-v3 --pass fwd \
    --rows-per-expert 256,512,1024,2048 --routing-dir "$TMP/routing" --json "$OUT/moe_bench.json" &&
    part moe-torch 30 python3 bench/moe_baseline.py --routing-dir "$TMP/routing" --iters 30 \
      --json "$OUT/moe_torch.json" --tandem "$OUT/moe_bench.json"
  show '^\||speedup|Error' 30
  built "$B/bench/grouped_gemm_bench" grouped-torch &&
    part grouped-torch 40 python3 bench/grouped_mm_baseline.py --iters 30 --json "$OUT/grouped_torch.json" \
    --counts-out "$TMP/counts.txt"
  local counts=()
  [ -s "$TMP/counts.txt" ] && counts=(--counts "$TMP/counts.txt")
  part grouped-bench 40 "$B/bench/grouped_gemm_bench" --iters 30 --sweep ${counts[@]+"${counts[@]}"}
  show '^\||TFLOP|Error' 30
}

step_xnode() {
  local t=$B/tests/gpu/tandem_gpu_tests
  part pieces 25 "$B/tests/gpu/tandem_span_exchange_gpu_tests" -d
  part ranks-per-node 50 "$t" "-tc=*at 1 and 2 ranks per node*" -d
  part paths 25 "$t" "-tc=*barriers across nodes match*" -d
  part exchange-off 35 "$t" "-tc=*gpu_exchange off*" -d
  part kill-first 20 "$t" "-tc=*rank killed mid-op*" -d
  part kill-gpu-wait 25 "$t" "-tc=*waits for its data*" -d
  part kill-tandemd 35 "$t" "-tc=*a tandemd killed while*" -d
  part hung-node 35 "$t" "-tc=*a hung node (a cut link)*" -d
}

step_verbs() {
  # The GPU test puts the double in its daemons' LD_LIBRARY_PATH itself; the test process keeps rdma-core.
  [ -e "$B/verbs-double/libibverbs.so.1" ] || { STEP_SKIP="the verbs double is not built (target tandem_verbs_double)"; return; }
  part gpu 80 "$B/tests/gpu/tandem_gpu_tests" "-tc=*over cluster.transport: verbs*" -d
  show 'verbs double: (registered|cannot|.*failed)|ERROR' 20
  # The CPU cluster tests load the double in the test process too (their daemons inherit it), as CTest does.
  part cpu-cluster 40 LD_LIBRARY_PATH="$B/verbs-double${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$B/tests/tandem_verbs_cluster_tests" -d
}

step_proxy() {
  part tests 60 "$B/tests/gpu/tandem_proxy_gpu_tests" -s -d
  show '^[0-9.]+ s: |ERROR|FATAL' 20
  part push-bench 50 "$B/bench/proxy_push_bench" --commands 1000000 --samples 20000 --json "$OUT/proxy_push_bench.json"
  show '.' 30
}

step_bench_gemm() {
  part gemm 100000 "$B/bench/gemm_bench" --no-sweep --json "$OUT/gemm_bench.json"
  show '^\||TFLOP|FAIL' 30
}

step_bench_fused() {
  part e2e-1rank 60 "$B/bench/fused_e2e_bench" --ranks 1 --executor client --iters 10 --warmup 2 \
    --json "$OUT/fused_e2e_1rank.json"
  show '^\||TFLOP|FAIL' 30
  local b=$B/bench/gemm_rs_one_rank_bench
  part one-rank 60 "$b" --iters 10 --warmup 3 --no-early --shape 8192x8192x8192 --shape 16384x14336x8192 \
    --json "$OUT/gemm_rs_one_rank.json"
  show '^\||FAIL|differ' 40
  part one-rank-edges 30 "$b" --iters 3 --warmup 1 --no-early --shape 1000x1000x1040 --shape 777x1024x512 \
    --shape 129x264x64 --shape 4096x8192x8192 --json "$OUT/gemm_rs_one_rank_edges.json"
  show 'FAIL|differ' 20
  # The early-peer candidates last: should one hang, the tables above stand.
  part two-ranks-early 30 "$b" --iters 10 --warmup 3 --two-ranks-only --shape 8192x8192x8192 \
    --shape 16384x14336x8192 --shape 1000x1000x1040 --shape 777x1024x512 --shape 129x264x64 \
    --json "$OUT/gemm_rs_two_ranks_early.json"
  show 'FAIL|differ' 20
}

step_bench_comm() {
  part allgather-2r 120 "$B/bench/allgather_bench" --ranks 2 --executor client --json "$OUT/allgather_client.json"
  show '^\||GB/s|FAIL' 30
  part roundtrip-1r 40 "$B/bench/roundtrip_bench" --executor client --ranks 1
  show 'us|FAIL' 10
  part roundtrip-2r 40 "$B/bench/roundtrip_bench" --executor client --ranks 2
  show 'us|FAIL' 10
}

step_bench_span() {
  local b=$B/bench/span_bench
  part both-paths 50 "$b" --iters 5 --warmup 1
  show '^\||lost|rank process' 20
  # The GPU path with its region in GPU memory, and with its waits in the kernels (node-local knobs, same protocol).
  part device-region 35 TANDEM_GPU_REGION=device "$b" --iters 5 --warmup 1 --paths gpu
  show '^\||lost|rank process' 20
  part kernel-waits 30 TANDEM_SPAN_WAIT=kernel "$b" --iters 5 --warmup 1 --paths gpu
  show '^\||lost|rank process' 20
}

step_bench_daemon() {
  mps_start || return
  part roundtrip-daemon-1r 30 "$B/bench/roundtrip_bench" --executor daemon --ranks 1
  part roundtrip-daemon-2r 30 "$B/bench/roundtrip_bench" --executor daemon --ranks 2
  part roundtrip-client-2r 30 "$B/bench/roundtrip_bench" --executor client --ranks 2
  part allgather-daemon 60 "$B/bench/allgather_bench" --ranks 2 --executor daemon --json "$OUT/allgather_daemon.json"
  part e2e-client 25 "$B/bench/fused_e2e_bench" --ranks 1 --executor client --iters 10 --warmup 2 \
    --json "$OUT/fused_e2e_client_mps.json"
  part e2e-daemon 25 "$B/bench/fused_e2e_bench" --ranks 1 --executor daemon --iters 10 --warmup 2 \
    --json "$OUT/fused_e2e_daemon.json"
  show '^\||TFLOP|FAIL' 30
  part span 30 "$B/bench/span_bench" --iters 3 --warmup 1 --ms 1024
  show '^\||lost|rank process' 20
}

step_advise() {
  needs_bins "$B/daemon/tandemd" "$B/client/tandemctl" || return
  mps_start || return
  local ctl=("$B/client/tandemctl") shapes=(--shape 8192x8192x8192 --shape 4096x8192x8192 --shape 16384x14336x8192)
  mkdir -p "$OUT/advise-plans" "$TMP/autotune-plans"
  daemon_start tandemd-advise "$(printf 'daemon:\n  executor: daemon\nplans:\n  state_dir: %s' "$OUT/advise-plans")" ||
    return
  part advise 60 "${ctl[@]}" -s "$SOCK" advise ag-gemm,gemm-rs,gemm-ar "${shapes[@]}" --save --svg "$OUT/advise.svg" \
    --json-file "$OUT/advise.json"
  show '.' 40
  part status 10 "${ctl[@]}" -s "$SOCK" status
  daemon_stop
  # On a fresh table the shape's first ops have no trial plan: tandemd tries its candidates on them and saves the
  # winner, which status then shows.
  daemon_start tandemd-autotune "$(printf 'daemon:\n  executor: daemon\nplans:\n  state_dir: %s\n  autotune: on-first-use\n  autotune_runs: 2' "$TMP/autotune-plans")" ||
    return
  part autotune 20 "${ctl[@]}" -s "$SOCK" advise gemm-rs --shape 8192x8192x8192 --sms 8 --iters 10 \
    --svg "$OUT/autotune.svg"
  part autotune-status 10 "${ctl[@]}" -s "$SOCK" status
  show 'autotune|plan' 20
}

step_bench_2gpu() {
  part ag-gemm 200 "$B/bench/ag_gemm_bench"
  show '^\||FAIL' 40
  part gemm-rs 200 "$B/bench/gemm_rs_bench" --json "$OUT/gemm_rs_bench.json"
  show '^\||FAIL' 40
}

step_sass() {
  local objs o
  objs=$(find "$B/kernels" \( -name 'gemm*.cu.o' -o -name 'ag_gemm.cu.o' -o -name 'attention.cu.o' \) 2>/dev/null)
  [ -n "$objs" ] || { STEP_SKIP="no kernel objects under ${B#"$ROOT"/}/kernels (name the build step first)"; return; }
  for o in $objs; do
    part "$(basename "$o" .cu.o)" 30 bash -c 'cuobjdump -res-usage "$1" 2>&1 | grep -E "Function|REG" &&
      cuobjdump -sass "$1" | python3 "$2"' _ "$o" "$ROOT/scripts/lib/sass_loop_counts.py"
    echo "    $(grep -c 'Function' "$LOG") kernels, $(grep -Ec 'STACK:[1-9]|LOCAL:[1-9]' "$LOG") with stack or local memory"
  done
}

step_regress() {
  local base=${GPU_CHECK_BASE_SRC:-}
  [ -n "$base" ] && [ -f "$base/CMakeLists.txt" ] ||
    { STEP_SKIP="GPU_CHECK_BASE_SRC is not an older tree (git archive OLD | tar -x -C DIR)"; return; }
  base=$(cd "$base" && pwd)
  local targets=(tandemd tandem gemm_bench roundtrip_bench fused_e2e_bench) which dir
  part base-build 200 bash -c 'cmake -S "$1" -B "$1/build-base" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DTANDEM_BUILD_BENCH=ON && cmake --build "$1/build-base" -j "$(nproc)" --target "${@:2}"' _ "$base" \
    "${targets[@]}" || return
  pair() { # NAME CAP ARGS...: the older build, then this one
    local name=$1 cap=$2
    shift 2
    for which in base head; do
      dir=$base/build-base
      [ "$which" = head ] && dir=$B
      part "$which-$name" "$cap" "$dir/bench/$name" "$@"
      show '^\||TFLOP|us|FAIL' 30
    done
  }
  pair gemm_bench 60 --no-sweep
  pair roundtrip_bench 30 --executor client --ranks 1
  pair fused_e2e_bench 60 --ranks 1 --iters 15
}

# ---- the run ----
echo "gpu-check: ${RUN[*]} (budget $BUDGET s; $GPUS GPUs; build ${B#"$ROOT"/}; results $OUT)"
for i in "${!RUN[@]}"; do run_step "${RUN[$i]}" "${RUN_LIMIT[$i]}"; done
echo "== summary ($((SECONDS - DEADLINE + BUDGET)) s)"
cat "$SUMMARY"
exit $STATUS
