#!/usr/bin/env bash
# One device call for ring attention (nvidia-h200, one GPU): a Release build in build-gpu-ring/ of ring attention's
# targets, the attention core's gpu test, attention_bench at the shapes (16 heads, head_dim 128, seq 4K-32K,
# causal and not) and torch SDPA (cuDNN, flash) in the same call, the ring attention gpu tests (1, 2 and 4 ranks sharing
# the GPU), then in the time left the causal tile-order sweep and a second default pass. Logs go to OUT. Under 240 s
# in all (about 90 s when nothing hangs); every step under `timeout`.
#   scripts/ring-gpu-run.sh OUT
set -uo pipefail
out=${1:?usage: $0 OUT}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu --format=csv \
  > "$out/gpu.txt" 2>&1
git rev-parse HEAD >> "$out/gpu.txt" 2>&1
git status --short >> "$out/gpu.txt" 2>&1
t0=$(date +%s)
if ! timeout 60 cmake -S . -B build-gpu-ring -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=ON \
  > "$out/configure.log" 2>&1; then
  tail -40 "$out/configure.log"
  exit 1
fi
# One build, keep going (-k 0): a failure elsewhere (tandemd, libtandem) must not cost the core's measurements; each
# step below runs if its binary exists.
timeout 150 cmake --build build-gpu-ring -j16 --target tandem_attention_core_tests attention_bench \
  tandem_ring_attention_gpu_tests -- -k 0 > "$out/build.log" 2>&1
echo "build rc=$?"
grep -E "error|FAILED" -A4 "$out/build.log" | head -60
echo "build: $(($(date +%s) - t0)) s"
timeout 40 stdbuf -oL ./build-gpu-ring/tests/gpu/tandem_attention_core_tests > "$out/core_test.log" 2>&1
echo "attention core test rc=$? ($(($(date +%s) - t0)) s)"
grep -E "ERROR|FAILED|test cases|assertions|SKIPPED" "$out/core_test.log" | head -30
# The essential steps first: tandem's default configuration against torch SDPA in the same call, then the ring tests,
# then (time left) the causal tile-order sweep and a second default pass for the run-to-run spread.
timeout 40 ./build-gpu-ring/bench/attention_bench > "$out/bench.log" 2>&1
echo "attention_bench rc=$? ($(($(date +%s) - t0)) s)"
grep -E "FAIL|non-finite" "$out/bench.log" | head -10
timeout 45 python3 bench/sdpa_baseline.py --json "$out/sdpa.json" > "$out/sdpa.log" 2>&1
echo "sdpa_baseline rc=$? ($(($(date +%s) - t0)) s)"
grep -E "^\|" "$out/bench.log"
grep -E "^\||CHECK|SKIP|Error" "$out/sdpa.log" | head -40
TANDEM_OP_TIMEOUT_MS=20000 timeout 90 stdbuf -oL ./build-gpu-ring/tests/gpu/tandem_ring_attention_gpu_tests -s \
  > "$out/ring_test.log" 2>&1
echo "ring attention gpu tests rc=$? ($(($(date +%s) - t0)) s)"
grep -E "ERROR|FAIL|rank .* of|test cases|assertions|SKIPPED" "$out/ring_test.log" | head -40
left=$((232 - ($(date +%s) - t0)))
if [ "$left" -gt 30 ]; then
  timeout $((left - 15)) ./build-gpu-ring/bench/attention_bench --head-groups 1,2,16 > "$out/bench-sweep.log" 2>&1
  echo "attention_bench sweep rc=$? ($(($(date +%s) - t0)) s)"
  grep -E "^\|" "$out/bench-sweep.log"
fi
left=$((232 - ($(date +%s) - t0)))
if [ "$left" -gt 12 ]; then
  timeout $((left - 2)) ./build-gpu-ring/bench/attention_bench > "$out/bench2.log" 2>&1
  echo "attention_bench (2nd pass) rc=$? ($(($(date +%s) - t0)) s)"
  grep -E "^\|" "$out/bench2.log"
fi
