#!/usr/bin/env bash
# PyTorch, NumPy and pytest for the Python package's tests, in a virtual environment of their own
# (${TANDEM_PYTHON_VENV:-~/.cache/tandem/venv}, where tests/python/CMakeLists.txt looks first). Called by
# scripts/install-deps.sh; does nothing when the environment already has them. TANDEM_PYTHON_TESTS=0 skips it (the
# Python tests then report Skipped).
#
# Why PyPI and not Debian: Debian 12's python3-torch is 1.13, which has neither torch.compile nor torch.library's
# fake implementations that the package registers its ops with; the GPU machines run 2.11, so CI does too. PyPI's
# Linux wheel of torch depends on NVIDIA's CUDA library wheels (about 3 GB); the CPU tests use none of them, but
# `import torch` needs them present. A virtual environment keeps all of it away from the system's Python.
set -euo pipefail
[[ "${TANDEM_PYTHON_TESTS:-1}" == 0 ]] && { echo "install-deps: Python test dependencies skipped"; exit 0; }
venv="${TANDEM_PYTHON_VENV:-$HOME/.cache/tandem/venv}"
torch_version=2.11.0
if [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$torch_version" <<'PY' 2>/dev/null; then
import sys, torch, numpy, pytest
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
  echo "install-deps: Python test environment present ($venv: torch $torch_version, numpy, pytest)"
  exit 0
fi
python=$(command -v python3)
echo "install-deps: installing torch==$torch_version, numpy and pytest into $venv (with $python)"
mkdir -p "$(dirname "$venv")"
# A failure here (no route to PyPI, a full disk) must not stop the C++ build and tests: the Python tests then
# report Skipped with the reason, and this says loudly why.
if ! { [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"; } ||
   ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" numpy pytest; then
  echo "install-deps: WARNING: could not install torch==$torch_version, numpy and pytest into $venv; the Python" \
       "package's tests will be skipped. Retry scripts/install-deps.sh, or set TANDEM_PYTHON_VENV." >&2
fi
