# Shared by the device-call scripts (scripts/*-gpu-run.sh): a time budget, one summary line per step, and the
# machine's state. Source it after setting `out` (the output folder, absolute) and `limit` (seconds for the script);
# it turns NVLink multicast off, sets a 20 s op timeout (unless set), starts the clock, empties $out/summary.txt and writes $out/env.txt.
#   step NAME CAP LOG CMD...   runs CMD under `timeout` for the smaller of CAP and the time left, its output in
#                              $out/LOG, then says "NAME: rc=N (timed out|skipped: no GPU) <doctest totals>(T s)"
# A missing CMD or no time left is one "skipped" line; a failing step never stops the script.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast stays off on these machines
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-20000}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((limit - $(elapsed))); }
summary="$out/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
{
  date -u
  git rev-parse HEAD 2>/dev/null || cat COMMIT 2>/dev/null
  git status --short 2>/dev/null | head -40
  nvidia-smi --query-gpu=name,uuid,clocks.sm,memory.used,utilization.gpu --format=csv
} > "$out/env.txt" 2>&1
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
