"""Sessions, daemon memory (tandem.empty, DLPack) and the registration of PyTorch's memory.

Which memory an op can use (tandem.h, "memory"):
- cpu backend: only memory the daemon can map: its own buffers (tandem_alloc: what tandem.empty returns) or a
  sealed memfd the process registers. PyTorch's CPU allocator uses malloc, which the daemon cannot map, so such
  tensors are copied through a staging buffer in daemon memory (one per communicator, grown as needed).
- cuda backend: tandem_alloc'd device memory (tandem.empty), or cudaMalloc memory registered by its legacy IPC
  handle. PyTorch's caching allocator hands out blocks of cudaMalloc'd segments; each segment is registered once,
  on first use, and cached (SegmentCache below).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import weakref

import torch

from . import _capi
from ._capi import lib
from ._errors import TandemError, error_for


def check(status: int) -> None:
    if status != _capi.SUCCESS:
        raise error_for(status, _capi.last_error())


# ---- sessions ---------------------------------------------------------------------------------------------------

class HitCache(dict):
    """A communicator's data_ptr -> (buffer, offset, bytes to the buffer's end, Segment or None, segment base,
    segment buffer id) cache (a dict subclass, so its session can hold it weakly and clear it whenever a buffer or
    registration is forgotten; daemon memory has base and id 0). The C fast path (_tandem_fastcall.Hot) probes the
    same dict.
    Daemon memory (Segment None) is valid while cached: its entry goes before the buffer does. A registered
    cudaMalloc segment's entry is used only after SegmentCache.live() confirmed its segment during the same op."""


class Session:
    """One connection to tandemd (tandem_connect). One per socket path per process, shared by every Communicator
    and tandem.empty() that name the same socket; get one with Session.get()."""

    _sessions: dict = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, socket: str | None = None) -> "Session":
        # socket=None means libtandem's rule; naming $TANDEM_SOCKET's path explicitly is the same daemon, and must
        # be the same session too (a buffer serves only ops of the session that made it).
        socket = socket or os.environ.get("TANDEM_SOCKET") or None
        key = (os.getpid(), socket)  # a forked child has its own connection, never its parent's
        with cls._lock:
            s = cls._sessions.get(key)
            if s is None or s.closed:
                s = cls._sessions[key] = Session(socket)
            return s

    def __init__(self, socket: str | None = None):
        h = ctypes.c_void_p()
        # NULL: libtandem's own rule ($TANDEM_SOCKET, else the default path), so Python and C agree.
        check(lib.tandem_connect(socket.encode() if socket else None, ctypes.byref(h)))
        self.handle = h.value
        self.socket = socket
        self.pid = os.getpid()
        self.closed = False
        self.backend = lib.tandem_session_backend(self.handle).decode()
        self.is_cuda = self.backend == "cuda"
        # Buffers this session owns (tandem.empty, staging), by address: parallel sorted lists, so a tensor's
        # buffer is one bisect away. An entry is removed before its buffer is freed, so an address is never
        # resolved to a buffer that no longer backs it.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._buffers: list[int] = []
        self._devices: list[int] = []  # cuda: the buffer's device; cpu: -1
        # Communicators' pointer caches, by id (weakly: a closed communicator's cache goes with it).
        self.hit_caches: "weakref.WeakValueDictionary[int, HitCache]" = weakref.WeakValueDictionary()
        self._deferred: list = []  # cuda buffers whose last user may still be running: (event or None, handle)
        self.segments = SegmentCache(self) if self.is_cuda else None

    # -- the owned-buffer table
    def add_span(self, start: int, nbytes: int, handle: int, device: int = -1) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + nbytes)
        self._buffers.insert(i, handle)
        self._devices.insert(i, device)

    def remove_span(self, start: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i], self._ends[i], self._buffers[i], self._devices[i]
        self.forget_hits()  # communicators' caches may name this buffer

    def forget_hits(self) -> None:
        """Empties every communicator's pointer cache: called before a buffer or a registration goes away."""
        for hits in list(self.hit_caches.values()):
            hits.clear()

    def span_end(self, ptr: int) -> int:
        i = bisect.bisect_right(self._starts, ptr) - 1
        return self._ends[i]

    def span_device(self, ptr: int) -> int:
        i = bisect.bisect_right(self._starts, ptr) - 1
        return self._devices[i]

    def lookup(self, ptr: int, nbytes: int):
        """(buffer handle, offset) of [ptr, ptr+nbytes) in a buffer this session owns, else None."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr + nbytes <= self._ends[i]:
            return self._buffers[i], ptr - self._starts[i]
        return None

    def free_later(self, handle: int) -> None:
        """cuda: frees `handle` once the work queued so far on the current stream is done (torch may drop a tensor
        while a kernel still reads it, as its caching allocator allows). Nothing is recorded while a CUDA graph is
        being captured; the buffer then waits for the next call outside capture."""
        event = None
        if not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
        self._deferred.append((event, handle))

    def reap(self) -> None:
        """Frees deferred cuda buffers whose work is done. Never called during capture."""
        keep = []
        for event, handle in self._deferred:
            if event is None:
                event = torch.cuda.Event()
                event.record()
                keep.append((event, handle))
            elif event.query():
                lib.tandem_free(handle)
            else:
                keep.append((event, handle))
        self._deferred = keep

    def close(self) -> None:
        """Disconnects. Every tensor in this session's memory becomes invalid (its pages are unmapped): close only
        when none is in use. Communicators of the session fail every later call."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() == self.pid:
            check(lib.tandem_disconnect(self.handle))


