#!/usr/bin/env bash
# One device call (nvidia-h200, one GPU) for communicators that span nodes computing on the GPUs: a Release build in
# build-gpu-span/ of tandemd, tandem_gpu_tests and span_bench; the multi-node GPU tests (two tandemds as two nodes on
# loopback sharing the GPU: both paths against the fp64 reference, the fused GEMMs at 1 and 2 ranks per node with 20
# bitwise repeats, the plan lines, a killed rank); then span_bench (two nodes vs one node, M 1024/4096, N = K = 8192)
# with the daemons' plan lines. Logs go to OUTDIR. Within 180 s in all (build included); every step under `timeout`.
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

if [ -x "$build/tests/gpu/tandem_gpu_tests" ]; then
  # The tests first (correctness), leaving the bench about 25 s.
  left=$((150 - $(elapsed))); [ "$left" -lt 45 ] && left=45
  timeout "$left" stdbuf -oL "./$build/tests/gpu/tandem_gpu_tests" "-tc=two nodes*" -s > "$out/multinode_test.log" 2>&1
  echo "multinode gpu tests rc=$? ($(elapsed) s)"
  grep -E "ERROR|FAIL|TEST CASE|test cases|assertions|SKIPPED" "$out/multinode_test.log" | head -40
fi
if [ -x "$build/bench/span_bench" ]; then
  left=$((176 - $(elapsed)))
  if [ "$left" -gt 10 ]; then
    iters=20; [ "$left" -lt 20 ] && iters=5
    timeout "$left" stdbuf -oL "./$build/bench/span_bench" --iters "$iters" > "$out/span_bench.log" 2>&1
    echo "span_bench rc=$? ($(elapsed) s)"
    cat "$out/span_bench.log" | head -40
  else
    echo "span_bench skipped: no time left ($(elapsed) s)"
  fi
fi
