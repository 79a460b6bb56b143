#!/usr/bin/env bash
# One device call (nvidia-h200): the hostile-client attacks on the paths every backend shares (saturated and
# blocked wakeups, a completion ring never drained, huge shapes, registrations of unsealed/shrunk memfds, files and
# pipes, one session's fds, half-joined communicators), against a tandemd running the cuda backend on one GPU. Each
# attack is followed by an honest 2-rank allgather on GPU memory (checked), fds and RSS back near their baseline,
# and SIGTERM obeyed. Release build in build-gpu-hostile/ (only tandemd and the test); logs go to OUTDIR.
#   scripts/hostile-gpu-run.sh OUTDIR
# Finishes within about 150 s (build included): the build and the run each have their own time limit.
set -uo pipefail
out=${1:?usage: scripts/hostile-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# A wedged kernel reports through its deadline instead of holding the machine.
export TANDEM_OP_TIMEOUT_MS=${TANDEM_OP_TIMEOUT_MS:-15000}
build=build-gpu-hostile
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
{
  date -u
  git rev-parse HEAD
  nvidia-smi --query-gpu=name,uuid,memory.used,utilization.gpu --format=csv
  ls /tmp/nvidia-mps/control 2>/dev/null && echo "MPS control pipe present"
} > "$out/env.txt" 2>&1

# Configured only when new: the build dir may be a link to a shared tree whose cache must not change under others.
if [ ! -f "$build/build.ninja" ] && ! timeout 30 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     > "$out/configure.log" 2>&1; then
  echo "configure failed ($(elapsed) s)"; tail -30 "$out/configure.log"; exit 1
fi
if ! timeout 100 cmake --build "$build" -j16 --target tandemd tandem_hostile_tests > "$out/build.log" 2>&1; then
  echo "build failed or timed out ($(elapsed) s)"; grep -E "error|Error|FAILED" -A4 "$out/build.log" | head -60; exit 1
fi
echo "build: $(elapsed) s"

left=$((145 - $(elapsed)))
[ "$left" -lt 20 ] && left=20
# -ts: the suite whose attacks follow TANDEM_HOSTILE_BACKEND; -s: every case's measurements (honest op time, fds,
# RSS before and after), not only failures.
TANDEM_HOSTILE_BACKEND=cuda timeout "$left" stdbuf -oL \
  "./$build/tests/integration/tandem_hostile_tests" "-ts=hostile clients (any backend)" -s \
  > "$out/hostile-cuda.log" 2>&1
rc=$?
echo "tandem_hostile_tests (cuda) rc=$rc ($(elapsed) s)"
grep -E "honest op .* before|status [0-9-]+:|as REGISTER_KIND|test cases|assertions|ERROR|FATAL|TEST CASE" \
  "$out/hostile-cuda.log" | head -80
exit $rc
