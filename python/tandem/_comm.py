"""tandem.Communicator: its life cycle and the ops on torch tensors (the full path: every argument checked, cpu
tensors staged, CUDA graphs recorded). How it learns its rank and id is in _bootstrap.py; the fast path of the GEMM
ops, allgather and barrier in _fastpath.py."""

from __future__ import annotations

import ctypes
import os
import weakref

import torch

from . import _bootstrap, _capi, _optable
from ._capi import ARG_STRUCTS, C_FUNCTIONS, lib
from ._errors import TandemError, error_for
from ._fastpath import _DTYPES, _ELSIZE, _POLL_EVERY, FastPath, _capturing_stream, _raw_stream
from ._memory import Buffer, HitCache, Session, check

_DTYPE_NAMES = "torch.bfloat16, torch.float16 or torch.float32"
# FP8 inputs of the GEMM ops (tandem_dtype_t codes); not in _DTYPES, so the fast paths leave them to the full path.
_FP8_DTYPES = {torch.float8_e4m3fn: 5, torch.float8_e5m2: 6}

# Communicators by id, so torch.library ops (which take ints, not Python objects) can find theirs. The id carries the
# rank and the size (id = count << 16 | world_size << 8 | rank): a compiled graph holds it as a constant, so graphs
# whose output shapes the fakes took from the rank or the size differ in their code, and torch.compile's on-disk
# caches (shared by every process of a user) never hand one rank's or one world size's graph to another.
_registry: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_next_id = iter(range(1, 1 << 46))


