"""Per-call overhead of the Python binding: the same op and shape through the C ABI directly, through ctypes with a
prepacked struct (the floor of any ctypes binding), through a pybind11 module doing the same (the floor of a
compiled extension, where pybind11 is importable), and through tandem's public API.

usage: python overhead.py BASELINE_BINARY [--noop LIBTANDEM_NOOP] [--iters N]
  BASELINE_BINARY: overhead_baseline.c compiled against the same libtandem (python/bench/build.sh does it).
Needs a running tandemd ($TANDEM_SOCKET or the default socket). One rank. Prints a table and one JSON line.
It runs with the package on sys.path, whichever that is, so an older package's copy of this file measures that
package the same way. `scripts/gpu-check.sh bench-python` runs it on the cuda backend.

cpu backend: every call submits and waits (the daemon round trip is in every row, and cancels in the differences).
cuda backend: every call enqueues on the current stream (torch's default stream, the legacy stream the C loop uses);
only the submission loop is timed and the stream is synchronised after it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import torch

import tandem
from tandem import _capi


def timed(fn, iters: int, repeats: int = 7, sync=None, cpu: bool = False) -> float:
    """Mean ns per call of `iters` calls of fn(), `repeats` times: the median of wall times, or with cpu=True the
    minimum of this thread's CPU times (which a loaded machine's preemption does not inflate)."""
    clock = time.thread_time_ns if cpu else time.perf_counter_ns
    fn()
    if sync:
        sync()
    per = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(iters):
            fn()
        per.append((clock() - t0) / iters)
        if sync:
            sync()
    # CPU time: the least disturbed repeat (other processes' cache and core sharing only ever add); wall: median.
    return min(per) if cpu else statistics.median(per)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("--noop", default=None, help="libtandem_noop.so (default: beside BASELINE)")
    ap.add_argument("--iters", type=int, default=0)
    args = ap.parse_args()
    if args.noop is None:
        import os
        args.noop = os.path.join(os.path.dirname(os.path.abspath(args.baseline)), "libtandem_noop.so")
    comm = tandem.Communicator()
    cuda = comm.is_cuda
    iters = args.iters or (200 if cuda else 2000)
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = comm.device
    results: dict[str, float] = {}

    def c_baseline(op):
        out = subprocess.run([args.baseline, op, str(iters)], capture_output=True, text=True, check=True)
        return float(out.stdout.split()[2])

    sync = (lambda: comm.synchronize()) if cuda else None
    for op in ("barrier", "gemm_ar"):
        results[f"{op}: C ABI loop"] = c_baseline(op)

    # ctypes floor: the struct packed once, one foreign call per op (plus tandem_wait on cpu).
    a_d, b_d, c_d = (tandem.empty((8, 8), dtype) for _ in range(3))
    for t in (a_d, b_d, c_d):
        t.zero_()
    s = comm.session
    ha, hb, hc = (s.lookup(t.data_ptr(), t.nbytes)[0] for t in (a_d, b_d, c_d))
    code = _capi.DTYPE_BF16 if cuda else _capi.DTYPE_FP32
    buf = ctypes.create_string_buffer(256)
    _capi.ARG_STRUCTS["gemm_ar"].pack_into(buf, 0, _capi.ARG_STRUCTS["gemm_ar"].size, code, 8, 8, 8, ha, 0, hb, 0,
                                           hc, 0, 0)
    bbuf = ctypes.create_string_buffer(64)
    _capi.ARG_STRUCTS["barrier"].pack_into(bbuf, 0, 16, 0)
    op = _capi.Op()
    opref = ctypes.byref(op)
    lib = _capi.lib
    addr, baddr = ctypes.addressof(buf), ctypes.addressof(bbuf)
    h = comm.handle

    def raw(fn, a):
        def call():
            fn(h, a, opref)
            if not cuda:
                lib.tandem_wait(op, -1)
        return call

    def raw_sync():
        lib.tandem_wait(op, 60000)

    results["barrier: ctypes, prepacked"] = timed(raw(lib.tandem_barrier_stream, baddr), iters,
                                                  sync=raw_sync if cuda else None)
    results["gemm_ar: ctypes, prepacked"] = timed(raw(lib.tandem_gemm_ar, addr), iters,
                                                  sync=raw_sync if cuda else None)

    try:
        import tandem_overhead_pybind as pb  # built by python/bench/build.sh where pybind11 is installed
        pb.setup(_capi.library_path)
        results["barrier: pybind11, prepacked"] = timed(lambda: pb.barrier(h, baddr, cuda), iters,
                                                        sync=raw_sync if cuda else None)
        results["gemm_ar: pybind11, prepacked"] = timed(lambda: pb.gemm_ar(h, addr, cuda), iters,
                                                        sync=raw_sync if cuda else None)
    except ImportError as e:
        print(f"(no pybind11 comparison: {e})", file=sys.stderr)

    results["barrier: tandem API"] = timed(comm.barrier, iters, sync=sync)
    results["gemm_ar: tandem API, tandem.empty tensors"] = timed(lambda: comm.gemm_ar(a_d, b_d, out=c_d), iters,
                                                                 sync=sync)
    if cuda:
        a_t, b_t, c_t = (torch.zeros((8, 8), dtype=dtype, device=dev) for _ in range(3))
        results["gemm_ar: tandem API, torch allocator tensors"] = timed(lambda: comm.gemm_ar(a_t, b_t, out=c_t),
                                                                        iters, sync=sync)
    else:
        a_t, b_t, c_t = (torch.zeros((8, 8), dtype=dtype) for _ in range(3))
        results["gemm_ar: tandem API, torch tensors (staged copies)"] = timed(
            lambda: comm.gemm_ar(a_t, b_t, out=c_t), iters, sync=sync)

    # The binding's own work per call, apart from libtandem and the daemon: the same calls with libtandem's entry
    # points swapped for no-op C functions of the same signatures (libtandem_noop.so). CPU time of this thread.
    alone: dict[str, float] = {}
    noop = ctypes.CDLL(args.noop)
    for name in ("tandem_gemm_ar", "tandem_barrier_stream", "tandem_ag_gemm", "tandem_allgather", "tandem_wait",
                 "tandem_op_status"):
        f = getattr(noop, name)
        f.restype = ctypes.c_int
        f.argtypes = getattr(lib, name).argtypes
    n2 = iters * 10
    if cuda:
        # Three tensors in three cudaMalloc segments (over 10 MiB each: a segment of their own in PyTorch's large
        # pool), registered by one real op, for the per-segment check's cost.
        big = [torch.zeros(6 << 20, dtype=dtype, device=dev) for _ in range(3)]
        a3, b3, c3 = (t[:64].view(8, 8) for t in big)
        comm.gemm_ar(a3, b3, out=c3)  # registers the three segments (the full path)
        comm.gemm_ar(a3, b3, out=c3)  # caches their pointers (the fast path)
        comm.synchronize()
        segs = comm.session.segments
        seg = segs.entry(a3.data_ptr(), a3.nbytes)[3]
        alone["driver query: one segment check (SegmentCache.live)"] = timed(lambda: segs.live(seg), n2,
                                                                             repeats=15, cpu=True)
    saved_fn, saved_addr, saved_wait, saved_status = dict(comm._fn), dict(comm._fnaddr), comm._wait_addr, \
        comm._status_addr
    saved = {name: getattr(lib, name) for name in ("tandem_wait", "tandem_op_status")}
    comm._fn["gemm_ar"], comm._fn["barrier"] = noop.tandem_gemm_ar, noop.tandem_barrier_stream
    comm._fnaddr["gemm_ar"] = _capi.address(noop.tandem_gemm_ar)
    comm._fnaddr["barrier"] = _capi.address(noop.tandem_barrier_stream)
    for op_name, cname in (("ag_gemm", "tandem_ag_gemm"), ("allgather", "tandem_allgather")):
        comm._fn[op_name] = getattr(noop, cname)
        comm._fnaddr[op_name] = _capi.address(getattr(noop, cname))
    comm._wait_addr = _capi.address(noop.tandem_wait)
    comm._status_addr = _capi.address(noop.tandem_op_status)
    comm._make_plans()
    lib.tandem_wait, lib.tandem_op_status = noop.tandem_wait, noop.tandem_op_status
    last_real = (comm._op.session_serial, comm._op.seq)
    try:
        def raw_noop():
            noop.tandem_gemm_ar(h, addr, opref)
            if not cuda:
                noop.tandem_wait(op, -1)
        alone["gemm_ar: ctypes, prepacked"] = timed(raw_noop, n2, repeats=15, cpu=True)
        try:
            pb.setup(args.noop)
            alone["gemm_ar: pybind11, prepacked"] = timed(lambda: pb.gemm_ar(h, addr, cuda), n2, repeats=15,
                                                          cpu=True)
        except NameError:
            pass
        alone["barrier: tandem API"] = timed(comm.barrier, n2, repeats=15, cpu=True)
        alone["gemm_ar: tandem API, tandem.empty tensors"] = timed(lambda: comm.gemm_ar(a_d, b_d, out=c_d), n2,
                                                                   repeats=15, cpu=True)
        alone["ag_gemm: tandem API, tandem.empty tensors"] = timed(lambda: comm.ag_gemm(a_d, b_d, out=c_d), n2,
                                                                   repeats=15, cpu=True)
        alone["allgather: tandem API, tandem.empty tensors"] = timed(lambda: comm.allgather(a_d, out=c_d), n2,
                                                                     repeats=15, cpu=True)
        if cuda:
            alone["gemm_ar: tandem API, torch allocator tensors"] = timed(lambda: comm.gemm_ar(a_t, b_t, out=c_t), n2,
                                                                          repeats=15, cpu=True)
            alone["gemm_ar: tandem API, torch allocator, 3 segments"] = timed(
                lambda: comm.gemm_ar(a3, b3, out=c3), n2, repeats=15, cpu=True)
    finally:
        comm._fn.update(saved_fn)
        comm._fnaddr.update(saved_addr)
        comm._wait_addr = saved_wait
        comm._status_addr = saved_status
        comm._make_plans()
        # The no-op "ops" are not real ones: the op struct holds the last real op again, so synchronize() waits for
        # something that was submitted.
        comm._op.session_serial, comm._op.seq = last_real
        comm._marker = None
        lib.tandem_wait, lib.tandem_op_status = saved["tandem_wait"], saved["tandem_op_status"]

    hot = type(getattr(comm, "_hot", None)).__name__ == "Hot"  # the C fast path (_tandem_fastcall.Hot); absent before it existed
    print(f"backend {comm.backend}, torch {torch.__version__}, {iters} calls x 7 repeats, median ns per call; "
          f"hot-path calls through {'_tandem_fastcall' if _capi.fastcall else 'ctypes'}; fast path in "
          f"{'C (_tandem_fastcall.Hot)' if hot else 'Python'}")
    print("end to end (wall time; includes libtandem and the daemon):")
    for name, ns in results.items():
        base = results[name.split(":")[0] + ": C ABI loop"]
        print(f"  {name:55s} {ns / 1000:8.2f} us   (+{(ns - base) / 1000:6.2f} us over the C loop)")
    print(f"the binding's own work per call (libtandem replaced by no-op C functions; thread CPU time, least of 15 x {n2} calls):")
    for name, ns in alone.items():
        print(f"  {name:55s} {ns / 1000:8.2f} us")
    print(json.dumps({"backend": comm.backend, "torch": torch.__version__, "iters": iters,
                      "fastcall": _capi.fastcall is not None, "c_fast_path": hot,
                      "ns_per_call": {k: round(v) for k, v in results.items()},
                      "binding_alone_cpu_ns_per_call": {k: round(v) for k, v in alone.items()}}))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
