"""Forward + backward of context-parallel (ring) attention through tandem.nn.functional.ring_attention, against
PyTorch's usual context-parallel baseline with the same shapes: all-gather K and V over torch.distributed (NCCL),
scaled_dot_product_attention of this rank's queries over the whole sequence, and autograd's reduce-scatter of the
K/V gradients back (torch.distributed.nn). At one rank the baseline is SDPA alone (cuDNN or flash, as PyTorch picks).

usage (one GPU, a tandemd on the cuda backend at $TANDEM_SOCKET):
    python python/bench/cp_attention_step.py [--seq 16384] [--heads 16] [--kv-heads 16] [--head-dim 128] [--causal]
several GPUs of one node:
    torchrun --nproc-per-node N python/bench/cp_attention_step.py --layout zigzag --causal ...
--device cpu runs the same on the cpu backend with gloo (a check that the program works, not a speed claim).
Prints the median ms of each over --iters after --warmup (CUDA events on GPUs), their ratio and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import tandem
from _steptime import DTYPES, start_rank, timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=16384, help="the whole sequence; each rank holds its share")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="grouped-query attention (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    started = start_rank("cp_attention_step", cuda)
    if started is None:
        return 2
    world, rank, comm = started
    dtype = DTYPES[args.dtype]
    kv_heads = args.kv_heads or args.heads
    pos = tandem.nn.context_parallel_positions(args.seq, rank, world, args.layout)
    rows = len(pos)
    dev = comm.device
    g = torch.Generator().manual_seed(1 + rank)
    q = torch.randn(rows, args.heads, args.head_dim, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(rows, kv_heads, args.head_dim, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(rows, kv_heads, args.head_dim, generator=g).to(dev, dtype).requires_grad_()
    dout = torch.randn(rows, args.heads, args.head_dim, generator=g).to(dev, dtype)

    def tandem_step():
        out = tandem.nn.functional.ring_attention(q, k, v, comm, causal=args.causal, layout=args.layout)
        out.backward(dout)

    # Every rank's positions, to place the gathered K/V rows in sequence order and build the causal mask.
    all_pos = [tandem.nn.context_parallel_positions(args.seq, p, world, args.layout) for p in range(world)]
    order = torch.cat(all_pos).argsort().to(dev)
    mask = None
    if args.causal:
        mask = (pos.to(dev)[:, None] >= torch.arange(args.seq, device=dev)[None, :])  # [rows, seq]
    group_size = args.heads // kv_heads

    def gather(t):
        if world == 1:
            return t
        import torch.distributed.nn.functional as dfn
        parts = dfn.all_gather(t)  # autograd: the backward reduce-scatters the gradients
        return torch.cat(parts, dim=0)

    def torch_step():
        kk, vv = gather(k)[order], gather(v)[order]  # [seq, kv_heads, hd] in sequence order
        if group_size > 1:
            kk, vv = kk.repeat_interleave(group_size, dim=1), vv.repeat_interleave(group_size, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                             attn_mask=mask)
        out.transpose(0, 1).backward(dout)

    res = {"tandem": timed(tandem_step, args.iters, args.warmup, cuda),
           "torch": timed(torch_step, args.iters, args.warmup, cuda)}
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "cpu"
        for name, ms in res.items():
            print(f"{name:7s} {ms:9.3f} ms")
        print(f"torch / tandem {res['torch'] / res['tandem']:.3f}x  ({world} rank(s), {card}, seq {args.seq}, "
              f"heads {args.heads}/{kv_heads}, hd {args.head_dim}, causal={args.causal}, {args.layout})")
        print(json.dumps({"bench": "cp_attention_step", "card": card, "world": world, "seq": args.seq,
                          "heads": args.heads, "kv_heads": kv_heads, "head_dim": args.head_dim,
                          "causal": args.causal, "layout": args.layout, "dtype": args.dtype,
                          **{f"{n}_ms": v for n, v in res.items()}}))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
