#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call: configure a Release build in build-gpu/, build, run the
# gpu-labelled tests without MPS, run every GPU benchmark that was built, start MPS, run the executor tests again
# under MPS (client executor under MPS, daemon executor) and the daemon-executor benchmarks, stop MPS.
#
#   scripts/gpu-check.sh OUTDIR
#
# Progress goes to stdout and OUTDIR/gpu-check.log as it happens (a call that is cut short still shows where it
# was); OUTDIR/summary.txt has one PASS/FAIL/SKIP line per step; build.log and the benchmarks' JSON sit beside them.
# Every step has its own time limit, and GPU_CHECK_DEADLINE_S bounds the whole run: steps that would start after
# it are skipped (and reported as such), so the script always ends cleanly and stops MPS.
#
# Environment (all optional):
#   BUILD_DIR               build tree (default: build-gpu/ in the repository)
#   GPU_CHECK_TARGETS       build only these targets (default: all; ninja keeps going past an unrelated failure)
#   GPU_CHECK_BENCHES       "all" (default), "none", or names of benchmarks to run ("allgather_bench roundtrip_bench")
#   GPU_CHECK_SKIP_TESTS=1  benchmarks only
#   GPU_CHECK_MPS=0         skip the MPS phase
#   GPU_CHECK_DAEMON_AG=0   skip the AllGather bandwidth run with the daemon executor under MPS
#   GPU_CHECK_MPS_FILTER    doctest -tc filter for the suite's run under MPS (default *executor*,*barrier*)
#   GPU_CHECK_DEADLINE_S    no step runs past this many seconds from the start (default 0: no limit); use this
#                           rather than an outer `timeout`, whose signal bash defers while a step runs
#   TANDEM_GPU_TEST_MAX_BYTES  cap the AllGather test sizes (default: up to 1 GiB)
#   TANDEM_OP_TIMEOUT_MS    every kernel wait's deadline (default here 15000)
#   TANDEM_LOG              libtandem's log level (default here debug: each rank prints the plan a fused GEMM ran,
#                           once per op and shape, "tandem: rank R: gemm-ar bf16 m=... : plan ...")
# Exit status: non-zero if the build, a test run or a benchmark failed.
set -uo pipefail

OUT=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
BENCHES=${GPU_CHECK_BENCHES:-all}
DEADLINE=${GPU_CHECK_DEADLINE_S:-0}
START=$SECONDS
# NVLink multicast stays off on these machines (see the device notes); keep it off in every child too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A wedged kernel reports through its deadline instead of holding the machine (the library's default is 60 s).
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-15000}
export TANDEM_LOG=${TANDEM_LOG:-debug}
status=0
MPS_DIR=/tmp/tandem-gpu-check-mps

exec > >(tee -a "$OUT/gpu-check.log") 2>&1

note() { echo "== [$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
result() { # name rc
  if [ "$2" -eq 0 ]; then note "PASS $1"; elif [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then note "FAIL $1 (timed out)"; status=1;
  else note "FAIL $1 (exit $2)"; status=1; fi
}
in_time() { # name: false (and a SKIP line) once the deadline has passed
  if [ "$DEADLINE" -gt 0 ] && [ $((SECONDS - START)) -ge "$DEADLINE" ]; then note "SKIP $1 (past GPU_CHECK_DEADLINE_S=$DEADLINE)"; return 1; fi
  return 0
}
run_step() { # name limit_s command...: runs with a time limit (timeout kills the step's whole process group)
  local name=$1 limit=$2
  shift 2
  in_time "$name" || return 0
  if [ "$DEADLINE" -gt 0 ]; then  # never past the deadline: bash runs no trap while a step holds the foreground
    local left=$((DEADLINE - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  note "start $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@"
  result "$name" $?
}

mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 20 nvidia-cuda-mps-control -d; then
    sleep 1
    note "MPS started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    return 0
  fi
  note "FAIL could not start MPS"
  status=1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 1
}
mps_stop() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    # quit waits for MPS clients; never let it hold the run.
    echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null 2>&1 || note "MPS quit did not finish within 20 s"
    for _ in $(seq 50); do [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break; sleep 0.1; done
    tail -n 40 "$CUDA_MPS_LOG_DIRECTORY"/control.log > "$OUT/mps-control.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    note "MPS stopped"
  fi
}
trap mps_stop EXIT
trap 'note "interrupted"; mps_stop; exit 143' TERM INT

wants() { [ "$BENCHES" = all ] || [[ " $BENCHES " == *" $1 "* ]]; }
bench() { # name limit_s args...
  local name=$1 limit=$2
  shift 2
  wants "$name" || return
  [ -x "$BUILD/bench/$name" ] || { note "SKIP $name (not built)"; return; }
  run_step "$name $*" "$limit" "$BUILD/bench/$name" "$@"
}

note "machine"
{ date -u; nvidia-smi -L; nvidia-smi topo -m; echo "commit $(git -C "$ROOT" rev-parse --short HEAD)"; git -C "$ROOT" status --short | head -40; } 2>&1

run_step configure 300 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_BENCH=ON
# shellcheck disable=SC2086
run_step "build ${GPU_CHECK_TARGETS:-(all targets)}" 1200 \
  sh -c "cmake --build '$BUILD' -j $(nproc) ${GPU_CHECK_TARGETS:+--target $GPU_CHECK_TARGETS} -- -k 0 > '$OUT/build.log' 2>&1 \
         || { grep -E 'error|FAILED' -A4 '$OUT/build.log' | head -60; exit 1; }"

if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]; then
  run_step "ctest -L gpu (no MPS)" 900 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 850 -V
fi

# Benchmarks without MPS: the client executor, and every other GPU benchmark that exists.
bench allgather_bench 300 --ranks 2 --executor client --json "$OUT/allgather-client.json"
bench roundtrip_bench 120 --executor client --ranks 1
bench roundtrip_bench 120 --executor client --ranks 2
bench gemm_bench 600 --json "$OUT/gemm.json"
bench ag_gemm_bench 600
bench gemm_rs_bench 600
bench fused_e2e_bench 300 --json "$OUT/fused-e2e.json"

if [ "${GPU_CHECK_MPS:-1}" = 1 ] && in_time "MPS phase" && mps_start; then
  if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ] && [ -x "$BUILD/tests/gpu/tandem_gpu_tests" ]; then
    run_step "tandem_gpu_tests under MPS (${GPU_CHECK_MPS_FILTER:=*executor*,*barrier*})" 900 \
      "$BUILD/tests/gpu/tandem_gpu_tests" -tc="$GPU_CHECK_MPS_FILTER"
  fi
  bench roundtrip_bench 120 --executor daemon --ranks 1
  bench roundtrip_bench 120 --executor daemon --ranks 2
  bench roundtrip_bench 120 --executor client --ranks 2
  if [ "${GPU_CHECK_DAEMON_AG:-1}" = 1 ]; then
    bench allgather_bench 300 --ranks 2 --executor daemon --json "$OUT/allgather-daemon-mps.json"
  fi
  bench fused_e2e_bench 300 --executor daemon --json "$OUT/fused-e2e-daemon.json"
  mps_stop
fi

note "done: $( [ $status -eq 0 ] && echo PASS || echo FAIL ) after $((SECONDS - START)) s"
exit $status
