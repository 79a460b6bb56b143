#!/usr/bin/env bash
# One device call (nvidia-h200, one GPU) for communicators that span nodes computing on the GPUs: a Release build in
# build-gpu-span/ of tandemd, tandem_gpu_tests and span_bench; span_bench (two nodes vs one node, M 1024/4096,
# N = K = 8192) with the daemons' plan lines; then the multi-node GPU tests one case at a time (two tandemds as two
# nodes on loopback sharing the GPU: a killed rank; the fused GEMMs at 1 and 2 ranks per node with 20 bitwise repeats
# and the plan lines; both paths against the fp64 reference). Logs go to OUTDIR. Within 180 s in all (build
# included; SPAN_LIMIT_S=N ends the steps by N s instead); every step under `timeout`.
#   scripts/span-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/span-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-20000}
build=build-gpu-span
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
{
  date -u
  git rev-parse HEAD
  git status --short
  nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,memory.used,utilization.gpu --format=csv
  ls /tmp/nvidia-mps/control 2>/dev/null && echo "MPS control pipe present"
} > "$out/env.txt" 2>&1

if [ ! -f "$build/build.ninja" ] && ! timeout 40 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     > "$out/configure.log" 2>&1; then
  echo "configure failed ($(elapsed) s)"; tail -30 "$out/configure.log"; exit 1
fi
# -k 0: a failure in one target must not cost the others.
timeout 110 cmake --build "$build" -j16 --target tandemd tandem_gpu_tests span_bench -- -k 0 > "$out/build.log" 2>&1
echo "build rc=$? ($(elapsed) s)"
grep -E "error|FAILED" -A4 "$out/build.log" | head -40

# Most wanted first, each under its own limit, so that a call cut short still brings the first results back: the
# bench (two nodes vs one node), the killed-rank case, the GPU path at 1 and 2 ranks per node, the mixed-path case.
limit=${SPAN_LIMIT_S:-176}
left() { echo $((limit - $(elapsed))); }
if [ -x "$build/bench/span_bench" ]; then
  t=$(left); [ "$t" -gt 40 ] && t=40
  if [ "$t" -gt 8 ]; then
    timeout "$t" stdbuf -oL "./$build/bench/span_bench" --iters 10 --warmup 2 > "$out/span_bench.log" 2>&1
    echo "span_bench rc=$? ($(elapsed) s)"
    head -40 "$out/span_bench.log"
  fi
fi
run_case() {  # name, log, limit cap
  local t; t=$(left); [ "$t" -gt "$3" ] && t=$3
  [ "$t" -lt 5 ] && { echo "$2 skipped: no time left ($(elapsed) s)"; return; }
  timeout "$t" stdbuf -oL "./$build/tests/gpu/tandem_gpu_tests" "-tc=$1" -s > "$out/$2.log" 2>&1
  echo "$2 rc=$? ($(elapsed) s)"
  grep -E "ERROR|FAIL|test cases|assertions|SKIPPED" "$out/$2.log" | head -20
}
if [ -x "$build/tests/gpu/tandem_gpu_tests" ]; then
  run_case "*rank killed mid-op*" test_kill 30
  run_case "*at 1 and 2 ranks per node*" test_ranks_per_node 70
  run_case "*barriers across nodes match*" test_paths 30
fi
