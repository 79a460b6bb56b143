#!/usr/bin/env bash
# One device call for the MoE ops (about 150 s on an H200 once built; MOE_BUDGET_S): a Release
# build of their targets only in build-gpu-moe, the grouped GEMM's GPU test, the MoE ops' end-to-end GPU tests (client
# executor, one test case per process so that one hang costs only its own limit; the daemon executor under a private
# MPS server when nvidia-cuda-mps-control exists), the MoE unit cases, then the MoE benchmark and its PyTorch baseline
# on the same routings. Every step runs under `timeout`; logs go to OUTDIR.
#   bash scripts/moe-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/moe-gpu-run.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
# A kernel wait that never ends fails its op after 10 s instead of 60, so a broken case does not eat the call.
export TANDEM_OP_TIMEOUT_MS=10000
b=build-gpu-moe
t0=$(date +%s)
# The shared call gives this script about 150 s (MOE_BUDGET_S): the end-to-end tests come first, the bench last.
budget=${MOE_BUDGET_S:-148}
left() { echo $((budget - ($(date +%s) - t0))); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
step() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/steps.txt"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$out/gpu.txt" 2>&1
git rev-parse HEAD >>"$out/gpu.txt" 2>&1
step configure
timeout 60 cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$out/configure.log" 2>&1 || step "configure failed"
step build
timeout "$(cap 200)" cmake --build "$b" -j16 --target tandem_grouped_gemm_tests moe_bench tandemd tandemctl \
  tandem_moe_gpu_tests tandem_unit_tests >"$out/build.log" 2>&1 || { step "build failed"; tail -30 "$out/build.log"; }
grep -E "spill|stack frame|warning|error" "$out/build.log" | sort | uniq -c | head -40 >"$out/build-warnings.txt"

step "grouped GEMM test"
timeout "$(cap 40)" "$b"/tests/gpu/tandem_grouped_gemm_tests >"$out/grouped_gemm_test.log" 2>&1
echo "rc $?" >>"$out/grouped_gemm_test.log"

t="$b"/tests/gpu/tandem_moe_gpu_tests
n=0
for tc in "moe-dispatch-gemm? client executor*:50" "moe-dispatch-ffn-combine? client executor*:55" \
          "*capacity overflow*:12" "*bad expert id*:12" "*refused before submission*:12"; do
  n=$((n + 1))
  name=${tc%:*}; limit=${tc##*:}
  [ -x "$t" ] && [ "$(left)" -gt 8 ] || break
  step "moe GPU test $n: $name"
  timeout "$(cap "$limit")" "$t" --duration=true --test-case="$name" >"$out/moe_gpu_test_$n.log" 2>&1
  echo "rc $?" >>"$out/moe_gpu_test_$n.log"
done
if [ -x "$t" ] && command -v nvidia-cuda-mps-control >/dev/null && [ "$(left)" -gt 30 ]; then
  step "moe GPU test, daemon executor under a private MPS server"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/moe-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moe-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    timeout "$(cap 25)" "$t" --duration=true --test-case="*daemon executor*" >"$out/moe_gpu_test_mps.log" 2>&1
    echo "rc $?" >>"$out/moe_gpu_test_mps.log"
    echo quit | nvidia-cuda-mps-control
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if [ -x "$b"/tests/tandem_unit_tests ]; then
  step "unit tests: the MoE ops' host checks, the executors' op sets, the workspace layout"
  timeout "$(cap 10)" "$b"/tests/tandem_unit_tests --test-case="moe ops*,executor strategies*,fused ops*" \
    >"$out/unit_test.log" 2>&1
  echo "rc $?" >>"$out/unit_test.log"
fi

if [ "$(left)" -gt 20 ]; then
  step "moe_bench"
  mkdir -p "$out/routing"
  timeout "$(cap 30)" "$b"/bench/moe_bench --iters 30 --routing-dir "$out/routing" --json "$out/moe_bench.json" \
    >"$out/moe_bench.log" 2>&1
  echo "rc $?" >>"$out/moe_bench.log"
  if [ "$(left)" -gt 12 ]; then
    step "PyTorch baseline"
    timeout "$(cap 30)" python3 bench/moe_baseline.py --routing-dir "$out/routing" --iters 30 --json "$out/torch.json" \
      --tandem "$out/moe_bench.json" >"$out/torch.log" 2>&1
    echo "rc $?" >>"$out/torch.log"
  fi
  rm -rf "$out/routing"
fi
step done
for f in "$out"/grouped_gemm_test.log "$out"/moe_gpu_test_*.log "$out"/unit_test.log "$out"/moe_bench.log \
         "$out"/torch.log; do
  [ -f "$f" ] && { echo "== $(basename "$f")"; tail -12 "$f"; }
done
