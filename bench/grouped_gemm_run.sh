#!/usr/bin/env bash
# One device call for the grouped GEMM: Release build of its targets only, its GPU test, the PyTorch baseline and the
# tandem bench on the same shapes (the baseline's random routings are fed to the bench). Logs to $1 (default $OUT).
#   bash bench/grouped_gemm_run.sh [LOGDIR]        (about 3 minutes on an H200, most of it the build)
set -uo pipefail
out=${1:-${OUT:?give a log directory}}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$out/gpu.txt" 2>&1
git rev-parse HEAD >>"$out/gpu.txt" 2>&1
gg=${BUILD_DIR:-build-gpu-gg}
if ! { cmake -S . -B "$gg" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
       cmake --build "$gg" -j16 --target tandem_grouped_gemm_tests grouped_gemm_bench; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
{ grep -E "spill|stack frame" "$out/build.log" | sort | uniq -c
  cuobjdump --dump-sass "$gg"/kernels/CMakeFiles/tandem_grouped_gemm.dir/grouped_gemm.cu.o | grep -cE "HGMMA"
} >>"$out/gpu.txt" 2>&1
timeout 120 "$gg"/tests/gpu/tandem_grouped_gemm_tests 2>&1 | tee "$out/test.log" | tail -25
timeout 150 python3 bench/grouped_mm_baseline.py --iters 30 --json "$out/torch.json" --counts-out "$out/counts.txt" 2>&1 |
  tee "$out/torch.log"
counts=()
[ -s "$out/counts.txt" ] && counts=(--counts "$out/counts.txt")
timeout 150 "$gg"/bench/grouped_gemm_bench --iters 30 --sweep "${counts[@]}" 2>&1 | tee "$out/bench.log"
