#!/usr/bin/env bash
# One device call (one H200, at most 150 s) for the lean epilogue of the fused GEMM+ReduceScatter / GEMM+AllReduce
# kernels: a Release build in build-gpu-epi/ of only gemm_rs_one_rank_bench and the kernels library (-j16), the
# mainloop's code generation per fused kernel (cuobjdump: R2UR / WARPSYNC next to the wgmma, where the tool exists),
# then gemm_rs_one_rank_bench with every candidate (gemm-rs and gemm-ar forced fused at one rank with the default,
# generic and legacy own-tile epilogues, send8, the GEMM core, cuBLASLt) at 8192^3 and 16384x14336x8192 (10
# iterations, a per-tile %globaltimer trace of each fused candidate), each shape also at two ranks sharing the GPU in
# one process (66 SMs each: the multi-rank paths checked against the reference and bitwise across kernels and repeats,
# with the kTmaPeer own-tile epilogue as a candidate), and a correctness pass at edge shapes (partial tiles in M and N,
# a tile row split between the ranks; every tandem candidate at one rank must equal the GEMM core bitwise). Every step
# under `timeout`; logs in OUT (bench.log, edge.log, early.log: the kTmaPeerEarly candidates at two ranks).
#   scripts/epi-gpu-run.sh OUT
set -uo pipefail
out=${1:?usage: $0 OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
budget=${EPI_GPU_BUDGET_S:-145}
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(elapsed))); }
status=0
note() { echo "== [$(elapsed)s] $*" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
  --format=csv > "$out/gpu.txt" 2>&1
git rev-parse HEAD >> "$out/gpu.txt" 2>&1
git status --short -- kernels bench scripts >> "$out/gpu.txt" 2>&1
build=build-gpu-epi
if [ ! -f "$build/build.ninja" ]; then
  if ! timeout 40 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$out/configure.log" 2>&1; then
    tail -40 "$out/configure.log"
    note "FAIL configure"
    exit 1
  fi
fi
if ! timeout 110 cmake --build "$build" -j16 --target gemm_rs_one_rank_bench > "$out/build.log" 2>&1; then
  grep -E "error|Error" -A4 "$out/build.log" | head -60
  note "FAIL build"
  exit 1
fi
note "build done"
grep -E "Local memory used|Registers are spilled|Potential Performance Loss" "$out/build.log" | sort -u > "$out/ptxas.txt"

# The mainloop's code generation: a wgmma fed from vector registers (R2UR) and a WARPSYNC before warpgroup.arrive mean
# ptxas treated the tile loop as divergent (the legacy kernels show it; the others must not).
if command -v cuobjdump > /dev/null 2>&1; then
  for o in $(find "$build/kernels" -name 'gemm_rs.cu.o' -o -name 'gemm_ar.cu.o' -o -name 'gemm.cu.o'); do
    timeout 30 cuobjdump -sass "$o" 2> /dev/null | awk -v obj="$(basename "$o")" '
      /Function :/ { if (name != "" && hg) print obj, name, "sass", n, "R2UR", r2, "WARPSYNC", ws; name = $3; n = 0; hg = 0; r2 = 0; ws = 0; win = 0; next }
      /\/\*[0-9a-f]+\*\// { n++ }
      /HGMMA/ && !hg { hg = 1; win = 80 }
      win > 0 { if ($0 ~ /R2UR/) r2++; if ($0 ~ /WARPSYNC/) ws++; win-- }
      END { if (name != "" && hg) print obj, name, "sass", n, "R2UR", r2, "WARPSYNC", ws }' >> "$out/sass-mainloop.txt"
  done
  note "mainloop code generation (R2UR/WARPSYNC in the 80 instructions after the first wgmma):"
  sed 's/_ZN6tandem7kernels//' "$out/sass-mainloop.txt" | cut -c1-160 | tee -a "$out/summary.txt"
fi

bench=$build/bench/gemm_rs_one_rank_bench
run() { # name limit log args...
  local name=$1 limit=$2 log=$3
  shift 3
  local l
  l=$(left)
  if [ "$l" -le 5 ]; then note "SKIP $name (budget)"; status=1; return; fi
  [ "$l" -lt "$limit" ] && limit=$l
  note "start $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$out/$log" 2>&1
  local rc=$?
  cat "$out/$log"
  if [ $rc -eq 0 ]; then note "PASS $name"; else note "FAIL $name (exit $rc)"; status=1; fi
}
# The kTmaPeerEarly candidates run in a step of their own (last): should one hang, the other steps' tables stand.
run "gemm_rs_one_rank_bench, target shapes" 60 bench.log \
  "$bench" --iters 10 --warmup 3 --no-early --shape 8192x8192x8192 --shape 16384x14336x8192 --json "$out/bench.json"
run "gemm_rs_one_rank_bench, edge shapes (correctness)" 30 edge.log \
  "$bench" --iters 3 --warmup 1 --no-early --shape 1000x1000x1040 --shape 777x1024x512 --shape 129x264x64 \
  --shape 4096x8192x8192 --json "$out/edge.json"
run "gemm_rs_one_rank_bench, two ranks with kTmaPeerEarly" 30 early.log \
  "$bench" --iters 10 --warmup 3 --two-ranks-only --shape 8192x8192x8192 --shape 16384x14336x8192 \
  --shape 1000x1000x1040 --shape 777x1024x512 --shape 129x264x64 --json "$out/early.json"
note "done: $([ $status -eq 0 ] && echo PASS || echo FAIL) after $(elapsed) s"
exit $status
