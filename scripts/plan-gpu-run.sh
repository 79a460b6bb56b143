#!/usr/bin/env bash
# The plan table / advise / daemon-executor work on one GPU, in one device call (about 90 s when the shared build is
# already there; essential steps first):
#   1. build tandemd, tandemctl, libtandem, fused_e2e_bench and gemm_rs_one_rank_bench (Release, build-gpu-plan, -j16);
#   2. the fused gemm-rs/gemm-ar kernels forced onto their fused plan at one rank against the GEMM alone
#      (gemm_rs_one_rank_bench, 8192^3 and 16384x14336x8192);
#   3. under MPS (started and stopped as scripts/gpu-check.sh does): fused_e2e_bench --ranks 1 with the client
#      executor, the daemon executor, and the daemon executor with TANDEM_LAUNCH_AHEAD=1 (same build, same call);
#      `tandemctl advise` for ag-gemm, gemm-rs and gemm-ar at 3 shapes on a private tandemd (executor daemon, --save,
#      then `tandemctl status`); plans.autotune: on-first-use on a fresh table.
#   With PLAN_GPU_ROUNDTRIP=1 also the empty-op round trips (roundtrip_bench, TANDEM_TRACE_OPS=1; TANDEM_HOST_DONE=0
#   gives the old path as the same-build baseline).
#
#   scripts/plan-gpu-run.sh OUTDIR
#
# Every step runs under `timeout`; PLAN_GPU_DEADLINE_S (default 110) bounds the whole run: a step that would start
# after it is skipped and reported. OUTDIR/summary.txt has one line per step; each step's output is in its own log.
set -uo pipefail

OUT=${1:?usage: scripts/plan-gpu-run.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu-plan}
DEADLINE=${PLAN_GPU_DEADLINE_S:-110}
START=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-10000}
MPS_DIR=/tmp/tandem-plan-gpu-mps
status=0
DAEMON_PID=

note() { echo "== [$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
step() { # name limit_s logfile command...
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -le 3 ]; then note "SKIP $name (past PLAN_GPU_DEADLINE_S=$DEADLINE)"; return 0; fi
  [ "$left" -lt "$limit" ] && limit=$left
  note "start $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$log"
  if [ $rc -eq 0 ]; then note "PASS $name"; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then note "FAIL $name (timed out)"; status=1;
  else note "FAIL $name (exit $rc)"; status=1; fi
}

mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 20 nvidia-cuda-mps-control -d; then
    sleep 1
    note "MPS started"
    return 0
  fi
  note "FAIL could not start MPS"
  status=1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 1
}
daemon_stop() {
  if [ -n "$DAEMON_PID" ]; then
    kill "$DAEMON_PID" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$DAEMON_PID" 2>/dev/null
    DAEMON_PID=
  fi
}
daemon_start() { # config-file log-file
  rm -f "$SOCK"
  TANDEM_OP_TIMEOUT_MS=5000 "$BUILD/daemon/tandemd" --foreground --backend cuda --socket "$SOCK" --config "$1" \
    > "$2" 2>&1 &
  DAEMON_PID=$!
  for _ in $(seq 300); do [ -S "$SOCK" ] && break; sleep 0.1; done
}
mps_stop() {
  daemon_stop
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null 2>&1 || note "MPS quit did not finish within 20 s"
    for _ in $(seq 50); do [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break; sleep 0.1; done
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    note "MPS stopped"
  fi
}
trap mps_stop EXIT
trap 'note "interrupted"; mps_stop; exit 143' TERM INT

note "machine: $(nvidia-smi -L 2>&1 | head -2 | tr '\n' ' ') commit $(git -C "$ROOT" rev-parse --short HEAD)"
TARGETS="tandemd tandemctl tandem fused_e2e_bench gemm_rs_one_rank_bench"
[ "${PLAN_GPU_ROUNDTRIP:-0}" = 1 ] && TARGETS="$TARGETS roundtrip_bench"
if [ ! -f "$BUILD/build.ninja" ]; then
  step configure 60 configure.log cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
step "build $TARGETS" 150 build.log cmake --build "$BUILD" -j 16 --target $TARGETS
B=$BUILD/bench
CTL="$BUILD/client/tandemctl"
SOCK=/tmp/tandem-plan-gpu.sock

# The lean-epilogue target, no MPS needed.
step "gemm_rs_one_rank_bench (forced fused plans at one rank vs the GEMM alone)" 30 one-rank.log \
  "$B/gemm_rs_one_rank_bench" --iters 10 --warmup 3 --shape 8192x8192x8192 --shape 16384x14336x8192 \
  --json "$OUT/one-rank.json"

if mps_start; then
  # Fused GEMMs through libtandem at one rank: client executor, daemon executor, daemon executor launching ahead.
  step "fused_e2e_bench --ranks 1 --executor client (MPS)" 25 e2e-client.log \
    "$B/fused_e2e_bench" --ranks 1 --executor client --iters 10 --warmup 2 --json "$OUT/e2e-client.json"
  step "fused_e2e_bench --ranks 1 --executor daemon" 25 e2e-daemon.log \
    env TANDEM_TRACE_OPS=1 "$B/fused_e2e_bench" --ranks 1 --executor daemon --iters 10 --warmup 2 \
    --json "$OUT/e2e-daemon.json"
  # advise on a private tandemd (executor daemon) whose plan table lands in OUTDIR.
  mkdir -p "$OUT/plan-state"
  printf 'daemon:\n  executor: daemon\nplans:\n  state_dir: %s\n' "$OUT/plan-state" > "$OUT/tandemd-advise.yaml"
  daemon_start "$OUT/tandemd-advise.yaml" "$OUT/tandemd-advise.log"
  SHAPES="--shape 8192x8192x8192 --shape 4096x8192x8192 --shape 16384x14336x8192"
  # shellcheck disable=SC2086
  step "tandemctl advise ag-gemm,gemm-rs,gemm-ar (3 shapes, --save)" 60 advise.log \
    "$CTL" -s "$SOCK" advise ag-gemm,gemm-rs,gemm-ar $SHAPES --save --svg "$OUT/advise.svg" --json-file "$OUT/advise.json"
  step "tandemctl status (the plan table)" 10 status.log "$CTL" -s "$SOCK" status
  daemon_stop
  # The launch-ahead candidate, after the essentials: should it hang, the killed client could leave MPS unusable.
  step "fused_e2e_bench --ranks 1 --executor daemon, TANDEM_LAUNCH_AHEAD=1" 25 e2e-daemon-ahead.log \
    env TANDEM_LAUNCH_AHEAD=1 TANDEM_TRACE_OPS=1 "$B/fused_e2e_bench" --ranks 1 --executor daemon --iters 10 \
    --warmup 2 --json "$OUT/e2e-daemon-ahead.json"
  # plans.autotune: on-first-use on a fresh table: advise's "built-in rules" ops (no trial plan) are the shape's first
  # ops, so tandemd tries its candidates on them and saves the winner; status shows the autotune entry.
  mkdir -p "$OUT/autotune-state"
  printf 'daemon:\n  executor: daemon\nplans:\n  state_dir: %s\n  autotune: on-first-use\n  autotune_runs: 2\n' \
    "$OUT/autotune-state" > "$OUT/tandemd-autotune.yaml"
  daemon_start "$OUT/tandemd-autotune.yaml" "$OUT/tandemd-autotune.log"
  step "autotune on first use (gemm-rs 8192^3)" 20 autotune.log \
    "$CTL" -s "$SOCK" advise gemm-rs --shape 8192x8192x8192 --sms 8 --iters 10 --svg "$OUT/autotune.svg"
  step "tandemctl status (autotune's entry)" 10 autotune-status.log "$CTL" -s "$SOCK" status
  daemon_stop
  if [ "${PLAN_GPU_ROUNDTRIP:-0}" = 1 ]; then
    step "roundtrip_bench --executor daemon --ranks 1 (TANDEM_TRACE_OPS=1)" 20 roundtrip-daemon.log \
      env TANDEM_TRACE_OPS=1 "$B/roundtrip_bench" --executor daemon --ranks 1 --iters 3000 --warmup 300
    step "roundtrip_bench --executor daemon --ranks 1, TANDEM_HOST_DONE=0" 20 roundtrip-daemon-kernel.log \
      env TANDEM_TRACE_OPS=1 TANDEM_HOST_DONE=0 "$B/roundtrip_bench" --executor daemon --ranks 1 --iters 3000 \
      --warmup 300
  fi
  mps_stop
fi
note "done: $([ $status -eq 0 ] && echo PASS || echo FAIL) after $((SECONDS - START)) s"
exit $status
