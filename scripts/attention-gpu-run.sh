#!/usr/bin/env bash
# One device call for the attention core (nvidia-h200, one GPU), within ATTN_BUDGET_S (default 125) seconds: a
# Release build in build-gpu-attn/ of only the attention targets (-j16; a shared build is left as configured), the
# registers / stack / local memory of every kernel (cuobjdump) and its SASS counts, the gpu-labelled attention core
# test, attention_bench (the defaults; 16 heads, head_dim 128, seq 4K-32K, causal and not, each checked against an
# fp32 reference), torch SDPA (cuDNN, flash) on the same shapes in the same call, a second pass of the defaults
# (run-to-run spread), the ratios; then in the time left ncu (--set full) of the default at non-causal 4K
# (ATTN_NCU=1) and attention_bench --variants all. Every step under `timeout`; logs in OUT.
#   scripts/attention-gpu-run.sh OUT [attention_bench arguments for the first pass; default: none]
set -uo pipefail
out=${1:?usage: $0 OUT [bench args]}
shift
bench_args=("$@")
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
budget=${ATTN_BUDGET_S:-125}  # the lead grants 130 s (call 2) to 180 s
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(elapsed))); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,utilization.gpu \
  --format=csv > "$out/gpu.txt" 2>&1
git rev-parse HEAD >> "$out/gpu.txt" 2>&1
git status --short -- kernels bench scripts tests/gpu >> "$out/gpu.txt" 2>&1
# Configure only a new build dir: build-gpu-attn may be a link to the call's shared build, whose cache (flags
# included) must not change under the other steps of the call.
if [ ! -f build-gpu-attn/CMakeCache.txt ]; then
  if ! timeout 40 cmake -S . -B build-gpu-attn -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=ON \
    > "$out/configure.log" 2>&1; then
    tail -40 "$out/configure.log"
    exit 1
  fi
fi
targets=(tandem_attention attention_bench tandem_attention_core_tests)
if ! timeout 100 cmake --build build-gpu-attn -j16 --target "${targets[@]}" > "$out/build.log" 2>&1; then
  grep -E "error|Error" -A4 "$out/build.log" | head -80
  exit 1
fi
echo "build: $(elapsed) s"
# Spill / local-memory / wgmma serialisation warnings from the build (the project builds with --warn-on-spills and
# --warn-on-local-memory-usage; a no-op build prints none: res-usage below has each kernel's STACK and LOCAL bytes).
grep -E "Potential Performance Loss|Local memory used|Registers are spilled" "$out/build.log" | sort -u \
  > "$out/ptxas.txt"
# SASS per kernel: HGMMA, WARPSYNC and R2UR counts (a main loop that ptxas takes for divergent gets a WARPSYNC and
# R2UR descriptor moves before every GEMM batch).
obj=$(find build-gpu-attn/kernels -name 'attention.cu.o' | head -1)
if [ -n "$obj" ]; then
  cuobjdump -res-usage "$obj" 2>&1 | grep -E "Function|REG|STACK" > "$out/res-usage.txt"
  cuobjdump -sass "$obj" 2>/dev/null | awk '/Function :/ {f = $3} /HGMMA/ {h[f]++} /WARPSYNC/ {w[f]++} /R2UR/ {r[f]++}
    END {for (k in h) printf "%s HGMMA %d WARPSYNC %d R2UR %d\n", k, h[k], w[k], r[k]}' | sort > "$out/sass-counts.txt"
fi
if [ -f "$out/res-usage.txt" ]; then
  nk=$(grep -c "Function.*attentionKernel" "$out/res-usage.txt")
  nbad=$(grep -A1 "Function.*attentionKernel" "$out/res-usage.txt" | grep -Ec "STACK:[1-9]|LOCAL:[1-9]")
  echo "res-usage: $nk attention kernels, $nbad with stack or local memory; build warnings: $(wc -l < "$out/ptxas.txt")"
fi
timeout 45 stdbuf -oL ./build-gpu-attn/tests/gpu/tandem_attention_core_tests > "$out/test.log" 2>&1
echo "attention core test rc=$? ($(elapsed) s)"
grep -E "ERROR|FAILED|test cases|assertions|SKIPPED" "$out/test.log" | head -30
cap() { local t=$(($(left) - $2)); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 5 ] && t=5; echo "$t"; }
timeout "$(cap 60 40)" ./build-gpu-attn/bench/attention_bench ${bench_args[@]+"${bench_args[@]}"} \
  > "$out/bench.log" 2>&1
echo "attention_bench ${bench_args[*]+${bench_args[*]}} rc=$? ($(elapsed) s)"
grep -E "FAIL|non-finite|WRONG" "$out/bench.log" | head -10
timeout "$(cap 45 5)" python3 bench/sdpa_baseline.py --json "$out/sdpa.json" > "$out/sdpa.log" 2>&1
echo "sdpa_baseline rc=$? ($(elapsed) s)"
grep -E "CHECK|SKIP|Error" "$out/sdpa.log" | head -20
if [ "$(left)" -gt 20 ]; then
  timeout "$(cap 40 3)" ./build-gpu-attn/bench/attention_bench > "$out/bench2.log" 2>&1
  echo "attention_bench (2nd pass, defaults) rc=$? ($(elapsed) s)"
fi
python3 bench/attention_vs_sdpa.py "$out/bench.log" "$out/sdpa.json" "$out/bench2.log" > "$out/ratios.md" 2>&1
cat "$out/ratios.md"
if [ "${ATTN_NCU:-0}" = 1 ] && [ "$(left)" -gt 25 ]; then
  timeout "$(cap 30 3)" ncu --clock-control none --set full -k regex:attentionKernel -c 1 -o "$out/tandem-4096" \
    ./build-gpu-attn/bench/attention_bench --seqs 4096 --causal 0 --iters 1 --warmup 0 > "$out/ncu.log" 2>&1
  echo "ncu rc=$? ($(elapsed) s)"
  if [ -f "$out/tandem-4096.ncu-rep" ]; then
    ncu --import "$out/tandem-4096.ncu-rep" --page details > "$out/tandem-4096.details.txt" 2>&1
    ncu --import "$out/tandem-4096.ncu-rep" --page raw --csv > "$out/tandem-4096.raw.csv" 2>&1
  fi
fi
if [ "$(left)" -gt 25 ]; then
  timeout "$(cap 40 3)" ./build-gpu-attn/bench/attention_bench --variants all > "$out/bench-variants.log" 2>&1
  echo "attention_bench --variants all rc=$? ($(elapsed) s)"
  python3 bench/attention_vs_sdpa.py --no-default "$out/bench-variants.log" "$out/sdpa.json" \
    > "$out/ratios-variants.md" 2>&1
fi
echo "total: $(elapsed) s"