# ---- daemon buffers and DLPack ----------------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_KDL_CPU, _KDL_CUDA = 1, 2
_DL_DTYPES = {  # torch dtype -> (DLDataTypeCode, bits): kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4
    torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float64: (2, 64),
    torch.int32: (0, 32), torch.int64: (0, 64), torch.int16: (0, 16), torch.int8: (0, 8), torch.uint8: (1, 8),
    torch.bool: (6, 8),
}

# What each exported DLManagedTensor keeps alive (its Buffer, shape array, the struct itself), by manager_ctx.
_exports: dict[int, tuple] = {}
_export_ids = iter(range(1, 1 << 62))


@_DELETER
def _dl_deleter(managed):
    _exports.pop(managed.contents.manager_ctx, None)


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The destructor gets the dying capsule as a raw pointer: these take it as void*, so no reference is taken to an
# object being destroyed. (ctypes.pythonapi[...] returns a fresh function object, configured on its own.)
_PyCapsule_IsValid = ctypes.pythonapi["PyCapsule_IsValid"]
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule_ptr):
    # A capsule nobody consumed still carries the name "dltensor": then its tensor is ours to delete. A consumer
    # renames it "used_dltensor" and calls the deleter itself when it is done with the memory.
    if _PyCapsule_IsValid(capsule_ptr, b"dltensor"):
        p = _PyCapsule_GetPointer(capsule_ptr, b"dltensor")
        managed = ctypes.cast(p, ctypes.POINTER(_DLManagedTensor))
        _exports.pop(managed.contents.manager_ctx, None)


class Buffer:
    """Daemon memory (tandem_alloc), mapped into this process: host memory on the cpu backend, device memory on the
    cuda backend. Exports itself through DLPack (`__dlpack__`), so torch.from_dlpack, numpy.from_dlpack,
    cupy.from_dlpack and jax.dlpack.from_dlpack see the same memory without a copy. Freed when the Buffer and every
    tensor made from it are gone."""

    def __init__(self, session: Session, nbytes: int, device: int = -1):
        self.session = session
        self.device = device
        h = ctypes.c_void_p()
        if session.is_cuda:
            session.reap()
        check(lib.tandem_alloc(session.handle, max(int(nbytes), 1), ctypes.byref(h)))
        self.handle = h.value
        self.ptr = lib.tandem_buffer_ptr(self.handle)
        self.nbytes = int(nbytes)
        session.add_span(self.ptr, max(self.nbytes, 1), self.handle, device if session.is_cuda else -1)
        self._finalizer = weakref.finalize(self, Buffer._release, session, self.ptr, self.handle)

    @staticmethod
    def _release(session: Session, ptr: int, handle: int) -> None:
        if os.getpid() != session.pid:
            return  # a forked child's copy of its parent's buffer: the connection is the parent's, not ours
        session.remove_span(ptr)  # first: no later op may resolve an address to this buffer
        if session.closed:
            lib.tandem_free(handle)  # frees the handle only; the session already released the memory
        elif session.is_cuda:
            session.free_later(handle)
        else:
            lib.tandem_free(handle)

    def __dlpack_device__(self):
        return (_KDL_CUDA, self.device) if self.session.is_cuda else (_KDL_CPU, 0)

    def dlpack(self, shape, dtype: torch.dtype):
        """A DLPack capsule viewing this buffer as a contiguous `shape` of `dtype`."""
        if dtype not in _DL_DTYPES:
            raise ValueError(f"tandem: dtype {dtype} has no DLPack export here; use one of {list(_DL_DTYPES)}")
        shape = tuple(int(s) for s in shape)
        need = _element_size(dtype)
        for s in shape:
            need *= s
        if need > max(self.nbytes, 1) and need > 0:
            raise ValueError(f"tandem: shape {shape} of {dtype} needs {need} bytes; the buffer has {self.nbytes}")
        ctx = next(_export_ids)
        shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        m = _DLManagedTensor()
        m.dl_tensor.data = self.ptr
        dev_type, dev_id = self.__dlpack_device__()
        m.dl_tensor.device = _DLDevice(dev_type, dev_id)
        m.dl_tensor.ndim = len(shape)
        code, bits = _DL_DTYPES[dtype]
        m.dl_tensor.dtype = _DLDataType(code, bits, 1)
        m.dl_tensor.shape = shape_arr
        m.dl_tensor.strides = None  # compact row-major
        m.dl_tensor.byte_offset = 0
        m.manager_ctx = ctx
        m.deleter = _dl_deleter
        _exports[ctx] = (self, shape_arr, m)
        return _PyCapsule_New(ctypes.addressof(m), b"dltensor", ctypes.cast(_capsule_destructor, ctypes.c_void_p))

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # Fresh daemon memory has no pending work on any stream, so there is nothing to order with `stream`.
        if copy:
            raise BufferError("tandem.Buffer exports its memory without copying (copy=True was asked)")
        return self.dlpack((self.nbytes,), torch.uint8)

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_dlpack(_Export(self, shape, dtype))


