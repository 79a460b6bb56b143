"""Expert-parallel mixture of experts over tandem's MoE ops: the experts are spread over the communicator's ranks, each
rank routes its own tokens, and one fused op (moe-dispatch-ffn-combine) sends every token to its top-k experts' ranks,
runs the SwiGLU FFN there and brings the weighted sum back in token order.

    comm = tandem.Communicator()
    moe = tandem.nn.MoE(hidden, ffn, experts, topk, comm)   # w1 [experts/world, 2*ffn, hidden], w2 [.., hidden, ffn]
    y = moe(x)                 # x, y [tokens, hidden]: this rank's tokens (ranks may differ; 0 is fine)
    y.sum().backward()
    moe.reduce_router_grad()   # the router is replicated: sum its gradient over the ranks before the step

Forward and backward are torch.library custom ops (tandem::moe_ffn_layer and its _backward) joined with
register_autograd, as the tensor-parallel layers are, so torch.compile(fullgraph=True) keeps both. The backward is one
tandem op (moe-ffn-backward): it takes the forward's inputs and dout and returns dx, dtopk_weights, and dw1, dw2 of this
rank's experts (summed over every rank's tokens routed to them). Every sum runs in a fixed order, so the gradients
repeat bit for bit. SwiGLU's backward needs the gate and up activations of every routed row; two ways:
- recomputed (the default): the forward keeps nothing, the backward recomputes gate|up on the experts' ranks (one
  grouped GEMM, a quarter of the backward's matrix work), so the autograd context saves only the inputs the caller
  holds anyway;
- saved (save_activations=True; tandem::moe_ffn_layer_saved and its _backward): the forward also writes gate|up of
  the rows routed to this rank's experts into a tensor the autograd context keeps until the backward, which then skips
  that GEMM. It costs 2 * ffn elements per routed row (about tokens * topk rows per rank with balanced routing) and,
  to size that tensor exactly, one small allgather of every rank's per-expert counts per forward, whose count is
  read on the host (a stream synchronisation on the cuda backend). With saved_rows=N the tensor has a fixed N rows
  instead: no allgather, no host read, a static shape, so the layer can be captured in a CUDA graph; a forward that
  routes more than N rows to this rank's experts fails naming the rows it needs, and the communicator stays usable.
tandem.h (tandem_moe_dispatch_ffn_combine_backward) says what each costs in memory and time.

Routing (MoE.route): the router's logits in float32, softmax over the experts, the top-k, their weights renormalised
to sum to 1 (Mixtral). With a capacity factor each expert takes at most ceil(factor * tokens * topk / experts) of this
rank's (token, slot) pairs, first slot 0 of every token in token order, then slot 1, ... (GShard's priority); a
dropped pair keeps its expert id but gets weight 0, so it adds nothing to the output and no gradient to anything.
"""

from __future__ import annotations

import math

import torch

from .. import _comm
from .functional import _c, _saved

__all__ = ["MoE", "moe_ffn", "moe_ffn_torch"]

_WHAT = "moe_ffn"


@torch.library.custom_op("tandem::moe_ffn_layer", mutates_args=())
def _moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
         comm: int) -> torch.Tensor:
    return _c(comm, _WHAT).moe_ffn(x, topk_ids, topk_weights, w1, w2)


@_moe.register_fake
def _(x, topk_ids, topk_weights, w1, w2, comm):
    return x.new_empty(x.shape)


def _check_forward_inputs(dout, x, topk_ids, topk_weights, w1, w2):
    """The forward's inputs the backward gets back from autograd: still there, and of the shapes dout implies."""
    tokens, hidden = dout.shape
    _saved(x, "x", _WHAT, (tokens, hidden))
    _saved(topk_ids, "topk_ids", _WHAT, (tokens, topk_ids.shape[1]))
    _saved(topk_weights, "topk_weights", _WHAT, tuple(topk_ids.shape))
    _saved(w1, "w1", _WHAT, tuple(w1.shape))
    _saved(w2, "w2", _WHAT, (w1.shape[0], hidden, w1.shape[1] // 2))


@torch.library.custom_op("tandem::moe_ffn_layer_backward", mutates_args=())
def _moe_bwd(dout: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             w1: torch.Tensor, w2: torch.Tensor, comm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    c = _c(comm, _WHAT)
    _check_forward_inputs(dout, x, topk_ids, topk_weights, w1, w2)
    dx, dweights, dw1, dw2 = c.moe_ffn_backward(x, topk_ids, topk_weights, w1, w2, dout.contiguous())
    return dx, dweights, dw1, dw2


@_moe_bwd.register_fake
def _(dout, x, topk_ids, topk_weights, w1, w2, comm):
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape))


def _moe_setup(ctx, inputs, output):
    x, topk_ids, topk_weights, w1, w2, comm = inputs
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2)
    ctx.comm = comm


