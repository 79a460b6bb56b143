"""tandem's fused GEMM ops with FP8 inputs (torch.float8_e4m3fn, one fp32 scale per tensor, bf16 output) at the
shapes of a tensor-parallel Llama-70B MLP's training step, against PyTorch's unfused FP8 path in the same process:
torch._scaled_mm plus NCCL (torch.distributed), and the same ops in bf16 on both sides for reference.

- ag_gemm (column-parallel, sequence parallel): A's M/TP rows per rank [M/TP, hidden], B [ffn/TP, hidden] ->
  [M, ffn/TP]; torch: all_gather_into_tensor of the FP8 rows (as bytes), then torch._scaled_mm.
- gemm_rs (row-parallel, sequence parallel): A [M, ffn/TP], B [hidden, ffn/TP] -> this rank's [M/TP, hidden] of the
  sum; torch: torch._scaled_mm to bf16, then reduce_scatter_tensor.
- gemm_ar (row-parallel, replicated): as gemm_rs, every rank gets the summed [M, hidden]; torch: torch._scaled_mm,
  then all_reduce.
At one rank the baseline is torch._scaled_mm alone. Quantizing (amax / 448 per tensor; ag_gemm's A shards share
one scale, their amax reduced over the ranks) happens before the timing.

usage (one GPU, a tandemd on the cuda backend at $TANDEM_SOCKET):
    python python/bench/fp8_gemm_step.py [--tokens 8192] [--hidden 8192] [--ffn 28672] [--iters 20]
several GPUs of one node:  torchrun --nproc-per-node N python/bench/fp8_gemm_step.py ...
Where tandem refuses FP8 (the cuda backend may, saying why), the refusal's text is printed for that op and the
program goes on with the rest. Prints one line per op with the median ms of each variant (CUDA events), tandem's
results checked against the baseline's, and one JSON line. --device cpu runs it on the cpu backend with gloo at
small shapes (tokens 256, hidden 256, ffn 512): a check that the program works, not a speed claim. Exits 1 if a
result of tandem's differs from the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import tandem
from _steptime import start_rank, timed

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x, shared: bool = False):
    """(FP8 tensor, fp32 scale [1]) of x, one scale for the whole tensor; shared: one scale for every rank's shard
    (the amax reduced over the ranks, as FP8 recipes do for a sequence-parallel input), so that the gathered A has
    one scale, as torch._scaled_mm needs."""
    amax = x.abs().max().float().reshape(1)
    if shared and torch.distributed.is_initialized():
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale).to(FP8), scale


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--tokens", type=int, help="rows of the whole sequence, M (default 8192; cpu 256)")
    ap.add_argument("--hidden", type=int, help="default 8192 (cpu 256)")
    ap.add_argument("--ffn", type=int, help="the whole layer's; each rank holds ffn / TP (default 28672; cpu 512)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the cpu backend with gloo, small default shapes (a check that the program works, not "
                         "a speed claim)")
    ap.add_argument("--iters", type=int, help="timed runs per variant (default 20; cpu 3)")
    ap.add_argument("--warmup", type=int, help="untimed runs first (default 5; cpu 1)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    started = start_rank("fp8_gemm_step", cuda)
    if started is None:
        return 2
    world, rank, comm = started
    m = args.tokens or (8192 if cuda else 256)
    hidden = args.hidden or (8192 if cuda else 256)
    ffn = args.ffn or (28672 if cuda else 512)
    iters = args.iters or (20 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    import torch.distributed as dist
    if m % world or ffn % world:
        print(f"fp8_gemm_step: --tokens and --ffn must be multiples of the {world} ranks", file=sys.stderr)
        return 2
    dev, bf16 = comm.device, torch.bfloat16
    fr, rows = ffn // world, m // world
    g = torch.Generator().manual_seed(1 + rank)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, bf16)

    def scaled_mm(a, sa, b, sb, out=None):  # a [rows, k] @ b [n, k].T, b column-major as _scaled_mm wants it
        return torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=bf16, out=out)

    # Inputs per op (bf16, then their FP8 forms), outputs allocated once.
    x_ag, w_ag = rand(rows, hidden), rand(fr, hidden, scale=hidden ** -0.5)
    x_red, w_red = rand(m, fr), rand(hidden, fr, scale=fr ** -0.5)
    q = {name: quantize(t, name == "x_ag") for name, t in (("x_ag", x_ag), ("w_ag", w_ag), ("x_red", x_red),
                                                             ("w_red", w_red))}
    gathered8 = torch.empty(m, hidden, device=dev, dtype=FP8)
    gathered = torch.empty(m, hidden, device=dev, dtype=bf16)
    full = torch.empty(m, hidden, device=dev, dtype=bf16)
    out = {"ag_gemm": torch.empty(m, fr, device=dev, dtype=bf16), "gemm_rs": torch.empty(rows, hidden, device=dev,
           dtype=bf16), "gemm_ar": torch.empty(m, hidden, device=dev, dtype=bf16)}
    ref = {k: torch.empty_like(v) for k, v in out.items()}

    def ag_torch(fp8: bool):
        a, b = (q["x_ag"][0], q["w_ag"][0]) if fp8 else (x_ag, w_ag)
        dst = gathered8 if fp8 else gathered
        if world > 1:  # FP8 travels as bytes: collectives take no float8 dtype on every backend
            dist.all_gather_into_tensor(dst.view(torch.uint8) if fp8 else dst, a.view(torch.uint8) if fp8 else a)
        else:
            dst = a
        if fp8:
            scaled_mm(dst, q["x_ag"][1], b, q["w_ag"][1], out=ref["ag_gemm"])
        else:
            torch.matmul(dst, b.T, out=ref["ag_gemm"])

    def reduce_torch(op: str, fp8: bool):
        c = full if op == "gemm_rs" and world > 1 else ref[op]
        if fp8:
            scaled_mm(q["x_red"][0], q["x_red"][1], q["w_red"][0], q["w_red"][1], out=c)
        else:
            torch.matmul(x_red, w_red.T, out=c)
        if world > 1:
            if op == "gemm_rs":
                dist.reduce_scatter_tensor(ref[op], c)
            else:
                dist.all_reduce(c)

    def tandem_op(op: str, fp8: bool):
        if op == "ag_gemm":
            (a, sa), (b, sb) = (q["x_ag"], q["w_ag"]) if fp8 else ((x_ag, None), (w_ag, None))
        else:
            (a, sa), (b, sb) = (q["x_red"], q["w_red"]) if fp8 else ((x_red, None), (w_red, None))
        kw = dict(a_scale=sa, b_scale=sb, out_dtype=bf16) if fp8 else {}
        getattr(comm, op)(a, b, out=out[op], **kw)

    torch_fns = {"ag_gemm": ag_torch, "gemm_rs": lambda fp8: reduce_torch("gemm_rs", fp8),
                 "gemm_ar": lambda fp8: reduce_torch("gemm_ar", fp8)}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    card = torch.cuda.get_device_name() if cuda else "cpu"
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"fp8_gemm_step: {world} rank(s), {card}; M {m}, hidden {hidden}, ffn {ffn} ({fr} per rank); e4m3 inputs, "
        f"per-tensor scales, bf16 output; ms per call (median of {iters})")
    say(f"  {'op':8s} {'tandem fp8':>11s} {'torch fp8':>10s} {'tandem bf16':>12s} {'torch bf16':>11s}  "
        f"torch/tandem fp8, bf16")
    rows_json, wrong = [], []
    for op, torch_fn in torch_fns.items():
        res = {}
        for fp8 in (True, False):
            kind = "fp8" if fp8 else "bf16"
            torch_fn(fp8)
            res[f"torch_{kind}_ms"] = timed(lambda: torch_fn(fp8), iters, warmup, cuda)
            try:
                tandem_op(op, fp8)
                if cuda:
                    comm.synchronize()
            except (tandem.TandemError, ValueError) as e:
                say(f"  {op} tandem {kind}: refused: {type(e).__name__}: {e}")
                res[f"tandem_{kind}_ms"] = None
                continue
            sync()
            err = rel_err(out[op], ref[op])
            res[f"rel_err_{kind}"] = err
            if err > 3e-2:  # both sides round to bf16 from fp32 sums; FP8 inputs are the same bytes on both
                wrong.append(f"{op} {kind}: tandem differs from the baseline by {err:.3g} (relative; limit 0.03)")
            res[f"tandem_{kind}_ms"] = timed(lambda: tandem_op(op, fp8), iters, warmup, cuda)
        rows_json.append({"op": op, **res})
        f = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        ratio = lambda a, b: f"{res[a] / res[b]:.3f}x" if res.get(b) else "-"  # noqa: E731
        say(f"  {op:8s} {f(res['tandem_fp8_ms']):>11s} {f(res['torch_fp8_ms']):>10s} "
            f"{f(res['tandem_bf16_ms']):>12s} {f(res['torch_bf16_ms']):>11s}  "
            f"{ratio('torch_fp8_ms', 'tandem_fp8_ms')} {ratio('torch_bf16_ms', 'tandem_bf16_ms')}")
    for w in wrong:
        say(f"WRONG {w}")
    say(json.dumps({"bench": "fp8_gemm_step", "card": card, "world": world, "tokens": m, "hidden": hidden,
                    "ffn": ffn, "iters": iters, "ops": rows_json}))
    if world > 1:
        dist.barrier()
    comm.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