def rows_of(m: int, rank: int, nranks: int) -> tuple[int, int]:
    """The balanced row split every sharded op uses (tandem.h): (first row, row count) of `rank`."""
    base, extra = divmod(m, nranks)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class Communicator(FastPath):
    """One rank's membership of a tandem communicator: the ops below are collective over it.

    Bootstrap (in this order):
    - rank, world_size and unique_id given: used as they are (unique_id: 32 hex digits or 16 bytes).
    - `group` given, or torch.distributed initialised: rank and size of the group (the default group for None);
      rank 0's tandem_get_unique_id() reaches the others through the process group's store.
    - otherwise the environment: RANK and WORLD_SIZE (as torchrun sets them; 0 and 1 if unset), and TANDEM_ID, the
      same 32 hex digits on every rank (`tandemctl new-id`); a single rank needs no TANDEM_ID.
    It connects to the node's tandemd at `socket`, else $TANDEM_SOCKET, else the default path (libtandem's rule).
    cuda backend: the communicator's GPU is `device` (default: torch.cuda.current_device()); every op takes tensors
    on that device and runs on torch.cuda.current_stream(). cpu backend: ops run synchronously on host tensors.

    Not thread-safe across ranks' submission order: ops must be called in the same order on every rank.
    """

    def __init__(self, group=None, *, rank: int | None = None, world_size: int | None = None,
                 unique_id: str | bytes | None = None, socket: str | None = None, device=None,
                 timeout_ms: int = 0, op_timeout_ms: int = -1, workspace_bytes: int = 0):
        self.session = Session.get(socket)
        self.backend = self.session.backend
        self.is_cuda = self.session.is_cuda
        self._op_timeout_ms = int(op_timeout_ms)
        if self.is_cuda:
            index = None if device is None else torch.device("cuda", device).index if isinstance(device, int) \
                else torch.device(device).index
            self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            torch.cuda.set_device(self.device)
            torch.cuda.init()
        else:
            self.device = torch.device("cpu")
        self._devidx = self.device.index if self.is_cuda else -1
        rank, world_size, raw = _bootstrap.membership(group, rank, world_size, unique_id)
        uid = _capi.UniqueId()
        ctypes.memmove(uid.bytes, raw, 16)
        h = ctypes.c_void_p()
        # workspace_bytes: the GPU workspace per rank this rank's largest ops need (tandem_comm_config_t); an op
        # refused for want of workspace names the bytes to ask for. 0: tandemd's cuda.workspace_bytes.
        config = _capi.CommConfig(ctypes.sizeof(_capi.CommConfig), int(workspace_bytes))
        check(lib.tandem_comm_init_config(self.session.handle, ctypes.byref(uid), world_size, rank, int(timeout_ms),
                                          ctypes.byref(config), ctypes.byref(h)))
        self.handle = h.value
        self.rank = lib.tandem_comm_rank(self.handle)
        self.world_size = lib.tandem_comm_nranks(self.handle)
        self.id = next(_next_id) << 16 | self.world_size << 8 | self.rank
        _registry[self.id] = self
        self._closed = False
        # One argument buffer per op kind, packed in place for every call.
        # Zeroed beyond each struct's size: fields a newer tandem.h appends read as 0 (absent) even from a library
        # that ignored struct_size.
        self._args = {name: ctypes.create_string_buffer(s.size + 128) for name, s in ARG_STRUCTS.items()}
        self._argaddr = {name: ctypes.addressof(b) for name, b in self._args.items()}
        self._fn = {name: getattr(lib, cname) for name, cname in C_FUNCTIONS.items()}
        self._fnaddr = {name: _capi.address(f) for name, f in self._fn.items()}
        self._wait_addr = _capi.address(lib.tandem_wait)
        self._op = _capi.Op()
        self._opref = ctypes.byref(self._op)
        self._opaddr = ctypes.addressof(self._op)
        self._pack = {name: st.pack_into for name, st in ARG_STRUCTS.items()}
        self._sizes = {name: st.size for name, st in ARG_STRUCTS.items()}
        self._hits = HitCache()  # data_ptr -> (buffer, offset, bytes to its end, Segment or None, base, buffer id)
        self._rows_cache: dict[int, int] = {}
        self.session.hit_caches[id(self._hits)] = self._hits
        self._staging: Buffer | None = None
        self._staging_tensor: torch.Tensor | None = None
        self._defer: list | None = None  # set by _start while it submits
        self._inflight: Pending | None = None  # a started op whose staged outputs still sit in the staging buffer
        # cuda: ops complete in stream order; their completions are drained (and an op's failure reported) every
        # _POLL_EVERY calls, without waiting, so the session's completion ring never fills (see poll()). The count
        # (since_poll) lives in self._hot, which every path shares: the C fast path's object, or _PyHot.
        self._marker: tuple[int, int] | None = None  # the op the next poll asks about
        self._checked = 0  # seq of the newest op known to have completed
        self._status_addr = _capi.address(lib.tandem_op_status)
        self._cap_op = _capi.Op()  # where ops recorded into a CUDA graph put their tandem_op_t (never waited for)
        self._capref = ctypes.byref(self._cap_op)
        self._capaddr = ctypes.addressof(self._cap_op)
        self._init_fast_path()

    # ---- life cycle
    def close(self) -> None:
        """Leaves the communicator (tandem_comm_destroy): other ranks' later ops fail with PeerLost."""
        if self._closed:
            return
        self._closed = True
        self._hot.closed = True
        _registry.pop(self.id, None)
        self._staging_tensor = None
        self._staging = None
        if os.getpid() == self.session.pid:  # never a forked child's copy of its parent's communicator
            lib.tandem_comm_destroy(self.handle)

    def abort(self) -> None:
        """Aborts the communicator: every rank's pending and future ops fail with tandem.Aborted."""
        check(lib.tandem_comm_abort(self.handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"tandem.Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device})")

    # ---- tensors -> (buffer, offset)
    def _check(self, t, arg: str, op: str, dtype=None, ndim: int | None = None) -> None:
        _check_meta(t, arg, op, dtype, ndim)
        if (t.get_device() != self._devidx) if self.is_cuda else not t.is_cpu:  # (meta tensors say -1 too)
            where = f"on {self.device} (the communicator's GPU)" if self.is_cuda else \
                "on the CPU (tandemd runs the cpu backend)"
            raise ValueError(f"tandem.{op}: argument '{arg}' must be {where}, got a tensor on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"tandem.{op}: argument '{arg}' must be contiguous (row-major); call .contiguous() "
                             "first")

    def _shape(self, t, arg: str, op: str, want: tuple, what: str) -> None:
        if tuple(t.shape) != want:
            raise ValueError(f"tandem.{op}: argument '{arg}' must have shape {list(want)} ({what}), got "
                             f"{list(t.shape)}")

    def _out(self, shape, dtype) -> torch.Tensor:
        """A new output: daemon memory on the cpu backend (no staging needed), PyTorch's allocator on cuda."""
        if self.is_cuda:
            return torch.empty(shape, dtype=dtype, device=self.device)
        n = 1
        for s in shape:
            n *= s
        return Buffer(self.session, n * _capi_elsize(dtype)).tensor(shape, dtype)

    def _resolve(self, tensors, names, op):
        """Slots as (buffer, offset) pairs, flattened. cpu tensors outside daemon memory go through staging:
        returns (slots, staged) with staged = [(tensor, staging view)] to copy back after the op."""
        slots = []
        staged = None
        session = self.session
        for t, arg in zip(tensors, names):
            if t is None or t.numel() == 0:  # (an empty tensor may have no memory at all: data_ptr 0)
                slots += (0, 0)
                continue
            ptr = t.data_ptr()
            nbytes = t.nbytes
            hit = session.lookup(ptr, nbytes)
            if hit is None:
                if self.is_cuda:
                    hit = session.segments.resolve(ptr, nbytes, arg, op)
                else:
                    if staged is None:
                        staged = []
                    staged.append((len(slots), t, arg))
                    slots += (0, 0)
                    continue
            slots += hit
        if staged is None:
            return slots, None
        return self._stage(slots, staged)

    def _stage(self, slots, staged):
        if self._inflight is not None:
            raise RuntimeError(f"tandem.{self._inflight.op}: started and not waited for, and its outputs are staged "
                               "in this communicator's staging buffer; call wait() before the next op")
        need = sum(_align(t.nbytes) for _, t, _ in staged)
        if self._staging is None or self._staging.nbytes < need:
            size = 1 << max(need - 1, 4095).bit_length()
            self._staging_tensor = None
            self._staging = Buffer(self.session, size)
            self._staging_tensor = self._staging.tensor((size,), torch.uint8)
        off = 0
        back = []
        for pos, t, arg in staged:
            view = self._staging_tensor[off:off + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            slots[pos] = self._staging.handle
            slots[pos + 1] = off
            if arg in _OUTPUTS:
                back.append((t, view))
            off += _align(t.nbytes)
        return slots, back

    # ---- submission
    def _submit(self, op: str, fields, staged=None) -> None:
        if self._closed:
            raise ValueError(f"tandem.{op}: this communicator was closed")
        ARG_STRUCTS[op].pack_into(self._args[op], 0, *fields)
        if self._defer is not None:
            self._call(op, self._stream(), wait=False)
            self._defer.append((_capi.Op(self._op.session_serial, self._op.seq), staged))
            return
        self._call(op, self._stream())
        if staged:
            for t, view in staged:
                t.copy_(view)

    def _start(self, op: str, *inputs, **kw) -> "Pending":
        """Submits `op` (the full path, any layout) and returns before it completes: Pending.wait() waits for it and
        returns what the op returns. What runs in between overlaps the op's communication (the layers' weight
        gradients). cpu backend: the op runs in tandemd while this process goes on; its staged outputs are copied
        back by wait(), and no other op of this communicator may be submitted before it. cuda backend: ops are
        asynchronous anyway (the current stream); wait() returns at once."""
        if self._defer is not None:
            raise RuntimeError(f"tandem.{op}: another op was started on this communicator and not waited for")
        self._defer = []
        try:
            out = getattr(self, "_eager_" + op)(*inputs, **kw)
            pending = Pending(self, op, out, self._defer)
            if any(staged for _, staged in self._defer):
                self._inflight = pending
            return pending
        finally:
            self._defer = None

    def _call(self, op: str, stream: int, wait: bool = True) -> None:
        """Submits the packed op; cpu backend: waits for it. Raises the C status's exception.

        cuda: the op is enqueued on `stream` and not waited for; every _POLL_EVERY ops poll() drains the completion
        ring (so it never fills) and reports a failed op. An op recorded into a CUDA graph completes only when the
        graph is replayed, so its tandem_op_t goes to a scratch struct and is never waited for: waiting before the
        first replay would hang. (Capture never runs on the legacy default stream, stream 0, so that common case
        skips the capture query.)"""
        captured = stream != 0 and _capturing_stream()
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._fnaddr[op], self.handle, self._argaddr[op], self._capaddr if captured else self._opaddr)
        else:
            rc = self._fn[op](self.handle, self._argaddr[op], self._capref if captured else self._opref)
        if rc:
            raise error_for(rc, _capi.last_error())
        if self.is_cuda:
            if not captured:
                hot = self._hot
                hot.since_poll += 1
                if hot.since_poll >= _POLL_EVERY:
                    self.poll()
            return
        if not wait:
            return
        o = self._op
        if fast is not None:  # tandem_wait(tandem_op_t by value = two integer registers, timeout)
            rc = fast(self._wait_addr, o.session_serial, o.seq, self._op_timeout_ms)
        else:
            rc = lib.tandem_wait(o, self._op_timeout_ms)
        if rc:
            raise error_for(rc, _capi.last_error())

    def poll(self) -> None:
        """cuda: asks libtandem, without waiting, about one op and raises if it failed (tandem.PeerLost, ...); every
        call also drains the session's completion ring.

        One op per call is enough: a communicator's ops complete in submission order, and on the cuda backend an op
        that fails fails its communicator, so every later op fails too. The op asked about is the newest one at the
        previous poll (the marker): usually done by now, so its success covers every op before it; while it is still
        running it stays the marker. Then the newest op becomes the marker. No per-op list is kept."""
        self._hot.since_poll = 0
        if not self.is_cuda:
            return
        o = self._op
        serial, seq = o.session_serial, o.seq
        if seq == 0 or seq == self._checked:
            return
        marker = self._marker
        if marker is None:
            marker = (serial, seq)
        rc = self._status(marker)
        if rc == _capi.IN_PROGRESS:
            self._marker = marker
            return
        self._marker = None
        if rc != _capi.SUCCESS:
            raise self._failure(marker, rc)
        if marker[1] == seq:
            self._checked = seq
        else:
            self._marker = (serial, seq)

    def _status(self, op) -> int:
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._status_addr, op[0], op[1], 0, 0)
        else:
            rc = lib.tandem_op_status(_capi.Op(*op), None, 0)
        # NOT_FOUND: libtandem keeps the last 65536 results of a session; an op older than that completed long ago
        # (this communicator's failures poison its later ops, which are reported instead).
        return _capi.SUCCESS if rc == _capi.NOT_FOUND else rc

    def _failure(self, op, rc) -> TandemError:
        msg = ctypes.create_string_buffer(1024)
        lib.tandem_op_status(_capi.Op(*op), msg, 1024)
        return error_for(rc, msg.value.decode("utf-8", "replace") or _capi.last_error())

    def synchronize(self) -> None:
        """Waits for every op submitted so far (cuda: also the current stream), raising the first failure."""
        if not self.is_cuda:
            return
        torch.cuda.current_stream(self.device).synchronize()
        o = self._op
        serial, seq = o.session_serial, o.seq
        self._hot.since_poll = 0
        if seq == 0 or seq == self._checked:
            return
        marker, self._marker = self._marker, None
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._wait_addr, serial, seq, self._op_timeout_ms)
        else:
            rc = lib.tandem_wait(o, self._op_timeout_ms)
        if rc == _capi.NOT_FOUND:
            rc = _capi.SUCCESS
        if rc:
            err = error_for(rc, _capi.last_error())
            if marker is not None:  # an older op's failure says more than the later ops it poisoned
                mrc = self._status(marker)
                if mrc not in (_capi.SUCCESS, _capi.IN_PROGRESS):
                    err = self._failure(marker, mrc)
            raise err
        self._checked = seq

    def _stream(self) -> int:
        if not self.is_cuda:
            return 0
        if _raw_stream is not None:
            return _raw_stream(self._devidx)
        return torch.cuda.current_stream(self.device).cuda_stream

    def _rows(self, m: int) -> int:
        r = self._rows_cache.get(m)
        if r is None:
            r = self._rows_cache[m] = rows_of(m, self.rank, self.world_size)[1]
        return r

    # ---- ops (eager; under torch.compile the public functions call the torch.library ops instead)
    # The GEMM ops' checks (module functions below, which the fake implementations share) with this communicator's
    # tensor check: device and contiguity too.
    def _gemm_operands(self, op: str, a, b, layout):
        return _gemm_operands(op, a, b, layout, self._check)

    def _fp8(self, op: str, a, rows: int, n: int, k: int, a_scale, b_scale, out_dtype, scaling):
        return _fp8_args(op, a, rows, n, k, a_scale, b_scale, out_dtype, scaling, self._check)

    def _eager_ag_gemm(self, a, b, *, out=None, m: int | None = None, a_gathered=None, layout="nt", a_scale=None,
                       b_scale=None, out_dtype=None, scaling=None):
        """AllGather + GEMM: C = gather(op(A)) op(b), [m, n] on every rank. A is sharded by rows of op(A): this rank
        holds rows = rows_of(m, rank) of them. layout (the same on every rank; a name or its code):
        - "nt" (0, default): a [rows, k], b [n, k]; C = gather(A) @ b.T (the forward, Y = X W^T);
        - "nn" (1): a [rows, k], b [k, n]; C = gather(A) @ b (the input gradient, dX = dY W);
        - "tn" (2): a [k, rows], b [k, n]; C = gather(A^T) @ b: op(A) = a.T.
        a_gathered, if given ([m, k]), receives every rank's shard as stored, in rank order: gather(A) in "nt" and
        "nn"; in "tn" the shards [k, rows_r] one after another (a_gathered.view(-1)).
        FP8: a and b torch.float8_e4m3fn or torch.float8_e5m2 with fp32 a_scale and b_scale (one value each, or
        block scales a_scale [ceil(k/128), rows], b_scale [ceil(n/128), ceil(k/128)]); the product of the dequantized
        values (value * scale) in fp32, c in out_dtype (torch.bfloat16, the default, or torch.float32)."""
        op = "ag_gemm"
        lay, dt, rows, n, k = self._gemm_operands(op, a, b, layout)
        odt, ocode, scode, a_scale, b_scale = self._fp8(op, a, rows, n, k, a_scale, b_scale, out_dtype, scaling)
        if m is None:
            m = out.shape[0] if out is not None and out.dim() == 2 else rows * self.world_size
        _, want_rows = rows_of(m, self.rank, self.world_size)
        if rows != want_rows:
            want = f"[{k}, {want_rows}]" if lay == _TN else f"[{want_rows}, {k}]"
            raise ValueError(f"tandem.{op}: argument 'a' must have shape {want} (layout {_enum_name(op, lay)!r}: "
                             f"{_optable.SPECS[op].text_of(_optable.SPECS[op].inputs[0], lay)}; rows_of(m={m}, rank "
                             f"{self.rank}, {self.world_size} ranks) = {want_rows}), got {list(a.shape)}; pass m= when "
                             "the shards differ in size")
        if out is None:
            out = self._out((m, n), odt)
        else:
            self._check(out, "out", op, odt)
            self._shape(out, "out", op, (m, n), "[m, n]")
        if a_gathered is not None:
            self._check(a_gathered, "a_gathered", op, a.dtype)
            self._shape(a_gathered, "a_gathered", op, (m, k), "[m, k]" if lay != _TN else
                        "[m, k], holding the shards [k, rows] in rank order")
        slots, staged = self._resolve((a, b, out, a_gathered, a_scale, b_scale),
                                      ("a", "b", "out", "a_gathered", "a_scale", "b_scale"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, m, n, k, *slots[:8], self._stream(), lay, ocode, scode,
                          *slots[8:]), staged)
        return out

    def _gemm_reduce(self, op, a, b, out, layout, a_scale=None, b_scale=None, out_dtype=None, scaling=None):
        fp8 = a_scale is not None or b_scale is not None or out_dtype is not None or scaling is not None
        # (the fast path waits; _start must not)
        if (layout == 0 or layout == "nt") and self._defer is None and not fp8:
            fast = self._gemm_fast(op, a, b, out)
            if fast is not None:
                return fast
        lay, dt, m, n, k = self._gemm_operands(op, a, b, layout)
        odt, ocode, scode, a_scale, b_scale = self._fp8(op, a, m, n, k, a_scale, b_scale, out_dtype, scaling)
        shape = (rows_of(m, self.rank, self.world_size)[1], n) if op == "gemm_rs" else (m, n)
        if out is None:
            out = self._out(shape, odt)
        else:
            self._check(out, "out", op, odt)
            self._shape(out, "out", op, shape, "[rows_of(m, rank), n]" if op == "gemm_rs" else "[m, n]")
        slots, staged = self._resolve((a, b, out, a_scale, b_scale), ("a", "b", "out", "a_scale", "b_scale"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, m, n, k, *slots[:6], self._stream(), lay, ocode, scode,
                          *slots[6:]), staged)
        return out

    def _eager_gemm_rs(self, a, b, *, out=None, layout="nt", a_scale=None, b_scale=None, out_dtype=None,
                       scaling=None):
        """GEMM + ReduceScatter: K is split over the ranks (k: this rank's slice; ranks may differ); returns this
        rank's rows of C = sum over ranks of op(a_r) op(b_r): out [rows_of(m, rank), n]. layout (the same on every
        rank; a name or its code): "nt" (0, default): a [m, k], b [n, k], op(a) op(b) = a @ b.T; "nn" (1): a [m, k],
        b [k, n], a @ b (the input gradient of a column-parallel linear); "tn" (2): a [k, m], b [k, n], a.T @ b.
        FP8 inputs as ag_gemm's (a_scale's rows: m; k: this rank's slice), reduced in fp32."""
        return self._gemm_reduce("gemm_rs", a, b, out, layout, a_scale, b_scale, out_dtype, scaling)

    def _eager_gemm_ar(self, a, b, *, out=None, layout="nt", a_scale=None, b_scale=None, out_dtype=None,
                       scaling=None):
        """GEMM + AllReduce: as gemm_rs, but every rank receives the whole C = sum over ranks of op(a_r) op(b_r),
        [m, n]. layout: "nt" (0, default): a [m, k], b [n, k]; "nn" (1): a [m, k], b [k, n]; "tn" (2): a [k, m],
        b [k, n]. FP8 inputs as gemm_rs's."""
        return self._gemm_reduce("gemm_ar", a, b, out, layout, a_scale, b_scale, out_dtype, scaling)

    def _moe_route(self, op, x, topk_ids, topk_weights, w, wname, wdtype=None):
        self._check(x, "x", op, ndim=2)
        dt = _dtype_code(x, op)
        tokens, hidden = x.shape
        self._check(topk_ids, "topk_ids", op, torch.int32, 2)
        if topk_ids.shape[0] != tokens:
            raise ValueError(f"tandem.{op}: argument 'topk_ids' must have shape [{tokens}, topk] (tokens of 'x'), got "
                             f"{list(topk_ids.shape)}")
        topk = topk_ids.shape[1]
        self._check(topk_weights, "topk_weights", op, torch.float32)
        self._shape(topk_weights, "topk_weights", op, (tokens, topk), "[tokens, topk], as topk_ids")
        self._check(w, wname, op, x.dtype if wdtype is None else wdtype, 3)
        experts = w.shape[0] * self.world_size
        return dt, tokens, hidden, topk, experts

    def _eager_moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, *, capacity: int | None = None, out=None,
                          row_info=None, expert_counts=None, w_scale=None):
        """MoE dispatch + grouped GEMM. x [tokens, hidden]; topk_ids [tokens, topk] int32 (expert ids in
        [0, experts), no repeats in a row); topk_weights [tokens, topk] float32; w [experts/ranks, n_out, hidden]:
        this rank's experts. Returns (out [capacity, n_out], row_info [capacity, 4] int32 = (src_rank, src_token,
        slot, expert), expert_counts [experts/ranks] int32): the rows routed to this rank's experts, grouped by
        local expert, then source rank, token and slot. capacity defaults to tokens * topk * ranks.
        FP8 weights (eager only): w torch.float8_e4m3fn with float32 128 x 128 block scales w_scale
        [experts/ranks, ceil(n_out/128), ceil(hidden/128)] (w[e, o, p] means w[e, o, p] * w_scale[e, o // 128,
        p // 128]), x and out torch.bfloat16; x is quantised to e4m3 per 1 x 128 block on the way, as moe_ffn's
        (tandem.h says exactly how)."""
        op = "moe_dispatch_gemm"
        fp8 = self._moe_fp8_dtype(op, w)
        dt, tokens, hidden, topk, experts = self._moe_route(op, x, topk_ids, topk_weights, w, "w",
                                                            w.dtype if fp8 else None)
        local, n_out = w.shape[0], w.shape[1]
        if w.shape[2] != hidden:
            raise ValueError(f"tandem.{op}: argument 'w' must have shape [experts/ranks, n_out, {hidden}] (hidden of "
                             f"'x'), got {list(w.shape)}")
        hb, nb = -(-hidden // 128), -(-n_out // 128)
        wcode = self._moe_fp8_scales(op, x, w, (("w_scale", w_scale, (local, nb, hb)),))
        if capacity is None:
            capacity = out.shape[0] if out is not None else tokens * topk * self.world_size
        capacity = int(capacity)
        if out is None:
            out = self._out((capacity, n_out), x.dtype)
        else:
            self._check(out, "out", op, x.dtype)
            self._shape(out, "out", op, (capacity, n_out), "[capacity, n_out]")
        if row_info is None:
            row_info = self._out((capacity, 4), torch.int32)
        else:
            self._check(row_info, "row_info", op, torch.int32)
            self._shape(row_info, "row_info", op, (capacity, 4), "[capacity, 4]")
        if expert_counts is None:
            expert_counts = self._out((local,), torch.int32)
        else:
            self._check(expert_counts, "expert_counts", op, torch.int32)
            self._shape(expert_counts, "expert_counts", op, (local,), "[experts/ranks]")
        slots, staged = self._resolve((x, topk_ids, topk_weights, w, out, row_info, expert_counts, w_scale),
                                      ("x", "topk_ids", "topk_weights", "w", "out", "row_info", "expert_counts",
                                       "w_scale"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, tokens, hidden, n_out, experts, topk, capacity, *slots[:14],
                          self._stream(), wcode, *slots[14:16]), staged)
        return out, row_info, expert_counts

    def _eager_moe_ffn(self, x, topk_ids, topk_weights, w1, w2, *, out=None, saved=None, w1_scale=None,
                       w2_scale=None):
        """MoE dispatch + SwiGLU FFN + combine (the whole layer). x [tokens, hidden]; topk_ids, topk_weights as in
        moe_dispatch_gemm; w1 [experts/ranks, 2*ffn, hidden] (gate rows, then up rows); w2 [experts/ranks, hidden,
        ffn]. Returns out [tokens, hidden]: out_t = sum over slots of weight * (silu(x w_gate.T) * (x w_up.T)) w2.T.
        saved (optional, [saved_rows, 2*ffn] in x's dtype): receives the gate|up of every row routed to this rank's
        experts, for moe_ffn_backward(..., saved=saved) to use instead of recomputing it (tandem.h: the rows' order,
        what it costs; an op whose rows exceed saved_rows fails naming the rows needed).
        FP8 weights (forward only, eager only, no saved): w1 and w2 torch.float8_e4m3fn with float32 128 x 128 block
        scales w1_scale [experts/ranks, ceil(2*ffn/128), ceil(hidden/128)] and w2_scale [experts/ranks,
        ceil(hidden/128), ceil(ffn/128)] (w1[e, i, p] means w1[e, i, p] * w1_scale[e, i // 128, p // 128]), x and out
        torch.bfloat16; x and h are quantised to e4m3 per 1 x 128 block on the way (tandem.h says exactly how)."""
        op = "moe_ffn"
        fp8 = self._moe_fp8_dtype(op, w1)
        dt, tokens, hidden, topk, experts = self._moe_route(op, x, topk_ids, topk_weights, w1, "w1",
                                                            w1.dtype if fp8 else None)
        local, two_ffn = w1.shape[0], w1.shape[1]
        if w1.shape[2] != hidden or two_ffn % 2:
            raise ValueError(f"tandem.{op}: argument 'w1' must have shape [experts/ranks, 2*ffn, {hidden}] (hidden of "
                             f"'x'), got {list(w1.shape)}")
        ffn = two_ffn // 2
        self._check(w2, "w2", op, w1.dtype)
        self._shape(w2, "w2", op, (local, hidden, ffn), "[experts/ranks, hidden, ffn]")
        hb, fb, f2b = -(-hidden // 128), -(-ffn // 128), -(-2 * ffn // 128)
        wcode = self._moe_fp8_scales(op, x, w1, (("w1_scale", w1_scale, (local, f2b, hb)),
                                                 ("w2_scale", w2_scale, (local, hb, fb))))
        if out is None:
            out = self._out((tokens, hidden), x.dtype)
        else:
            self._check(out, "out", op, x.dtype)
            self._shape(out, "out", op, (tokens, hidden), "[tokens, hidden], as x")
        saved_rows = 0  # a saved tensor of no rows saves nothing (its slot resolves as absent)
        if saved is not None:
            self._check(saved, "saved", op, x.dtype, ndim=2)
            saved_rows = saved.shape[0]
            self._shape(saved, "saved", op, (saved_rows, 2 * ffn), "[saved_rows, 2*ffn]")
        slots, staged = self._resolve((x, topk_ids, topk_weights, w1, w2, out, saved, w1_scale, w2_scale),
                                      ("x", "topk_ids", "topk_weights", "w1", "w2", "out", "saved", "w1_scale",
                                       "w2_scale"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, tokens, hidden, ffn, experts, topk, *slots[:12], self._stream(),
                          saved_rows, *slots[12:14], wcode, *slots[14:18]), staged)
        return out

    @staticmethod
    def _moe_fp8_dtype(op, w) -> bool:
        """Whether the MoE op's weights w are FP8 (torch.float8_e4m3fn; e5m2 is refused)."""
        fp8 = w.dtype in _FP8_DTYPES
        if fp8 and w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"tandem.{op}: FP8 weights must be torch.float8_e4m3fn, got {w.dtype} (e5m2 is for "
                             "gradients)")
        return fp8

    def _moe_fp8_scales(self, op, x, w, scales) -> int:
        """The MoE ops' weight scales, checked: scales is ((name, tensor or None, block shape), ...). With FP8 weights
        w: bf16 x and float32 block scales of the shapes the op table gives; otherwise no scale at all. Returns
        w_dtype's code (0 without FP8 weights)."""
        if w.dtype not in _FP8_DTYPES:
            for name, t, _ in scales:
                if t is not None:
                    raise ValueError(f"tandem.{op}: argument '{name}' applies to FP8 weights (torch.float8_e4m3fn) "
                                     f"only; the weights are {w.dtype}")
            return 0
        if x.dtype != torch.bfloat16:
            raise ValueError(f"tandem.{op}: FP8 weights need torch.bfloat16 x (and out), got {x.dtype}")
        for name, t, shape in scales:
            if t is None:
                raise ValueError(f"tandem.{op}: argument '{name}' is required with {w.dtype} weights: float32 block "
                                 f"scales {list(shape)} (one per 128 x 128 block of each expert)")
            self._check(t, name, op, torch.float32)
            if tuple(t.shape) != shape:
                per_expert = t.numel() == shape[0]
                raise ValueError(f"tandem.{op}: argument '{name}' must have shape {list(shape)} (one float32 per "
                                 f"128 x 128 block of each expert), got {list(t.shape)}"
                                 + ("; for one scale per expert pass scale.view(-1, 1, 1).expand("
                                    f"{', '.join(map(str, shape))}).contiguous()" if per_expert else ""))
        return _FP8_DTYPES[w.dtype]

    def _eager_ring_attention(self, q, k, v, *, causal: bool = False, scale: float | None = None, out=None,
                              lse=None, return_lse: bool = False, layout: str = "contiguous"):
        """Ring attention over the sequence sharded over the ranks: q [seq, heads, head_dim] and k, v
        [seq, kv_heads, head_dim] for this rank's positions (ranks may differ in seq; seq may be 0; kv_heads divides
        heads: grouped-query attention, query head h reading KV head h // (heads // kv_heads)). Returns
        out [seq, heads, head_dim] =
        softmax(q K.T * scale [+ causal mask]) V over the whole sequence; scale None means 1/sqrt(head_dim).
        layout (the same on every rank) says which global positions this rank's rows are:
        - "contiguous": rank order, after the lower ranks' rows;
        - "zigzag": the sequence is cut into 2n chunks and rank r holds chunk r (its first ceil(seq / 2) rows)
          and chunk 2n-1-r (the rest), which gives every rank a like share of causal work.
        lse (an fp32 [heads, seq] tensor to fill) or return_lse=True: also the log-sum-exp of each row,
        ln sum_j exp(scale * q_i . k_j) over the keys row i sees (what a backward pass or a merge of partial
        attentions needs); the call then returns (out, lse)."""
        op = "ring_attention"
        self._check(q, "q", op, ndim=3)
        dt = _dtype_code(q, op)
        self._check(k, "k", op, q.dtype, ndim=3)
        kv_heads = k.shape[1]  # grouped-query attention: k and v may have fewer heads, dividing q's
        if kv_heads == 0 or q.shape[1] % kv_heads:
            raise ValueError(f"tandem.{op}: k has {kv_heads} heads, which does not divide q's {q.shape[1]}; pass k and "
                             "v with kv_heads heads, kv_heads dividing heads (grouped-query attention)")
        kv_shape = (q.shape[0], kv_heads, q.shape[2])
        self._shape(k, "k", op, kv_shape, "[seq, kv_heads, head_dim], kv_heads dividing q's heads")
        self._check(v, "v", op, q.dtype)
        self._shape(v, "v", op, kv_shape, "[seq, kv_heads, head_dim], as k")
        lay = _enum_code(layout, op)
        if out is None:
            out = self._out(tuple(q.shape), q.dtype)
        else:
            self._check(out, "out", op, q.dtype)
            self._shape(out, "out", op, tuple(q.shape), "[seq, heads, head_dim], as q")
        seq, heads, head_dim = q.shape
        want_lse = return_lse or lse is not None
        if lse is None and return_lse:
            lse = self._out((heads, seq), torch.float32)
        elif lse is not None:
            self._check(lse, "lse", op, torch.float32)
            self._shape(lse, "lse", op, (heads, seq), "[heads, seq] float32")
        slots, staged = self._resolve((q, k, v, out, lse), ("q", "k", "v", "out", "lse"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, seq, heads, head_dim, 1 if causal else 0,
                          0.0 if scale is None else float(scale), *slots[:8], self._stream(), *slots[8:], lay,
                          kv_heads),
                     staged)
        return (out, lse) if want_lse else out

    def _eager_allgather(self, x, *, out=None):
        """AllGather: every rank's x (any dtype, same shape everywhere), concatenated in rank order along dim 0:
        out [ranks * x.shape[0], *x.shape[1:]] (a 0-d x gives [ranks])."""
        op = "allgather"
        self._check(x, "x", op)
        shape = (self.world_size * x.shape[0], *x.shape[1:]) if x.dim() else (self.world_size,)
        if out is None:
            out = self._out(shape, x.dtype)
        else:
            self._check(out, "out", op, x.dtype)
            if out.numel() != self.world_size * x.numel():
                raise ValueError(f"tandem.{op}: argument 'out' must hold ranks * x.numel() = "
                                 f"{self.world_size * x.numel()} elements (e.g. shape {list(shape)}), got shape "
                                 f"{list(out.shape)}")
        slots, staged = self._resolve((x, out), ("x", "out"), op)
        self._submit(op, (ARG_STRUCTS[op].size, *slots, x.nbytes, self._stream()), staged)
        return out

    def _eager_table_op(self, op: str, inputs, kw: dict):
        """Any op of the table, checked, shaped and packed from it alone: the eager path of an op with no hand-written
        one above. inputs: its input tensors in slot order. kw: outputs by keyword (`out` for the first, the others by
        name; None: allocated, an optional one only with return_<name>=True), free dims by name (None: the default),
        flags and scale by field name. Returns the outputs it wrote (the required ones, then the optional ones given or
        asked for): one tensor alone, several as a tuple, none as None."""
        spec = _optable.SPECS[op]
        kw = dict(kw)
        opts = {s.name: kw.pop(s.name) for s in spec.opt_inputs if kw.get(s.name) is not None}
        for s in spec.opt_inputs:
            kw.pop(s.name, None)
        outs = {s: kw.pop(spec.out_name(s), None) for s in spec.outputs}
        want = {s for s in spec.outputs if s.optional and (kw.pop("return_" + s.name, False) or outs[s] is not None)}
        frees = {spec.dim_names[i]: kw.pop(spec.dim_names[i], None) for i in spec.free_dims}
        scal = {f["name"]: kw.pop(f["name"], None) for f in spec.scalars}
        fp8 = {k: kw.pop(k, None) for k in ("a_scale", "b_scale", "out_dtype", "scaling")} if spec.fp8 else {}
        if kw:
            raise TypeError(f"tandem.{op}: unexpected keyword argument(s) {', '.join(sorted(kw))}")
        if len(inputs) != len(spec.inputs):
            raise TypeError(f"tandem.{op}: takes {len(spec.inputs)} tensors ({', '.join(s.name for s in spec.inputs)}),"
                            f" got {len(inputs)}")
        like = raw = None
        for t, s in zip(inputs, spec.inputs):
            # The MoE ops' weights ("w_dtype") take x's dtype here: FP8 weights go through the ops' own eager paths.
            if s.type in ("op_dtype", "w_dtype") and like is not None:
                self._check(t, s.name, op, like.dtype)
            else:
                self._check(t, s.name, op, None if s.type in ("raw", "op_dtype") else s.dtype(None))
            if s.type == "op_dtype" and like is None:
                like = t
            if s.type == "raw" and raw is None:
                raw = t
        dt = _dtype_code(like, op, fp8=spec.fp8) if like is not None else 0
        for s in spec.opt_inputs:
            if s.name in opts:
                self._check(opts[s.name], s.name, op, like.dtype if s.type == "op_dtype" and like is not None
                            else s.dtype(None))
        tensors = {**{s.name: t for s, t in zip(spec.inputs, inputs)}, **opts}
        given = {**tensors, **{s.name: t for s, t in outs.items() if t is not None}}
        lay = _enum_code(scal.get("layout") or 0, op) if spec.transposes else None
        dims, share = spec.bind(given, frees, nranks=lambda: self.world_size, layout=lay)
        for i in spec.free_dims:
            if i not in dims:
                dims[i] = spec.default_dim(i, tensors, dims, self.world_size, layout=lay)
        rank, size = (lambda: self.rank), (lambda: self.world_size)
        for t, s in [*zip(inputs, spec.inputs), *((opts[s.name], s) for s in spec.opt_inputs if s.name in opts)]:
            if s.type != "raw":
                self._shape(t, s.name, op, spec.shape(s, dims, share, rank, size, layout=lay), spec.text_of(s, lay))
        out_dt, codes, scales = like.dtype if like is not None else None, {}, {}
        if spec.fp8:  # a_scale's block shape is [ceil(k/128), rows of A]; b_scale's [ceil(n/128), ceil(k/128)]
            rows = spec.shape(spec.fp8_scales[0], dims, share, rank, size)[1]
            k, n = dims[spec.dim_names.index("k")], dims[spec.dim_names.index("n")]
            out_dt, codes["out_dtype"], codes["scaling"], scales["a_scale"], scales["b_scale"] = self._fp8(
                op, like, rows, n, k, fp8["a_scale"], fp8["b_scale"], fp8["out_dtype"], fp8["scaling"])
        if spec.fp8_weights:  # weights in x's dtype (checked above): w_dtype 0, no scales
            codes["w_dtype"] = 0
        for s in spec.outputs:
            shape = spec.shape(s, dims, share, rank, size, like=raw, layout=lay)
            dtype = (raw.dtype if s.type == "raw" else out_dt if s.type == "out_dtype" else
                     s.dtype(like.dtype if like is not None else None))
            t = outs[s]
            if t is None and (not s.optional or s in want):
                outs[s] = self._out(shape, dtype)
            elif t is not None:
                self._check(t, spec.out_name(s), op, dtype)
                if s.type == "raw":
                    n = 1
                    for x in shape:
                        n *= x
                    if t.numel() != n:
                        raise ValueError(f"tandem.{op}: argument '{spec.out_name(s)}' must hold {n} elements (e.g. "
                                         f"shape {list(shape)}), got shape {list(t.shape)}")
                else:
                    self._shape(t, spec.out_name(s), op, shape, spec.text_of(s, lay))
        ordered = [scales.get(s.name) if s.fp8_scale else tensors.get(s.name) if not s.output else outs[s]
                   for s in spec.slots]
        slots, staged = self._resolve(ordered, [s.name for s in spec.slots], op)
        fields = [ARG_STRUCTS[op].size]
        for f in spec.fields:
            k, i = f["kind"], f["index"]
            if k == "dtype":
                fields.append(dt)
            elif k == "dim":
                fields.append(dims[i])
            elif k == "flag" and f["name"] in codes:  # FP8's out_dtype and scaling
                fields.append(codes[f["name"]])
            elif k == "flag":
                v = scal.get(f["name"])
                fields.append(_enum_code(v if v is not None else 0, op, f["name"]) if f["enum"] else (1 if v else 0))
            elif k == "scale":
                v = scal[f["name"]]
                fields.append(0.0 if v is None else float(v))
            elif k == "tensor":
                fields += slots[2 * i:2 * i + 2]
            else:  # stream
                fields.append(self._stream())
        self._submit(op, fields, staged)
        ret = [outs[s] for s in spec.outputs if not s.optional or s in want]
        return tuple(ret) if len(ret) > 1 else (ret[0] if ret else None)

    def barrier(self) -> None:
        """Completes once every rank reached it (cuda: in stream order on the current stream)."""
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.barrier(self)
        if self._hot_barrier() is None:
            if self._closed:
                raise ValueError("tandem.barrier: this communicator was closed")
            self._barrier_fast()

    # ---- the public ops: eager calls go straight to the C ABI; under torch.compile they become torch.library ops
    # (tandem::<op>, with fake implementations), so graphs hold them whole (fullgraph=True).
    # The fast paths serve the default layout ("nt"); another goes to the full path.
    # FP8 inputs (a_scale, b_scale, out_dtype, scaling) take the full eager path, and the torch.library ops under
    # torch.compile.
    def ag_gemm(self, a, b, *, out=None, m: int | None = None, a_gathered=None, layout="nt", **fp8):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.ag_gemm(self, a, b, out=out, m=m, a_gathered=a_gathered, layout=layout, **fp8)
        if (layout == 0 or layout == "nt") and not fp8:
            r = self._hot_ag_gemm(a, b, out, m, a_gathered)
            if r is not None:
                return r
        return self._eager_ag_gemm(a, b, out=out, m=m, a_gathered=a_gathered, layout=layout, **fp8)

    def gemm_rs(self, a, b, *, out=None, layout="nt", **fp8):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.gemm_rs(self, a, b, out=out, layout=layout, **fp8)
        if (layout == 0 or layout == "nt") and not fp8:
            r = self._hot_gemm_rs(a, b, out)
            if r is not None:
                return r
        return self._eager_gemm_rs(a, b, out=out, layout=layout, **fp8)

    def gemm_ar(self, a, b, *, out=None, layout="nt", **fp8):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.gemm_ar(self, a, b, out=out, layout=layout, **fp8)
        if (layout == 0 or layout == "nt") and not fp8:
            r = self._hot_gemm_ar(a, b, out)
            if r is not None:
                return r
        return self._eager_gemm_ar(a, b, out=out, layout=layout, **fp8)

    def moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, *, capacity: int | None = None, out=None,
                          row_info=None, expert_counts=None, **fp8):
        if _tc._is_compiling_flag or _dynamo_compiling():
            _no_fp8_compiled("moe_dispatch_gemm", fp8)
            return _ops.moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, capacity=capacity, out=out,
                                          row_info=row_info, expert_counts=expert_counts)
        return self._eager_moe_dispatch_gemm(x, topk_ids, topk_weights, w, capacity=capacity, out=out,
                                             row_info=row_info, expert_counts=expert_counts, **fp8)

    def moe_ffn(self, x, topk_ids, topk_weights, w1, w2, *, out=None, saved=None, **fp8):
        if _tc._is_compiling_flag or _dynamo_compiling():
            _no_fp8_compiled("moe_ffn", fp8)
            return _ops.moe_ffn(self, x, topk_ids, topk_weights, w1, w2, out=out, saved=saved)
        return self._eager_moe_ffn(x, topk_ids, topk_weights, w1, w2, out=out, saved=saved, **fp8)

    def ring_attention(self, q, k, v, *, causal: bool = False, scale: float | None = None, out=None, lse=None,
                       return_lse: bool = False, layout: str = "contiguous"):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.ring_attention(self, q, k, v, causal=causal, scale=scale, out=out, lse=lse,
                                       return_lse=return_lse, layout=layout)
        return self._eager_ring_attention(q, k, v, causal=causal, scale=scale, out=out, lse=lse,
                                          return_lse=return_lse, layout=layout)

    def allgather(self, x, *, out=None):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.allgather(self, x, out=out)
        r = self._hot_allgather(x, out)
        if r is not None:
            return r
        return self._eager_allgather(x, out=out)

    for _name in ("ag_gemm", "gemm_rs", "gemm_ar", "moe_dispatch_gemm", "moe_ffn", "ring_attention", "allgather"):
        locals()[_name].__doc__ = locals()["_eager_" + _name].__doc__
    del _name


