#!/usr/bin/env bash
# `tandemctl run` on one GPU (nvidia-h200), in one device call: a Release build of tandemd and tandemctl only
# (build-gpu-ctl/), a private tandemd on the cuda backend (executor client), then ag-gemm, gemm-rs, gemm-ar and
# allgather at 1 and 2 ranks (2 ranks share the GPU) with --check (host fp64 reference for the small shapes, the fp32
# GPU reference GEMM for the large ones) and --compare (NCCL + cuBLASLt; skipped with a reason where NCCL cannot run,
# e.g. two ranks on one GPU), and the argument checks (exit 2 before anything starts). At most CTL_GPU_BUDGET_S (110) s
# with the build: a step that would run past it is skipped and said so.
#   scripts/ctl-gpu-run.sh OUTDIR
# OUTDIR gets build.log, tandemd.log, one .log (and .json) per run and summary.txt (one line per step with its exit
# code and seconds).
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# A stuck device-side wait gives up (and says where) well inside a step's limit.
export TANDEM_OP_TIMEOUT_MS=12000
build=build-gpu-ctl
budget=${CTL_GPU_BUDGET_S:-110}  # seconds for the whole script, the build included
t0=$(date +%s)
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv; git rev-parse HEAD; } \
  > "$out/machine.txt" 2>&1
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_BENCH=OFF \
  > "$out/configure.log" 2>&1; then
  note "configure FAILED"; tail -30 "$out/configure.log"; exit 1
fi
if ! cmake --build "$build" -j16 --target tandemd tandemctl > "$out/build.log" 2>&1; then
  note "build FAILED ($(($(date +%s) - t0)) s)"; grep -E "error|FAILED" -A4 "$out/build.log" | head -60; exit 1
fi
note "build ok ($(($(date +%s) - t0)) s)"
grep -E "NCCL" "$out/configure.log" | head -3

dir=$(mktemp -d)
sock="$dir/tandemd.sock"
printf 'daemon:\n  backend: cuda\n  executor: client\n' > "$dir/tandemd.yaml"
"$build/daemon/tandemd" --foreground --config "$dir/tandemd.yaml" --socket "$sock" > "$out/tandemd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 300); do [ -S "$sock" ] && break; sleep 0.1; done
ctl() { "$build/client/tandemctl" --socket "$sock" "$@"; }

# step NAME LIMIT_S ARGS...: one tandemctl invocation, its output in NAME.log, its exit code in the summary.
step() {
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  # The whole script has $budget s: a step that could run past it is skipped (and said so) rather than cut off.
  if (( s - t0 + limit > budget )); then
    limit=$(( budget - (s - t0) ))
    if (( limit < 5 )); then note "$name skipped: the ${budget} s budget is spent"; return 0; fi
  fi
  timeout -k 5 "$limit" "$build/client/tandemctl" --socket "$sock" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  note "$name rc=$rc ($(($(date +%s) - s)) s): tandemctl $*"
  grep -E "^(PASS|FAIL)|TFLOP|GB/s|baseline|plan|^rank [0-9]|tandemctl run:|error|\"(p50_us|tflops_per_rank|bus_gbps|baseline_over_tandem|baseline_note|check_method|rel_error|message)\"" "$out/$name.log" | head -16
  return 0
}

ctl status > "$out/status.log" 2>&1
# Argument checks first (they take no time): exit 2, one message naming the flag, no rank started.
step bad-m               5 run ag-gemm --m -5
step bad-topk            5 run moe-dispatch-gemm --topk 9
step bad-experts         5 run moe-dispatch-gemm --ranks 3 --experts 8
# Large shapes: checked by the fp32 GPU reference GEMM, the NCCL + cuBLASLt baseline timed beside tandem.
step ag-gemm-1r-large   20 run ag-gemm --ranks 1 --m 8192 --n 8192 --k 8192 --check --compare --iters 10 --warmup 3 --json
step gemm-rs-1r-large   20 run gemm-rs --ranks 1 --m 8192 --n 8192 --k 8192 --check --compare --iters 10 --warmup 3 --json
step gemm-ar-1r-large   20 run gemm-ar --ranks 1 --m 8192 --n 8192 --k 8192 --check --compare --iters 10 --warmup 3 --json
step allgather-1r       15 run allgather --ranks 1 --bytes 16777216 --check --compare --iters 20 --warmup 3
# Two ranks sharing the GPU (NCCL refuses two ranks on one GPU, so --compare says why it has no baseline).
step ag-gemm-2r         20 run ag-gemm --ranks 2 --m 4096 --n 4096 --k 4096 --check --compare --iters 5 --warmup 1 --timeout-ms 15000
step gemm-rs-2r         20 run gemm-rs --ranks 2 --m 1024 --n 1024 --k 2048 --check --compare --iters 5 --warmup 1 --timeout-ms 15000
step gemm-ar-2r         20 run gemm-ar --ranks 2 --m 1024 --n 1024 --k 2048 --check --compare --iters 5 --warmup 1 --timeout-ms 15000
step allgather-2r       15 run allgather --ranks 2 --bytes 16777216 --check --compare --iters 10 --warmup 2 --json
# A small shape: checked on the host (fp64 reference, outputs copied back).
step ag-gemm-1r-small   15 run ag-gemm --ranks 1 --m 512 --n 512 --k 512 --check --compare --iters 20 --warmup 3
# What the cuda backend does not run is refused with the backend's list of ops, once.
step moe-unsupported    10 run moe-dispatch-gemm --ranks 1 --check
note "total $(($(date +%s) - t0)) s"
