"""Tensor-parallel layers over tandem's fused GEMM ops, named as in Megatron-LM and TransformerEngine, and
context-parallel attention over its ring attention.

    comm = tandem.Communicator()
    up = tandem.nn.ColumnParallelLinear(hidden, ffn, comm, sequence_parallel=True)    # weight [ffn/world, hidden]
    down = tandem.nn.RowParallelLinear(ffn, hidden, comm, sequence_parallel=True)     # weight [hidden, ffn/world]
    y = down(torch.relu(up(x)))     # x, y: this rank's rows of the sequence

    attn = tandem.nn.ContextParallelAttention(comm, heads, head_dim, num_kv_heads=kv_heads, causal=True)
    o = attn(q, k, v)   # q [seq_r, heads, head_dim], k, v [seq_r, kv_heads, head_dim]: this rank's rows

How each layer runs forward and backward (which tandem op, which layout, what overlaps what): functional.py and
attention.py.
"""

from __future__ import annotations

import math

import torch

from . import functional
from .attention import ContextParallelAttention, context_parallel_positions
from .functional import column_parallel_linear, ring_attention, row_parallel_linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ContextParallelAttention", "functional",
           "column_parallel_linear", "row_parallel_linear", "ring_attention", "context_parallel_positions"]


def _split(what: str, name: str, features: int, world: int) -> int:
    if features % world:
        raise ValueError(f"tandem.nn.{what}: argument '{name}' ({features}) must be a multiple of the communicator's "
                         f"{world} ranks")
    return features // world


class _ParallelLinear(torch.nn.Module):
    def __init__(self, in_features, out_features, comm, bias, sequence_parallel, dtype, device, shape, bias_shape):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.comm, self.sequence_parallel = comm, bool(sequence_parallel)
        kw = dict(dtype=dtype or torch.get_default_dtype(), device=comm.device if device is None else device)
        self.weight = torch.nn.Parameter(torch.empty(shape, **kw))
        self.bias = torch.nn.Parameter(torch.empty(bias_shape, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the whole layer (U(-1/sqrt(in), 1/sqrt(in)) for weight and bias), drawn
        on this rank's shard. For the same values as one nn.Linear, load them: load_full()."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, comm, **kw):
        """This rank's shard of `linear` (same in and out features, bias if it has one)."""
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    dtype=kw.pop("dtype", linear.weight.dtype), **kw)
        layer.load_full(linear.weight, linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, rank={self.comm.rank}/{self.comm.world_size}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with the output features split over the communicator's ranks: weight [out/world, in] and bias
    [out/world] are this rank's rows, y [..., out/world] this rank's columns of the output (feed it to a
    RowParallelLinear, or an elementwise op first). x [..., in] is replicated; with sequence_parallel=True it is this
    rank's rows of the sequence (first axis, equal shares) and is gathered inside the fused AllGather + GEMM."""

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None, device=None):
        out_r = _split("ColumnParallelLinear", "out_features", out_features, comm.world_size)
        super().__init__(in_features, out_features, comm, bias, sequence_parallel, dtype, device,
                         (out_r, in_features), (out_r,))

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Sets this rank's shard from the whole layer's weight [out, in] (and bias [out])."""
        r, n = self.comm.rank, self.weight.shape[0]
        with torch.no_grad():
            self.weight.copy_(weight[r * n:(r + 1) * n])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias[r * n:(r + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.comm, self.sequence_parallel)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with the input features split over the communicator's ranks: weight [out, in/world] is this
    rank's columns, bias [out] replicated (added after the sum over ranks). x [..., in/world] is this rank's columns
    (input_is_parallel=True, as a ColumnParallelLinear gives them; False: x [..., in] replicated, split here). y
    [..., out] is the sum over ranks, on every rank; with sequence_parallel=True this rank's rows of it (the fused
    GEMM + ReduceScatter)."""

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None, device=None):
        in_r = _split("RowParallelLinear", "in_features", in_features, comm.world_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("tandem.nn.RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel = bool(input_is_parallel)
        super().__init__(in_features, out_features, comm, bias, sequence_parallel, dtype, device,
                         (out_features, in_r), (out_features,))

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Sets this rank's shard from the whole layer's weight [out, in] (and bias [out])."""
        r, n = self.comm.rank, self.weight.shape[1]
        with torch.no_grad():
            self.weight.copy_(weight[:, r * n:(r + 1) * n])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, self.comm, self.sequence_parallel,
                                   self.input_is_parallel)


# Expert parallelism: the MoE layer and its functional form (moe.py).
from .moe import MoE, moe_ffn, moe_ffn_torch  # noqa: E402

__all__ += ["MoE", "moe_ffn", "moe_ffn_torch"]
