#!/usr/bin/env bash
# Checks tandem's systemd units with `systemd-analyze verify` (CTest: systemd_units_verify).
#
# usage: verify-systemd-units.sh BUILT_SERVICE_FILE SOCKET_FILE [EXISTING_BINARY]
#   BUILT_SERVICE_FILE  tandemd.service as configure_file wrote it into the build tree
#   SOCKET_FILE         systemd/tandemd.socket
#   EXISTING_BINARY     an executable to put in ExecStart= (the built tandemd); default /bin/true
#
# `systemd-analyze verify` fails when ExecStart= names a binary that does not exist, and the installed
# path (/usr/local/bin/tandemd) usually does not exist on a build machine. So the units are copied to a
# temporary directory with ExecStart= pointing at EXISTING_BINARY and verified there. verify exits 0
# even for unknown directives or unparsable values (it only prints them), so any output line that names
# a tandemd unit is a failure.
# Exit codes: 0 pass, 1 fail, 77 skip (no systemd-analyze), as CTest's SKIP_RETURN_CODE expects.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 BUILT_SERVICE_FILE SOCKET_FILE [EXISTING_BINARY]" >&2
  exit 2
fi
service_in=$1
socket_in=$2
binary=${3:-/bin/true}

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "SKIPPED systemd_units_verify: systemd-analyze not found;" \
    "install systemd (apt-get install systemd) to check the units"
  exit 77
fi
for f in "$service_in" "$socket_in"; do
  if [[ ! -r $f ]]; then
    echo "FAIL: cannot read $f; build the project first so configure_file writes tandemd.service" >&2
    exit 1
  fi
done
if [[ ! -x $binary || -d $binary ]]; then
  echo "FAIL: $binary is not an executable; build tandemd first or pass an existing binary as the 3rd argument" >&2
  exit 1
fi
binary=$(realpath "$binary")  # ExecStart= needs an absolute path

status=0
fail() {
  echo "FAIL: $*" >&2
  status=1
}

# Checks on the text itself, which verify does not make.
if grep -n '@[A-Za-z_]*@' "$service_in"; then
  fail "$service_in still has an @VARIABLE@ that configure_file did not replace"
fi
exec_start=$(grep -m1 '^ExecStart=' "$service_in" || true)
if [[ ! $exec_start =~ ^ExecStart=/[^[:space:]]*/tandemd[[:space:]].*--systemd ]]; then
  fail "$service_in: ExecStart= must run an absolute path to tandemd with --systemd; got '$exec_start'"
fi
# One config path everywhere: README.md and the config file's header say /etc/tandem/tandemd.yaml.
if [[ ! $exec_start =~ --config[[:space:]]+/etc/tandem/tandemd\.yaml([[:space:]]|$) ]]; then
  fail "$service_in: ExecStart= must pass --config /etc/tandem/tandemd.yaml (the path README.md and the config header name); got '$exec_start'"
fi
# The OOM killer must pick clients before the daemon.
oom=$(sed -n 's/^OOMScoreAdjust=\(-\{0,1\}[0-9]*\)$/\1/p' "$service_in" | head -1)
if [[ -z $oom || $oom -ge 0 ]]; then
  fail "$service_in: OOMScoreAdjust= must be negative (got '${oom}'), so that out of memory the kernel kills clients, not tandemd"
fi
# These hide /dev/nvidia* or /dev/infiniband (ProtectClock= implies DeviceAllow=, which enables the
# device allow-list), or the MPS pipe directory in /tmp.
for directive in PrivateDevices ProtectClock DevicePolicy DeviceAllow PrivateTmp; do
  if grep -n "^[[:space:]]*${directive}=" "$service_in"; then
    fail "$service_in sets ${directive}=, which hides GPU/RDMA devices or /tmp/nvidia-mps from the daemon; remove it"
  fi
done

# Without LimitNOFILE= the daemon gets systemd's soft limit of 1024 fds, below what the default
# limits.max_sessions x limits.max_fds_per_session need (config/tandemd.yaml states the rule).
nofile=$(sed -n 's/^LimitNOFILE=\([0-9]*\)$/\1/p' "$service_in" | head -1)
if [[ -z $nofile ]]; then
  fail "$service_in sets no numeric LimitNOFILE=; set it to at least 2 x limits.max_sessions x limits.max_fds_per_session"
elif ((nofile < 65536)); then
  fail "$service_in: LimitNOFILE=$nofile is below 65536, what the default limits need (2 x 256 sessions x 128 fds)"
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-units.XXXXXX")
# The units must keep their names: tandemd.socket activates the service of the same name.
sed "s|^ExecStart=[^[:space:]]*|ExecStart=${binary}|" "$service_in" >"$tmp/tandemd.service"
cp "$socket_in" "$tmp/tandemd.socket"

rc=0
output=$(cd "$tmp" && systemd-analyze verify ./tandemd.service ./tandemd.socket 2>&1) || rc=$?
rm -rf "$tmp"

if [[ -n $output ]]; then
  echo "systemd-analyze verify said:"
  echo "$output"
fi
if [[ $rc -ne 0 ]]; then
  fail "systemd-analyze verify exited $rc"
fi
# Lines about other units (dependencies installed on this host) are shown but do not fail the test.
if grep -q 'tandemd' <<<"$output"; then
  fail "systemd-analyze verify reported problems in the tandemd units (above)"
fi

if [[ $status -eq 0 ]]; then
  echo "PASS: tandemd.service and tandemd.socket verify cleanly"
fi
exit $status
