#!/usr/bin/env bash
# The Python package (python/) on one GPU (nvidia-h200), in one device call, within $PY_GPU_BUDGET_S (100 s) including
# the build:
#   1. a Release build of libtandem and tandemd only (build-gpu-py/, -j16);
#   2. pip install --no-build-isolation --no-deps --target (no package index there; the GPU machines have PyTorch);
#   3. a private tandemd on the cuda backend (executor client);
#   4. tests/python/gpu_run.py at 1 rank: every op (GEMMs, allgather, MoE, ring attention with lse and both
#      layouts) against float64 torch math, the registration cache (also through the C fast path: hot), DLPack into
#      CuPy, torch.compile, a CUDA graph replayed 100 times (each replay checked exactly);
#   5. the per-call overhead: python/bench/overhead.py against the same op through the C ABI (and pybind11's floor),
#      for this package ("overhead") and, right after it, as the same-call baseline, for the package before the
#      overhead work ("overhead-before": $PY_OLD_DIR, else 37addcf's python/ from git), both with this tree's
#      _tandem_fastcall module (the old package uses only its call/call_out);
#   6. gpu_run.py at 2 ranks sharing the GPU under torchrun (ops, attention, graph);
#   7. the README's torchrun example as the README gives it: `pip install ./python` (offline form) into a venv with
#      --system-site-packages (the machine's PyTorch), then torchrun --nproc-per-node 2 from that venv;
#   8. JAX through DLPack (a process of its own; call 1's times put it just past 100 s: PY_GPU_BUDGET_S=110 runs it);
#   9. if time is left, the overhead with ctypes alone (TANDEM_NO_FASTCALL=1: the Python fast path).
#   scripts/py-gpu-run.sh OUTDIR
# OUTDIR gets machine.txt, configure.log, build.log, pip.log, tandemd.log, one log per step and summary.txt (one line
# per step with its exit code and seconds). Every step runs under `timeout`, and a step that would not fit in what
# is left of the budget is skipped (said so in the summary).
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
build=build-gpu-py
py=${PYTHON:-python3}
user_pythonpath=${PYTHONPATH:-}  # the caller's, before this script adds the test dirs: the README step runs with it
budget=${PY_GPU_BUDGET_S:-100}  # call 3 ran the whole script in 81 s under a 105 s limit
t0=$(date +%s)
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(date +%s) + t0)); }

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv; git rev-parse HEAD
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
             torch.version.cuda)'
  for m in cupy jax numpy; do "$py" -c "import $m; print('$m', $m.__version__)" 2>&1 | tail -1; done
  echo "PYTHONPATH=${PYTHONPATH:-}"; "$py" -c 'import torch; print("torch from", torch.__file__)'; "$py" -m site; } \
  > "$out/machine.txt" 2>&1

# An existing build dir (the lead may link build-gpu-py to one shared Release build) keeps its own options.
if [ -f "$build/CMakeCache.txt" ]; then
  note "configure skipped: $build is configured already"
elif ! timeout 60 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=OFF \
     -DTANDEM_BUILD_BENCH=OFF > "$out/configure.log" 2>&1; then
  note "configure FAILED ($(elapsed) s)"; tail -30 "$out/configure.log"; exit 1
fi
if ! timeout 140 cmake --build "$build" -j16 --target tandem tandemd > "$out/build.log" 2>&1; then
  note "build FAILED or timed out ($(elapsed) s)"; grep -E "error|FAILED" -A4 "$out/build.log" | head -60; exit 1
fi
note "build ok ($(elapsed) s)"

work=$(mktemp -d)
# The tests import the package from the source tree with its C module compiled here (a second); the README step
# below installs it with pip into a venv, as a user would.
site="$root/python:$work/fast"
mkdir -p "$work/fast"
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ext=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cc -O2 -shared -fPIC -I"$inc" python/_tandem_fastcall.c -o "$work/fast/_tandem_fastcall$ext" > "$out/pip.log" 2>&1 ||
  note "compiling _tandem_fastcall FAILED (see pip.log): the tests run through ctypes alone"
export PYTHONPATH="$site:$root/tests/python${PYTHONPATH:+:$PYTHONPATH}"
export TANDEM_LIBRARY="$root/$build/client/libtandem.so.0.2"
"$py" -c 'import tandem; from tandem import _capi; print("tandem from", tandem.__file__, "library",
           tandem.library_path, "fastcall", _capi.fastcall, _capi.fastcall_out)' >> "$out/pip.log" 2>&1

sock="$work/tandemd.sock"
printf 'daemon:\n  backend: cuda\n  executor: client\n' > "$work/tandemd.yaml"
"$build/daemon/tandemd" --foreground --config "$work/tandemd.yaml" --socket "$sock" > "$out/tandemd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 300); do [ -S "$sock" ] && break; sleep 0.1; done
export TANDEM_SOCKET="$sock"

# step NAME LIMIT_S COMMAND...: output in NAME.log, exit code and seconds in the summary, PASS/FAIL lines shown.
# Skipped when fewer than LIMIT_S seconds of the budget are left (the limit shrinks to what is left, down to 60%).
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt $((limit * 6 / 10)) ]; then note "$name SKIPPED: ${l} s of the budget left, it needs up to ${limit}"
    return 0; fi
  [ "$l" -lt "$limit" ] && limit=$l
  local s; s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  note "$name rc=$rc ($(($(date +%s) - s)) s, total $(elapsed) s)"
  grep -E "PASS|FAIL|Error|error:| us|OK" "$out/$name.log" | cut -c1-600 | head -30
  return 0
}

