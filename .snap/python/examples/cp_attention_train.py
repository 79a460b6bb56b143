#!/usr/bin/env python3
"""Train a Llama-style attention block with context parallelism over tandem, next to the same model in plain PyTorch.

The block is y = x + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))) with grouped-query attention
(--kv-heads KV heads shared by --heads query heads) and rotary position embeddings, causal. Each of --ranks processes
holds one shard of the sequence (the rows tandem.nn.context_parallel_positions names under --layout: "zigzag"
balances causal work, "contiguous" is rank order) and the whole, replicated, projections; the projections and RoPE
run locally on the shard (RoPE at the rows' global positions), and attention runs over every rank's shard through
tandem.nn.ContextParallelAttention (ring attention: KV blocks travel round the ranks, forward and backward). Each
rank's weight gradients cover its own rows only, so they are summed over the ranks (allgather and a sum in rank
order, the same on every rank; a real model would let its data-parallel all-reduce do this) before each step.

Rank 0 prints each step's loss next to the loss of one PyTorch model with the same initial weights on the whole
sequence, trained with the same data and optimizer. The script exits 1 when a loss or, at the end, a weight differs
beyond the dtype's tolerance (float32: 1e-4 relative; bfloat16: 5e-2), else 0. Ranks are processes on this node,
each a rank of one tandem communicator on the node's tandemd ($TANDEM_SOCKET or the default socket).

  python python/examples/cp_attention_train.py --ranks 2                              # cpu backend, float32
  python python/examples/cp_attention_train.py --ranks 4 --device cuda --dtype bfloat16 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import tandem
from _ranks import DTYPES, run_ranks, verdict


def rope(x, positions, base=10000.0):
    """Rotary position embedding (Llama's, rotate-half form) of x [seq, heads, head_dim] at the rows' global
    positions [seq]: pairs (i, i + head_dim/2) rotate by position * base^(-2i/head_dim). Computed in float32."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = positions.to(x.device, torch.float32)[:, None] * freq[None, :]  # [seq, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class AttentionBlock(torch.nn.Module):
    """Llama's attention block (pre-norm left out): q/k/v/o projections without bias, RoPE, grouped-query causal
    attention, a residual. `attend(q, k, v)` is the attention core: torch's SDPA on the whole sequence for the
    reference, tandem.nn.ContextParallelAttention on a rank's shard."""

    def __init__(self, hidden, heads, kv_heads, head_dim, attend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.attend = attend

    def forward(self, x, positions):
        seq = x.shape[0]
        q = rope(self.q_proj(x).view(seq, self.heads, self.head_dim), positions)
        k = rope(self.k_proj(x).view(seq, self.kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(seq, self.kv_heads, self.head_dim)
        return x + self.o_proj(self.attend(q, k, v).reshape(seq, self.heads * self.head_dim))


def whole_sequence_attention(heads, kv_heads):
    """The reference core: causal SDPA over the whole sequence (rows in global order), KV heads repeated per group."""
    group = heads // kv_heads

    def attend(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                           v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)
    return attend


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
    dev, dtype = comm.device, DTYPES[args.dtype]
    torch.manual_seed(args.seed)  # the same initial weights in every rank's reference
    ref = AttentionBlock(args.hidden, args.heads, args.kv_heads, args.head_dim,
                         whole_sequence_attention(args.heads, args.kv_heads)).to(dev, dtype)
    core = tandem.nn.ContextParallelAttention(comm, args.heads, args.head_dim, num_kv_heads=args.kv_heads,
                                              causal=True, layout=args.layout)
    cp = AttentionBlock(args.hidden, args.heads, args.kv_heads, args.head_dim, core).to(dev, dtype)
    cp.load_state_dict(ref.state_dict())
    opt_ref, opt_cp = optimizer(args.optimizer, ref.parameters(), args.lr), \
        optimizer(args.optimizer, cp.parameters(), args.lr)
    everywhere = torch.arange(args.seq)
    mine = tandem.nn.context_parallel_positions(args.seq, rank, args.ranks, args.layout)
    data = torch.Generator().manual_seed(args.seed + 1)
    worst = 0.0
    lines = []
    for step in range(args.steps):
        x = torch.randn(args.seq, args.hidden, generator=data).to(dev, dtype)
        target = torch.randn(args.seq, args.hidden, generator=data).to(dev, dtype)
        count = target.numel()
        # reference: the whole sequence in one process
        opt_ref.zero_grad()
        loss_ref = ((ref(x, everywhere).float() - target.float()) ** 2).sum() / count
        loss_ref.backward()
        opt_ref.step()
        loss_ref = float(loss_ref.detach())
        # context-parallel: this rank's rows; the loss is the sum of the ranks' parts, and so are the gradients
        opt_cp.zero_grad()
        rows = mine.to(dev)
        part = ((cp(x[rows], mine).float() - target[rows].float()) ** 2).sum() / count
        part.backward()
        for p in cp.parameters():
            p.grad = comm.allgather(p.grad.reshape(1, -1).contiguous()).sum(0).view_as(p)
        opt_cp.step()
        loss_cp = float(comm.allgather(part.detach().reshape(1).contiguous()).sum())
        rel = abs(loss_cp - loss_ref) / max(abs(loss_ref), 1e-12)
        worst = max(worst, rel)
        lines.append(f"step {step}: loss tandem CP {loss_cp:.6f}  torch {loss_ref:.6f}  rel diff {rel:.2e}")
    with torch.no_grad():
        wdiff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                    for a, b in zip(cp.parameters(), ref.parameters()))
    comm.close()
    return lines, worst, wdiff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="context-parallel ranks, one process each (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: tandemd runs the cpu backend; cuda: the cuda backend (default cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag",
                   help="which global rows each rank holds (default zigzag: balanced causal work)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="default adamw")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads, dividing --heads (default 2)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="per-head width, even (default 16 on cpu, 64 on cuda: the cuda core takes 64 and 128)")
    p.add_argument("--seq", type=int, default=37, help="sequence length, any split over the ranks (default 37)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.head_dim = args.head_dim or (64 if args.device == "cuda" else 16)
    if args.ranks < 1:
        p.error(f"--ranks {args.ranks} must be at least 1")
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.head_dim % 2:
        p.error(f"--head-dim {args.head_dim} must be even (RoPE rotates pairs)")
    got = run_ranks(rank_main, args, args.device)
    if got is None:
        return 1
    lines = got[0][0]
    print(f"Llama attention block, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads of "
          f"{args.head_dim}, seq {args.seq} over {args.ranks} ranks ({args.layout}), causal, {args.dtype} on "
          f"{args.device}, {args.optimizer} lr {args.lr}")
    print("\n".join(lines))
    return verdict(got, args.dtype)


if __name__ == "__main__":
    sys.exit(main())
