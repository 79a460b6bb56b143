#!/usr/bin/env python3
"""CTest entry point for the Python package tests: run_pytest.py TANDEMD LIBTANDEM [pytest args...].

Exits 77 (CTest: Skipped) with the reason when this Python has no PyTorch or pytest, so a machine without them
reports the tests as skipped instead of failed; scripts/install-deps.sh installs both. Runs the checkout's python/
package (first on sys.path) against the given libtandem and tandemd.
"""

import os
import sys
from pathlib import Path

SKIP = 77


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: run_pytest.py TANDEMD LIBTANDEM [pytest args...]", file=sys.stderr)
        return 2
    tandemd, library, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED tandem Python tests: PyTorch is not importable by {sys.executable} ({e}); run "
              "scripts/install-deps.sh (it installs torch into ~/.cache/tandem/venv) or configure with "
              "-DTANDEM_PYTHON=/path/to/python-with-torch")
        return SKIP
    try:
        import pytest
    except ImportError as e:
        print(f"SKIPPED tandem Python tests: pytest is not importable by {sys.executable} ({e}); "
              f"{sys.executable} -m pip install pytest, or run scripts/install-deps.sh")
        return SKIP
    here = Path(__file__).resolve().parent
    repo = here.parents[1]
    os.environ["TANDEMD"] = tandemd
    os.environ["TANDEM_LIBRARY"] = library
    os.environ.pop("TANDEM_SOCKET", None)  # every test names its own daemon's socket
    paths = [str(repo / "python"), str(here)]
    if os.environ.get("TANDEM_FASTCALL_DIR"):  # the hot path's C module, where CMake built it
        paths.append(os.environ["TANDEM_FASTCALL_DIR"])
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(here), *args])
    # 5: no test collected. A suite that ran nothing has failed, not passed.
    return 1 if code == 5 else int(code)


if __name__ == "__main__":
    sys.exit(main())