# Under torch.compile the public methods call the torch.library ops. Dynamo traces `_dynamo_compiling()` as True;
# export's non-strict tracing sets torch.compiler._is_compiling_flag. Together they are what
# torch.compiler.is_compiling() reads, at a third of its cost per eager call (it also asks torch.jit).
import torch.compiler as _tc  # noqa: E402
_dynamo_compiling = torch.compiler.is_dynamo_compiling

from . import _ops  # noqa: E402  (it needs Communicator's module loaded first)


def _table_method(name: str):
    """Communicator.<op> for an op of the table with no hand-written method: the generic eager path, or the
    torch.library op under torch.compile."""
    def method(self, *inputs, **kw):
        if _tc._is_compiling_flag or _dynamo_compiling():
            return _ops.call(name, self, *inputs, **kw)
        return self._eager_table_op(name, inputs, kw)

    spec = _optable.SPECS[name]
    method.__name__ = name
    method.__doc__ = (f"{spec.op['summary']}. Tensors: {', '.join(f'{s.name} {s.shape_text}' for s in spec.inputs)}"
                      f"; returns {', '.join(f'{s.name} {s.shape_text}' for s in spec.outputs) or 'nothing'}.")
    return method


for _name in _optable.SPECS:
    if not hasattr(Communicator, _name):
        setattr(Communicator, _name, _table_method(_name))
