#!/usr/bin/env bash
# One device step for the attention core (loop control lane0, the only one built since hoist measured no faster:
# bench/RESULTS.md, session 8) against cuDNN (nvidia-h200, one GPU), within ATTN_BUDGET_S (default 110) seconds.
# Assumes a Release build with everything built in $BUILD_DIR (default build-gpu; the targets below are built there
# under a timeout if one is missing). Steps, each under `timeout`, each one line in
# OUT/summary.txt; a failed step does not stop the later ones:
#   1. SASS of the attention object: per kernel, HGMMA / WARPSYNC / R2UR in the whole kernel and in the per-KV-block
#      loop (its instruction count), and registers / stack / local memory (cuobjdump).
#   2. tandem_attention_core_tests: every case with lane0 against the fp64 reference, repeats, shape rules (loop
#      controls 1 and 3 refused) (call 1 of 2026-12-02: 8 s).
#   3. the same binary's environment case with TANDEM_ATTN_LOOP=lane0 (launches that leave
#      AttentionParams::loopControl at 0, as ring attention's do, run lane0), then =hoist (refused, the fix named).
#   4. bench/attention_vs_sdpa.py --run: per shape (16 heads, head_dim 128, bf16, seq 4K/8K/16K/32K, causal and not)
#      torch SDPA cuDNN + flash, then attention_bench --loop lane0 --rounds ATTN_ROUNDS (default 3) on the same
#      inputs, each row checked against an fp32 reference.
#   5. tandem_ring_attention_gpu_tests, client executor (1, 2, 4 ranks sharing the GPU), TANDEM_ATTN_LOOP unset
#      (call 1: 5 s);
#   6. in the time left, unless ATTN_NCU=0: ncu of one launch (non-causal 4K and 8K: tensor pipe, issue, stall
#      reasons per instruction), the chosen metrics into OUT/summary.txt.
#   scripts/attn-gpu-run.sh OUT
set -uo pipefail
out=${1:?usage: $0 OUT}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
build=${BUILD_DIR:-build-gpu}
budget=${ATTN_BUDGET_S:-110}
rounds=${ATTN_ROUNDS:-3}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(elapsed))); }
# cap MAX RESERVE: at most MAX seconds, leaving RESERVE for the steps after (at least 5).
cap() { local t=$(($(left) - $2)); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 5 ] && t=5; echo "$t"; }
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,utilization.gpu \
  --format=csv > "$out/gpu.txt" 2>&1
git rev-parse HEAD >> "$out/gpu.txt" 2>&1 || cat COMMIT >> "$out/gpu.txt" 2>/dev/null

