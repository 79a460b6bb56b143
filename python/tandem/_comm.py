"""tandem.Communicator: bootstrap, and the ops on torch tensors."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch

from . import _capi
from ._capi import ARG_STRUCTS, C_FUNCTIONS, lib
from ._errors import TandemError, error_for
from ._memory import Buffer, HitCache, Session, check

_DTYPES = {torch.float32: _capi.DTYPE_FP32, torch.float16: _capi.DTYPE_FP16, torch.bfloat16: _capi.DTYPE_BF16}
_DTYPE_NAMES = "torch.bfloat16, torch.float16 or torch.float32"

# Communicators by id, so torch.library ops (which take ints, not Python objects) can find theirs.
_registry: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_next_id = iter(range(1, 1 << 62))
_store_counters: dict[str, int] = {}
_store_lock = threading.Lock()


def rows_of(m: int, rank: int, nranks: int) -> tuple[int, int]:
    """The balanced row split every sharded op uses (tandem.h): (first row, row count) of `rank`."""
    base, extra = divmod(m, nranks)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _parse_id(text: str) -> bytes:
    t = text.strip().lower()
    if t.startswith("0x"):
        t = t[2:]
    try:
        raw = bytes.fromhex(t)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"tandem: TANDEM_ID must be 32 hex digits (from `tandemctl new-id` or tandem.new_id()), got "
                         f"{text!r}")
    return raw


def new_id() -> str:
    """A fresh communicator id (tandem_get_unique_id) as 32 hex digits, for TANDEM_ID."""
    uid = _capi.UniqueId()
    check(lib.tandem_get_unique_id(ctypes.byref(uid)))
    return bytes(uid.bytes).hex()


class Communicator:
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
                 timeout_ms: int = 0, op_timeout_ms: int = -1):
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
        rank, world_size, raw = self._bootstrap(group, rank, world_size, unique_id)
        uid = _capi.UniqueId()
        ctypes.memmove(uid.bytes, raw, 16)
        h = ctypes.c_void_p()
        check(lib.tandem_comm_init(self.session.handle, ctypes.byref(uid), world_size, rank, int(timeout_ms),
                                   ctypes.byref(h)))
        self.handle = h.value
        self.rank = lib.tandem_comm_rank(self.handle)
        self.world_size = lib.tandem_comm_nranks(self.handle)
        self.id = next(_next_id)
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
        self._hits = HitCache()  # data_ptr -> (buffer, offset, bytes to its end), for daemon memory
        self._rows_cache: dict[int, int] = {}
        self.session.hit_caches[id(self._hits)] = self._hits
        self._staging: Buffer | None = None
        self._staging_tensor: torch.Tensor | None = None
        # cuda: ops complete in stream order; their completions are drained (and an op's failure reported) a few
        # calls later, without waiting, so the session's completion ring never fills.
        self._inflight: list[tuple[int, int]] = []

    # ---- bootstrap
    def _bootstrap(self, group, rank, world_size, unique_id):
        if unique_id is not None:
            raw = unique_id if isinstance(unique_id, bytes) else _parse_id(unique_id)
            if rank is None or world_size is None:
                raise ValueError("tandem.Communicator: unique_id needs rank and world_size too")
            return int(rank), int(world_size), raw
        import torch.distributed as dist
        if group is not None or (dist.is_available() and dist.is_initialized()):
            return self._from_store(group)
        rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
        env = os.environ.get("TANDEM_ID")
        if env:
            return rank, world_size, _parse_id(env)
        if world_size == 1:
            return rank, world_size, bytes.fromhex(new_id())
        raise ValueError(
            f"tandem.Communicator: rank {rank} of {world_size} needs the communicator's id: set TANDEM_ID to the "
            "same 32 hex digits on every rank (tandemctl new-id), or call torch.distributed.init_process_group() "
            "first (the id then travels through its store), or pass unique_id=, rank= and world_size=")

    def _from_store(self, group):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        if group is None:
            group = c10d._get_default_group()
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        store = c10d._get_default_store()
        name = getattr(group, "group_name", None) or "default"
        with _store_lock:  # every rank creates its communicators of a group in the same order: same key
            n = _store_counters.get(name, 0)
            _store_counters[name] = n + 1
        key = f"tandem/unique_id/{name}/{n}"
        if rank == 0:
            raw = bytes.fromhex(new_id())
            store.set(key, raw.hex())
        else:
            raw = bytes.fromhex(store.get(key).decode())
        return rank, world_size, raw

    # ---- life cycle
    def close(self) -> None:
        """Leaves the communicator (tandem_comm_destroy): other ranks' later ops fail with PeerLost."""
        if self._closed:
            return
        self._closed = True
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
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tandem.{op}: argument '{arg}' must be a torch.Tensor, got {type(t).__name__}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"tandem.{op}: argument '{arg}' must have dtype {dtype}, got {t.dtype}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"tandem.{op}: argument '{arg}' must be {ndim}-D, got shape {tuple(t.shape)}")
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
            if t is None:
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
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._fnaddr[op], self.handle, self._argaddr[op], self._opaddr)
        else:
            rc = self._fn[op](self.handle, self._argaddr[op], self._opref)
        if rc:
            raise error_for(rc, _capi.last_error())
        if self.is_cuda:
            self._track()
            return
        o = self._op
        if fast is not None:
            rc = fast(self._wait_addr, o.session_serial, o.seq, self._op_timeout_ms)
        else:
            rc = lib.tandem_wait(o, self._op_timeout_ms)
        if rc:
            raise error_for(rc, _capi.last_error())
        if staged:
            for t, view in staged:
                t.copy_(view)

    def _track(self) -> None:
        """cuda: remembers the op; every 32 ops, asks (without waiting) about the older ones, which drains the
        completion ring and raises the first failure an op reported. An op recorded into a CUDA graph is not
        remembered: it completes only when the graph is first replayed, so waiting for it before would hang."""
        op = self._op
        # Capture happens on a side stream (torch.cuda.graph's own), so the common default stream skips the query.
        if _raw_stream is not None and _raw_stream(self._devidx) != 0 and torch.cuda.is_current_stream_capturing():
            return
        self._inflight.append((op.session_serial, op.seq))
        if len(self._inflight) < 64:
            return
        self.poll(keep=32)

    def poll(self, keep: int = 0) -> None:
        """cuda: checks the ops submitted so far, except the newest `keep`, without waiting; raises the first one
        that failed (tandem.PeerLost, ...). Ops still running stay tracked."""
        pending = []
        old, self._inflight = self._inflight[:len(self._inflight) - keep], self._inflight[len(self._inflight) - keep:]
        err = None
        for serial, seq in old:
            rc = lib.tandem_op_status(_capi.Op(serial, seq), None, 0)
            if rc == _capi.IN_PROGRESS:
                pending.append((serial, seq))
            elif rc != _capi.SUCCESS and err is None:
                msg = ctypes.create_string_buffer(1024)
                lib.tandem_op_status(_capi.Op(serial, seq), msg, 1024)
                err = error_for(rc, msg.value.decode("utf-8", "replace"))
        self._inflight = pending + self._inflight
        if err is not None:
            raise err

    def synchronize(self) -> None:
        """Waits for every op submitted so far (cuda: also the current stream), raising the first failure."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
            for serial, seq in self._inflight:
                rc = lib.tandem_wait(_capi.Op(serial, seq), self._op_timeout_ms)
                if rc:
                    self._inflight = []
                    raise error_for(rc, _capi.last_error())
            self._inflight = []

    def _stream(self) -> int:
        if not self.is_cuda:
            return 0
        if _raw_stream is not None:
            return _raw_stream(self._devidx)
        return torch.cuda.current_stream(self.device).cuda_stream

    # ---- the fast path of the GEMM ops: the common case (contiguous tensors of one op dtype on the right device,
    # in daemon memory or registered segments, shapes that fit) checked in as few tensor-attribute reads as
    # possible. Anything else returns None, and the caller takes the full path, which validates argument by
    # argument (raising the ValueError that names the rule) and stages cpu tensors.
    def _resolve_fast(self, ptr, nbytes):
        """(buffer, offset, ...) of [ptr, +nbytes) in daemon memory (then cached) or a registered cuda segment;
        None where the full path must decide (staging, a first registration, or an error naming the argument)."""
        hit = self.session.lookup(ptr, nbytes)
        if hit is not None:
            if len(self._hits) > 4096:
                self._hits.clear()
            # NOTE: valid until the session forgets a buffer (remove_span clears every communicator's hits).
            e = self._hits[ptr] = (hit[0], hit[1], self.session.span_end(ptr) - ptr)
            return e
        if self.is_cuda:
            return self.session.segments.resolve_known(ptr, nbytes)
        return None

    def _gemm_fast(self, op, a, b, out):
        try:
            m, k = a.shape
            n, kb = b.shape
        except (ValueError, AttributeError, TypeError):
            return None
        dtype = a.dtype
        dt = _DTYPES.get(dtype)
        if dt is None or kb != k or b.dtype is not dtype or not a.is_contiguous() or not b.is_contiguous():
            return None
        cuda = self.is_cuda
        if cuda:
            if a.get_device() != self._devidx or b.get_device() != self._devidx:
                return None
        elif not (a.is_cpu and b.is_cpu):
            return None
        rows = m if op == "gemm_ar" else self._rows(m)
        if out is None:
            out = self._out((rows, n), dtype)
        elif (out.dtype is not dtype or out.shape != (rows, n) or not out.is_contiguous() or
              (out.get_device() != self._devidx if cuda else not out.is_cpu)):
            return None
        es = _ELSIZE[dtype]
        hits = self._hits
        pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
        # Daemon memory seen before: one dict probe each (the cache is cleared whenever a buffer is forgotten).
        ea, eb, ec = hits.get(pa), hits.get(pb), hits.get(pc)
        if ea is None or ea[2] < m * k * es:
            ea = self._resolve_fast(pa, m * k * es)
        if eb is None or eb[2] < n * k * es:
            eb = self._resolve_fast(pb, n * k * es)
        if ec is None or ec[2] < rows * n * es:
            ec = self._resolve_fast(pc, rows * n * es)
        if ea is None or eb is None or ec is None:
            return None
        args = self._args[op]
        self._pack[op](args, 0, self._sizes[op], dt, m, n, k, ea[0], ea[1], eb[0], eb[1], ec[0], ec[1],
                       _raw_stream(self._devidx) if cuda and _raw_stream is not None else self._stream())
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._fnaddr[op], self.handle, self._argaddr[op], self._opaddr)
        else:
            rc = self._fn[op](self.handle, self._argaddr[op], self._opref)
        if rc:
            raise error_for(rc, _capi.last_error())
        if cuda:
            self._track()
            return out
        o = self._op
        if fast is not None:  # tandem_wait(tandem_op_t by value = two integer registers, timeout)
            rc = fast(self._wait_addr, o.session_serial, o.seq, self._op_timeout_ms)
        else:
            rc = lib.tandem_wait(o, self._op_timeout_ms)
        if rc:
            raise error_for(rc, _capi.last_error())
        return out

    def _slot(self, t, nbytes):
        """(buffer, offset, ...) of a tensor, from the pointer cache or _resolve_fast; None: take the full path."""
        ptr = t.data_ptr()
        e = self._hits.get(ptr)
        if e is None or e[2] < nbytes:
            e = self._resolve_fast(ptr, nbytes)
        return e

    def _ag_gemm_fast(self, a, b, out, m, a_gathered):
        try:
            rows, k = a.shape
            n, kb = b.shape
        except (ValueError, AttributeError, TypeError):
            return None
        dtype = a.dtype
        dt = _DTYPES.get(dtype)
        if dt is None or kb != k or b.dtype is not dtype or not a.is_contiguous() or not b.is_contiguous():
            return None
        cuda = self.is_cuda
        if cuda:
            if a.get_device() != self._devidx or b.get_device() != self._devidx:
                return None
        elif not (a.is_cpu and b.is_cpu):
            return None
        if m is None:
            if out is None:
                m = rows * self.world_size
            elif out.dim() == 2:
                m = out.shape[0]
            else:
                return None
        if self._rows(m) != rows:
            return None
        if out is None:
            out = self._out((m, n), dtype)
        elif (out.dtype is not dtype or out.shape != (m, n) or not out.is_contiguous() or
              (out.get_device() != self._devidx if cuda else not out.is_cpu)):
            return None
        es = _ELSIZE[dtype]
        ea, eb, ec = self._slot(a, rows * k * es), self._slot(b, n * k * es), self._slot(out, m * n * es)
        if ea is None or eb is None or ec is None:
            return None
        eg = (0, 0)
        if a_gathered is not None:
            if (a_gathered.dtype is not dtype or a_gathered.shape != (m, k) or not a_gathered.is_contiguous() or
                    (a_gathered.get_device() != self._devidx if cuda else not a_gathered.is_cpu)):
                return None
            eg = self._slot(a_gathered, m * k * es)
            if eg is None:
                return None
        self._pack["ag_gemm"](self._args["ag_gemm"], 0, self._sizes["ag_gemm"], dt, m, n, k, ea[0], ea[1], eb[0],
                              eb[1], ec[0], ec[1], eg[0], eg[1], self._stream())
        self._call("ag_gemm")
        return out

    def _allgather_fast(self, x, out):
        if not x.is_contiguous() or (x.get_device() != self._devidx if self.is_cuda else not x.is_cpu):
            return None
        nb = x.nbytes
        world = self.world_size
        if out is None:
            out = self._out((world * x.shape[0], *x.shape[1:]) if x.dim() else (world,), x.dtype)
        elif (out.dtype is not x.dtype or not out.is_contiguous() or out.numel() != world * x.numel() or
              (out.get_device() != self._devidx if self.is_cuda else not out.is_cpu)):
            return None
        ex, eo = self._slot(x, nb), self._slot(out, nb * world)
        if ex is None or eo is None:
            return None
        self._pack["allgather"](self._args["allgather"], 0, self._sizes["allgather"], ex[0], ex[1], eo[0], eo[1], nb,
                                self._stream())
        self._call("allgather")
        return out

    def _call(self, op) -> None:
        """Submits the packed op; cpu backend: waits for it. Raises the C status's exception."""
        fast = _capi.fastcall
        if fast is not None:
            rc = fast(self._fnaddr[op], self.handle, self._argaddr[op], self._opaddr)
        else:
            rc = self._fn[op](self.handle, self._argaddr[op], self._opref)
        if rc:
            raise error_for(rc, _capi.last_error())
        if self.is_cuda:
            self._track()
            return
        o = self._op
        if fast is not None:  # tandem_wait(tandem_op_t by value = two integer registers, timeout)
            rc = fast(self._wait_addr, o.session_serial, o.seq, self._op_timeout_ms)
        else:
            rc = lib.tandem_wait(o, self._op_timeout_ms)
        if rc:
            raise error_for(rc, _capi.last_error())

    def _rows(self, m: int) -> int:
        r = self._rows_cache.get(m)
        if r is None:
            r = self._rows_cache[m] = rows_of(m, self.rank, self.world_size)[1]
        return r

    # ---- ops (eager; under torch.compile the public functions call the torch.library ops instead)
    def _eager_ag_gemm(self, a, b, *, out=None, m: int | None = None, a_gathered=None):
        """AllGather + GEMM: a [rows, k] is this rank's row shard of A [m, k] (rows = rows_of(m, rank)), b [n, k];
        returns out = gather(A) @ b.T, [m, n] on every rank. a_gathered, if given, receives A [m, k]."""
        op = "ag_gemm"
        self._check(a, "a", op, ndim=2)
        dt = _dtype_code(a, op)
        self._check(b, "b", op, a.dtype, 2)
        rows, k = a.shape
        n = b.shape[0]
        if b.shape[1] != k:
            raise ValueError(f"tandem.{op}: argument 'b' must have shape [n, {k}] (k of 'a'), got {list(b.shape)}")
        if m is None:
            m = out.shape[0] if out is not None and out.dim() == 2 else rows * self.world_size
        _, want_rows = rows_of(m, self.rank, self.world_size)
        if rows != want_rows:
            raise ValueError(f"tandem.{op}: argument 'a' must have {want_rows} rows (rows_of(m={m}, rank {self.rank}, "
                             f"{self.world_size} ranks)), got {rows}; pass m= when the shards differ in size")
        if out is None:
            out = self._out((m, n), a.dtype)
        else:
            self._check(out, "out", op, a.dtype)
            self._shape(out, "out", op, (m, n), "[m, n]")
        if a_gathered is not None:
            self._check(a_gathered, "a_gathered", op, a.dtype)
            self._shape(a_gathered, "a_gathered", op, (m, k), "[m, k]")
        slots, staged = self._resolve((a, b, out, a_gathered), ("a", "b", "out", "a_gathered"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, m, n, k, *slots, self._stream()), staged)
        return out

    def _gemm_reduce(self, op, a, b, out):
        if not self._closed:
            fast = self._gemm_fast(op, a, b, out)
            if fast is not None:
                return fast
        self._check(a, "a", op, ndim=2)
        dt = _dtype_code(a, op)
        self._check(b, "b", op, a.dtype, 2)
        m, k = a.shape
        n = b.shape[0]
        if b.shape[1] != k:
            raise ValueError(f"tandem.{op}: argument 'b' must have shape [n, {k}] (this rank's k slice, as 'a'), "
                             f"got {list(b.shape)}")
        shape = (rows_of(m, self.rank, self.world_size)[1], n) if op == "gemm_rs" else (m, n)
        if out is None:
            out = self._out(shape, a.dtype)
        else:
            self._check(out, "out", op, a.dtype)
            self._shape(out, "out", op, shape, "[rows_of(m, rank), n]" if op == "gemm_rs" else "[m, n]")
        slots, staged = self._resolve((a, b, out), ("a", "b", "out"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, m, n, k, *slots, self._stream()), staged)
        return out

    def _eager_gemm_rs(self, a, b, *, out=None):
        """GEMM + ReduceScatter: a [m, k_r], b [n, k_r] (this rank's K slice); returns this rank's rows of
        C = sum over ranks of a_r @ b_r.T: out [rows_of(m, rank), n]."""
        return self._gemm_reduce("gemm_rs", a, b, out)

    def _eager_gemm_ar(self, a, b, *, out=None):
        """GEMM + AllReduce: a [m, k_r], b [n, k_r]; returns C = sum over ranks of a_r @ b_r.T, [m, n], everywhere."""
        return self._gemm_reduce("gemm_ar", a, b, out)

    def _moe_route(self, op, x, topk_ids, topk_weights, w, wname):
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
        self._check(w, wname, op, x.dtype, 3)
        experts = w.shape[0] * self.world_size
        return dt, tokens, hidden, topk, experts

    def _eager_moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, *, capacity: int | None = None, out=None,
                          row_info=None, expert_counts=None):
        """MoE dispatch + grouped GEMM. x [tokens, hidden]; topk_ids [tokens, topk] int32 (expert ids in
        [0, experts), no repeats in a row); topk_weights [tokens, topk] float32; w [experts/ranks, n_out, hidden]:
        this rank's experts. Returns (out [capacity, n_out], row_info [capacity, 4] int32 = (src_rank, src_token,
        slot, expert), expert_counts [experts/ranks] int32): the rows routed to this rank's experts, grouped by
        local expert, then source rank, token and slot. capacity defaults to tokens * topk * ranks."""
        op = "moe_dispatch_gemm"
        dt, tokens, hidden, topk, experts = self._moe_route(op, x, topk_ids, topk_weights, w, "w")
        local, n_out = w.shape[0], w.shape[1]
        if w.shape[2] != hidden:
            raise ValueError(f"tandem.{op}: argument 'w' must have shape [experts/ranks, n_out, {hidden}] (hidden of "
                             f"'x'), got {list(w.shape)}")
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
        slots, staged = self._resolve((x, topk_ids, topk_weights, w, out, row_info, expert_counts),
                                      ("x", "topk_ids", "topk_weights", "w", "out", "row_info", "expert_counts"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, tokens, hidden, n_out, experts, topk, capacity, *slots,
                          self._stream()), staged)
        return out, row_info, expert_counts

    def _eager_moe_ffn(self, x, topk_ids, topk_weights, w1, w2, *, out=None):
        """MoE dispatch + SwiGLU FFN + combine (the whole layer). x [tokens, hidden]; topk_ids, topk_weights as in
        moe_dispatch_gemm; w1 [experts/ranks, 2*ffn, hidden] (gate rows, then up rows); w2 [experts/ranks, hidden,
        ffn]. Returns out [tokens, hidden]: out_t = sum over slots of weight * (silu(x w_gate.T) * (x w_up.T)) w2.T."""
        op = "moe_ffn"
        dt, tokens, hidden, topk, experts = self._moe_route(op, x, topk_ids, topk_weights, w1, "w1")
        local, two_ffn = w1.shape[0], w1.shape[1]
        if w1.shape[2] != hidden or two_ffn % 2:
            raise ValueError(f"tandem.{op}: argument 'w1' must have shape [experts/ranks, 2*ffn, {hidden}] (hidden of "
                             f"'x'), got {list(w1.shape)}")
        ffn = two_ffn // 2
        self._check(w2, "w2", op, x.dtype)
        self._shape(w2, "w2", op, (local, hidden, ffn), "[experts/ranks, hidden, ffn]")
        if out is None:
            out = self._out((tokens, hidden), x.dtype)
        else:
            self._check(out, "out", op, x.dtype)
            self._shape(out, "out", op, (tokens, hidden), "[tokens, hidden], as x")
        slots, staged = self._resolve((x, topk_ids, topk_weights, w1, w2, out),
                                      ("x", "topk_ids", "topk_weights", "w1", "w2", "out"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, tokens, hidden, ffn, experts, topk, *slots, self._stream()),
                     staged)
        return out

    def _eager_ring_attention(self, q, k, v, *, causal: bool = False, scale: float | None = None, out=None):
        """Ring attention over the sequence sharded in rank order: q, k, v [seq, heads, head_dim] for this rank's
        positions (ranks may differ; they follow the lower ranks'). Returns out [seq, heads, head_dim] =
        softmax(q K.T * scale [+ causal mask]) V over the whole sequence; scale None means 1/sqrt(head_dim)."""
        op = "ring_attention"
        self._check(q, "q", op, ndim=3)
        dt = _dtype_code(q, op)
        self._check(k, "k", op, q.dtype)
        self._shape(k, "k", op, tuple(q.shape), "[seq, heads, head_dim], as q")
        self._check(v, "v", op, q.dtype)
        self._shape(v, "v", op, tuple(q.shape), "[seq, heads, head_dim], as q")
        if out is None:
            out = self._out(tuple(q.shape), q.dtype)
        else:
            self._check(out, "out", op, q.dtype)
            self._shape(out, "out", op, tuple(q.shape), "[seq, heads, head_dim], as q")
        seq, heads, head_dim = q.shape
        slots, staged = self._resolve((q, k, v, out), ("q", "k", "v", "out"), op)
        self._submit(op, (ARG_STRUCTS[op].size, dt, seq, heads, head_dim, 1 if causal else 0,
                          0.0 if scale is None else float(scale), *slots, self._stream()), staged)
        return out

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

    def barrier(self) -> None:
        """Completes once every rank reached it (cuda: in stream order on the current stream)."""
        if _compiling():
            return _ops.barrier(self)
        self._submit("barrier", (ARG_STRUCTS["barrier"].size, self._stream()))

    # ---- the public ops: eager calls go straight to the C ABI; under torch.compile they become torch.library ops
    # (tandem::<op>, with fake implementations), so graphs hold them whole (fullgraph=True).
    def ag_gemm(self, a, b, *, out=None, m: int | None = None, a_gathered=None):
        if _compiling():
            return _ops.ag_gemm(self, a, b, out=out, m=m, a_gathered=a_gathered)
        if not self._closed:
            r = self._ag_gemm_fast(a, b, out, m, a_gathered)
            if r is not None:
                return r
        return self._eager_ag_gemm(a, b, out=out, m=m, a_gathered=a_gathered)

    def gemm_rs(self, a, b, *, out=None):
        if _compiling():
            return _ops.gemm_rs(self, a, b, out=out)
        if not self._closed:
            r = self._gemm_fast("gemm_rs", a, b, out)
            if r is not None:
                return r
        return self._eager_gemm_rs(a, b, out=out)

    def gemm_ar(self, a, b, *, out=None):
        if _compiling():
            return _ops.gemm_ar(self, a, b, out=out)
        if not self._closed:
            r = self._gemm_fast("gemm_ar", a, b, out)
            if r is not None:
                return r
        return self._eager_gemm_ar(a, b, out=out)

    def moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, *, capacity: int | None = None, out=None,
                          row_info=None, expert_counts=None):
        if _compiling():
            return _ops.moe_dispatch_gemm(self, x, topk_ids, topk_weights, w, capacity=capacity, out=out,
                                          row_info=row_info, expert_counts=expert_counts)
        return self._eager_moe_dispatch_gemm(x, topk_ids, topk_weights, w, capacity=capacity, out=out,
                                             row_info=row_info, expert_counts=expert_counts)

    def moe_ffn(self, x, topk_ids, topk_weights, w1, w2, *, out=None):
        if _compiling():
            return _ops.moe_ffn(self, x, topk_ids, topk_weights, w1, w2, out=out)
        return self._eager_moe_ffn(x, topk_ids, topk_weights, w1, w2, out=out)

    def ring_attention(self, q, k, v, *, causal: bool = False, scale: float | None = None, out=None):
        if _compiling():
            return _ops.ring_attention(self, q, k, v, causal=causal, scale=scale, out=out)
        return self._eager_ring_attention(q, k, v, causal=causal, scale=scale, out=out)

    def allgather(self, x, *, out=None):
        if _compiling():
            return _ops.allgather(self, x, out=out)
        if not self._closed and isinstance(x, torch.Tensor):
            r = self._allgather_fast(x, out)
            if r is not None:
                return r
        return self._eager_allgather(x, out=out)

    for _name in ("ag_gemm", "gemm_rs", "gemm_ar", "moe_dispatch_gemm", "moe_ffn", "ring_attention", "allgather"):
        locals()[_name].__doc__ = locals()["_eager_" + _name].__doc__
    del _name


_compiling = torch.compiler.is_compiling
from . import _ops  # noqa: E402  (it needs Communicator's module loaded first)


def _dtype_code(t, op):
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        raise ValueError(f"tandem.{op}: dtype {t.dtype} is not supported; use {_DTYPE_NAMES}")
    return dt


_ELSIZE: dict = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4}
# The current stream's raw handle without making a torch.cuda.Stream object (what inductor's generated code calls).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _capi_elsize(dtype) -> int:
    s = _ELSIZE.get(dtype)
    if s is None:
        s = _ELSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return s


_OUTPUTS = frozenset(("out", "a_gathered", "row_info", "expert_counts"))


def _align(n: int) -> int:
    return (n + 255) & ~255
