#!/usr/bin/env bash
# Installs tandem's build and test dependencies from the distribution (Debian 12 / Ubuntu 24.04), only
# those that are missing. Nothing else is downloaded, except PyTorch, NumPy and pytest from PyPI into a virtual
# environment for the Python package's tests (tests/python/install-deps.sh says why; TANDEM_PYTHON_TESTS=0 skips
# them). CUDA (nvcc) is optional: without it the CPU backend builds alone.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libprotobuf-dev protobuf-compiler      # control-plane protocol
  libboost-dev                           # Boost.Asio
  libyaml-cpp-dev                        # config
  doctest-dev                            # tests
  libfmt-dev libspdlog-dev libcli11-dev nlohmann-json3-dev
  libibverbs-dev libnuma-dev             # verbs transport, NUMA pinning of proxy threads
  libssl-dev                             # libcrypto: HMAC-SHA256 of the tcp transport handshake
  libsystemd-dev systemd                 # sd_notify; systemd-analyze verifies the units in a test
  iproute2                               # network namespaces for multi-node tests
  python3 python3-venv                   # the Python package's tests (PyTorch from PyPI: tests/python/install-deps.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exec "$(dirname "$0")/../tests/python/install-deps.sh"
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
"$(dirname "$0")/../tests/python/install-deps.sh"
