#!/usr/bin/env python3
"""Train a Mixtral-style MoE block with expert parallelism over tandem, next to the same model in plain PyTorch.

The block is y = x + MoE(RMSNorm(x)): a router (a bias-free linear layer, softmax over the experts, the top-k renormalised)
sends each token to --topk of --experts SwiGLU experts, and the experts' outputs are summed with the routing weights.
tandem.nn.MoE spreads the experts over the ranks (rank r holds experts [r*E/ranks, (r+1)*E/ranks)); the norm and the
router are replicated. Each rank holds its share of the batch's tokens (data parallel), and one fused tandem op moves
every token to its experts' ranks and back, forward and backward (moe-dispatch-ffn-combine, moe-ffn-backward).

The script starts --ranks processes on this node, each a rank of one tandem communicator on the node's tandemd
($TANDEM_SOCKET or the default socket), trains --steps steps of AdamW on a regression target, and has rank 0 print each
step's loss next to the loss of one PyTorch model in one process with the same initial weights, data and optimizer.
The replicated parameters' gradients are summed over the ranks before each step (MoE.reduce_router_grad, and an
allgather for the norm). It exits 1 when a loss or, at the end, a weight differs beyond the tolerance of the dtype
(float32: 1e-4 relative; bfloat16: 5e-2), else 0.

  python python/examples/moe_train.py --ranks 2                 # cpu backend, float32
  python python/examples/moe_train.py --ranks 4 --experts 8 --topk 2
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import tandem
from _ranks import DTYPES, run_ranks, verdict


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(torch.nn.Module):
    """The reference: the Mixtral MoE block in plain PyTorch, every expert in this process."""

    def __init__(self, hidden, ffn, experts, topk):
        super().__init__()
        self.topk = topk
        self.norm = RMSNorm(hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.empty(experts, 2 * ffn, hidden).uniform_(-hidden ** -0.5, hidden ** -0.5))
        self.w2 = torch.nn.Parameter(torch.empty(experts, hidden, ffn).uniform_(-ffn ** -0.5, ffn ** -0.5))

    def forward(self, x):
        h = self.norm(x)
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, ids = probs.topk(self.topk, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        ffn = self.w1.shape[1] // 2
        for e in range(self.w1.shape[0]):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            gate, up = (h[rows] @ self.w1[e].T).split(ffn, dim=-1)
            y = (F.silu(gate) * up) @ self.w2[e].T
            out = out.index_add(0, rows, y * weights[rows, slots, None].to(h.dtype))
        return x + out


class EPBlock(torch.nn.Module):
    """The same block with its experts spread over `comm`'s ranks, its weights taken from `ref`."""

    def __init__(self, ref: Block, comm, dtype):
        super().__init__()
        hidden, experts = ref.router.in_features, ref.router.out_features
        self.norm = RMSNorm(hidden)
        self.moe = tandem.nn.MoE(hidden, ref.w1.shape[1] // 2, experts, ref.topk, comm, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(ref.norm.weight)
        self.moe.load_full(ref.router.weight, ref.w1, ref.w2)
        self.to(dtype)

    def forward(self, x):
        return x + self.moe(self.norm(x))


def sum_over_ranks(t: torch.Tensor, comm) -> torch.Tensor:
    """The sum of t over the ranks, in rank order (the same bits on every rank)."""
    every = comm.allgather(t.detach().contiguous().view(1, -1))
    total = every[0].clone()
    for r in range(1, every.shape[0]):
        total += every[r]
    return total.view_as(t)


def rank_main(rank, args, uid, results):
    try:
        results.put((rank, train(rank, args, uid)))
    except BaseException as e:  # noqa: BLE001  (the parent reports every rank's failure)
        import traceback
        results.put((rank, f"rank {rank} failed:\n{traceback.format_exc()}" if not isinstance(e, SystemExit) else
                     str(e)))


def train(rank, args, uid):
    torch.set_num_threads(1)  # the ranks and tandemd share the node's cores
    comm = tandem.Communicator(rank=rank, world_size=args.ranks, unique_id=uid)
    dtype, n = DTYPES[args.dtype], comm.world_size
    torch.manual_seed(args.seed)  # the same initial weights in every rank's reference
    ref = Block(args.hidden, args.ffn, args.experts, args.topk).to(dtype)
    ep = EPBlock(ref, comm, dtype)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.01)
    opt_ep = torch.optim.AdamW(ep.parameters(), lr=args.lr, weight_decay=0.01)
    first, count = tandem.rows_of(args.tokens, rank, n)  # this rank's tokens (ranks may differ by one)
    mine = slice(first, first + count)
    data = torch.Generator().manual_seed(args.seed + 1)
    worst, lines = 0.0, []
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, generator=data).to(dtype)
        target = torch.randn(args.tokens, args.hidden, generator=data).to(dtype)
        # reference: the whole batch in one process
        opt_ref.zero_grad()
        loss_ref = ((ref(x).float() - target.float()) ** 2).sum() / target.numel()
        loss_ref.backward()
        opt_ref.step()
        loss_ref = float(loss_ref.detach())
        # expert parallel: this rank's tokens; the loss is the sum of the ranks' parts, so each rank's backward
        # starts from its part, and the replicated parameters' gradients are summed over the ranks
        opt_ep.zero_grad()
        part = ((ep(x[mine]).float() - target[mine].float()) ** 2).sum() / target.numel()
        part.backward()
        ep.moe.reduce_router_grad()
        ep.norm.weight.grad.copy_(sum_over_ranks(ep.norm.weight.grad, comm))
        opt_ep.step()
        loss_ep = float(sum_over_ranks(part.detach().reshape(1), comm))
        rel = abs(loss_ep - loss_ref) / max(abs(loss_ref), 1e-12)
        worst = max(worst, rel)
        lines.append(f"step {step}: loss tandem EP {loss_ep:.6f}  torch {loss_ref:.6f}  rel diff {rel:.2e}")
    # the trained weights: this rank's experts and the replicated ones against the reference's
    e0, local = ep.moe.first_expert, ep.moe.w1.shape[0]
    with torch.no_grad():
        pairs = [(ep.moe.w1, ref.w1[e0:e0 + local]), (ep.moe.w2, ref.w2[e0:e0 + local]),
                 (ep.moe.router.weight, ref.router.weight), (ep.norm.weight, ref.norm.weight)]
        wdiff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in pairs)
    comm.close()
    return lines, worst, wdiff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks, one process each (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="default float32")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=32, help="model width (default 32)")
    p.add_argument("--ffn", type=int, default=48, help="each expert's SwiGLU width (default 48)")
    p.add_argument("--experts", type=int, default=8, help="experts, a multiple of --ranks (default 8)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (default 2, as Mixtral)")
    p.add_argument("--tokens", type=int, default=24, help="tokens per step over all ranks (default 24)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 1 <= args.topk <= args.experts:
        p.error(f"--topk {args.topk} must be in [1, --experts]")
    got = run_ranks(rank_main, args, "cpu")
    if got is None:
        return 1
    lines, _, _ = got[0]
    print(f"Mixtral MoE block, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts top-{args.topk}, "
          f"{args.tokens} tokens a step over {args.ranks} ranks, {args.dtype}, AdamW lr {args.lr}")
    print("\n".join(lines))
    return verdict(got, args.dtype)


if __name__ == "__main__":
    sys.exit(main())
