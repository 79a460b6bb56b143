#!/usr/bin/env bash
# One device call for the attention core (nvidia-h200): Release build in build-gpu-attn/ (only the attention targets),
# the gpu-labelled attention test, attention_bench, then torch SDPA (cuDNN, flash) on the same shapes. Logs go to OUT.
#   scripts/attention-gpu-run.sh OUT [attention_bench arguments...]
set -uo pipefail
out=${1:?usage: $0 OUT [bench args]}
shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu --format=csv \
  > "$out/gpu.txt" 2>&1
git rev-parse HEAD >> "$out/gpu.txt" 2>&1
t0=$(date +%s)
if ! cmake -S . -B build-gpu-attn -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=ON > "$out/configure.log" 2>&1; then
  tail -40 "$out/configure.log"
  exit 1
fi
if ! cmake --build build-gpu-attn -j16 --target tandem_attention attention_bench tandem_attention_core_tests \
  > "$out/build.log" 2>&1; then
  grep -E "error|Error" -A4 "$out/build.log" | head -80
  exit 1
fi
echo "build: $(($(date +%s) - t0)) s"
timeout 45 stdbuf -oL ./build-gpu-attn/tests/gpu/tandem_attention_core_tests > "$out/test.log" 2>&1
echo "attention test rc=$? ($(($(date +%s) - t0)) s)"
grep -E "rel. error|ERROR|FAILED|test cases|assertions|SKIPPED" "$out/test.log" | head -60
timeout 80 ./build-gpu-attn/bench/attention_bench "$@" > "$out/bench.log" 2>&1
echo "attention_bench rc=$? ($(($(date +%s) - t0)) s)"
if [ -n "${BENCH2_ARGS:-}" ]; then  # a second pass (e.g. the same configuration again, for the run-to-run spread)
  timeout 40 ./build-gpu-attn/bench/attention_bench $BENCH2_ARGS > "$out/bench2.log" 2>&1
  echo "attention_bench (2nd: $BENCH2_ARGS) rc=$? ($(($(date +%s) - t0)) s)"
fi
grep -E "FAIL|non-finite" "$out/bench.log" | head -10
timeout 60 python3 bench/sdpa_baseline.py --json "$out/sdpa.json" > "$out/sdpa.log" 2>&1
echo "sdpa_baseline rc=$? ($(($(date +%s) - t0)) s)"
grep -E "^\|" "$out/bench.log"
[ -f "$out/bench2.log" ] && grep -E "^\|" "$out/bench2.log"
grep -E "^\||CHECK|SKIP|Error" "$out/sdpa.log" | head -60
