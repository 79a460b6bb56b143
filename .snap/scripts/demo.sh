#!/usr/bin/env bash
# The main job on any machine: install what is missing, build what the demo runs, start tandemd on a private socket,
# run fused ops across 4 client processes on it (checked against the fp64 reference), show the daemon's status, stop
# it.
#
# It builds tandemd, tandemctl (which also runs each rank: it re-executes itself) and libtandem, not the tests or the
# benchmarks, in the same build tree and with the same options as scripts/build.sh (BUILD_DIR, default build/): so
# scripts/demo-two-nodes.sh and `pip install ./python` find them there, and scripts/test.sh later builds only the
# rest. PyTorch for the Python tests is not installed here (scripts/install-deps.sh does that).
set -euo pipefail
cd "$(dirname "$0")/.."
TANDEM_PYTHON_TESTS=0 ./scripts/install-deps.sh
./scripts/build.sh tandemd tandemctl tandem
build="${BUILD_DIR:-build}"

dir="$(mktemp -d /tmp/tandem-demo-XXXXXX)"
socket="$dir/tandemd.sock"
cleanup() { "$build/client/tandemctl" --socket "$socket" shutdown >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT

echo "== starting tandemd on $socket"
"$build/daemon/tandemd" --socket "$socket" 2>"$dir/tandemd.log"
ctl() { "$build/client/tandemctl" --socket "$socket" "$@"; }

echo "== AllGather+GEMM on 4 rank processes"
ctl run ag-gemm --ranks 4 --m 512 --n 256 --k 256 --check
for op in gemm-rs gemm-ar moe-dispatch-gemm moe-dispatch-ffn-combine ring-attention; do
  echo "== $op on 4 rank processes"
  ctl run "$op" --ranks 4 --check | tail -n 1
done
echo "== tandemctl status"
ctl status
echo "== tandemd log"
cat "$dir/tandemd.log"
