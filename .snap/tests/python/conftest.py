"""Fixtures for the Python package tests: a real tandemd (cpu backend) on a private socket, and rank processes.

run_pytest.py (the CTest entry point) sets TANDEMD (the daemon binary) and TANDEM_LIBRARY (the libtandem to test),
and puts python/ first on sys.path, so these tests exercise the checkout's package against its own build.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback

import pytest

from tandemd_process import Daemon  # noqa: F401  (test_api.py imports it from here)


@pytest.fixture(scope="session")
def daemon():
    d = Daemon()
    # The default socket of this process, so tandem.empty() and Communicator() without socket= use this daemon.
    os.environ["TANDEM_SOCKET"] = d.socket
    yield d
    code = d.stop()
    assert code == 0, f"tandemd exited with {code} on SIGTERM:\n{d.log()}"


@pytest.fixture
def fresh_daemon():
    d = Daemon()
    yield d
    d.kill()


def _rank_main(fn, rank, nranks, socket, uid, args, results):
    try:
        import torch
        torch.set_num_threads(1)  # up to 4 ranks and the daemon share 2 cores
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(nranks), TANDEM_ID=uid, TANDEM_SOCKET=socket)
        results.put((rank, fn(rank, nranks, *args), None))
    except BaseException:  # noqa: BLE001  (everything a rank raised goes back to the test)
        results.put((rank, None, traceback.format_exc()))


def run_ranks(fn, nranks: int, socket: str, *args, timeout_s: float = 90):
    """Runs fn(rank, nranks, *args) in nranks forked processes with RANK, WORLD_SIZE, TANDEM_ID (fresh) and
    TANDEM_SOCKET set, as torchrun plus the README's launch would. Returns each rank's result, in rank order;
    raises with every failing rank's traceback."""
    import tandem
    ctx = multiprocessing.get_context("fork")  # the parent has imported torch and tandem: the ranks start at once
    results = ctx.Queue()
    uid = tandem.new_id()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, nranks, socket, uid, args, results), daemon=True)
             for r in range(nranks)]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < nranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{nranks - len(out) - len(errors)} of {nranks} ranks did not finish "
                                   f"{fn.__name__} within {timeout_s} s")
            try:
                rank, value, err = results.get(timeout=min(left, 1.0))
            except queue.Empty:  # none reported this second: look for ranks that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} of {fn.__name__} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]}) without reporting")
                continue
            if err is None:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{err}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError(f"{fn.__name__} at {nranks} ranks failed:\n" + "\n".join(errors))
    return [out[r] for r in range(nranks)]
