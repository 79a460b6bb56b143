"""The ops as torch.library custom ops (namespace `tandem`), with fake implementations, for torch.compile.

Each op has a functional form (`tandem::gemm_ar(a, b, comm) -> Tensor`, output allocated by the op) and an out form
(`tandem::gemm_ar_out(a, b, comm, out) -> ()`, which mutates `out`). The communicator travels as its integer id
(Communicator.id): torch.library schemas take tensors and scalars, not Python objects. The fake implementations
compute output shapes only (they run on FakeTensors while tracing), from the shapes and the communicator's rank and
size. Eager calls skip all of this and go straight to the C ABI (Communicator.<op>); these ops are what Dynamo puts
into a graph, so a compiled function holds every tandem call whole (fullgraph=True).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _capi, _comm
from ._comm import rows_of

_lib = "tandem::"


def _c(comm_id: int) -> "_comm.Communicator":
    c = _comm._registry.get(comm_id)
    if c is None:
        raise ValueError(f"tandem: communicator {comm_id} was closed (or never existed in this process)")
    return c


# ---- ag_gemm
@torch.library.custom_op(_lib + "ag_gemm", mutates_args=())
def _ag_gemm(a: Tensor, b: Tensor, comm: int, m: int) -> Tensor:
    return _c(comm)._eager_ag_gemm(a, b, m=m)


@_ag_gemm.register_fake
def _(a, b, comm, m):
    return a.new_empty((m, b.shape[0]))


@torch.library.custom_op(_lib + "ag_gemm_out", mutates_args=("out", "a_gathered"))
def _ag_gemm_out(a: Tensor, b: Tensor, comm: int, m: int, out: Tensor, a_gathered: Optional[Tensor]) -> None:
    _c(comm)._eager_ag_gemm(a, b, m=m, out=out, a_gathered=a_gathered)


@_ag_gemm_out.register_fake
def _(a, b, comm, m, out, a_gathered):
    return None


def ag_gemm(comm, a, b, *, out=None, m=None, a_gathered=None):
    if m is None:
        m = out.shape[0] if out is not None else a.shape[0] * comm.world_size
    if out is None and a_gathered is None:
        return torch.ops.tandem.ag_gemm(a, b, comm.id, m)
    if out is None:
        out = a.new_empty((m, b.shape[0]))
    torch.ops.tandem.ag_gemm_out(a, b, comm.id, m, out, a_gathered)
    return out


# ---- gemm_rs / gemm_ar
@torch.library.custom_op(_lib + "gemm_rs", mutates_args=())
def _gemm_rs(a: Tensor, b: Tensor, comm: int) -> Tensor:
    return _c(comm)._eager_gemm_rs(a, b)


@_gemm_rs.register_fake
def _(a, b, comm):
    c = _c(comm)
    return a.new_empty((rows_of(a.shape[0], c.rank, c.world_size)[1], b.shape[0]))


@torch.library.custom_op(_lib + "gemm_rs_out", mutates_args=("out",))
def _gemm_rs_out(a: Tensor, b: Tensor, comm: int, out: Tensor) -> None:
    _c(comm)._eager_gemm_rs(a, b, out=out)


@_gemm_rs_out.register_fake
def _(a, b, comm, out):
    return None


def gemm_rs(comm, a, b, *, out=None):
    if out is None:
        return torch.ops.tandem.gemm_rs(a, b, comm.id)
    torch.ops.tandem.gemm_rs_out(a, b, comm.id, out)
    return out


@torch.library.custom_op(_lib + "gemm_ar", mutates_args=())
def _gemm_ar(a: Tensor, b: Tensor, comm: int) -> Tensor:
    return _c(comm)._eager_gemm_ar(a, b)


@_gemm_ar.register_fake
def _(a, b, comm):
    return a.new_empty((a.shape[0], b.shape[0]))


@torch.library.custom_op(_lib + "gemm_ar_out", mutates_args=("out",))
def _gemm_ar_out(a: Tensor, b: Tensor, comm: int, out: Tensor) -> None:
    _c(comm)._eager_gemm_ar(a, b, out=out)


@_gemm_ar_out.register_fake
def _(a, b, comm, out):
    return None


def gemm_ar(comm, a, b, *, out=None):
    if out is None:
        return torch.ops.tandem.gemm_ar(a, b, comm.id)
    torch.ops.tandem.gemm_ar_out(a, b, comm.id, out)
    return out


# ---- moe_dispatch_gemm
@torch.library.custom_op(_lib + "moe_dispatch_gemm", mutates_args=())
def _moe_dispatch_gemm(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w: Tensor, comm: int,
                       capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    return _c(comm)._eager_moe_dispatch_gemm(x, topk_ids, topk_weights, w, capacity=capacity)


@_moe_dispatch_gemm.register_fake
def _(x, topk_ids, topk_weights, w, comm, capacity):
    return (x.new_empty((capacity, w.shape[1])), x.new_empty((capacity, 4), dtype=torch.int32),
            x.new_empty((w.shape[0],), dtype=torch.int32))


@torch.library.custom_op(_lib + "moe_dispatch_gemm_out", mutates_args=("out", "row_info", "expert_counts"))
def _moe_dispatch_gemm_out(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w: Tensor, comm: int, out: Tensor,
                           row_info: Tensor, expert_counts: Tensor) -> None:
    _c(comm)._eager_moe_dispatch_gemm(x, topk_ids, topk_weights, w, capacity=out.shape[0], out=out,
                                      row_info=row_info, expert_counts=expert_counts)


@_moe_dispatch_gemm_out.register_fake
def _(x, topk_ids, topk_weights, w, comm, out, row_info, expert_counts):
    return None


def moe_dispatch_gemm(comm, x, topk_ids, topk_weights, w, *, capacity=None, out=None, row_info=None,
                      expert_counts=None):
    if capacity is None:
        capacity = out.shape[0] if out is not None else x.shape[0] * topk_ids.shape[1] * comm.world_size
    if out is None and row_info is None and expert_counts is None:
        return torch.ops.tandem.moe_dispatch_gemm(x, topk_ids, topk_weights, w, comm.id, capacity)
    if out is None:
        out = x.new_empty((capacity, w.shape[1]))
    if row_info is None:
        row_info = x.new_empty((capacity, 4), dtype=torch.int32)
    if expert_counts is None:
        expert_counts = x.new_empty((w.shape[0],), dtype=torch.int32)
    torch.ops.tandem.moe_dispatch_gemm_out(x, topk_ids, topk_weights, w, comm.id, out, row_info, expert_counts)
    return out, row_info, expert_counts


# ---- moe_ffn
@torch.library.custom_op(_lib + "moe_ffn", mutates_args=())
def _moe_ffn(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, comm: int) -> Tensor:
    return _c(comm)._eager_moe_ffn(x, topk_ids, topk_weights, w1, w2)


@_moe_ffn.register_fake
def _(x, topk_ids, topk_weights, w1, w2, comm):
    return torch.empty_like(x)


@torch.library.custom_op(_lib + "moe_ffn_out", mutates_args=("out",))
def _moe_ffn_out(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, comm: int,
                 out: Tensor) -> None:
    _c(comm)._eager_moe_ffn(x, topk_ids, topk_weights, w1, w2, out=out)


@_moe_ffn_out.register_fake
def _(x, topk_ids, topk_weights, w1, w2, comm, out):
    return None


def moe_ffn(comm, x, topk_ids, topk_weights, w1, w2, *, out=None):
    if out is None:
        return torch.ops.tandem.moe_ffn(x, topk_ids, topk_weights, w1, w2, comm.id)
    torch.ops.tandem.moe_ffn_out(x, topk_ids, topk_weights, w1, w2, comm.id, out)
    return out


# ---- ring_attention (scale 0.0: 1/sqrt(head_dim), as in tandem.h; layout: 0 contiguous, 1 zigzag)
@torch.library.custom_op(_lib + "ring_attention", mutates_args=())
def _ring_attention(q: Tensor, k: Tensor, v: Tensor, comm: int, causal: bool, scale: float, layout: int) -> Tensor:
    return _c(comm)._eager_ring_attention(q, k, v, causal=causal, scale=scale, layout=_LAYOUT_NAMES[layout])


@_ring_attention.register_fake
def _(q, k, v, comm, causal, scale, layout):
    return torch.empty_like(q)


@torch.library.custom_op(_lib + "ring_attention_lse", mutates_args=())
def _ring_attention_lse(q: Tensor, k: Tensor, v: Tensor, comm: int, causal: bool, scale: float,
                        layout: int) -> tuple[Tensor, Tensor]:
    return _c(comm)._eager_ring_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                          layout=_LAYOUT_NAMES[layout])


@_ring_attention_lse.register_fake
def _(q, k, v, comm, causal, scale, layout):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(_lib + "ring_attention_out", mutates_args=("out", "lse"))
def _ring_attention_out(q: Tensor, k: Tensor, v: Tensor, comm: int, causal: bool, scale: float, layout: int,
                        out: Tensor, lse: Optional[Tensor]) -> None:
    _c(comm)._eager_ring_attention(q, k, v, causal=causal, scale=scale, out=out, lse=lse,
                                   layout=_LAYOUT_NAMES[layout])


@_ring_attention_out.register_fake
def _(q, k, v, comm, causal, scale, layout, out, lse):
    return None


_LAYOUT_NAMES = {code: name for name, code in _capi.LAYOUTS.items()}


def ring_attention(comm, q, k, v, *, causal=False, scale=None, out=None, lse=None, return_lse=False,
                   layout="contiguous"):
    s = 0.0 if scale is None else float(scale)
    lay = _comm._layout_code(layout, "ring_attention")
    if out is None and lse is None:
        if return_lse:
            return torch.ops.tandem.ring_attention_lse(q, k, v, comm.id, bool(causal), s, lay)
        return torch.ops.tandem.ring_attention(q, k, v, comm.id, bool(causal), s, lay)
    if out is None:
        out = torch.empty_like(q)
    if lse is None and return_lse:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    torch.ops.tandem.ring_attention_out(q, k, v, comm.id, bool(causal), s, lay, out, lse)
    return (out, lse) if lse is not None else out


# ---- allgather
@torch.library.custom_op(_lib + "allgather", mutates_args=())
def _allgather(x: Tensor, comm: int) -> Tensor:
    return _c(comm)._eager_allgather(x)


@_allgather.register_fake
def _(x, comm):
    n = _c(comm).world_size
    return x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))


@torch.library.custom_op(_lib + "allgather_out", mutates_args=("out",))
def _allgather_out(x: Tensor, comm: int, out: Tensor) -> None:
    _c(comm)._eager_allgather(x, out=out)


@_allgather_out.register_fake
def _(x, comm, out):
    return None


def allgather(comm, x, *, out=None):
    if out is None:
        return torch.ops.tandem.allgather(x, comm.id)
    torch.ops.tandem.allgather_out(x, comm.id, out)
    return out


# ---- barrier: no tensors in or out, so it is marked as having a side effect (never removed as dead code)
@torch.library.custom_op(_lib + "barrier", mutates_args=())
def _barrier(comm: int) -> None:
    _c(comm)._submit("barrier", (_comm.ARG_STRUCTS["barrier"].size, _c(comm)._stream()))


@_barrier.register_fake
def _(comm):
    return None


torch.fx.node.has_side_effect(torch.ops.tandem.barrier.default)


def barrier(comm):
    torch.ops.tandem.barrier(comm.id)