del _name


class Pending:
    """An op Communicator._start submitted: wait() waits for it (cpu backend; cuda: nothing to wait for, the
    stream orders it), copies its staged outputs back, and returns what the op returns."""

    def __init__(self, comm: Communicator, op: str, out, ops: list):
        self.comm, self.op, self.out, self._ops = comm, op, out, ops

    def wait(self):
        ops, self._ops = self._ops, []
        if self.comm._inflight is self:
            self.comm._inflight = None
        for o, staged in ops:
            rc = lib.tandem_wait(o, self.comm._op_timeout_ms)
            if rc:
                raise error_for(rc, _capi.last_error())
            for t, view in staged or ():
                t.copy_(view)
        return self.out


def _dtype_code(t, op, fp8: bool = False):
    dt = _DTYPES.get(t.dtype) or (_FP8_DTYPES.get(t.dtype) if fp8 else None)
    if dt is None:
        more = "" if fp8 or t.dtype not in _FP8_DTYPES else " (FP8 inputs are taken by ag_gemm, gemm_rs and gemm_ar)"
        raise ValueError(f"tandem.{op}: dtype {t.dtype} is not supported; use {_DTYPE_NAMES}"
                         f"{' (or torch.float8_e4m3fn, torch.float8_e5m2)' if fp8 else ''}{more}")
    return dt


