#!/usr/bin/env python3
"""Train a Llama-style MLP block with tensor parallelism over tandem, next to the same model in plain PyTorch.

The block is y = down(silu(gate(x)) * up(x)): gate and up are tandem.nn.ColumnParallelLinear (each rank holds
ffn/ranks of their output features), down is tandem.nn.RowParallelLinear (the matching ffn/ranks input features),
all sequence-parallel by default (each rank holds seq/ranks rows of x and y; the AllGather and the ReduceScatter are
fused into the GEMMs). The script starts --ranks processes on this node, each a rank of one tandem communicator on
the node's tandemd ($TANDEM_SOCKET or the default socket), trains for --steps steps of AdamW (or SGD) on a
regression target, and has rank 0 print each step's loss next to the loss of one unsharded PyTorch model with the
same initial weights, data and optimizer. It exits 1 when a loss or, at the end, a weight differs beyond the
tolerance of the dtype (float32: 1e-4 relative; bfloat16: 5e-2), else 0.

  python python/examples/tp_mlp_train.py --ranks 2                            # cpu backend, float32
  python python/examples/tp_mlp_train.py --ranks 4 --device cuda --dtype bfloat16   # cuda backend, ranks share GPUs
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import tandem
from _ranks import DTYPES, run_ranks, verdict


class MLP(torch.nn.Module):
    """The reference: Llama's MLP block in plain PyTorch."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TPMLP(torch.nn.Module):
    """The same block, tensor-parallel over `comm`, its shards taken from `ref`."""

    def __init__(self, ref: MLP, comm, sequence_parallel: bool):
        super().__init__()
        col = dict(sequence_parallel=sequence_parallel)
        self.gate = tandem.nn.ColumnParallelLinear.from_linear(ref.gate, comm, **col)
        self.up = tandem.nn.ColumnParallelLinear.from_linear(ref.up, comm, **col)
        self.down = tandem.nn.RowParallelLinear.from_linear(ref.down, comm, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def optimizer(name, params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01) if name == "adamw" else torch.optim.SGD(params, lr=lr)


def rank_main(rank, args, uid, results):
    try:
        results.put((rank, train(rank, args, uid)))
    except BaseException as e:  # noqa: BLE001  (the parent reports every rank's failure)
        import traceback
        results.put((rank, f"rank {rank} failed:\n{traceback.format_exc()}" if not isinstance(e, SystemExit) else
                     str(e)))


def train(rank, args, uid):
    torch.set_num_threads(1)  # the ranks and tandemd share the node's cores
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks beyond the GPU count share them
    comm = tandem.Communicator(rank=rank, world_size=args.ranks, unique_id=uid)
    if comm.is_cuda != (args.device == "cuda"):
        raise SystemExit(f"--device {args.device}, but the node's tandemd runs the {comm.backend} backend")
    dev, dtype, n = comm.device, DTYPES[args.dtype], comm.world_size
    torch.manual_seed(args.seed)  # the same initial weights in every rank's reference
    ref = MLP(args.hidden, args.ffn).to(dev, dtype)
    tp = TPMLP(ref, comm, args.sequence_parallel)
    opt_ref, opt_tp = optimizer(args.optimizer, ref.parameters(), args.lr), \
        optimizer(args.optimizer, tp.parameters(), args.lr)
    s = args.seq // n
    rows = slice(rank * s, (rank + 1) * s) if args.sequence_parallel else slice(None)
    data = torch.Generator().manual_seed(args.seed + 1)
    worst = 0.0
    lines = []
    for step in range(args.steps):
        x = torch.randn(args.seq, args.batch, args.hidden, generator=data).to(dev, dtype)
        target = torch.randn(args.seq, args.batch, args.hidden, generator=data).to(dev, dtype)
        count = target.numel()
        # reference: the whole batch in one process
        opt_ref.zero_grad()
        loss_ref = ((ref(x).float() - target.float()) ** 2).sum() / count
        loss_ref.backward()
        opt_ref.step()
        loss_ref = float(loss_ref.detach())
        # tensor-parallel: this rank's rows (sequence parallel) or all of them (replicated); the loss is the sum of
        # the ranks' parts, so each rank's backward starts from its part
        opt_tp.zero_grad()
        part = ((tp(x[rows]).float() - target[rows].float()) ** 2).sum() / count
        part.backward()
        opt_tp.step()
        parts = comm.allgather(part.detach().reshape(1).contiguous())
        loss_tp = float(parts.sum()) if args.sequence_parallel else float(parts[0])
        rel = abs(loss_tp - loss_ref) / max(abs(loss_ref), 1e-12)
        worst = max(worst, rel)
        lines.append(f"step {step}: loss tandem TP {loss_tp:.6f}  torch {loss_ref:.6f}  rel diff {rel:.2e}")
    # the trained weights: this rank's shards against the reference's
    c = args.ffn // n
    with torch.no_grad():
        pairs = [(tp.gate.weight, ref.gate.weight[rank * c:(rank + 1) * c]),
                 (tp.up.weight, ref.up.weight[rank * c:(rank + 1) * c]),
                 (tp.down.weight, ref.down.weight[:, rank * c:(rank + 1) * c])]
        wdiff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in pairs)
    comm.close()
    return lines, worst, wdiff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks, one process each (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: tandemd runs the cpu backend; cuda: the cuda backend (default cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="default adamw")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--ffn", type=int, default=128, help="MLP width, a multiple of --ranks (default 128)")
    p.add_argument("--seq", type=int, default=16, help="sequence length, a multiple of --ranks (default 16)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="replicate the activations instead of sharding them by sequence")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    for name, v in (("--ffn", args.ffn), ("--seq", args.seq)):
        if v % args.ranks:
            p.error(f"{name} {v} must be a multiple of --ranks {args.ranks}")
    got = run_ranks(rank_main, args, args.device)
    if got is None:
        return 1
    lines, worst, _ = got[0]
    print(f"Llama MLP block, hidden {args.hidden}, ffn {args.ffn}, {args.ranks} ranks "
          f"({'sequence parallel' if args.sequence_parallel else 'replicated activations'}), {args.dtype} on "
          f"{args.device}, {args.optimizer} lr {args.lr}")
    print("\n".join(lines))
    return verdict(got, args.dtype)


if __name__ == "__main__":
    sys.exit(main())
