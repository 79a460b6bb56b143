"""The fast path of the GEMM ops, allgather and barrier, and what it shares with the C one (_tandem_fastcall.Hot).

Communicator (_comm.py) inherits FastPath. Its public ops first try self._hot_<op>: the C module's Hot where it is
built, else the Python methods here (TANDEM_NO_FASTCALL=1 keeps them). Both serve the common case (contiguous tensors
of one op dtype, in daemon memory or registered segments of the communicator's device, shapes that fit), checked in
as few tensor attribute reads as possible (each costs 0.1-0.2 us from Python). Anything else returns None, and the
caller takes the full path (_comm.py), which validates argument by argument (raising the ValueError that names the
rule), stages cpu tensors and records into a CUDA graph.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from . import _capi
from ._capi import ARG_STRUCTS
from ._errors import error_for

_DTYPES = {torch.float32: _capi.DTYPE_FP32, torch.float16: _capi.DTYPE_FP16, torch.bfloat16: _capi.DTYPE_BF16}
_ELSIZE: dict = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4}
# The current stream's raw handle without making a torch.cuda.Stream object (what inductor's generated code calls).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# torch.cuda.is_current_stream_capturing without its Python frame (it only calls this).
_capturing_stream = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
# Ops between two completion polls on the cuda backend. The daemon holds a session's completions in its completion
# ring (rings.capacity, 256 by default, at least 8) plus limits.max_pending_completions (4096 by default, at least
# 16) before it closes the session as unresponsive: a poll every 16 ops stays inside even the smallest setting.
_POLL_EVERY = 16
_NO_SLOT = (0, 0, 0, None, 0, 0)
# The ops the C fast path serves, in its order, and each one's argument struct in 8-byte slots (_tandem_fastcall.c
# writes them so: every field of these structs is 8 bytes, the dtype enum with its padding as a little-endian one).
_HOT_OPS = ("gemm_ar", "gemm_rs", "ag_gemm", "allgather", "barrier")
_HOT_SLOTS = {"gemm_ar": 12, "gemm_rs": 12, "ag_gemm": 14, "allgather": 7, "barrier": 2}


def _hot_size(name: str) -> int | None:
    """The struct_size the C fast path passes for `name`: its slots' bytes. The GEMM ops' structs end with `layout`,
    appended after the slots it writes; a struct_size that ends before a field gives the field's default (tandem.h),
    here the "nt" layout, the one layout the fast paths serve. None: the struct does not start with those slots."""
    op, size = _capi.OPS[name], 8 * _HOT_SLOTS[name]
    past = [f for f in op["fields"] if f["offset"] >= size]
    # (past the slots: enums read as 0 and tensors as absent, e.g. the GEMM ops' FP8 scales)
    if op["struct_size"] < size or any(not (f["kind"] == "flag" and f["enum"] or f["kind"] == "tensor") for f in past):
        return None
    return size


_HOT_SIZES = {n: _hot_size(n) for n in _HOT_OPS}
_HOT_FITS = sys.byteorder == "little" and all(v is not None for v in _HOT_SIZES.values())


class _PyHot:
    """What the communicator's paths share with the C fast path where that is not built: the poll count and the
    closed flag."""
    __slots__ = ("since_poll", "closed")

    def __init__(self):
        self.since_poll = 0
        self.closed = False


def _inherited(name: str):
    """torch's C tensor type's descriptor of `name` where torch.Tensor and torch.nn.Parameter both use it as it
    is (the C fast path then calls its function directly), else None (it reads the attribute by name)."""
    base = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase", None)
    d = base.__dict__.get(name) if base is not None else None
    if d is None or any(inspect.getattr_static(c, name, None) is not d for c in (torch.Tensor, torch.nn.Parameter)):
        return None
    return d


_TENSOR_DESCRIPTORS = tuple(_inherited(n) for n in ("shape", "dtype", "is_contiguous", "data_ptr", "nbytes"))


def _raise_status(rc: int):
    """The C fast path's error: the op's status as its exception, with libtandem's message (this thread's)."""
    raise error_for(rc, _capi.last_error())


class FastPath:
    """Communicator's fast-path methods (a mixin: they use the communicator's state and its full-path methods
    _call, _out, _stream, _rows and poll)."""

    def _init_fast_path(self) -> None:
        """Picks the C or the Python fast path and configures it (last in Communicator.__init__)."""
        # The fast path of the GEMM ops, allgather and barrier: one C call each (_tandem_fastcall.Hot) where the
        # module is built, else the Python methods below (_gemm_fast, ...). Either returns None where the full path
        # must decide (it validates argument by argument, stages cpu tensors, records into a CUDA graph).
        # Both backends (the cuda steps checked on an H200 at 1 and 2 ranks, bench/RESULTS.md;
        # TANDEM_NO_FASTCALL=1 keeps the Python path).
        use_c = _capi.Hot is not None and _HOT_FITS
        self._hot = _capi.Hot() if use_c else _PyHot()
        if isinstance(self._hot, _PyHot):
            self._hot_gemm_ar = functools.partial(self._gemm_fast, "gemm_ar")
            self._hot_gemm_rs = functools.partial(self._gemm_fast, "gemm_rs")
            self._hot_ag_gemm, self._hot_allgather = self._ag_gemm_fast, self._allgather_fast
            self._hot_barrier = self._barrier_fast
        else:
            h = self._hot
            self._hot_gemm_ar, self._hot_gemm_rs, self._hot_ag_gemm = h.gemm_ar, h.gemm_rs, h.ag_gemm
            self._hot_allgather, self._hot_barrier = h.allgather, h.barrier
        self._make_plans()

    def _make_plans(self) -> None:
        """Per op, what the fast paths use, in one tuple: (name, pack_into, args buffer, C function address, args
        address, struct size); and the C fast path's configuration (the same addresses). (python/bench/overhead.py
        calls it again after swapping in no-op C functions.)"""
        self._plans = {name: (name, st.pack_into, self._args[name], self._fnaddr[name], self._argaddr[name], st.size)
                       for name, st in ARG_STRUCTS.items()}
        if isinstance(self._hot, _PyHot):
            return
        segs = self.session.segments
        self._hot.configure(
            comm=self.handle, fns=tuple(self._fnaddr[n] for n in _HOT_OPS),
            args=tuple(self._argaddr[n] for n in _HOT_OPS), sizes=tuple(_HOT_SIZES[n] for n in _HOT_OPS),
            op=self._opaddr, wait=self._wait_addr, ptr_attr=segs._get1_addr if segs is not None else 0,
            cuda=self.is_cuda, devidx=self._devidx, rank=self.rank, nranks=self.world_size,
            timeout_ms=self._op_timeout_ms, poll_every=_POLL_EVERY, keep=(self._args, self._op), hits=self._hits,
            resolve=self._resolve_fast, alloc=self._out, poll=self.poll, raise_status=_raise_status,
            raw_stream=_raw_stream, capturing=_capturing_stream, tensor_types=(torch.Tensor, torch.nn.Parameter),
            dtypes=tuple((d, c, _ELSIZE[d]) for d, c in _DTYPES.items()), descriptors=_TENSOR_DESCRIPTORS)
        if self._closed:
            self._hot.closed = True

    def _resolve_fast(self, ptr, nbytes):
        """(buffer, offset, bytes to its end, Segment or None) of [ptr, +nbytes) in daemon memory or a registered
        cuda segment on this communicator's device, then cached; None where the full path must decide (staging, a
        first registration, another device, or an error naming the argument). A Segment entry must pass _live() in
        the op that uses it.

        Why a cached pointer needs no device check: the cache holds only memory of this communicator's device
        (checked here), and a tensor's data pointer lies in its own device's memory (CPU tensors: host memory,
        which is never a daemon buffer of the cuda backend nor a device allocation; on the cpu backend daemon
        buffers are host memory, where no CUDA tensor lies)."""
        session = self.session
        hit = session.lookup(ptr, nbytes)
        if hit is not None:
            if session.span_device(ptr) != self._devidx:
                return None
            e = (hit[0], hit[1], session.span_end(ptr) - ptr, None, 0, 0)
        elif self.is_cuda:
            e = session.segments.entry(ptr, nbytes)
            if e is None or e[3].device != self._devidx:
                return None
        else:
            return None
        if len(self._hits) > 4096:
            self._hits.clear()
        # NOTE: valid until the session forgets a buffer or a registration (both clear every communicator's hits).
        self._hits[ptr] = e
        return e

    def _live(self, sa, sb, sc=None, sd=None) -> bool:
        """cuda: confirms each distinct registered segment among the op's tensors (None: daemon memory, nothing to
        confirm) with one driver query; a dead one drops the cached pointers and sends the op down the full path."""
        live = self.session.segments.live if (sa is not None or sb is not None or sc is not None or
                                               sd is not None) else None
        if live is None:
            return True
        if ((sa is not None and not live(sa)) or
                (sb is not None and sb is not sa and not live(sb)) or
                (sc is not None and sc is not sa and sc is not sb and not live(sc)) or
                (sd is not None and sd is not sa and sd is not sb and sd is not sc and not live(sd))):
            self._hits.clear()
            return False
        return True

    def _go(self, plan, stream: int) -> None:
        """Submits an op whose struct _fast packed (plan: _plans[op]). cpu backend: waits for it."""
        fast = _capi.fastcall
        if fast is None or (stream != 0 and _capturing_stream()):
            self._call(plan[0], stream)
            return
        rc = fast(plan[3], self.handle, plan[4], self._opaddr)
        if rc:
            raise error_for(rc, _capi.last_error())
        if self._devidx >= 0:  # cuda
            hot = self._hot
            hot.since_poll += 1
            if hot.since_poll >= _POLL_EVERY:
                self.poll()
            return
        o = self._op
        rc = fast(self._wait_addr, o.session_serial, o.seq, self._op_timeout_ms)
        if rc:
            raise error_for(rc, _capi.last_error())

    def _gemm_fast(self, op, a, b, out):
        if self._closed:
            return None
        try:
            m, k = a.shape
            n, kb = b.shape
        except (ValueError, AttributeError, TypeError):
            return None
        dtype = a.dtype
        dt = _DTYPES.get(dtype)
        if dt is None or kb != k or b.dtype is not dtype or not a.is_contiguous() or not b.is_contiguous():
            return None
        rows = m if op == "gemm_ar" else self._rows(m)
        if out is None:
            out = self._out((rows, n), dtype)
        elif out.dtype is not dtype or out.shape != (rows, n) or not out.is_contiguous():
            return None
        es = _ELSIZE[dtype]
        hits = self._hits
        pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
        # Seen before: one dict probe each (the cache is cleared whenever a buffer or registration is forgotten).
        ea, eb, ec = hits.get(pa), hits.get(pb), hits.get(pc)
        if ea is None or ea[2] < m * k * es:
            ea = self._resolve_fast(pa, m * k * es)
            if ea is None:
                return None
        if eb is None or eb[2] < n * k * es:
            eb = self._resolve_fast(pb, n * k * es)
            if eb is None:
                return None
        if ec is None or ec[2] < rows * n * es:
            ec = self._resolve_fast(pc, rows * n * es)
            if ec is None:
                return None
        stream = 0
        if self._devidx >= 0:  # cuda
            sa, sb, sc = ea[3], eb[3], ec[3]
            if (sa is not None or sb is not None or sc is not None) and not self._live(sa, sb, sc):
                return None
            stream = _raw_stream(self._devidx) if _raw_stream is not None else self._stream()
        plan = self._plans[op]
        # layout "nt"; no FP8 fields (out_dtype, scaling, a_scale, b_scale)
        plan[1](plan[2], 0, plan[5], dt, m, n, k, ea[0], ea[1], eb[0], eb[1], ec[0], ec[1], stream, 0, 0, 0, 0, 0, 0, 0)
        self._go(plan, stream)
        return out

    def _slot(self, t, nbytes):
        """(buffer, offset, ...) of a tensor, from the pointer cache or _resolve_fast; None: take the full path."""
        ptr = t.data_ptr()
        e = self._hits.get(ptr)
        if e is None or e[2] < nbytes:
            e = self._resolve_fast(ptr, nbytes)
        return e

    def _ag_gemm_fast(self, a, b, out, m, a_gathered):
        if self._closed:
            return None
        try:
            rows, k = a.shape
            n, kb = b.shape
        except (ValueError, AttributeError, TypeError):
            return None
        dtype = a.dtype
        dt = _DTYPES.get(dtype)
        if dt is None or kb != k or b.dtype is not dtype or not a.is_contiguous() or not b.is_contiguous():
            return None
        if m is None:
            if out is None:
                m = rows * self.world_size
            elif out.dim() == 2:
                m = out.shape[0]
            else:
                return None
        if self._rows_cache.get(m) != rows and self._rows(m) != rows:
            return None
        if out is None:
            out = self._out((m, n), dtype)
        elif out.dtype is not dtype or out.shape != (m, n) or not out.is_contiguous():
            return None
        es = _ELSIZE[dtype]
        hits = self._hits
        pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
        ea, eb, ec = hits.get(pa), hits.get(pb), hits.get(pc)
        if ea is None or ea[2] < rows * k * es:
            ea = self._resolve_fast(pa, rows * k * es)
            if ea is None:
                return None
        if eb is None or eb[2] < n * k * es:
            eb = self._resolve_fast(pb, n * k * es)
            if eb is None:
                return None
        if ec is None or ec[2] < m * n * es:
            ec = self._resolve_fast(pc, m * n * es)
            if ec is None:
                return None
        eg = _NO_SLOT
        if a_gathered is not None:
            if a_gathered.dtype is not dtype or a_gathered.shape != (m, k) or not a_gathered.is_contiguous():
                return None
            eg = self._slot(a_gathered, m * k * es)
            if eg is None:
                return None
        stream = 0
        if self._devidx >= 0:  # cuda
            if not self._live(ea[3], eb[3], ec[3], eg[3]):
                return None
            stream = _raw_stream(self._devidx) if _raw_stream is not None else self._stream()
        plan = self._plans["ag_gemm"]
        plan[1](plan[2], 0, plan[5], dt, m, n, k, ea[0], ea[1], eb[0], eb[1], ec[0], ec[1], eg[0], eg[1], stream,
                0, 0, 0, 0, 0, 0, 0)  # layout "nt"; no FP8 fields
        self._go(plan, stream)
        return out

    def _allgather_fast(self, x, out):
        if self._closed or not isinstance(x, torch.Tensor) or not x.is_contiguous():
            return None
        nb = x.nbytes
        world = self.world_size
        if out is None:
            out = self._out((world * x.shape[0], *x.shape[1:]) if x.dim() else (world,), x.dtype)
        elif out.dtype is not x.dtype or not out.is_contiguous() or out.numel() != world * x.numel():
            return None
        ex, eo = self._slot(x, nb), self._slot(out, nb * world)
        if ex is None or eo is None:
            return None
        stream = 0
        if self._devidx >= 0:  # cuda
            if not self._live(ex[3], eo[3]):
                return None
            stream = _raw_stream(self._devidx) if _raw_stream is not None else self._stream()
        plan = self._plans["allgather"]
        plan[1](plan[2], 0, plan[5], ex[0], ex[1], eo[0], eo[1], nb, stream)
        self._go(plan, stream)
        return out

    def _barrier_fast(self):
        if self._closed:
            return None
        stream = self._stream()
        plan = self._plans["barrier"]
        plan[1](plan[2], 0, plan[5], stream)
        self._go(plan, stream)
        return True
