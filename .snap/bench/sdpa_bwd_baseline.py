#!/usr/bin/env python3
"""torch SDPA backward baseline for bench/attention_bwd_bench.cu: the cuDNN and flash backends on the same shapes.

One sequence of `seq` tokens, `heads` heads (kv heads == heads), bf16, causal and not, head_dim from --hds. Inputs are
made in tandem's layout [seq, heads, head_dim] and handed to SDPA as the [1, heads, seq, head_dim] view ("bshd",
strided) and as contiguous [1, heads, seq, head_dim] tensors ("bhsd"); each backend's faster layout is its baseline.
Timed: torch.autograd.grad of the forward's output (graph retained), CUDA events around each call, median of >= 20
after a warm-up. FLOPs as attention_bwd_bench counts them: 2.5 x 4 * seq^2 * heads * head_dim, half with causal.

  python3 bench/sdpa_bwd_baseline.py [--seqs 4096,8192,16384] [--hds 128,64] [--iters 20] [--heads 16] [--json FILE]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def make_inputs(seq, heads, hd, layout, dtype):
    ts = []
    for _ in range(3):
        x = torch.empty(seq, heads, hd, device="cuda", dtype=dtype).uniform_(-1.0, 1.0)
        if layout == "bshd":
            t = x.unsqueeze(0).transpose(1, 2)  # [1, heads, seq, hd] view of [seq, heads, hd]
        else:
            t = x.transpose(0, 1).contiguous().unsqueeze(0)
        ts.append(t.detach().requires_grad_(True))
    return ts


def time_backward(backend, inputs, causal, iters, warmup):
    q, k, v = inputs
    with sdpa_kernel([BACKENDS[backend]]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        dout = torch.empty_like(out).uniform_(-1.0, 1.0)
        for _ in range(warmup):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for e0, e1 in events:
            e0.record()
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            e1.record()
        torch.cuda.synchronize()
    times = sorted(e0.elapsed_time(e1) for e0, e1 in events)
    return statistics.median(times), times[0], times[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--hds", default="128,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    iters = max(20, args.iters)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}")
    results = []
    for hd in [int(h) for h in args.hds.split(",") if h]:
        for seq in [int(s) for s in args.seqs.split(",") if s]:
            for causal in (False, True):
                flops = 2.5 * 4.0 * seq * seq * args.heads * hd * (0.5 if causal else 1.0)
                for layout in ("bshd", "bhsd"):
                    inputs = make_inputs(seq, args.heads, hd, layout, torch.bfloat16)
                    for backend in BACKENDS:
                        try:
                            med, lo, hi = time_backward(backend, inputs, causal, iters, args.warmup)
                        except RuntimeError as e:  # a backend that refuses the shape or layout
                            print(f"SKIP seq={seq} hd={hd} causal={int(causal)} backend={backend} layout={layout}: "
                                  f"{str(e).splitlines()[0]}")
                            continue
                        tf = flops / (med * 1e-3) / 1e12
                        results.append(dict(seq=seq, hd=hd, causal=causal, backend=backend, layout=layout,
                                            median_ms=med, min_ms=lo, max_ms=hi, tflops=tf))
                        print(f"RESULT seq={seq} hd={hd} causal={int(causal)} backend={backend} layout={layout} "
                              f"median_ms={med:.4f} min_ms={lo:.4f} max_ms={hi:.4f} tflops={tf:.1f}", flush=True)
                    del inputs
                    torch.cuda.empty_cache()
    print("\n| seq | hd | causal | backend | layout | median ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seq']} | {r['hd']} | {'yes' if r['causal'] else 'no'} | {r['backend']} | {r['layout']} | "
              f"{r['median_ms']:.4f} | {r['tflops']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
