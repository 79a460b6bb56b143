"""Forward + backward of an expert-parallel MoE FFN layer (top-k routing, SwiGLU experts, weighted combine) through
tandem.nn.functional.moe_ffn, against PyTorch's unfused layer with the same routing and weights under autograd: the
rows sorted by expert, torch._grouped_mm for both expert GEMMs (a per-expert loop where it is missing, e.g. on CPUs),
SwiGLU and the weighted combine. Across ranks the baseline dispatches by all-gathering every rank's tokens and
routing (NCCL), runs this rank's experts, and reduce-scatters the combined rows back (torch.distributed.nn, so its
backward is the reverse collectives).

usage (one GPU, a tandemd on the cuda backend at $TANDEM_SOCKET):
    python python/bench/moe_step.py [--tokens 4096] [--hidden 7168] [--ffn 2048] [--experts 32] [--topk 8]
    python python/bench/moe_step.py --hidden 4096 --ffn 14336 --experts 8 --topk 2        # Mixtral's experts
several GPUs of one node:  torchrun --nproc-per-node N python/bench/moe_step.py ...
--device cpu runs it on the cpu backend with gloo (a check that the program works, not a speed claim).
--forward-only times the forward alone. Prints the median ms of each (CUDA events on GPUs) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import tandem
from _steptime import DTYPES, start_rank, timed


def torch_layer(x, ids, weights, w1, w2, first_expert):
    """This rank's experts [first_expert, first_expert + w1.shape[0]) applied to the rows routed to them, combined
    into [tokens, hidden] (rows routed elsewhere contribute 0)."""
    local = w1.shape[0]
    ffn = w1.shape[1] // 2
    flat = ids.reshape(-1).long() - first_expert
    mine = ((flat >= 0) & (flat < local)).nonzero(as_tuple=True)[0]
    order = flat[mine].argsort(stable=True)
    pick = mine[order]  # (token, slot) pairs of this rank's experts, grouped by expert
    rows = pick // ids.shape[1]
    xe = x[rows]
    counts = torch.bincount(flat[pick], minlength=local)
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        offs = counts.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(xe, w1.transpose(1, 2), offs=offs)
        h = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    else:
        parts, at = [], 0
        for e, c in enumerate(counts.tolist()):
            gu = xe[at:at + c] @ w1[e].T
            parts.append((F.silu(gu[:, :ffn]) * gu[:, ffn:]) @ w2[e].T)
            at += c
        y = torch.cat(parts) if parts else xe.new_zeros((0, w2.shape[1]))
    y = y * weights.reshape(-1)[pick].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add(0, rows, y)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    started = start_rank("moe_step", cuda)
    if started is None:
        return 2
    world, rank, comm = started
    dtype = DTYPES[args.dtype]
    if args.experts % world:
        print(f"moe_step: --experts must be a multiple of the {world} ranks", file=sys.stderr)
        return 2
    dev, local = comm.device, args.experts // world
    g = torch.Generator().manual_seed(1 + rank)
    x = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    logits = torch.randn(args.tokens, args.experts, generator=g)
    top = logits.softmax(-1).topk(args.topk, dim=-1)
    ids = top.indices.to(dev, torch.int32)
    weights = (top.values / top.values.sum(-1, keepdim=True)).to(dev, torch.float32).requires_grad_()
    gw = torch.Generator().manual_seed(100 + rank)  # this rank's experts
    w1 = (torch.randn(local, 2 * args.ffn, args.hidden, generator=gw) * args.hidden ** -0.5).to(dev, dtype)
    w2 = (torch.randn(local, args.hidden, args.ffn, generator=gw) * args.ffn ** -0.5).to(dev, dtype)
    w1.requires_grad_()
    w2.requires_grad_()
    dout = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(dev, dtype)

    def tandem_step():
        out = tandem.nn.functional.moe_ffn(x, ids, weights, w1, w2, comm)
        if not args.forward_only:
            out.backward(dout)

    def torch_step():
        if world == 1:
            out = torch_layer(x, ids, weights, w1, w2, 0)
        else:
            import torch.distributed.nn.functional as dfn
            xs = torch.cat(dfn.all_gather(x))
            ws = torch.cat(dfn.all_gather(weights))
            id_parts = [torch.empty_like(ids) for _ in range(world)]
            torch.distributed.all_gather(id_parts, ids)
            full = torch_layer(xs, torch.cat(id_parts), ws, w1, w2, rank * local)
            out = dfn.reduce_scatter(torch.empty_like(x), list(full.chunk(world)))
        if not args.forward_only:
            out.backward(dout)

    res = {"tandem": timed(tandem_step, args.iters, args.warmup, cuda),
           "torch": timed(torch_step, args.iters, args.warmup, cuda)}
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "cpu"
        for name, ms in res.items():
            print(f"{name:7s} {ms:9.3f} ms")
        what = "forward" if args.forward_only else "forward+backward"
        print(f"torch / tandem {res['torch'] / res['tandem']:.3f}x  ({what}, {world} rank(s), {card}, "
              f"{args.tokens} tokens/rank, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, "
              f"top-{args.topk})")
        print(json.dumps({"bench": "moe_step", "card": card, "world": world, "pass": what, "tokens": args.tokens,
                          "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "topk": args.topk,
                          "dtype": args.dtype, **{f"{n}_ms": v for n, v in res.items()}}))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
