#!/usr/bin/env bash
# One device call (nvidia-h200): GPU-issued transfer commands and tcp receiving into GPU memory.
#   tandem_proxy_gpu_tests  kernels push into the proxy FIFO in mapped pinned memory; a real proxy drains it into a
#                           real tcp pair on loopback; GPU memory at both ends through the CUDA DeviceCopier; flag after
#                           data checked by a kernel on the receiving side; malformed commands; blocked producers
#   proxy_push_bench        commands/s pushed by 1 warp .. 132 CTAs and the push -> proxy -> completed round trip
# Release build in build-gpu-fifo/ (only those two targets); logs go to OUTDIR.
#   scripts/fifo-gpu-run.sh OUTDIR
# Finishes within about 150 s (build included): configure, build, test and bench each have their own time limit.
set -uo pipefail
out=${1:?usage: scripts/fifo-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
build=build-gpu-fifo
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
{
  date -u
  git rev-parse HEAD
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.used,utilization.gpu,clocks.sm --format=csv
  nproc
} > "$out/env.txt" 2>&1

# Configured only when new: the build dir may be a link to a shared tree whose cache must not change under others.
if [ ! -f "$build/build.ninja" ] && ! timeout 40 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     > "$out/configure.log" 2>&1; then
  echo "configure failed ($(elapsed) s)"; tail -30 "$out/configure.log"; exit 1
fi
if ! timeout 90 cmake --build "$build" -j16 --target tandem_proxy_gpu_tests proxy_push_bench > "$out/build.log" 2>&1; then
  echo "build failed or timed out ($(elapsed) s)"; grep -E "error|Error|FAILED" -A4 "$out/build.log" | head -60; exit 1
fi
echo "build: $(elapsed) s"

rc=0
left=$((140 - $(elapsed)))
[ "$left" -gt 60 ] && left=60
[ "$left" -lt 15 ] && left=15
# -s: every assertion's values, not only failures; -d: each case's duration.
timeout "$left" stdbuf -oL "./$build/tests/gpu/tandem_proxy_gpu_tests" -s -d > "$out/proxy_gpu_tests.log" 2>&1
trc=$?
echo "tandem_proxy_gpu_tests rc=$trc ($(elapsed) s)"
# Failures with their context, each case's duration, the totals (-s also logs every passing assertion: not here).
grep -E -B3 -A6 "ERROR|FATAL" "$out/proxy_gpu_tests.log" | head -80
grep -E "^[0-9.]+ s: |test cases|assertions" "$out/proxy_gpu_tests.log"
[ "$trc" -ne 0 ] && rc=$trc

left=$((148 - $(elapsed)))
[ "$left" -lt 10 ] && left=10
timeout "$left" stdbuf -oL "./$build/bench/proxy_push_bench" --commands 1000000 --samples 20000 \
  --json "$out/proxy_push_bench.json" > "$out/proxy_push_bench.log" 2>&1
brc=$?
echo "proxy_push_bench rc=$brc ($(elapsed) s)"
cat "$out/proxy_push_bench.log"
[ "$brc" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$brc
exit $rc