def _moe_backward(ctx, dout):
    x, topk_ids, topk_weights, w1, w2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dweights, dw1, dw2 = torch.ops.tandem.moe_ffn_layer_backward(dout, x, topk_ids, topk_weights, w1, w2, ctx.comm)
    return (dx if need[0] else None), None, (dweights if need[2] else None), (dw1 if need[3] else None), \
        (dw2 if need[4] else None), None


_moe.register_autograd(_moe_backward, setup_context=_moe_setup)


def _routed_rows(c, topk_ids: torch.Tensor, local: int) -> int:
    """The rows every rank routes to this rank's experts (what the saved gate|up must hold): each rank's per-expert
    counts, allgathered in rank order, summed over this rank's experts. Collective."""
    experts = local * c.world_size
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=experts).to(torch.int32)
    every = c.allgather(counts.view(1, -1))  # [world, experts]
    first = c.rank * local
    return int(every[:, first:first + local].sum().item())


@torch.library.custom_op("tandem::moe_ffn_layer_saved", mutates_args=())
def _moe_saved(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, comm: int, saved_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """saved_rows: the saved tensor's fixed rows, or -1: exactly the routed rows (counted: collective, host read)."""
    c = _c(comm, _WHAT)
    rows = saved_rows if saved_rows >= 0 else _routed_rows(c, topk_ids, w1.shape[0])
    saved = c._out((rows, w1.shape[1]), x.dtype)
    return c.moe_ffn(x, topk_ids, topk_weights, w1, w2, saved=saved if rows else None), saved


@_moe_saved.register_fake
def _(x, topk_ids, topk_weights, w1, w2, comm, saved_rows):
    # The exact routed rows are known only once every rank's ids are counted: a dynamic size.
    rows = saved_rows if saved_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(x.shape), x.new_empty((rows, w1.shape[1]))


@torch.library.custom_op("tandem::moe_ffn_layer_saved_backward", mutates_args=())
def _moe_saved_bwd(dout: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w1: torch.Tensor, w2: torch.Tensor, saved: torch.Tensor,
                   comm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _c(comm, _WHAT)
    _check_forward_inputs(dout, x, topk_ids, topk_weights, w1, w2)
    _saved(saved, "saved", _WHAT, (saved.shape[0], w1.shape[1]))
    return c.moe_ffn_backward(x, topk_ids, topk_weights, w1, w2, dout.contiguous(),
                              saved=saved if saved.shape[0] else None)


@_moe_saved_bwd.register_fake
def _(dout, x, topk_ids, topk_weights, w1, w2, saved, comm):
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape))


def _moe_saved_setup(ctx, inputs, output):
    x, topk_ids, topk_weights, w1, w2, comm, _ = inputs
    saved = output[1]
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, saved)
    ctx.mark_non_differentiable(saved)
    ctx.comm = comm


def _moe_saved_backward(ctx, dout, _dsaved):
    x, topk_ids, topk_weights, w1, w2, saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dweights, dw1, dw2 = torch.ops.tandem.moe_ffn_layer_saved_backward(dout, x, topk_ids, topk_weights, w1, w2,
                                                                            saved, ctx.comm)
    return (dx if need[0] else None), None, (dweights if need[2] else None), (dw1 if need[3] else None), \
        (dw2 if need[4] else None), None, None


_moe_saved.register_autograd(_moe_saved_backward, setup_context=_moe_saved_setup)


