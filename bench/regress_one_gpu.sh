#!/usr/bin/env bash
# No-regression check on one GPU against an older commit, in one device call: builds BASE_SRC (a `git archive` of
# the older commit, untracked so that it travels with the tree) in BASE_SRC/build-base, then runs the single-GPU
# benchmarks on both builds, the older one first in each pair, then this one:
#   gemm_bench (GEMM core vs cuBLASLt), roundtrip_bench (client executor, 1 rank) and fused_e2e_bench --ranks 1
#   (the fused GEMMs through libtandem and a private tandemd vs cuBLASLt + NCCL's one-rank collective).
#
#   bench/regress_one_gpu.sh BASE_SRC OUTDIR          (this tree's build: BUILD_DIR, default build-gpu, built already)
#
# Every run has its own time limit; logs and JSON go to OUTDIR/{base,head}-*.
set -uo pipefail
base=$(cd "${1:?usage: bench/regress_one_gpu.sh BASE_SRC OUTDIR}" && pwd)
out=${2:?usage: bench/regress_one_gpu.sh BASE_SRC OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
head=${BUILD_DIR:-$root/build-gpu}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
targets="tandemd tandem gemm_bench roundtrip_bench fused_e2e_bench"
if [ ! -x "$base/build-base/bench/fused_e2e_bench" ]; then
  { cmake -S "$base" -B "$base/build-base" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_BENCH=ON &&
    cmake --build "$base/build-base" -j "$(nproc)" --target $targets; } >"$out/base-build.log" 2>&1 ||
    { tail -30 "$out/base-build.log"; exit 1; }
fi
status=0
pair() { # name limit args...: base, then head
  local name=$1 limit=$2; shift 2
  for which in base head; do
    local dir=$base/build-base; [ $which = head ] && dir=$head
    local tag=$which-$name${SUFFIX:-}
    echo "== $tag: $name $*"
    timeout -k 5 "$limit" "$dir/bench/$name" "$@" ${JSON:+--json "$out/$tag.json"} >"$out/$tag.log" 2>&1
    local rc=$?; [ $rc -ne 0 ] && { echo "   exit $rc"; status=1; }
    tail -n "${TAIL:-25}" "$out/$tag.log"
  done
}
JSON=1 pair gemm_bench 150 --no-sweep
TAIL=6 pair roundtrip_bench 60 --executor client --ranks 1
JSON=1 TAIL=40 pair fused_e2e_bench 200 --ranks 1 --iters 15
exit $status