class _Export:
    """Exports a Buffer with a given shape and dtype through the DLPack protocol."""

    def __init__(self, buf: Buffer, shape, dtype):
        self.buf, self.shape, self.dtype = buf, shape, dtype

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.buf.dlpack(self.shape, self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- registration of PyTorch's CUDA memory ----------------------------------------------------------------------

_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class Segment:
    """One registered cudaMalloc allocation: [base, end), the driver's buffer id for it, the tandem buffer."""

    __slots__ = ("base", "end", "bid", "handle", "device")

    def __init__(self, base: int, size: int, bid: int, handle: int, device: int):
        self.base, self.end, self.bid, self.handle, self.device = base, base + size, bid, handle, device


class SegmentCache:
    """Registers each cudaMalloc segment of PyTorch's caching allocator once, and never uses a registration after
    its memory was freed.

    Key: the driver's CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation, "a process-wide unique ID for an allocated
    memory region", which the driver never hands out again. A registration is used only after the driver confirmed,
    during the same op, that the allocation carrying its id still exists:
    - first sight of a pointer: one cuPointerGetAttributes (host only, no sync, allowed during graph capture) gives
      the id, base and size of its allocation. A known id: the cached registration, offset = ptr - base. An unknown
      id: a new segment (first use, or PyTorch freed a segment and cudaMalloc returned the same addresses again).
      Registered entries whose range overlaps it are dead: their memory was freed, so they are deregistered first
      (libtandem would otherwise hand back the old buffer for the same (ptr, size)). Then entries whose memory is no
      longer allocated are released too, so the daemon does not keep freed memory mapped. This may happen while a
      CUDA graph is being captured (an output allocated in the graph's pool): registering records nothing on a
      stream.
    - later ops: the communicator's pointer cache gives the Segment, and one cuPointerGetAttribute of the buffer id
      at the segment's base (live()) per distinct segment per op confirms it: the same id means the same
      allocation, whose range never changes, so every pointer cached inside it is still inside it. Any other answer
      (another id, or no allocation) sends the op down the path above.
    Why a driver query per op and not a cached "allocator generation": PyTorch frees segments (cudaFree) not only in
    torch.cuda.empty_cache() but inside its allocator, on an out-of-memory retry and under
    garbage_collection_threshold, and announces that only to C++ trace trackers; nothing a Python package can see
    cheaply counts those frees, so a counter kept here could miss one and reuse a dead registration.
    """

    def __init__(self, session: Session, driver: ctypes.CDLL | None = None):
        self.session = session
        self.by_id: dict[int, Segment] = {}
        cuda = ctypes.CDLL("libcuda.so.1") if driver is None else driver
        self._get = cuda.cuPointerGetAttributes
        self._get.restype = ctypes.c_int
        self._get.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        self._get1 = cuda.cuPointerGetAttribute
        self._get1.restype = ctypes.c_int
        self._get1.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._attrs = (ctypes.c_int * 4)(_CU_POINTER_ATTRIBUTE_BUFFER_ID, _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                         _CU_POINTER_ATTRIBUTE_RANGE_SIZE, _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        self._vals = (ctypes.c_uint64 * 4)()  # the device ordinal is an int: it fills the low half of its slot
        self._data = (ctypes.c_void_p * 4)(*[ctypes.addressof(self._vals) + 8 * i for i in range(4)])
        self._id = ctypes.c_uint64()
        self._id_addr = ctypes.addressof(self._id)
        self._get_addr = _capi.address(self._get)
        self._get1_addr = _capi.address(self._get1)
        self._attrs_addr = ctypes.addressof(self._attrs)
        self._data_addr = ctypes.addressof(self._data)
        self.registrations = 0  # counters, for tests and tandem.stats()
        self.releases = 0

    def query(self, ptr: int):
        """(buffer id, base, size, device) of the allocation holding ptr, or None where ptr is no live device
        memory."""
        v = self._vals
        v[3] = 0
        fast = _capi.fastcall
        if (fast(self._get_addr, 4, self._attrs_addr, self._data_addr, ptr) if fast is not None else
                self._get(4, self._attrs_addr, self._data_addr, ptr)) != 0:
            return None
        d = v[3] & 0xFFFFFFFF
        return v[0], v[1], v[2], d - (1 << 32) if d >> 31 else d

    def live(self, seg: Segment) -> bool:
        """Whether seg's allocation still exists (its base still carries its buffer id): one driver query."""
        fast = _capi.fastcall_out
        if fast is not None:
            return fast(self._get1_addr, _CU_POINTER_ATTRIBUTE_BUFFER_ID, seg.base) == seg.bid
        if self._get1(self._id_addr, _CU_POINTER_ATTRIBUTE_BUFFER_ID, seg.base) != 0:
            return False
        return self._id.value == seg.bid

    def entry(self, ptr: int, nbytes: int):
        """(buffer, offset, bytes to the segment's end, Segment, its base, its buffer id) where ptr lies in a
        registered, still allocated segment; else None (the caller then takes the path that registers, or raises
        naming the argument). The last two are what the C fast path's live() check reads."""
        q = self.query(ptr)
        if q is None:
            return None
        seg = self.by_id.get(q[0])
        if seg is None or ptr + nbytes > seg.end:
            return None
        return seg.handle, ptr - seg.base, seg.end - ptr, seg, seg.base, seg.bid

    def resolve(self, ptr: int, nbytes: int, arg: str, op: str):
        q = self.query(ptr)
        if q is None or q[0] == 0:
            raise ValueError(f"tandem.{op}: argument '{arg}' is not in CUDA device memory the driver knows "
                             f"(address {ptr:#x}); pass a CUDA tensor from PyTorch's allocator or tandem.empty()")
        bid, base, size, device = q
        seg = self.by_id.get(bid)
        if seg is None:
            seg = self._register(bid, base, size, device, arg, op)
        if ptr + nbytes > base + size:
            raise ValueError(f"tandem.{op}: argument '{arg}' runs past the end of its CUDA allocation")
        return seg.handle, ptr - seg.base

    def _register(self, bid: int, base: int, size: int, device: int, arg: str, op: str) -> Segment:
        # Also while a CUDA graph is being captured: an output allocated inside the capture lies in the graph's
        # private pool, which no eager call saw. The round trip to tandemd and libtandem's driver queries record
        # nothing on a stream (libtandem makes them in CUDA's relaxed capture mode), so the capture holds only the op.
        self.release_dead(overlapping=(base, base + size))
        h = ctypes.c_void_p()
        try:
            check(lib.tandem_register(self.session.handle, base, size, -1, 0, ctypes.byref(h)))
        except TandemError as e:
            if "IPC handle" in e.message:  # cuMem (VMM) memory: PyTorch's expandable segments
                e.message += (f" [tandem.{op}, argument '{arg}': PyTorch's expandable segments are cuMem memory, "
                              "which has no IPC handle; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or "
                              "use tandem.empty() tensors]")
            raise
        seg = Segment(base, size, bid, h.value, device)
        self.by_id[bid] = seg
        self.registrations += 1
        return seg

    def _drop(self, bids) -> None:
        if not bids:
            return
        # First: no communicator's pointer cache may name a segment that is about to lose its registration.
        self.session.forget_hits()
        for bid in bids:
            seg = self.by_id.pop(bid)
            lib.tandem_deregister(seg.handle)
            self.releases += 1

    def release_dead(self, overlapping=None) -> int:
        """Deregisters every cached segment whose memory was freed (its base no longer carries its buffer id),
        and every one overlapping `overlapping` (a new allocation took its addresses). Returns how many."""
        dead = []
        for bid, seg in self.by_id.items():
            if overlapping is not None and seg.base < overlapping[1] and overlapping[0] < seg.end:
                dead.append(bid)
                continue
            q = self.query(seg.base)
            if q is None or q[0] != bid:
                dead.append(bid)
        self._drop(dead)
        return len(dead)

    def clear(self) -> None:
        self._drop(list(self.by_id))
