#!/usr/bin/env python3
"""CTest entry point for the Python package on the cuda backend (label gpu):
run_gpu.py TANDEMD LIBTANDEM [--ranks N] [--needs MODULE]... SECTION...

Starts a tandemd on the cuda backend (client executor) and runs gpu_run.py's SECTIONs against it, at one rank, or at
N ranks sharing the GPUs under torch.distributed.run. Passes only when the run exits 0 and printed "PASS <section>"
for every section, so a pass means each section's checks ran. Exits 77 (CTest: Skipped) with the reason when this
Python has no PyTorch, PyTorch sees no CUDA device, or a module a section needs (--needs: cupy, jax) is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tandemd_process import Daemon  # beside this file, so on sys.path

SKIP = 77
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def skip(reason: str) -> int:
    print(f"SKIPPED tandem Python GPU tests: {reason}", flush=True)
    return SKIP


def run_sections(args, daemon) -> tuple[int | str, str]:
    """gpu_run.py against `daemon`: (its exit code, or why it has none; its output, also printed)."""
    paths = [str(REPO / "python"), str(HERE)]
    if os.environ.get("TANDEM_FASTCALL_DIR"):  # the hot path's C module, where CMake built it
        paths.append(os.environ["TANDEM_FASTCALL_DIR"])
    env = dict(os.environ, TANDEM_SOCKET=daemon.socket, TANDEM_LIBRARY=args.library,
               PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
               # NVLink multicast stays off on the shared GPU machines; JAX takes memory as it needs it, beside torch.
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    script = str(HERE / "gpu_run.py")
    cmd = [sys.executable, script, *args.sections]
    if args.ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               script, *args.sections]
    print("+", " ".join(cmd), flush=True)
    # A session of its own, so that a timeout ends torchrun's ranks too, not only torchrun.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = f"was killed after {args.timeout:.0f} s"
    print(output, end="", flush=True)
    return code, output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tandemd")
    ap.add_argument("library")
    ap.add_argument("--ranks", type=int, default=1, help="ranks under torch.distributed.run (1: a plain process)")
    ap.add_argument("--needs", action="append", default=[], help="a module the sections import (else Skipped)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds the sections may take")
    ap.add_argument("sections", nargs="+")
    args = ap.parse_args()

    try:
        import torch
    except ImportError as e:
        return skip(f"PyTorch is not importable by {sys.executable} ({e}); configure with "
                    "-DTANDEM_PYTHON=/path/to/python-with-torch")
    if torch.version.cuda is None:
        return skip(f"PyTorch {torch.__version__} in {sys.executable} is built without CUDA")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return skip(f"no CUDA device visible to PyTorch {torch.__version__} (CUDA {torch.version.cuda}); "
                    "run on a GPU host")
    for module in args.needs:
        if importlib.util.find_spec(module) is None:
            return skip(f"sections {' '.join(args.sections)} need {module}, which {sys.executable} cannot import")

    daemon = Daemon(backend="cuda", config="daemon:\n  executor: client\n", tandemd=args.tandemd)
    try:
        code, output = run_sections(args, daemon)
    finally:
        stopped = daemon.stop()

    passed = set(re.findall(r"\] PASS (\S+) ", output))
    missing = [s for s in args.sections if s not in passed]
    failures = []
    if code != 0:
        failures.append(f"gpu_run.py exited {code}" if isinstance(code, int) else f"gpu_run.py {code}")
    if missing:
        failures.append(f"no PASS line for section(s) {' '.join(missing)}")
    if stopped != 0:
        failures.append(f"tandemd exited {stopped} on SIGTERM")
    if failures:
        print(f"FAILED: {'; '.join(failures)}\n--- tandemd log ---\n{daemon.log()[-8000:]}", flush=True)
        return 1
    print(f"PASSED: sections {' '.join(args.sections)} at {args.ranks} rank(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