def _no_fp8_compiled(op: str, fp8: dict) -> None:
    if fp8:
        raise NotImplementedError(f"tandem.{op}: FP8 arguments ({', '.join(sorted(fp8))}) are not taken under "
                                  "torch.compile yet; call it eagerly (torch.compiler.disable)")


def _check_meta(t, arg: str, op: str, dtype=None, ndim: int | None = None) -> None:
    """The checks of Communicator._check that need neither the communicator nor data: type, dtype, rank. The fake
    implementations run them (with the functions below) while tracing, so a bad call fails there as eagerly."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tandem.{op}: argument '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"tandem.{op}: argument '{arg}' must have dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"tandem.{op}: argument '{arg}' must be {ndim}-D, got shape {tuple(t.shape)}")


def _gemm_operands(op: str, a, b, layout, check=_check_meta):
    """The GEMM ops' operands under `layout` (a name or code): (layout code, dtype code, a's rows of op(A), n, k),
    a and b checked (by `check`: Communicator._check eagerly, _check_meta while tracing), b's k against a's."""
    lay = _enum_code(layout, op)
    check(a, "a", op, ndim=2)
    dt = _dtype_code(a, op, fp8=True)
    check(b, "b", op, a.dtype, 2)
    spec = _optable.SPECS[op]
    sa, sb = spec.inputs[0], spec.inputs[1]
    rows, k = (a.shape[1], a.shape[0]) if spec.transposed(sa, lay) else a.shape
    tb = spec.transposed(sb, lay)
    kb, n = b.shape if tb else (b.shape[1], b.shape[0])
    if kb != k:
        want = f"[{k}, n]" if tb else f"[n, {k}]"
        raise ValueError(f"tandem.{op}: argument 'b' must have shape {want} (layout {_enum_name(op, lay)!r}: b is "
                         f"{spec.text_of(sb, lay)}; k = {k} from 'a' {list(a.shape)}, which is "
                         f"{spec.text_of(sa, lay)}), got {list(b.shape)}")
    return lay, dt, rows, n, k


def _fp8_out_dtype(op: str, a, out_dtype):
    """c's torch dtype: out_dtype, checked against a's dtype (FP8: torch.bfloat16, the default, or torch.float32;
    other dtypes: a's own)."""
    if a.dtype not in _FP8_DTYPES:
        if out_dtype is not None and out_dtype != a.dtype:
            raise ValueError(f"tandem.{op}: out_dtype={out_dtype} differs from a's dtype {a.dtype}; only FP8 "
                             "inputs take another output dtype")
        return a.dtype
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"tandem.{op}: out_dtype must be torch.bfloat16 or torch.float32 with {a.dtype} inputs, "
                         f"got {out_dtype}")
    return out_dtype


