#!/usr/bin/env bash
# The GPU-issued exchange over cluster.transport: verbs on the verbs test double (issue 18, helper verbs) on one H200,
# within 120 s (VERBS_LIMIT_S=N to change). Assumes a Release build with everything built in $BUILD_DIR (default
# build-gpu): tandemd, tandemctl, tandem_gpu_tests, the double (verbs-double/libibverbs.so.1) and
# tandem_verbs_cluster_tests. Logs go to OUTDIR, one line per step to OUTDIR/summary.txt; every step under `timeout`,
# and a failed step does not stop the later ones. Most wanted first:
#   1. the two-node GPU case over verbs (two tandemds sharing the GPU, no MPS, each loading the double): the fused
#      GEMMs with the GPU-issued exchange at 1 and 2 ranks per node, the GPU regions registered with the double as GPU
#      memory, every result against the fp64 reference and 20 bitwise repeats; the daemons' logs (with the double's
#      "registered GPU" lines) are in the test's output where a check fails;
#   2. the CPU cluster tests over the double, on this host (tandemd built with CUDA: does the double still take every
#      registration there for host memory?).
# Exit 77 of a step means skipped (no GPU visible).
#   scripts/verbs-gpu-run.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/verbs-gpu-run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build-gpu}
limit=${VERBS_LIMIT_S:-120}
# shellcheck source=lib/steps.sh
. scripts/lib/steps.sh
ls -l "$b/verbs-double" >> "$out/env.txt" 2>&1
case $b in /*) bdir=$b ;; *) bdir=$PWD/$b ;; esac
tests="$bdir/tests/gpu/tandem_gpu_tests"
cluster="$bdir/tests/tandem_verbs_cluster_tests"

if [ ! -e "$bdir/verbs-double/libibverbs.so.1" ]; then
  say "the verbs double is not built ($bdir/verbs-double/libibverbs.so.1): ninja -C $b tandem_verbs_double"
fi
# The GPU test puts the double in its daemons' LD_LIBRARY_PATH itself; the test process keeps rdma-core.
step "two nodes over verbs (double): GPU-issued exchange at 1 and 2 ranks per node" 80 verbs_gpu.log "$tests" \
  "-tc=*over cluster.transport: verbs*" -d
if [ -f "$out/verbs_gpu.log" ]; then
  # What the double said in the daemons' logs (printed by doctest where a check failed).
  grep -E "verbs double: (registered|cannot|.*failed)" "$out/verbs_gpu.log" | sort | uniq -c | head -20 | tee -a "$summary"
fi
# The CPU cluster tests load the double in the test process too (their daemons inherit it), as ctest's ENVIRONMENT does.
LD_LIBRARY_PATH="$bdir/verbs-double${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  step "CPU verbs cluster tests on the double" 40 verbs_cluster.log "$cluster" -d
say "done ($(elapsed) s)"
