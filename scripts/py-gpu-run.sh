#!/usr/bin/env bash
# The Python package (python/) on one GPU (nvidia-h200), in one device call, under 200 s with the build:
#   1. a Release build of libtandem and tandemd only (build-gpu-py/, -j16);
#   2. pip install --no-build-isolation --no-deps --target (no package index there; the GPU machines have PyTorch);
#   3. a private tandemd on the cuda backend (executor client);
#   4. tests/python/gpu_run.py at 1 rank (ops, torch.compile, CUDA graph capture + 100 replays, the registration
#      cache under freed and reused segments) and at 2 ranks sharing the GPU under torchrun (ops, graph);
#   5. the per-call overhead: python/bench/overhead.py against the same op through the C ABI (and pybind11's floor),
#      with the hot path's C module (_tandem_fastcall, built by pip) and with ctypes alone.
#   scripts/py-gpu-run.sh OUTDIR
# OUTDIR gets machine.txt, configure.log, build.log, tandemd.log, one log per step and summary.txt (one line per step
# with its exit code and seconds). Every step runs under `timeout`.
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
build=build-gpu-py
py=${PYTHON:-python3}
t0=$(date +%s)
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $(($(date +%s) - t0)); }

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv; git rev-parse HEAD
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
             torch.version.cuda)'; } > "$out/machine.txt" 2>&1

# An existing build dir (the lead may link build-gpu-py to one shared Release build) keeps its own options.
if [ -f "$build/CMakeCache.txt" ]; then
  note "configure skipped: $build is configured already"
elif ! timeout 60 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=OFF \
     -DTANDEM_BUILD_BENCH=OFF > "$out/configure.log" 2>&1; then
  note "configure FAILED ($(elapsed) s)"; tail -30 "$out/configure.log"; exit 1
fi
if ! timeout 150 cmake --build "$build" -j16 --target tandem tandemd > "$out/build.log" 2>&1; then
  note "build FAILED or timed out ($(elapsed) s)"; grep -E "error|FAILED" -A4 "$out/build.log" | head -60; exit 1
fi
note "build ok ($(elapsed) s)"

work=$(mktemp -d)
site="$work/site"
# The package is pure Python; --no-build-isolation uses the setuptools already installed (no index reachable).
if timeout 60 "$py" -m pip install --no-build-isolation --no-deps --target "$site" ./python > "$out/pip.log" 2>&1; then
  note "pip install ok ($(elapsed) s)"
else
  # e.g. setuptools too old to build a wheel without the `wheel` package: the source tree, and the C module by hand
  note "pip install FAILED (see pip.log); using the source tree python/ and compiling _tandem_fastcall directly"
  site="$root/python"
  mkdir -p "$work/fast"
  inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  ext=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  cc -O2 -shared -fPIC -I"$inc" python/_tandem_fastcall.c -o "$work/fast/_tandem_fastcall$ext" >> "$out/pip.log" 2>&1 &&
    site="$site:$work/fast"
fi
export PYTHONPATH="$site:$root/tests/python${PYTHONPATH:+:$PYTHONPATH}"
export TANDEM_LIBRARY="$root/$build/client/libtandem.so.0.2"
"$py" -c 'import tandem; from tandem import _capi; print("tandem from", tandem.__file__, "library",
           tandem.library_path, "fastcall", _capi.fastcall)' >> "$out/pip.log" 2>&1

sock="$work/tandemd.sock"
printf 'daemon:\n  backend: cuda\n  executor: client\n' > "$work/tandemd.yaml"
"$build/daemon/tandemd" --foreground --config "$work/tandemd.yaml" --socket "$sock" > "$out/tandemd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 300); do [ -S "$sock" ] && break; sleep 0.1; done
export TANDEM_SOCKET="$sock"

# step NAME LIMIT_S COMMAND...: output in NAME.log, exit code and seconds in the summary, PASS/FAIL lines shown.
step() {
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  note "$name rc=$rc ($(($(date +%s) - s)) s, total $(elapsed) s)"
  grep -E "PASS|FAIL|Error|error:| us" "$out/$name.log" | head -24
  return 0
}

# Most essential first. The graph section last in each run: a replay that goes wrong can leave the stream stuck,
# and the step's timeout ends it.
step gpu-1rank 45 "$py" tests/python/gpu_run.py ops cache compile graph
timeout 30 python/bench/build.sh "$root/$build/client/libtandem.so.0.2" "$work/bench" "$py" > "$out/bench-build.log" 2>&1
export PYTHONPATH="$work/bench:$PYTHONPATH"
step overhead 25 "$py" python/bench/overhead.py "$work/bench/overhead_baseline"
step gpu-2ranks 45 "$py" -m torch.distributed.run --standalone --nproc-per-node 2 tests/python/gpu_run.py ops graph
TANDEM_NO_FASTCALL=1 step overhead-ctypes-only 25 "$py" python/bench/overhead.py "$work/bench/overhead_baseline"
note "done ($(elapsed) s)"
