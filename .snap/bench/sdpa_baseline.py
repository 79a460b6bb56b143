#!/usr/bin/env python3
"""torch SDPA baseline for bench/attention_bench.cu: the cuDNN and flash backends on the same shapes.

One sequence of `seq` tokens, 16 heads, head_dim 128, bf16, causal and not. Inputs are made in tandem's layout
[seq, heads, head_dim] and handed to SDPA as the [1, heads, seq, head_dim] view of it ("bshd", strided), and also
as contiguous [1, heads, seq, head_dim] tensors ("bhsd"); each backend's faster layout is its baseline. Timing: CUDA
events around every call, median of >= 20 after a warm-up, input sets rotated so that L2 (60 MB) holds none of them.
FLOPs counted as 4 * seq^2 * heads * head_dim, half with causal masking.

  python3 bench/sdpa_baseline.py [--seqs 4096,8192,16384,32768] [--iters 30] [--heads 16] [--hd 128] [--json FILE]
"""
import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def make_sets(seq, heads, hd, layout, count, dtype):
    sets = []
    for _ in range(count):
        tensors = []
        for _ in range(3):
            x = torch.empty(seq, heads, hd, device="cuda", dtype=dtype).uniform_(-1.0, 1.0)
            if layout == "bshd":
                tensors.append(x.unsqueeze(0).transpose(1, 2))  # [1, heads, seq, hd] view of [seq, heads, hd]
            else:
                tensors.append(x.transpose(0, 1).contiguous().unsqueeze(0))  # contiguous [1, heads, seq, hd]
        sets.append(tensors)
    return sets


def time_backend(backend, sets, causal, iters, warmup):
    with sdpa_kernel([BACKENDS[backend]]):
        for i in range(warmup):
            q, k, v = sets[i % len(sets)]
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (e0, e1) in enumerate(events):
            q, k, v = sets[(i + 1) % len(sets)]
            e0.record()
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            e1.record()
        torch.cuda.synchronize()
        times = sorted(e0.elapsed_time(e1) for e0, e1 in events)
        out = F.scaled_dot_product_attention(*sets[0], is_causal=causal)
    return statistics.median(times), times[0], times[-1], out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    iters = max(20, args.iters)
    dtype = torch.bfloat16
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}")
    l2 = 60 * 2**20
    results = []
    for seq in [int(s) for s in args.seqs.split(",") if s]:
        set_bytes = 3 * seq * args.heads * args.hd * 2
        count = max(2, math.ceil(3 * l2 / set_bytes))
        for causal in (False, True):
            flops = 4.0 * seq * seq * args.heads * args.hd * (0.5 if causal else 1.0)
            outs = {}
            for layout in ("bshd", "bhsd"):
                sets = make_sets(seq, args.heads, args.hd, layout, count, dtype)
                for backend in BACKENDS:
                    try:
                        med, lo, hi, out = time_backend(backend, sets, causal, iters, args.warmup)
                    except RuntimeError as e:  # a backend that refuses the shape or layout
                        print(f"SKIP seq={seq} causal={int(causal)} backend={backend} layout={layout}: {e}")
                        continue
                    tf = flops / (med * 1e-3) / 1e12
                    outs[(backend, layout)] = out.float()
                    r = dict(seq=seq, causal=causal, backend=backend, layout=layout, median_ms=med, min_ms=lo,
                             max_ms=hi, tflops=tf)
                    results.append(r)
                    print(f"RESULT seq={seq} causal={int(causal)} backend={backend} layout={layout} "
                          f"median_ms={med:.4f} min_ms={lo:.4f} max_ms={hi:.4f} tflops={tf:.1f}", flush=True)
                del sets
            # The backends must agree with each other on set 0 of each layout (a backend that silently fell back
            # or computed garbage shows up here).
            for layout in ("bshd", "bhsd"):
                a, b = outs.get(("cudnn", layout)), outs.get(("flash", layout))
                if a is not None and b is not None:
                    rel = ((a - b).norm() / b.norm()).item()
                    print(f"CHECK seq={seq} causal={int(causal)} layout={layout} cudnn_vs_flash_relerr={rel:.2e}")
            torch.cuda.empty_cache()
    print("\n| seq | causal | backend | layout | median ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['backend']} | {r['layout']} | "
              f"{r['median_ms']:.4f} | {r['tflops']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