core=$build/tests/gpu/tandem_attention_core_tests
bench=$build/bench/attention_bench
ring=$build/tests/gpu/tandem_ring_attention_gpu_tests
missing=()
for t in "$core" "$bench" "$ring"; do [ -x "$t" ] || missing+=("$(basename "$t")"); done
if [ ${#missing[@]} -gt 0 ]; then
  timeout 90 cmake --build "$build" -j16 --target "${missing[@]}" -- -k 0 > "$out/build.log" 2>&1
  summary "build of ${missing[*]}: rc=$? ($(elapsed) s)"
fi

# 1. SASS evidence.
obj=$(find "$build/kernels" -path '*tandem_attention.dir*' -name 'attention.cu.o' 2>/dev/null | head -1)
if [ -n "$obj" ] && command -v cuobjdump > /dev/null; then
  cuobjdump -res-usage "$obj" 2>&1 | grep -E "Function|REG" > "$out/res-usage.txt"
  cuobjdump -sass "$obj" 2>/dev/null | timeout 30 python3 scripts/sass_loop_counts.py attentionKernel \
    > "$out/sass-counts.txt" 2>&1
  nk=$(grep -c "Function.*attentionKernel" "$out/res-usage.txt")
  nbad=$(grep -A1 "Function.*attentionKernel" "$out/res-usage.txt" | grep -Ec "STACK:[1-9]|LOCAL:[1-9]")
  summary "sass: $nk attention kernels, $nbad with stack or local memory; per-KV-block loop of bf16 hd128 bn176 full:" \
    "$(grep -E 'bfloat16, 128, 176, false>' "$out/sass-counts.txt" | sed -E 's/.*innermost wgmma loop: //' |
      tr '\n' ';')"
else
  summary "sass: no attention.cu.o under $build/kernels or no cuobjdump"
fi

# 2. Core tests.
env -u TANDEM_ATTN_LOOP timeout "$(cap 40 70)" stdbuf -oL "$core" > "$out/core_test.log" 2>&1
rc=$?
summary "core tests (lane0): rc=$rc ($(elapsed) s): $(grep -E '^\[doctest\] (test cases|assertions)' \
  "$out/core_test.log" | tr -s ' ' | tr '\n' ' ')"
grep -E "ERROR|FAILED|differ" "$out/core_test.log" | head -20 >> "$out/summary.txt"

# 3. The environment's loop control: lane0 runs lane0, hoist is refused (the case passes when it is).
for loop in lane0 hoist; do
  TANDEM_ATTN_LOOP=$loop timeout 15 "$core" -tc='*TANDEM_ATTN_LOOP*' -s > "$out/core_env_$loop.log" 2>&1
  rc=$?
  want=$([ "$loop" = hoist ] && echo 'refused' || echo 'runs lane0')
  summary "core env case TANDEM_ATTN_LOOP=$loop ($want expected): rc=$rc $(grep -oE \
    "TANDEM_ATTN_LOOP=$loop: (\S+|loop control hoist is no longer built)" "$out/core_env_$loop.log" | head -1)"
done

# 4. The core against cuDNN.
timeout "$(cap 70 25)" python3 bench/attention_vs_sdpa.py --run "$bench" --rounds "$rounds" --out "$out/ab" \
  --bench-timeout 30 > "$out/ab.log" 2>&1
summary "attention_vs_sdpa --run (rounds $rounds): rc=$? ($(elapsed) s)"
grep -E "^SHAPE" "$out/ab.log" | sed 's/^/  /' >> "$out/summary.txt"
grep -E "^\|" "$out/ab.log" > "$out/ab.md"
tail -5 "$out/ab.log" | grep -iE "error|traceback" >> "$out/summary.txt"

# 5. Ring attention, client executor, the default loop control (TANDEM_ATTN_LOOP unset).
if [ "$(left)" -lt 12 ]; then
  summary "ring tests: SKIPPED (budget)"
else
  env -u TANDEM_ATTN_LOOP TANDEM_OP_TIMEOUT_MS=20000 timeout "$(cap 40 3)" stdbuf -oL "$ring" \
    -tc='*client executor*' > "$out/ring.log" 2>&1
  summary "ring tests client executor: rc=$? ($(elapsed) s): $(grep -E \
    '^\[doctest\] (test cases|assertions)' "$out/ring.log" | tr -s ' ' | tr '\n' ' ')"
  grep -E "ERROR|FAIL" "$out/ring.log" | head -10 >> "$out/summary.txt"
fi
# 6. ncu, in the time left (ATTN_NCU=0: never): one launch per shape; the raw metrics that tell tensor-pipe time
# from instruction issue and stalls go into the summary (the whole report stays in OUT).
if [ "${ATTN_NCU:-1}" = 1 ]; then
  for seq in 4096 8192; do
    for loop in lane0; do
      if [ "$(left)" -lt 20 ]; then
        summary "ncu $loop $seq: SKIPPED (budget)"
        continue
      fi
      rep=$out/ncu-$loop-$seq
      timeout "$(cap 25 3)" ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats \
        -k regex:attentionKernel -c 1 -o "$rep" "$bench" --seqs "$seq" --causal 0 --loop "$loop" --iters 20 \
        --warmup 0 --check-rows 64 > "$rep.log" 2>&1
      rc=$?
      line="ncu $loop non-causal $seq: rc=$rc ($(elapsed) s)"
      if [ -f "$rep.ncu-rep" ]; then
        ncu --import "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1
        ncu --import "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>&1
        line="$line $(python3 - "$rep.raw.csv" <<'PY'
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
names = rows[0] if rows else []
data = rows[2] if len(rows) > 2 else []  # row 1: units
want = [r"^gpu__time_duration\.sum$", r"^sm__pipe_tensor.*(gmma|hmma).*pct_of_peak_sustained_active$",
        r"^sm__inst_executed\.avg\.per_cycle_active$", r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
        r"^smsp__inst_executed\.sum$",
        r"^smsp__average_warps?_(latency_)?issue_stalled_(wait|branch_resolving|mio_throttle|barrier|long_scoreboard|"
        r"math_pipe_throttle|dispatch_stall)_per_issue_active\.ratio$"]
out = []
for i, n in enumerate(names):
    if i < len(data) and any(re.match(w, n) for w in want):
        short = re.sub(r"^smsp__average_warps?_(latency_)?issue_stalled_", "stall_", n)
        short = short.replace("_per_issue_active.ratio", "")
        out.append(f"{short}={data[i]}")
print(" ".join(out) if out else "(metrics not found)")
PY
)"
      fi
      summary "$line"
    done
  done
fi
summary "total: $(elapsed) s"
