#!/usr/bin/env bash
# Two tandemd daemons on this machine acting as two nodes of a cluster (127.0.0.1 and 127.0.0.2, one tcp port
# each, a shared secret), and fused ops whose ranks are split across them: ranks 0,1 on node 0, ranks 2,3 on node 1,
# each node's share run by its own `tandemctl run` with the same communicator id, checked against the fp64
# reference. On real hosts the steps are the same (README, "Two nodes, step by step"). Needs a build (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
[ -x "$build/daemon/tandemd" ] || { echo "no $build/daemon/tandemd: run ./scripts/demo.sh (or ./scripts/build.sh) first" >&2; exit 1; }

dir="$(mktemp -d /tmp/tandem-two-nodes-XXXXXX)"
port=$((20000 + RANDOM % 20000))
head -c 32 /dev/urandom | base64 > "$dir/cluster.secret"
chmod 600 "$dir/cluster.secret"
cat > "$dir/tandemd.yaml" <<YAML
daemon:
  backend: cpu
cluster:
  nodes: ["127.0.0.1:$port", "127.0.0.2:$port"]
  secret_file: $dir/cluster.secret
YAML
ctl() { local node=$1; shift; "$build/client/tandemctl" --socket "$dir/node$node.sock" "$@"; }
cleanup() {
  for n in 0 1; do ctl "$n" shutdown >/dev/null 2>&1 || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

for n in 0 1; do
  echo "== starting node $n (127.0.0.$((n + 1)):$port)"
  "$build/daemon/tandemd" --config "$dir/tandemd.yaml" --node-index "$n" --socket "$dir/node$n.sock" \
    2>"$dir/node$n.log"
done
echo "== waiting for the nodes to see each other"
for _ in $(seq 100); do
  ctl 0 status | grep -q "127.0.0.2:$port *connected" && break
  sleep 0.1
done
ctl 0 status | sed -n '/^cluster:/,/^communicators:/p'

status=0
for op in "ag-gemm --m 512 --n 256 --k 256" "gemm-rs --m 256 --n 128 --k 512" "gemm-ar --m 128 --n 128 --k 256" \
          "ring-attention"; do
  id=$(ctl 0 new-id)
  echo "== ${op%% *} on 4 ranks: 0,1 on node 0, 2,3 on node 1"
  # shellcheck disable=SC2086
  ctl 0 run $op --ranks 4 --id "$id" --local-ranks 0,1 --check > "$dir/run0.txt" 2>&1 & pid0=$!
  # shellcheck disable=SC2086
  ctl 1 run $op --ranks 4 --id "$id" --local-ranks 2,3 --check > "$dir/run1.txt" 2>&1 & pid1=$!
  wait "$pid0" || status=1
  wait "$pid1" || status=1
  tail -n 1 "$dir/run0.txt" "$dir/run1.txt" | grep -v '^$'
done
[ "$status" -eq 0 ] || { echo "== a run failed; node logs:"; cat "$dir/node0.log" "$dir/node1.log"; }
exit "$status"
