#!/usr/bin/env bash
# The GPU-issued exchange over cluster.transport: verbs on the verbs test double (issue 18, helper verbs) on one H200,
# within 120 s (VERBS_LIMIT_S=N to change). Assumes a Release build with everything built in $BUILD_DIR (default
# build-gpu): tandemd, tandemctl, tandem_gpu_tests, the double (verbs-double/libibverbs.so.1) and
# tandem_verbs_cluster_tests. Logs go to OUTDIR, one line per step to OUTDIR/summary.txt; every step under `timeout`,
# and a failed step does not stop the later ones. Most wanted first:
#   1. the two-node GPU case over verbs (two tandemds sharing the GPU, no MPS, each loading the double): the fused
#      GEMMs with the GPU-issued exchange at 1 and 2 ranks per node, the GPU regions registered with the double as GPU
#      memory, every result against the fp64 reference and 20 bitwise repeats; the daemons' logs (with the double's
#      "registered GPU" lines) are in the test's output where a check fails;
#   2. the CPU cluster tests over the double, on this host (tandemd built with CUDA: does the double still take every
#      registration there for host memory?).
# Exit 77 of a step means skipped (no GPU visible).
#   scripts/verbs-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/verbs-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build-gpu}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-20000}
limit=${VERBS_LIMIT_S:-120}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((limit - $(elapsed))); }
summary="$out/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
{
  date -u
  git rev-parse HEAD
  git status --short | head -40
  nvidia-smi --query-gpu=name,uuid,clocks.sm,memory.used,utilization.gpu --format=csv
  ls -l "$b/verbs-double" 2>&1
} > "$out/env.txt" 2>&1

# step NAME CAP LOG CMD...: runs CMD under the smaller of CAP and the time left; one summary line.
step() {
  local name=$1 cap=$2 log=$3; shift 3
  local t; t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 5 ]; then say "$name: skipped (no time left, $(elapsed) s)"; return; fi
  if [ ! -x "$1" ]; then say "$name: skipped ($1 not built)"; return; fi
  timeout -k 5 "$t" stdbuf -oL "$@" > "$out/$log" 2>&1
  local rc=$?
  local tail; tail=$(grep -E "test cases:|Status:" "$out/$log" | tr '\n' ' ' | sed 's/  */ /g')
  local why=""
  [ "$rc" = 124 ] && why=" (timed out)"
  [ "$rc" = 77 ] && why=" (skipped: no GPU)"
  say "$name: rc=$rc$why $tail($(elapsed) s)"
}
case $b in /*) bdir=$b ;; *) bdir=$PWD/$b ;; esac
tests="$bdir/tests/gpu/tandem_gpu_tests"
cluster="$bdir/tests/tandem_verbs_cluster_tests"

if [ ! -e "$bdir/verbs-double/libibverbs.so.1" ]; then
  say "the verbs double is not built ($bdir/verbs-double/libibverbs.so.1): ninja -C $b tandem_verbs_double"
fi
# The GPU test puts the double in its daemons' LD_LIBRARY_PATH itself; the test process keeps rdma-core.
step "two nodes over verbs (double): GPU-issued exchange at 1 and 2 ranks per node" 80 verbs_gpu.log "$tests" \
  "-tc=*over cluster.transport: verbs*" -d
if [ -f "$out/verbs_gpu.log" ]; then
  # What the double said in the daemons' logs (printed by doctest where a check failed).
  grep -E "verbs double: (registered|cannot|.*failed)" "$out/verbs_gpu.log" | sort | uniq -c | head -20 | tee -a "$summary"
fi
# The CPU cluster tests load the double in the test process too (their daemons inherit it), as ctest's ENVIRONMENT does.
LD_LIBRARY_PATH="$bdir/verbs-double${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  step "CPU verbs cluster tests on the double" 40 verbs_cluster.log "$cluster" -d
say "done ($(elapsed) s)"
