"""Tensor-parallel linear layers as autograd functions over tandem's fused GEMM ops (Megatron-LM's pattern).

Each layer is a torch.library custom op (tandem::column_parallel_linear, tandem::row_parallel_linear) whose backward
(torch.library.register_autograd) is itself a custom op (..._backward), so torch.compile(fullgraph=True) keeps
forward and backward whole, and everything the backward needs travels in the autograd context's saved tensors.

Column-parallel (weight [out/world, in], this rank's rows of the full weight; bias [out/world]):
- sequence_parallel: x is this rank's rows of the sequence. y = ag_gemm(x, W) (NT), keeping the gathered input;
  backward: dx = gemm_rs(dy, W, "nn") (this rank's rows), while dW = dy^T gather(x) runs locally on the gathered
  input saved by the forward, db = dy summed over rows.
- otherwise: x is replicated. y = x W^T locally; backward: dx = gemm_ar(dy, W, "nn"), dW and db locally meanwhile.
Row-parallel (weight [out, in/world], this rank's columns; bias [out], replicated, added after the reduction):
- sequence_parallel: y = gemm_rs(x, W) (this rank's rows of the sum); backward: dx = ag_gemm(dy, W, "nn"), whose
  a_gathered is gather(dy), then dW = gather(dy)^T x and db = gather(dy) summed over rows (the same on every rank).
- otherwise: y = gemm_ar(x, W); backward: dy is replicated, so dx = dy W, dW = dy^T x, db = dy summed, all local.

Why the weight gradient of the column-parallel sequence-parallel layer is a local torch GEMM on the gathered input the
forward kept, not a second AllGather in the backward (Megatron's choice, to save memory) nor tandem's gemm_ar in TN at
one rank: it needs no communication at all, so it runs entirely while the input gradient's reduce-scatter is in
flight, and a one-rank tandem op would add a submission round trip for a GEMM torch does in place. The cost is the
memory of the gathered input, [m, in] per layer, which the non-sequence-parallel layer keeps anyway.

How the weight gradient overlaps the input gradient's communication: the cpu backend's tandem op is submitted
without waiting (Communicator._start), torch computes dW and db, then the op is waited for; on the cuda backend the
op is enqueued on the current stream and dW, db on a second stream that waits for the current one's inputs, and the
current stream then waits for the second (events, through wait_stream). The row-parallel sequence-parallel backward
cannot overlap: its dW needs the gathered dy that its own op produces.

Weight gradients are one torch GEMM each, on the same inputs in the same order, so they are bitwise repeatable run
to run (on CUDA, given cuBLAS's usual determinism; set CUBLAS_WORKSPACE_CONFIG=:4096:8 with
torch.use_deterministic_algorithms to be sure).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _comm

_SIDE_STREAMS: dict = {}


def _c(comm_id: int, what: str) -> "_comm.Communicator":
    c = _comm._registry.get(comm_id)
    if c is None:
        raise ValueError(f"tandem.nn.{what}: communicator {comm_id} was closed (or never existed in this process)")
    return c


def _saved(t: torch.Tensor, name: str, what: str, shape: tuple) -> torch.Tensor:
    """A saved tensor, checked before the backward reads it: freed storage (resize_(0), as memory savers do) or a
    changed shape raise, naming it."""
    if tuple(t.shape) != tuple(shape):
        raise RuntimeError(f"tandem.nn.{what} backward: the saved tensor '{name}' has shape {list(t.shape)}, expected "
                           f"{list(shape)}; it was changed after the forward")
    need = t.numel() * t.element_size()
    if need and t.untyped_storage().nbytes() < t.storage_offset() * t.element_size() + need:
        raise RuntimeError(f"tandem.nn.{what} backward: the saved tensor '{name}' ({list(shape)}) was freed (its "
                           f"storage holds {t.untyped_storage().nbytes()} bytes, {need} needed); keep it alive until "
                           "the backward has run")
    return t


def _with_wgrad(c, comm_op: str, inputs, kw, wgrad):
    """Runs the tandem op `comm_op` and, while its communication is in flight, wgrad() (the local weight and bias
    gradients). Returns (the op's output, wgrad's result)."""
    if not c.is_cuda:
        pending = c._start(comm_op, *inputs, **kw)
        try:
            grads = wgrad()
        finally:
            out = pending.wait()
        return out, grads
    main = torch.cuda.current_stream(c.device)
    side = _SIDE_STREAMS.get(c.device)
    if side is None:
        side = _SIDE_STREAMS[c.device] = torch.cuda.Stream(c.device)
    out = getattr(c, comm_op)(*inputs, **kw)  # enqueued first: its communication starts before the wgrad GEMM
    side.wait_stream(main)  # the wgrad's inputs are ready
    with torch.cuda.stream(side):
        grads = wgrad()
    main.wait_stream(side)  # the caller's stream sees the gradients
    for g in grads:  # made on the side stream, used on the caller's: the allocator must not reuse them early
        if g is not None:
            g.record_stream(main)
    return out, grads


def _empty(x):
    return x.new_empty((0,))


# ---- column-parallel
@torch.library.custom_op("tandem::column_parallel_linear", mutates_args=())
def _column(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: int,
            sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    c = _c(comm, "column_parallel_linear")
    if sequence_parallel:
        gathered = c._out((x.shape[0] * c.world_size, x.shape[1]), x.dtype)
        y = c.ag_gemm(x, weight, a_gathered=gathered)
    else:
        gathered = _empty(x)
        y = x @ weight.T
    if bias is not None:
        y += bias
    return y, gathered


@_column.register_fake
def _(x, weight, bias, comm, sequence_parallel):
    m = x.shape[0] * _c(comm, "column_parallel_linear").world_size if sequence_parallel else x.shape[0]
    return x.new_empty((m, weight.shape[0])), x.new_empty((m, x.shape[1]) if sequence_parallel else (0,))


@torch.library.custom_op("tandem::column_parallel_linear_backward", mutates_args=())
def _column_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, comm: int, sequence_parallel: bool,
                need_dx: bool, need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    what = "column_parallel_linear"
    c = _c(comm, what)
    m = dy.shape[0]
    _saved(x, "input (gathered over the ranks)" if sequence_parallel else "input", what, (m, weight.shape[1]))
    _saved(weight, "weight", what, (dy.shape[1], weight.shape[1]))
    dy = dy.contiguous()

    def wgrad():
        return (dy.T @ x if need_dw else _empty(dy)), (dy.sum(0) if need_db else _empty(dy))

    if not need_dx:
        dw, db = wgrad()
        return _empty(dy), dw, db
    dx, (dw, db) = _with_wgrad(c, "gemm_rs" if sequence_parallel else "gemm_ar", (dy, weight), {"layout": "nn"},
                               wgrad)
    return dx, dw, db


@_column_bwd.register_fake
def _(dy, x, weight, comm, sequence_parallel, need_dx, need_dw, need_db):
    rows = dy.shape[0] // _c(comm, "column_parallel_linear").world_size if sequence_parallel else dy.shape[0]
    return (dy.new_empty((rows, weight.shape[1]) if need_dx else (0,)),
            dy.new_empty(tuple(weight.shape) if need_dw else (0,)), dy.new_empty((dy.shape[1],) if need_db else (0,)))


def _column_setup(ctx, inputs, output):
    x, weight, bias, comm, sequence_parallel = inputs
    ctx.save_for_backward(output[1] if sequence_parallel else x, weight)
    ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None


def _column_backward(ctx, dy, _dgathered):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = torch.ops.tandem.column_parallel_linear_backward(
        dy, x, weight, ctx.comm, ctx.sequence_parallel, need[0], need[1], ctx.has_bias and need[2])
    return (dx if need[0] else None), (dw if need[1] else None), \
        (db if ctx.has_bias and need[2] else None), None, None


_column.register_autograd(_column_backward, setup_context=_column_setup)


# ---- row-parallel
@torch.library.custom_op("tandem::row_parallel_linear", mutates_args=())
def _row(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: int,
         sequence_parallel: bool) -> torch.Tensor:
    c = _c(comm, "row_parallel_linear")
    y = c.gemm_rs(x, weight) if sequence_parallel else c.gemm_ar(x, weight)
    if bias is not None:
        y += bias  # after the reduction: the bias is replicated
    return y


@_row.register_fake
def _(x, weight, bias, comm, sequence_parallel):
    c = _c(comm, "row_parallel_linear")
    rows = _comm.rows_of(x.shape[0], c.rank, c.world_size)[1] if sequence_parallel else x.shape[0]
    return x.new_empty((rows, weight.shape[0]))


@torch.library.custom_op("tandem::row_parallel_linear_backward", mutates_args=())
def _row_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, comm: int, sequence_parallel: bool,
             need_dx: bool, need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    what = "row_parallel_linear"
    c = _c(comm, what)
    _saved(x, "input", what, (x.shape[0], weight.shape[1]))
    _saved(weight, "weight", what, (dy.shape[1], weight.shape[1]))
    dy = dy.contiguous()
    m = x.shape[0]
    dx = _empty(dy)
    if sequence_parallel:
        # dy is this rank's rows: the input gradient's AllGather + GEMM also gives gather(dy) for dW and db.
        g = c._out((m, dy.shape[1]), dy.dtype)
        if need_dx:
            dx = c.ag_gemm(dy, weight, m=m, a_gathered=g, layout="nn")
        elif need_dw or need_db:
            if m % c.world_size:
                raise ValueError(f"tandem.nn.{what}: the input's rows ({m}) must split evenly over the "
                                 f"{c.world_size} ranks")
            c.allgather(dy, out=g)
        dy = g
    elif need_dx:
        dx = dy @ weight
    dw = dy.T @ x if need_dw else _empty(dy)
    db = dy.sum(0) if need_db else _empty(dy)
    return dx, dw, db


@_row_bwd.register_fake
def _(dy, x, weight, comm, sequence_parallel, need_dx, need_dw, need_db):
    return (dy.new_empty(tuple(x.shape) if need_dx else (0,)), dy.new_empty(tuple(weight.shape) if need_dw else (0,)),
            dy.new_empty((dy.shape[1],) if need_db else (0,)))


def _row_setup(ctx, inputs, output):
    x, weight, bias, comm, sequence_parallel = inputs
    ctx.save_for_backward(x, weight)
    ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None


def _row_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = torch.ops.tandem.row_parallel_linear_backward(
        dy, x, weight, ctx.comm, ctx.sequence_parallel, need[0], need[1], ctx.has_bias and need[2])
    return (dx if need[0] else None), (dw if need[1] else None), \
        (db if ctx.has_bias and need[2] else None), None, None


_row.register_autograd(_row_backward, setup_context=_row_setup)


# ---- the input of a row-parallel layer that is not parallel yet: this rank's columns, the gradient gathered back
@torch.library.custom_op("tandem::scatter_to_parallel", mutates_args=())
def _scatter(x: torch.Tensor, comm: int) -> torch.Tensor:
    c = _c(comm, "scatter_to_parallel")
    w = x.shape[1] // c.world_size
    return x[:, c.rank * w:(c.rank + 1) * w].clone(memory_format=torch.contiguous_format)  # (never x itself)


@_scatter.register_fake
def _(x, comm):
    return x.new_empty((x.shape[0], x.shape[1] // _c(comm, "scatter_to_parallel").world_size))


@torch.library.custom_op("tandem::gather_from_parallel", mutates_args=())
def _gather(dx: torch.Tensor, comm: int) -> torch.Tensor:
    c = _c(comm, "gather_from_parallel")
    g = c.allgather(dx.T.contiguous())  # [world * cols, rows]: every rank's columns, in rank order
    return g.T.contiguous()


@_gather.register_fake
def _(dx, comm):
    return dx.new_empty((dx.shape[0], dx.shape[1] * _c(comm, "gather_from_parallel").world_size))


_scatter.register_autograd(lambda ctx, g: (torch.ops.tandem.gather_from_parallel(g.contiguous(), ctx.comm), None),
                           setup_context=lambda ctx, inputs, output: setattr(ctx, "comm", inputs[1]))


# The expert-parallel MoE FFN with autograd lives in moe.py; its functional form is here too.
from .moe import moe_ffn  # noqa: E402,F401  (moe.py imports _c and _saved from above)


# ---- the public functions
def _check(comm, x, weight, bias, what: str, in_dim: int, out_dim: int, bias_what: str):
    if not isinstance(comm, _comm.Communicator):
        raise TypeError(f"tandem.nn.{what}: argument 'comm' must be a tandem.Communicator, got {type(comm).__name__}")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tandem.nn.{what}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"tandem.nn.{what}: argument 'weight' must be 2-D, got shape {list(weight.shape)}")
    if x.dim() < 2 or x.shape[-1] != in_dim:
        raise ValueError(f"tandem.nn.{what}: argument 'x' must have shape [..., {in_dim}] (its last axis the "
                         f"weight's {weight.shape[1]} columns), got {list(x.shape)}")
    if bias is not None and tuple(bias.shape) != (out_dim,):
        raise ValueError(f"tandem.nn.{what}: argument 'bias' must have shape [{out_dim}] ({bias_what}), got "
                         f"{list(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"tandem.nn.{what}: argument '{name}' must have dtype {x.dtype} (as 'x'), got {t.dtype}")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           comm: "_comm.Communicator", sequence_parallel: bool = False) -> torch.Tensor:
    """y = x W^T + b with W's output features split over the ranks: weight [out/world, in] and bias [out/world] are
    this rank's rows; y [..., out/world] is this rank's columns of the output. x [..., in]: replicated, or with
    sequence_parallel this rank's rows of the sequence (its first axis; the ranks' equal shares), and then y holds
    every rank's rows ([world * x.shape[0], ...])."""
    what = "column_parallel_linear"
    _check(comm, x, weight, bias, what, weight.shape[1] if weight.dim() == 2 else -1,
           weight.shape[0] if weight.dim() == 2 else -1, "this rank's output features, as weight's rows")
    lead = list(x.shape[:-1])
    if sequence_parallel:
        lead[0] *= comm.world_size
    y, _ = torch.ops.tandem.column_parallel_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(),
                                                   bias, comm.id, bool(sequence_parallel))
    return y.view(*lead, weight.shape[0])


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        comm: "_comm.Communicator", sequence_parallel: bool = False,
                        input_is_parallel: bool = True) -> torch.Tensor:
    """y = x W^T + b with W's input features split over the ranks: weight [out, in/world] is this rank's columns,
    bias [out] is replicated (added once, after the sum over ranks). x [..., in/world] is this rank's columns of the
    input (input_is_parallel=False: x [..., in], replicated, and this rank takes its columns; the gradient is
    gathered back). y [..., out]: the sum over ranks, or with sequence_parallel this rank's rows of it (the first
    axis split evenly over the ranks)."""
    what = "row_parallel_linear"
    if not input_is_parallel and sequence_parallel:
        raise ValueError(f"tandem.nn.{what}: sequence_parallel needs input_is_parallel=True (the input of a "
                         "sequence-parallel row-parallel layer comes from a column-parallel one)")
    in_r = weight.shape[1] if weight.dim() == 2 else -1
    x_in = x if input_is_parallel else None
    if not input_is_parallel:
        _check(comm, x, weight, bias, what, in_r * comm.world_size, weight.shape[0] if weight.dim() == 2 else -1,
               "the output features; replicated")
        x_in = torch.ops.tandem.scatter_to_parallel(x.reshape(-1, x.shape[-1]).contiguous(), comm.id)
        x_in = x_in.view(*x.shape[:-1], in_r)
    _check(comm, x_in, weight, bias, what, in_r, weight.shape[0] if weight.dim() == 2 else -1,
           "the output features; replicated")
    lead = list(x.shape[:-1])
    if sequence_parallel:
        if x.dim() > 2 and lead[0] % comm.world_size:
            raise ValueError(f"tandem.nn.{what}: argument 'x' must have a first axis that splits evenly over the "
                             f"{comm.world_size} ranks (sequence_parallel), got {list(x.shape)}")
        rows = 1
        for d in lead:
            rows *= d
        lead = [lead[0] // comm.world_size, *lead[1:]] if x.dim() > 2 else \
            [_comm.rows_of(rows, comm.rank, comm.world_size)[1]]
    y = torch.ops.tandem.row_parallel_linear(x_in.reshape(-1, in_r).contiguous(), weight.contiguous(), bias,
                                             comm.id, bool(sequence_parallel))
    return y.view(*lead, weight.shape[0])


# Context-parallel attention (ring attention with autograd) lives in attention.py; its functional form is here too.
from .attention import ring_attention  # noqa: E402,F401  (attention.py imports _c and _saved from above)