def moe_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            comm: "_comm.Communicator", save_activations: bool = False,
            saved_rows: int | None = None) -> torch.Tensor:
    """The expert-parallel MoE FFN with autograd: out_t = sum over slots s of topk_weights[t, s] *
    FFN_e(x_t), e = topk_ids[t, s], FFN_e(x) = (silu(x W1g_e^T) * (x W1u_e^T)) W2_e^T.

    x [tokens, hidden] (this rank's tokens; 0 rows is fine); topk_ids [tokens, topk] (expert ids in [0, experts),
    distinct within a row; any integer dtype); topk_weights [tokens, topk] (computed in float32 whatever its dtype);
    w1 [experts/world, 2*ffn, hidden] (gate rows, then up rows) and w2 [experts/world, hidden, ffn]: this rank's
    experts, experts [r*E/world, (r+1)*E/world) on rank r. Gradients flow to x, topk_weights, w1 and w2 (w1 and w2's
    are summed over every rank's tokens routed to this rank's experts). Every rank must call it (it is collective).
    save_activations: keep gate|up of the rows routed to this rank's experts from the forward for the backward
    instead of recomputing it there (the module docstring says what each costs); every rank passes the same value.
    saved_rows (with save_activations): a fixed bound on the rows routed to this rank's experts, so the forward
    neither counts them (an allgather and a host read) nor has a dynamic shape: CUDA-graph capturable. None: counted
    exactly. A forward routing more rows here fails naming the rows needed."""
    if not isinstance(comm, _comm.Communicator):
        raise TypeError(f"tandem.nn.{_WHAT}: argument 'comm' must be a tandem.Communicator, got {type(comm).__name__}")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tandem.nn.{_WHAT}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"tandem.nn.{_WHAT}: argument 'x' must be [tokens, hidden], got {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"tandem.nn.{_WHAT}: arguments 'topk_ids' and 'topk_weights' must both be [{x.shape[0]}, "
                         f"topk] (tokens of 'x'), got {list(topk_ids.shape)} and {list(topk_weights.shape)}")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"tandem.nn.{_WHAT}: argument '{name}' is {t.dtype}: FP8 weights run the forward only, "
                             "without autograd; call comm.moe_ffn(x, topk_ids, topk_weights, w1, w2, w1_scale=..., "
                             "w2_scale=...) under torch.no_grad(), or pass weights in x's dtype")
        if t.dtype != x.dtype:
            raise ValueError(f"tandem.nn.{_WHAT}: argument '{name}' must have dtype {x.dtype} (as 'x'), got {t.dtype}")
    if saved_rows is not None and (not save_activations or isinstance(saved_rows, bool) or
                                   not isinstance(saved_rows, int) or saved_rows < 1):
        raise ValueError(f"tandem.nn.{_WHAT}: argument 'saved_rows' must be a positive int bound on the rows routed "
                         f"to this rank's experts, with save_activations=True; got {saved_rows!r} (save_activations="
                         f"{save_activations}); pass None to count them each forward")
    args = (x.contiguous(), topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous(), w1.contiguous(),
            w2.contiguous(), comm.id)
    if save_activations:
        return torch.ops.tandem.moe_ffn_layer_saved(*args, -1 if saved_rows is None else saved_rows)[0]
    return torch.ops.tandem.moe_ffn_layer(*args)


def moe_ffn_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """The same layer in plain PyTorch in one process, every expert local: w1 [experts, 2*ffn, hidden] and w2
    [experts, hidden, ffn] hold all experts (rank r's tandem shard is rows [r*E/world, (r+1)*E/world)). A reference
    for moe_ffn (its tests and python/examples/moe_train.py compare against its autograd)."""
    ffn = w1.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = x[rows]
        gate_up = xe @ w1[e].T
        h = torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        y = (h @ w2[e].T) * topk_weights[rows, slots].unsqueeze(1).to(x.dtype)
        out = out.index_add(0, rows, y)
    return out