# Most essential first. The graph section last in each run: a replay that goes wrong can leave the stream stuck,
# and the step's timeout ends it.
step gpu-1rank 60 "$py" tests/python/gpu_run.py ops attention cache hot dlpack compile graph
timeout 30 python/bench/build.sh "$root/$build/client/libtandem.so.0.2" "$work/bench" "$py" > "$out/bench-build.log" 2>&1
step overhead 25 env PYTHONPATH="$work/bench:$PYTHONPATH" "$py" python/bench/overhead.py "$work/bench/overhead_baseline"
# The same bench of the package as it was before the overhead work, in this call: the baseline of the numbers above.
# PY_OLD_DIR: that package's python/ already extracted (a snapshot without git history, e.g. a device call's copy).
top=$(git rev-parse --show-toplevel 2>/dev/null)
if { [ -n "${PY_OLD_DIR:-}" ] && [ -f "$PY_OLD_DIR/tandem/_comm.py" ] && cp -r "$PY_OLD_DIR" "$work/old"; } ||
   { [ -n "$top" ] && (cd "$top" && git archive 37addcf python) 2>/dev/null |
     tar -x -C "$work" --transform 's,^python,old,' 2>/dev/null && [ -f "$work/old/tandem/_comm.py" ]; }; then
  step overhead-before 25 env PYTHONPATH="$work/old:$work/bench:$work/fast" "$py" "$work/old/bench/overhead.py" \
    "$work/bench/overhead_baseline"
else
  note "overhead-before SKIPPED: no git history here to take the old package from, and no PY_OLD_DIR"
fi
# Both overhead runs side by side in the summary (binding-alone rows: this package / the old one).
compare_overhead() {
  "$py" - "$out/overhead.log" "$out/overhead-before.log" <<'PYEOF'
import json, sys
def rows(path):
    try:
        line = [l for l in open(path) if l.startswith("{")][-1]
    except (OSError, IndexError):
        return {}, {}
    d = json.loads(line)
    return d["binding_alone_cpu_ns_per_call"], d["ns_per_call"]
(new_a, new_e), (old_a, old_e) = rows(sys.argv[1]), rows(sys.argv[2])
for name in new_a:
    o = old_a.get(name)
    print(f"overhead alone {name}: {new_a[name] / 1000:.2f} us" + (f" (before {o / 1000:.2f} us)" if o else ""))
for name in new_e:
    if "C ABI loop" in name:
        continue
    base = new_e.get(name.split(":")[0] + ": C ABI loop")
    o, ob = old_e.get(name), old_e.get(name.split(":")[0] + ": C ABI loop")
    print(f"overhead e2e {name}: +{(new_e[name] - base) / 1000:.2f} us over the C loop" +
          (f" (before +{(o - ob) / 1000:.2f})" if o and ob else ""))
PYEOF
}
compare_overhead | tee -a "$summary"
step gpu-2ranks 50 "$py" -m torch.distributed.run --standalone --nproc-per-node 2 tests/python/gpu_run.py ops \
  attention graph
# The README's example, as a user would run it: a venv over the machine's PyTorch, `pip install ./python` (the
# offline form the README gives), and torchrun from the repository root, with nothing of this script's environment.
readme() {
  local venv="$work/venv" pip
  "$py" -m venv --system-site-packages "$venv" || "$py" -m venv --without-pip --system-site-packages "$venv" || return 1
  if "$venv/bin/python" -m pip --version; then pip=("$venv/bin/python" -m pip)
  else pip=("$py" -m pip --python "$venv/bin/python"); fi
  # The caller's PYTHONPATH (where this machine may keep its PyTorch), without the test dirs this script added.
  local envs=(-u PYTHONPATH -u TANDEM_LIBRARY)
  [ -n "$user_pythonpath" ] && envs=(-u TANDEM_LIBRARY PYTHONPATH="$user_pythonpath")
  if ! env "${envs[@]}" "$venv/bin/python" -c 'import torch'; then
    # A venv sees the system site-packages but not, e.g., a user site: point it at the machine's torch with a .pth
    local tdir; tdir=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    local vsite; vsite=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "the venv does not see the machine's torch; adding $tdir through $vsite/machine-torch.pth"
    echo "$tdir" > "$vsite/machine-torch.pth"
  fi
  echo "+ TANDEM_BUILD_DIR=$root/$build ${pip[*]} install --no-build-isolation ./python"
  env "${envs[@]}" TANDEM_BUILD_DIR="$root/$build" "${pip[@]}" install --no-build-isolation ./python || return 1
  env "${envs[@]}" "$venv/bin/python" -c 'import torch, tandem, _tandem_fastcall
print("venv: torch", torch.__version__, "from", torch.__file__, "| tandem from", tandem.__file__, "library",
      tandem.library_path)' || return 1
  local run=("$venv/bin/python" -m torch.distributed.run)
  [ -x "$venv/bin/torchrun" ] && run=("$venv/bin/torchrun")
  echo "+ ${run[*]} --nproc-per-node 2 python/examples/torchrun_example.py"
  env "${envs[@]}" "${run[@]}" --nproc-per-node 2 python/examples/torchrun_example.py | tee "$work/readme.out"
  local rc=${PIPESTATUS[0]} ok
  ok=$(grep -c ": OK" "$work/readme.out")
  echo "README example: exit $rc, $ok of 2 ranks printed OK"
  [ "$rc" -eq 0 ] && [ "$ok" -eq 2 ]
}
export -f readme
export work py root build user_pythonpath
step readme-torchrun 45 bash -c readme
XLA_PYTHON_CLIENT_PREALLOCATE=false step jax-1rank 20 "$py" tests/python/gpu_run.py jax
TANDEM_NO_FASTCALL=1 step overhead-ctypes-only 25 env PYTHONPATH="$work/bench:$PYTHONPATH" "$py" \
  python/bench/overhead.py "$work/bench/overhead_baseline"
note "done ($(elapsed) s)"
