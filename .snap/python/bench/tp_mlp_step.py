"""One forward+backward step of a tensor-parallel Llama MLP block (gate/up column-parallel, SwiGLU, down
row-parallel) through tandem.nn, against PyTorch's unfused step with the same shapes: the local matmuls plus NCCL's
all-gather / reduce-scatter (torch.distributed), or at one rank the matmuls alone. Also times the step's GEMMs alone
(the same matmuls with no communication), so that the step's overhead over its GEMMs is measured, not assumed.

usage (one GPU, a tandemd on the cuda backend at $TANDEM_SOCKET):
    python python/bench/tp_mlp_step.py [--hidden 8192] [--ffn 28672] [--tokens 8192] [--iters 20]
several GPUs of one node (tandemd on the node; NCCL for the baseline):
    torchrun --nproc-per-node N python/bench/tp_mlp_step.py --sequence-parallel ...
torchrun sets RANK, WORLD_SIZE and MASTER_ADDR/PORT; tandem bootstraps over the same torch.distributed group.
Prints one line per variant (median ms over --iters after --warmup, CUDA events) and one JSON line. --device cpu
runs it on the cpu backend with gloo: a check that the program works, not a speed claim.
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
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=28672, help="the whole layer's; each rank holds ffn / world_size")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the whole sequence (M)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (default off)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the cpu backend with gloo (a check that the program works, not a speed claim)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    started = start_rank("tp_mlp_step", cuda)
    if started is None:
        return 2
    world, rank, comm = started
    dtype = DTYPES[args.dtype]
    if args.ffn % world or args.tokens % world:
        print(f"tp_mlp_step: --ffn and --tokens must be multiples of the {world} ranks", file=sys.stderr)
        return 2
    sp = args.sequence_parallel
    dev = comm.device
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = args.tokens // world if sp else args.tokens
    x = (torch.randn(rows, args.hidden, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    dy = (torch.randn(rows, args.hidden, generator=g) * 0.5).to(dev, dtype)
    gate = tandem.nn.ColumnParallelLinear(args.hidden, args.ffn, comm, bias=False, sequence_parallel=sp, dtype=dtype)
    up = tandem.nn.ColumnParallelLinear(args.hidden, args.ffn, comm, bias=False, sequence_parallel=sp, dtype=dtype)
    down = tandem.nn.RowParallelLinear(args.ffn, args.hidden, comm, bias=False, sequence_parallel=sp, dtype=dtype)

    def tandem_step():
        y = down(F.silu(gate(x)) * up(x))
        y.backward(dy)

    # PyTorch's unfused step: the same weights, matmuls plus NCCL collectives in autograd.
    wg, wu, wd = (p.detach().clone().requires_grad_() for p in (gate.weight, up.weight, down.weight))

    def gather(t):
        if world == 1:
            return t
        import torch.distributed.nn.functional as dfn
        return torch.cat(dfn.all_gather(t), dim=0)

    def reduce(t):
        if world == 1:
            return t
        import torch.distributed.nn.functional as dfn
        if sp:
            return dfn.reduce_scatter(torch.empty_like(t.chunk(world)[0]), list(t.chunk(world)))
        return dfn.all_reduce(t)

    def torch_step():
        xf = gather(x) if sp else x
        h = F.silu(xf @ wg.T) * (xf @ wu.T)
        y = reduce(h @ wd.T)
        y.backward(dy)

    # The step's GEMMs alone: the same six matmuls of forward and backward, no communication, no activation math.
    xf = torch.randn(args.tokens, args.hidden, generator=g).to(dev, dtype)
    hf = torch.randn(args.tokens, args.ffn // world, generator=g).to(dev, dtype)
    dyf = torch.randn(args.tokens, args.hidden, generator=g).to(dev, dtype)
    w1, w3 = wg.detach(), wd.detach()

    def gemms_step():
        torch.matmul(xf, w1.T)          # gate forward
        torch.matmul(xf, w1.T)          # up forward
        torch.matmul(hf, w3.T)          # down forward
        torch.matmul(dyf, w3)           # down dgrad (NN)
        torch.matmul(dyf.T, hf)         # down wgrad (TN)
        torch.matmul(hf, w1)            # gate dgrad
        torch.matmul(hf, w1)            # up dgrad
        torch.matmul(hf.T, xf)          # gate wgrad
        torch.matmul(hf.T, xf)          # up wgrad

    results = {}
    for name, fn in (("tandem", tandem_step), ("torch", torch_step), ("gemms", gemms_step)):
        results[name] = timed(fn, args.iters, args.warmup, cuda)
    flops = 2 * args.tokens * args.hidden * (args.ffn // world) * 3 * 3  # 3 GEMMs forward, 6 backward
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "cpu"
        for name, ms in results.items():
            print(f"{name:7s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
        print(f"torch / tandem {results['torch'] / results['tandem']:.3f}x;  tandem / gemms "
              f"{results['tandem'] / results['gemms']:.3f}x  ({world} rank(s), {card}, sequence_parallel={sp})")
        print(json.dumps({"bench": "tp_mlp_step", "card": card, "world": world, "sequence_parallel": sp,
                          "hidden": args.hidden, "ffn": args.ffn, "tokens": args.tokens, "dtype": args.dtype,
                          **{f"{k}_ms": v for k, v in results.items()}}))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
