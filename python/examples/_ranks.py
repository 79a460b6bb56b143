"""The training examples' process handling: one process per rank on this node, each reporting back on a queue."""

from __future__ import annotations

import multiprocessing
import sys

import tandem


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
