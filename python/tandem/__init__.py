"""tandem from PyTorch: fused compute + communication ops served by the node's tandemd.

    import torch, tandem
    comm = tandem.Communicator()            # torch.distributed's group, or TANDEM_ID + RANK/WORLD_SIZE
    c = comm.gemm_ar(a, b)                  # C = sum over ranks of a_r @ b_r.T, on every rank
    x = tandem.empty((1024, 1024), torch.bfloat16)   # daemon memory, zero copy (DLPack)

Built over libtandem's stable C ABI (tandem.h 0.2) through ctypes. See the README's "PyTorch" section for what each
op expects, how memory is registered, and how to run it under torchrun, torch.compile and CUDA graphs.
"""

from __future__ import annotations

import torch

from . import _capi
from ._bootstrap import new_id
from ._comm import Communicator, rows_of
from ._errors import (Aborted, DaemonLost, InternalError, InvalidArgument, NotFound, OutOfMemory, PeerLost,
                      PermissionDenied, ProtocolError, RingFull, TandemError, Timeout, Unavailable, Unsupported,
                      VersionMismatch)
from ._memory import Buffer, Session

__version__ = "0.2.0"
library_path = _capi.library_path
library_version = _capi.library_version

__all__ = [
    "Communicator", "Session", "Buffer", "empty", "empty_like", "new_id", "rows_of",
    "ag_gemm", "gemm_rs", "gemm_ar", "moe_dispatch_gemm", "moe_ffn", "ring_attention", "allgather", "barrier",
    "TandemError", "InvalidArgument", "ProtocolError", "VersionMismatch", "PermissionDenied", "NotFound",
    "OutOfMemory", "Timeout", "PeerLost", "DaemonLost", "Aborted", "Unsupported", "Unavailable", "InternalError",
    "RingFull", "library_path", "library_version", "nn",
]


def empty(shape, dtype: torch.dtype = torch.float32, *, device=None, socket: str | None = None) -> torch.Tensor:
    """A tensor in daemon memory (tandem_alloc), zero copy: ops on it need no registration and no staging.

    cpu backend: host memory shared with tandemd. cuda backend: device memory on `device` (default: the current
    CUDA device). The tensor comes through DLPack, so numpy.from_dlpack / cupy.from_dlpack / jax see the same
    memory. The memory is freed when the last tensor viewing it is gone (cuda: once the current stream has passed
    the point where it was dropped). Like torch.empty, the contents are uninitialised."""
    if isinstance(shape, int):
        shape = (shape,)
    session = Session.get(socket)
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if not session.is_cuda:
        return Buffer(session, nbytes).tensor(tuple(shape), dtype)
    dev = torch.cuda.current_device() if device is None else torch.device(device).index
    if dev is None:
        dev = torch.cuda.current_device()
    with torch.cuda.device(dev):  # tandem_alloc allocates on the calling thread's current device
        return Buffer(session, nbytes, dev).tensor(tuple(shape), dtype)


def empty_like(t: torch.Tensor, *, socket: str | None = None) -> torch.Tensor:
    """tandem.empty with t's shape, dtype and (cuda) device."""
    return empty(tuple(t.shape), t.dtype, device=t.device if t.is_cuda else None, socket=socket)


# Module-level forms of the ops: tandem.gemm_ar(comm, a, b, out=None) is comm.gemm_ar(a, b, out=None).
def ag_gemm(comm: Communicator, a, b, *, out=None, m=None, a_gathered=None, layout="nt", **fp8):
    return comm.ag_gemm(a, b, out=out, m=m, a_gathered=a_gathered, layout=layout, **fp8)


def gemm_rs(comm: Communicator, a, b, *, out=None, layout="nt", **fp8):
    return comm.gemm_rs(a, b, out=out, layout=layout, **fp8)


def gemm_ar(comm: Communicator, a, b, *, out=None, layout="nt", **fp8):
    return comm.gemm_ar(a, b, out=out, layout=layout, **fp8)


def moe_dispatch_gemm(comm: Communicator, x, topk_ids, topk_weights, w, *, capacity=None, out=None, row_info=None,
                      expert_counts=None, **fp8):
    return comm.moe_dispatch_gemm(x, topk_ids, topk_weights, w, capacity=capacity, out=out, row_info=row_info,
                                  expert_counts=expert_counts, **fp8)


def moe_ffn(comm: Communicator, x, topk_ids, topk_weights, w1, w2, *, out=None, saved=None, **fp8):
    return comm.moe_ffn(x, topk_ids, topk_weights, w1, w2, out=out, saved=saved, **fp8)


def ring_attention(comm: Communicator, q, k, v, *, causal=False, scale=None, out=None, lse=None, return_lse=False,
                   layout="contiguous"):
    return comm.ring_attention(q, k, v, causal=causal, scale=scale, out=out, lse=lse, return_lse=return_lse,
                               layout=layout)


def allgather(comm: Communicator, x, *, out=None):
    return comm.allgather(x, out=out)


def barrier(comm: Communicator):
    return comm.barrier()


for _f in (ag_gemm, gemm_rs, gemm_ar, moe_dispatch_gemm, moe_ffn, ring_attention, allgather, barrier):
    _f.__doc__ = getattr(Communicator, _f.__name__).__doc__
del _f


def _module_form(name: str):
    def op(comm: Communicator, *inputs, **kw):
        return getattr(comm, name)(*inputs, **kw)

    op.__name__ = name
    op.__doc__ = getattr(Communicator, name).__doc__
    return op


# An op of the library's table with no function above gets the generic one: tandem.<op>(comm, ...) is comm.<op>(...).
for _name in _capi.OPS:
    if _name not in globals():
        globals()[_name] = _module_form(_name)
        __all__.append(_name)
del _name

from . import nn  # noqa: E402  (tensor-parallel layers; needs the ops above)