class MoE(torch.nn.Module):
    """A mixture-of-experts layer whose experts are spread over the communicator's ranks (expert parallelism):
    router [experts, hidden] (a bias-free nn.Linear, replicated: every rank holds all of it), w1 [experts/world,
    2*ffn, hidden] and w2 [experts/world, hidden, ffn] (this rank's experts). forward(x) takes this rank's tokens
    [..., hidden] and returns the layer's output for them. capacity_factor (None: no limit) caps each expert's share
    of this rank's (token, slot) pairs (the module docstring says how). save_activations: the forward keeps the
    experts' gate|up activations for the backward instead of its recomputing them (moe_ffn; the module docstring says
    what each costs); saved_rows: a fixed bound on the rows routed to this rank's experts for the saved tensor
    (moe_ffn: no host read, CUDA-graph capturable). Call reduce_router_grad() after backward: each rank's router
    gradient covers only its own tokens."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, comm, capacity_factor: float | None = None,
                 dtype: torch.dtype | None = None, device=None, save_activations: bool = False,
                 saved_rows: int | None = None):
        super().__init__()
        if experts % comm.world_size:
            raise ValueError(f"tandem.nn.MoE: argument 'experts' ({experts}) must be a multiple of the communicator's "
                             f"{comm.world_size} ranks")
        if not 1 <= topk <= experts:
            raise ValueError(f"tandem.nn.MoE: argument 'topk' ({topk}) must be in [1, experts = {experts}]")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"tandem.nn.MoE: argument 'capacity_factor' must be positive or None, got "
                             f"{capacity_factor}")
        self.hidden, self.ffn, self.experts, self.topk = int(hidden), int(ffn), int(experts), int(topk)
        self.comm, self.capacity_factor, self.save_activations = comm, capacity_factor, bool(save_activations)
        self.saved_rows = saved_rows
        kw = dict(dtype=dtype or torch.get_default_dtype(), device=comm.device if device is None else device)
        local = experts // comm.world_size
        self.router = torch.nn.Linear(hidden, experts, bias=False, **kw)
        self.w1 = torch.nn.Parameter(torch.empty((local, 2 * ffn, hidden), **kw))
        self.w2 = torch.nn.Parameter(torch.empty((local, hidden, ffn), **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of each expert's projections (U(-1/sqrt(in), 1/sqrt(in))), drawn on this
        rank's experts. For the same values on every world size, load them: load_full()."""
        torch.nn.init.uniform_(self.w1, -1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))
        torch.nn.init.uniform_(self.w2, -1 / math.sqrt(self.ffn), 1 / math.sqrt(self.ffn))

    @property
    def first_expert(self) -> int:
        return self.comm.rank * self.w1.shape[0]

    def load_full(self, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Sets the router [experts, hidden] and this rank's experts from all experts' w1 [experts, 2*ffn, hidden]
        and w2 [experts, hidden, ffn]."""
        e0, n = self.first_expert, self.w1.shape[0]
        with torch.no_grad():
            self.router.weight.copy_(router)
            self.w1.copy_(w1[e0:e0 + n])
            self.w2.copy_(w2[e0:e0 + n])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [tokens, topk] int32, topk_weights [tokens, topk] float32) for x [tokens, hidden]."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = probs.topk(self.topk, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.capacity_factor is not None:
            weights = weights * capacity_mask(ids, self.experts, self.capacity_factor)
        return ids.to(torch.int32), weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"tandem.nn.MoE: argument 'x' must have shape [..., {self.hidden}], got {list(x.shape)}")
        flat = x.reshape(-1, self.hidden)
        ids, weights = self.route(flat)
        return moe_ffn(flat, ids, weights, self.w1, self.w2, self.comm, self.save_activations,
                       self.saved_rows).view(x.shape)

    def reduce_router_grad(self) -> None:
        """Sums the router's gradient over the ranks (in rank order, so every rank gets the same bits): each rank's
        backward gave the gradient of its own tokens' loss only."""
        g = self.router.weight.grad
        if g is None or self.comm.world_size == 1:
            return
        every = self.comm.allgather(g.contiguous().view(1, -1))  # [world, numel], rank order
        total = every[0].clone()
        for r in range(1, every.shape[0]):
            total += every[r]
        g.copy_(total.view_as(g))

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, topk={self.topk}, "
                f"capacity_factor={self.capacity_factor}, save_activations={self.save_activations}, "
                f"saved_rows={self.saved_rows}, "
                f"local_experts={self.w1.shape[0]}, "
                f"rank={self.comm.rank}/{self.comm.world_size}")


def capacity_mask(topk_ids: torch.Tensor, experts: int, capacity_factor: float) -> torch.Tensor:
    """1.0 for each (token, slot) pair an expert keeps, 0.0 for those past its capacity, ceil(capacity_factor *
    tokens * topk / experts) pairs of these rows, taken slot-major (every token's slot 0 first, in token order)."""
    tokens, topk = topk_ids.shape
    capacity = math.ceil(capacity_factor * tokens * topk / experts)
    onehot = torch.nn.functional.one_hot(topk_ids.T.reshape(-1).long(), experts)  # [topk * tokens, experts]
    position = (onehot.cumsum(0) * onehot).sum(-1)  # 1-based place in its expert's queue
    return (position <= capacity).to(torch.float32).view(topk, tokens).T