def _fp8_args(op: str, a, rows: int, n: int, k: int, a_scale, b_scale, out_dtype, scaling, check=_check_meta):
    """The GEMM ops' FP8 arguments, checked: (c's torch dtype, out_dtype code, scaling code, a_scale, b_scale).
    FP8 a and b (torch.float8_e4m3fn, torch.float8_e5m2) need fp32 a_scale and b_scale: one value each (per
    tensor), or block scales a_scale [ceil(k/128), rows] and b_scale [ceil(n/128), ceil(k/128)] (scaling "block",
    the default when either scale is 2-D); c is out_dtype, torch.bfloat16 (default) or torch.float32. Other
    dtypes take none of these (out_dtype may be a's own dtype). check: as _gemm_operands'."""
    if a.dtype not in _FP8_DTYPES:
        for name, v in (("a_scale", a_scale), ("b_scale", b_scale), ("scaling", scaling)):
            if v is not None:
                raise ValueError(f"tandem.{op}: argument '{name}' applies to FP8 inputs (torch.float8_e4m3fn, "
                                 f"torch.float8_e5m2) only; a is {a.dtype}")
        return _fp8_out_dtype(op, a, out_dtype), 0, 0, None, None
    out_dtype = _fp8_out_dtype(op, a, out_dtype)
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t is None:
            raise ValueError(f"tandem.{op}: argument '{name}' is required with {a.dtype} inputs: an fp32 tensor of "
                             "one value (per tensor) or of block scales (see the docstring)")
        check(t, name, op, torch.float32)
    if scaling is None:
        scaling = "block" if a_scale.dim() == 2 or b_scale.dim() == 2 else "tensor"
    code = _enum_code(scaling, op, "scaling")
    kb = -(-k // 128)
    wants = (((kb, rows), f"[ceil(k/128), rows] = [{kb}, {rows}]"), ((-(-n // 128), kb), f"[ceil(n/128), "
             f"ceil(k/128)] = [{-(-n // 128)}, {kb}]")) if code else ((None, "one value"), (None, "one value"))
    for name, t, (shape, text) in zip(("a_scale", "b_scale"), (a_scale, b_scale), wants):
        if (t.numel() != 1) if shape is None else tuple(t.shape) != shape:
            raise ValueError(f"tandem.{op}: argument '{name}' must hold {text} (scaling "
                             f"{'block' if code else 'tensor'!r}), got shape {list(t.shape)}")
    return out_dtype, _DTYPES[out_dtype], code, a_scale, b_scale


def _capi_elsize(dtype) -> int:
    s = _ELSIZE.get(dtype)
    if s is None:
        s = _ELSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return s


_OUTPUTS = _optable.OUTPUT_NAMES


def _enum_code(value, op: str, field: str = "layout") -> int:
    """An enum field's code (ring attention's layout, the GEMM ops' layout) from its name, as the library's op table
    lists them (case-insensitive); a code passes through (the torch.library ops carry codes)."""
    codes = _capi.ENUMS[op][field]
    if isinstance(value, int) and not isinstance(value, bool):
        if value in codes.values():
            return value
    elif isinstance(value, str):
        code = codes.get(value.lower())
        if code is not None:
            return code
    names = [f"{name!r} ({code})" for name, code in codes.items()]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    raise ValueError(f"tandem.{op}: argument '{field}' must be {listed}, got {value!r}")


def _enum_name(op: str, code: int, field: str = "layout") -> str:
    return next((name for name, c in _capi.ENUMS[op][field].items() if c == code), str(code))


_TN = _capi.ENUMS.get("ag_gemm", {}).get("layout", {}).get("tn", 2)


def _align(n: int) -> int:
    return (n + 255) & ~255
