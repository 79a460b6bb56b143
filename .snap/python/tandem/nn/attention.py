"""Context-parallel attention: ring attention with autograd, the sequence split over the communicator's ranks.

Each rank holds q [seq, heads, head_dim] and k, v [seq, kv_heads, head_dim] for its own rows of the sequence (which
global positions they are is the layout's rule: context_parallel_positions). The forward is tandem's ring_attention
(its out and the rows' log-sum-exp); the backward is tandem's ring_attention_backward, which recomputes the
probabilities from the forward's out and lse (FlashAttention's recomputation) and returns dq for this rank's queries
and dk, dv for this rank's keys and values, summed over every rank's queries (and over each KV head's group of query
heads under grouped-query attention).

As the tensor-parallel layers (functional.py), the forward is a torch.library custom op
(tandem::context_parallel_attention) whose backward, registered with torch.library.register_autograd, is a custom op
too (tandem::context_parallel_attention_backward): torch.compile(fullgraph=True) keeps both whole, and what the
backward needs (q, k, v, out, lse) travels as the autograd context's saved tensors, checked before use.

What the library decides stays the library's to say: dtypes, and on the cuda backend the head sizes its attention core
has (64 and 128), are refused by the op with its own message.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _capi, _comm
from .functional import _c, _saved

_WHAT = "ring_attention"


def _layout_code(layout, what: str) -> int:
    codes = _capi.LAYOUTS
    if isinstance(layout, str) and layout.lower() in codes:
        return codes[layout.lower()]
    if isinstance(layout, int) and not isinstance(layout, bool) and layout in codes.values():
        return layout
    raise ValueError(f"tandem.nn.{what}: argument 'layout' must be one of {', '.join(repr(n) for n in codes)}, got "
                     f"{layout!r}")


def _scale(scale, head_dim: int, what: str) -> float:
    """The op's scale field: 0.0 for None (the library's 1/sqrt(head_dim)); a given scale must be finite and > 0,
    since 0 would silently mean the default."""
    if scale is None:
        return 0.0
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"tandem.nn.{what}: argument 'scale' must be finite and > 0 (None: 1/sqrt(head_dim) = "
                         f"{head_dim ** -0.5 if head_dim else float('inf'):.4g}), got {scale!r}")
    return s


@torch.library.custom_op("tandem::context_parallel_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: int, causal: bool, scale: float,
               layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _c(comm, _WHAT).ring_attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True)
    return out, lse


@_attention.register_fake
def _(q, k, v, comm, causal, scale, layout):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tandem::context_parallel_attention_backward", mutates_args=())
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, comm: int, causal: bool, scale: float,
                   layout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _c(comm, _WHAT)
    seq, heads, head_dim = dout.shape
    kv = (seq, k.shape[1], head_dim)
    for t, name, shape in ((q, "q", dout.shape), (k, "k", kv), (v, "v", kv), (out, "out", dout.shape),
                           (lse, "lse", (heads, seq))):
        _saved(t, name, _WHAT, tuple(shape))
    return c.ring_attention_backward(q, k, v, out, dout.contiguous(), lse, causal=causal, layout=layout, scale=scale)


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, comm, causal, scale, layout):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, comm, causal, scale, layout = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.comm, ctx.causal, ctx.scale, ctx.layout = comm, causal, scale, layout


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.tandem.context_parallel_attention_backward(dout, q, k, v, out, lse, ctx.comm, ctx.causal,
                                                                      ctx.scale, ctx.layout)
    need = ctx.needs_input_grad
    return (dq if need[0] else None), (dk if need[1] else None), (dv if need[2] else None), None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup)


def _check(q, k, v, comm, what: str) -> None:
    if not isinstance(comm, _comm.Communicator):
        raise TypeError(f"tandem.nn.{what}: argument 'comm' must be a tandem.Communicator, got {type(comm).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tandem.nn.{what}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"tandem.nn.{what}: argument '{name}' must be 3-D, [seq, heads, head_dim] for this "
                             f"rank's rows, got shape {list(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"tandem.nn.{what}: argument '{name}' must have dtype {q.dtype} (as 'q'), got {t.dtype}")
    seq, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"tandem.nn.{what}: k and v have {kv_heads} heads, which does not divide q's {heads} heads; "
                         "grouped-query attention needs kv_heads dividing heads")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (seq, kv_heads, head_dim):
            raise ValueError(f"tandem.nn.{what}: argument '{name}' must have shape {[seq, kv_heads, head_dim]} (q's "
                             f"rows and head_dim, kv_heads heads), got {list(t.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: "_comm.Communicator",
                   causal: bool = False, scale: Optional[float] = None, layout: str = "contiguous") -> torch.Tensor:
    """softmax(q K^T * scale [+ causal mask]) V over the whole sequence, per head, with autograd: q [seq, heads,
    head_dim], k and v [seq, kv_heads, head_dim] are this rank's rows (seq may differ per rank and be 0; kv_heads
    divides heads: query head h reads KV head h // (heads // kv_heads)). Returns out [seq, heads, head_dim], this
    rank's rows. causal: global position i attends to j <= i. scale None: 1/sqrt(head_dim). layout (the same on every
    rank): which global positions this rank's rows are, "contiguous" (rank order) or "zigzag" (chunks r and 2n-1-r of
    2n, balancing causal work); context_parallel_positions gives them. Every rank must call it, in the same order."""
    _check(q, k, v, comm, _WHAT)
    code = _layout_code(layout, _WHAT)
    s = _scale(scale, q.shape[2], _WHAT)
    out, _ = torch.ops.tandem.context_parallel_attention(q.contiguous(), k.contiguous(), v.contiguous(), comm.id,
                                                         bool(causal), s, code)
    return out


def context_parallel_positions(seq_total: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions (int64 [seq_r]) of rank `rank`'s rows when a sequence of seq_total rows is split over
    world_size ranks with the library's balanced split (rank r holds rows_of(seq_total, r, world_size)[1] rows) in
    `layout`: take x[positions] as this rank's shard, and use the positions for rotary embeddings.
    zigzag: the sequence is cut into 2n chunks; rank r holds chunk r (its first ceil(seq_r / 2) rows) and chunk
    2n-1-r (the rest); chunk c < n is ceil(seq_c / 2) long, chunk 2n-1-c floor(seq_c / 2)."""
    code = _layout_code(layout, "context_parallel_positions")
    if not 0 <= rank < world_size:
        raise ValueError(f"tandem.nn.context_parallel_positions: rank {rank} is not in [0, {world_size})")
    seqs = [_comm.rows_of(seq_total, p, world_size)[1] for p in range(world_size)]
    if code == _capi.LAYOUTS["contiguous"]:
        start = _comm.rows_of(seq_total, rank, world_size)[0]
        return torch.arange(start, start + seqs[rank])
    first = [s - s // 2 for s in seqs]  # chunk p (p < n): rank p's first ceil(seq_p / 2) rows
    head = sum(first[:rank])
    tail = sum(first) + sum(seqs[p] // 2 for p in range(rank + 1, world_size))  # chunks 2n-1-p for p > rank
    return torch.cat([torch.arange(head, head + first[rank]), torch.arange(tail, tail + seqs[rank] // 2)])


class ContextParallelAttention(torch.nn.Module):
    """Core attention (no projections, no parameters) with the sequence split over `comm`'s ranks: TransformerEngine's
    DotProductAttention with a context-parallel group and cp_comm_type="p2p" (the KV ring), for the sbhd format of
    one sequence. num_kv_heads is TE's num_gqa_groups; layout "zigzag" is TE's load-balanced causal split.

    forward(q, k, v): q [seq, num_heads, head_dim], k and v [seq, num_kv_heads, head_dim], this rank's rows (at the
    positions context_parallel_positions names); returns this rank's rows of the output, [seq, num_heads, head_dim].
    Every rank calls it, in the same order; the backward is collective too."""

    def __init__(self, comm, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 causal: bool = False, layout: str = "contiguous", scale: Optional[float] = None):
        super().__init__()
        what = "ContextParallelAttention"
        if not isinstance(comm, _comm.Communicator):
            raise TypeError(f"tandem.nn.{what}: argument 'comm' must be a tandem.Communicator, got "
                            f"{type(comm).__name__}")
        self.comm = comm
        self.num_heads, self.head_dim = int(num_heads), int(head_dim)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else int(num_kv_heads)
        if self.num_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"tandem.nn.{what}: num_heads ({num_heads}) and head_dim ({head_dim}) must be > 0")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"tandem.nn.{what}: num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads})")
        _layout_code(layout, what)
        self.causal, self.layout = bool(causal), layout
        _scale(scale, self.head_dim, what)
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for name, t, h in (("q", q, self.num_heads), ("k", k, self.num_kv_heads), ("v", v, self.num_kv_heads)):
            if isinstance(t, torch.Tensor) and (t.dim() != 3 or tuple(t.shape[1:]) != (h, self.head_dim)):
                raise ValueError(f"tandem.nn.ContextParallelAttention: argument '{name}' must have shape [seq, {h}, "
                                 f"{self.head_dim}], got {list(t.shape)}")
        return ring_attention(q, k, v, self.comm, self.causal, self.scale, self.layout)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, layout={self.layout!r}, scale={self.scale}, "
                f"rank={self.comm.rank}/{self.comm.world_size}")
