#!/usr/bin/env bash
# One device call for the MoE ops (about 5 minutes on an H200, most of it the build): a Release build of their targets
# only in build-gpu-moe, the grouped GEMM's GPU test, the MoE benchmark and its PyTorch baseline on the same routings,
# then the MoE ops' end-to-end GPU tests (client executor; the daemon executor under a private MPS server when
# nvidia-cuda-mps-control exists). Every step runs under `timeout`; logs go to OUTDIR.
#   bash scripts/moe-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/moe-gpu-run.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
b=build-gpu-moe
t0=$(date +%s)
left() { echo $((290 - ($(date +%s) - t0))); }
step() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/steps.txt"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$out/gpu.txt" 2>&1
git rev-parse HEAD >>"$out/gpu.txt" 2>&1
step configure
timeout 60 cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$out/configure.log" 2>&1 || step "configure failed"
# The end-to-end tests need tandemd and libtandem (the fused GEMM families too): build them in the background while
# the kernels' own test and the benchmarks run.
( timeout 230 cmake --build "$b" -j10 --target tandemd tandemctl tandem_moe_gpu_tests tandem_unit_tests \
    >"$out/build-e2e.log" 2>&1
  echo $? >"$out/build-e2e.rc" ) &
heavy=$!
step "build grouped GEMM test and moe_bench"
if ! timeout 170 cmake --build "$b" -j6 --target tandem_grouped_gemm_tests moe_bench >"$out/build.log" 2>&1; then
  step "build failed"; tail -30 "$out/build.log"
fi
grep -E "spill|stack frame|warning" "$out/build.log" | sort | uniq -c >"$out/build-warnings.txt" 2>&1

step "grouped GEMM test"
timeout 60 "$b"/tests/gpu/tandem_grouped_gemm_tests >"$out/grouped_gemm_test.log" 2>&1
echo "rc $?" >>"$out/grouped_gemm_test.log"; tail -3 "$out/grouped_gemm_test.log"

step "moe_bench"
mkdir -p "$out/routing"
timeout 100 "$b"/bench/moe_bench --iters 30 --routing-dir "$out/routing" --json "$out/moe_bench.json" \
  >"$out/moe_bench.log" 2>&1
echo "rc $?" >>"$out/moe_bench.log"
step "PyTorch baseline"
timeout 100 python3 bench/moe_baseline.py --routing-dir "$out/routing" --iters 30 --json "$out/torch.json" \
  --tandem "$out/moe_bench.json" >"$out/torch.log" 2>&1
echo "rc $?" >>"$out/torch.log"
rm -rf "$out/routing"

step "waiting for the e2e build"
wait "$heavy"
step "e2e build rc $(cat "$out/build-e2e.rc" 2>/dev/null)"
grep -E "error|warning" "$out/build-e2e.log" | sort | uniq -c | head -40 >"$out/build-e2e-warnings.txt"
if [ -x "$b"/tests/tandem_unit_tests ]; then
  step "unit tests: the MoE ops' host checks, the executors' op sets, the workspace layout"
  timeout 60 "$b"/tests/tandem_unit_tests --test-case="moe ops*,executor strategies*,fused ops*" \
    >"$out/unit_test.log" 2>&1
  echo "rc $?" >>"$out/unit_test.log"
fi
if [ -x "$b"/tests/gpu/tandem_moe_gpu_tests ]; then
  step "moe GPU tests, client executor"
  timeout "$(left)" "$b"/tests/gpu/tandem_moe_gpu_tests --test-case-exclude="*daemon executor*" \
    >"$out/moe_gpu_test.log" 2>&1
  echo "rc $?" >>"$out/moe_gpu_test.log"
  if command -v nvidia-cuda-mps-control >/dev/null && [ "$(left)" -gt 30 ]; then
    step "moe GPU tests, daemon executor under a private MPS server"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/moe-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/moe-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      timeout "$(( $(left) - 5 ))" "$b"/tests/gpu/tandem_moe_gpu_tests --test-case="*daemon executor*" \
        >"$out/moe_gpu_test_mps.log" 2>&1
      echo "rc $?" >>"$out/moe_gpu_test_mps.log"
      echo quit | nvidia-cuda-mps-control
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
step done
for f in grouped_gemm_test.log unit_test.log moe_bench.log torch.log moe_gpu_test.log moe_gpu_test_mps.log; do
  [ -f "$out/$f" ] && { echo "== $f"; tail -25 "$out/$f"; }
done
