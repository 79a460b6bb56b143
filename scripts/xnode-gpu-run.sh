#!/usr/bin/env bash
# The GPU-issued exchange across nodes (issue 18, helper xnode) on one H200, within 380 s (XNODE_LIMIT_S=N to change).
# Assumes a Release build with everything built in $BUILD_DIR (default build-gpu): tandemd, tandem_gpu_tests,
# tandem_span_exchange_gpu_tests, span_bench. Logs go to OUTDIR, one line per step to OUTDIR/summary.txt; every step
# under `timeout`, and a failed step does not stop the later ones. Most wanted first:
#   1. the exchange's pieces below tandemd (kernels, proxy, regions, abort word, deadlines): seconds;
#   2. the two-node cases of tandem_gpu_tests one at a time (two tandemds sharing the GPU, no MPS): the GPU path at 1
#      and 2 ranks per node, every path against the fp64 reference, cluster.gpu_exchange off bitwise equal to on, a
#      killed rank before the first exchange and while the GPU waits, a killed (then restarted) tandemd and a hung node
#      while the GPU waits;
#   3. span_bench, both paths in one run (GPU-issued vs staged, each against one node), then the GPU path again with
#      its region in GPU memory (TANDEM_GPU_REGION=device; tcp's default is mapped pinned host memory) and with its
#      waits in the kernels (TANDEM_SPAN_WAIT=kernel) instead of stream waits;
#   4. under a private MPS server: the pieces and the proxy GPU test (in-process, no tandemd: do they stall under MPS?),
#      the daemon-executor case (the GPU path over tcp and over the verbs double, both regions in host memory: a
#      GPU-memory region stalled under MPS on the double), and span_bench at M=1024 with every thread's stack after
#      15 s (mps_stacks.log).
#   scripts/xnode-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/xnode-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build-gpu}
limit=${XNODE_LIMIT_S:-380}
# shellcheck source=lib/steps.sh
. scripts/lib/steps.sh
tests="./$b/tests/gpu/tandem_gpu_tests"
pieces="./$b/tests/gpu/tandem_span_exchange_gpu_tests"
bench="./$b/bench/span_bench"

# XNODE_STEPS=mps runs only step 4 (the rest is in ctest -L gpu).
if [ "${XNODE_STEPS:-all}" != mps ]; then
step "span exchange pieces" 25 pieces.log "$pieces" -d
step "two nodes: GPU path at 1 and 2 ranks per node" 50 ranks_per_node.log "$tests" "-tc=*at 1 and 2 ranks per node*" -d
step "two nodes: every path vs the reference" 25 paths.log "$tests" "-tc=*barriers across nodes match*" -d
step "two nodes: gpu_exchange off bitwise = on" 35 off.log "$tests" "-tc=*gpu_exchange off*" -d
step "two nodes: rank killed before the first exchange" 20 kill.log "$tests" "-tc=*rank killed mid-op*" -d
step "two nodes: rank killed while the GPU waits" 25 kill_gpu_wait.log "$tests" "-tc=*waits for its data*" -d
# A node lost while node 0's GPU waits on its arrived flag: its tandemd killed, then restarted (the next communicator
# runs across it on the GPU path); or hung (SIGSTOP, a cut link on loopback: found by the heartbeat deadline), then
# continued (both nodes serve the next communicator).
step "two nodes: tandemd killed while the GPU waits, then restarted" 35 kill_daemon.log "$tests" \
  "-tc=*a tandemd killed while*" -d
step "two nodes: hung node (cut link) while the GPU waits" 35 hung_node.log "$tests" "-tc=*a hung node (a cut link)*" -d
step "span_bench both paths" 50 span_bench.log "$bench" --iters 5 --warmup 1
if [ -f "$out/span_bench.log" ]; then grep -E "^\||lost|rank process" "$out/span_bench.log" | tee -a "$summary"; fi
# The GPU path with its region in GPU memory (kDevice, staged by tcp per frame: the layout before session 8), and with
# its waits in the one-warp kernels instead of stream waits (node-local knobs, same protocol).
TANDEM_GPU_REGION=device step "span_bench GPU path, region in GPU memory" 35 span_bench_device_region.log "$bench" \
  --iters 5 --warmup 1 --paths gpu
TANDEM_SPAN_WAIT=kernel step "span_bench GPU path, kernel waits" 30 span_bench_kernel_wait.log "$bench" --iters 5 \
  --warmup 1 --paths gpu
for f in span_bench_device_region span_bench_kernel_wait; do
  if [ -f "$out/$f.log" ]; then grep -E "^\||lost|rank process" "$out/$f.log" | sed "s/^/$f /" | tee -a "$summary"; fi
done
fi

# Where every thread of every tandemd (and test process) sits after $1 s, into $2: for a step that hangs.
stacks_after() {
  sleep "$1"
  {
    for pid in $(pgrep -f "tandemd|tandem_span_exchange|span_bench" 2>/dev/null); do
      echo "== pid $pid: $(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-120)"
      for t in /proc/$pid/task/*; do echo "  $(cat $t/comm 2>/dev/null) wchan=$(cat $t/wchan 2>/dev/null)"; done
      if command -v gdb > /dev/null; then timeout 15 gdb -p "$pid" -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^#|^Thread" | head -150; fi
    done
  } > "$2" 2>&1
}

if command -v nvidia-cuda-mps-control > /dev/null && [ "$(left)" -gt 25 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/xnode-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/xnode-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 20 nvidia-cuda-mps-control -d; then
    sleep 1
    say "MPS started ($(elapsed) s)"
    step "MPS: span exchange pieces" 25 mps_pieces.log "$pieces" -d
    step "MPS: proxy GPU test (GPU -> proxy -> tcp -> GPU, no tandemd)" 25 mps_proxy.log \
      "./$b/tests/gpu/tandem_proxy_gpu_tests" -d
    step "MPS: two nodes, daemon executor (GPU path on tcp and on the verbs double, regions in host memory)" 80 mps_daemon.log "$tests" \
      "-tc=*daemon executor (MPS)*" -d
    stacks_after 15 "$out/mps_stacks.log" &
    step "MPS: span_bench, GPU path vs staged" 30 mps_span_bench.log "$bench" --iters 3 --warmup 1 --ms 1024
    wait
    if [ -f "$out/mps_span_bench.log" ]; then grep -E "^\||lost|rank process" "$out/mps_span_bench.log" | tee -a "$summary"; fi
    echo quit | timeout 20 nvidia-cuda-mps-control > /dev/null 2>&1 || say "MPS quit did not finish within 20 s"
    tail -n 40 "$CUDA_MPS_LOG_DIRECTORY"/control.log > "$out/mps-control.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    say "MPS: could not start a private server"
  fi
fi
say "done ($(elapsed) s)"
