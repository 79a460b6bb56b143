"""What the training examples share: one process per rank on this node, each reporting back on a queue, and the
verdict against the single-process PyTorch model."""

from __future__ import annotations

import multiprocessing
import sys

import torch

import tandem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Loss and weight relative difference allowed against the single-process model, per dtype (bf16: rounding noise).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def run_ranks(rank_main, args, device: str = "cpu"):
    """Runs rank_main(rank, args, uid, results) in args.ranks processes (spawned on CUDA, which a fork cannot carry,
    forked otherwise) over one fresh communicator id; each puts (rank, value) on `results`, value a string on failure.
    Returns {rank: value}, or None after printing why when a rank failed, hung or died."""
    ctx = multiprocessing.get_context("spawn" if device == "cuda" else "fork")
    uid = tandem.new_id()
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, uid, results)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        while len(got) < args.ranks:
            try:
                rank, value = results.get(timeout=600)
            except Exception:  # noqa: BLE001  (queue.Empty: a rank hung or died)
                print(f"FAIL: {args.ranks - len(got)} rank(s) did not finish", file=sys.stderr)
                return None
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failed = [v for v in got.values() if isinstance(v, str)]
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return None
    return got


def verdict(got, dtype: str) -> int:
    """Prints PASS or FAIL from every rank's (lines, worst loss rel diff, worst weight rel diff); the exit status."""
    tol = TOLERANCE[DTYPES[dtype]]
    worst = max(v[1] for v in got.values())
    wdiff = max(v[2] for v in got.values())
    ok = worst <= tol and wdiff <= tol
    print(f"{'PASS' if ok else 'FAIL'}: worst loss rel diff {worst:.2e}, worst weight rel diff {wdiff:.2e} "
          f"(tolerance {tol:.0e})")
    return 0 if ok else 1
