#!/usr/bin/env python3
"""PyTorch baselines for the MoE ops (bench/moe_bench.cu), one GPU, on the routings moe_bench wrote.

For each routing (DIR/<case>.ids int32 [tokens, 8], DIR/<case>.wts fp32 [tokens, 8]; 32 experts, hidden 7168,
ffn 2048, bf16):
  permute+grouped_mm   route (stable argsort, bincount, cumsum), permute x by gather, torch._grouped_mm with
                       w1 [32, 4096, 7168] (tandem's dispatch+GEMM, routing and permutation included on both sides);
  unfused layer        the same, then SwiGLU, torch._grouped_mm with w2 [32, 7168, 2048], and the weighted
                       un-permute (index_add_ in fp32, as tandem combines);
  gemm1 / gemm2        the two grouped GEMMs alone on rows already permuted.
Weights are passed as transposed views of nn.Linear's [E, n, k] layout (as tandem reads them) and as contiguous
[E, k, n]; the faster layout is the baseline. Timing: CUDA events, 3 warm-up calls, median of --iters, two input
sets rotated. With --tandem FILE (moe_bench's JSON) it prints tandem's times over these.

  python3 bench/moe_baseline.py --routing-dir DIR [--iters 30] [--json FILE] [--tandem FILE]
"""
import argparse
import glob
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

E, HIDDEN, FFN, TOPK = 32, 7168, 2048, 8
SETS = 2
WARM = 3


def time_calls(fns, iters):
    total = iters + WARM
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(total)]
    for i in range(total):
        ev[i][0].record()
        fns[i % len(fns)]()
        ev[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev[WARM:])


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing-dir", required=True)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--tandem", default="")
    args = ap.parse_args()
    if args.iters < 20:
        ap.error("--iters must be >= 20")
    if not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(77)
    dt = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, bf16")
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen) * 2 - 1).to(dt)

    w1 = [rnd(E, 2 * FFN, HIDDEN) for _ in range(SETS)]
    w2 = [rnd(E, HIDDEN, FFN) for _ in range(SETS)]
    layouts = {
        "k-major": ([w.transpose(-2, -1) for w in w1], [w.transpose(-2, -1) for w in w2]),
        "n-major": ([w.transpose(-2, -1).contiguous() for w in w1], [w.transpose(-2, -1).contiguous() for w in w2]),
    }
    cases = sorted(glob.glob(os.path.join(args.routing_dir, "*.ids")),
                   key=lambda p: (not os.path.basename(p).startswith("random"), os.path.getsize(p), p))
    results = []
    print(f"\n{'case':<10} {'tokens':>6} {'layout':<8} {'permute+gmm ms':>14} {'layer ms':>9} {'gemm1 ms':>9} "
          f"{'gemm2 ms':>9} {'outside GEMMs':>13}")
    for path in cases:
        name = os.path.basename(path)[:-4]
        ids_h = torch.from_file(path, dtype=torch.int32, size=os.path.getsize(path) // 4)
        wts_path = path[:-4] + ".wts"
        wts_h = torch.from_file(wts_path, dtype=torch.float32, size=os.path.getsize(wts_path) // 4)
        tokens = ids_h.numel() // TOPK
        ids = ids_h.view(tokens, TOPK).to("cuda", torch.int64)
        wts = wts_h.view(tokens, TOPK).to("cuda")
        xs = [rnd(tokens, HIDDEN) for _ in range(SETS)]
        rows = tokens * TOPK
        g1f = 2.0 * rows * HIDDEN * 2 * FFN
        g2f = 2.0 * rows * FFN * HIDDEN
        best = None
        for layout, (w1t, w2t) in layouts.items():
            def route():
                flat = ids.reshape(-1)
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=E)
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                return order, offs

            def dispatch_gemm(i):
                order, offs = route()
                xp = xs[i].index_select(0, order // TOPK)
                return torch._grouped_mm(xp, w1t[i], offs=offs)

            def layer(i):
                order, offs = route()
                tok = order // TOPK
                xp = xs[i].index_select(0, tok)
                gu = torch._grouped_mm(xp, w1t[i], offs=offs)
                hh = F.silu(gu[:, :FFN]) * gu[:, FFN:]
                y = torch._grouped_mm(hh, w2t[i], offs=offs)
                out = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.float32)
                out.index_add_(0, tok, y.float() * wts.reshape(-1)[order].unsqueeze(1))
                return out.to(dt)

            try:
                ms_dg = time_calls([lambda i=i: dispatch_gemm(i) for i in range(SETS)], args.iters)
                ms_layer = time_calls([lambda i=i: layer(i) for i in range(SETS)], args.iters)
                order, offs = route()
                xp = [x.index_select(0, order // TOPK) for x in xs]
                hh = [rnd(rows, FFN) for _ in range(SETS)]
                ms_g1 = time_calls([lambda i=i: torch._grouped_mm(xp[i], w1t[i], offs=offs) for i in range(SETS)],
                                   args.iters)
                ms_g2 = time_calls([lambda i=i: torch._grouped_mm(hh[i], w2t[i], offs=offs) for i in range(SETS)],
                                   args.iters)
            except RuntimeError as e:
                print(f"{name:<10} {tokens:>6} {layout:<8} refused: {str(e).splitlines()[0]}")
                continue
            outside = 1.0 - (ms_g1 + ms_g2) / ms_layer
            print(f"{name:<10} {tokens:>6} {layout:<8} {ms_dg:14.4f} {ms_layer:9.4f} {ms_g1:9.4f} {ms_g2:9.4f} "
                  f"{outside * 100:12.1f}%")
            r = {"case": name, "tokens": tokens, "layout": layout, "dispatch_gemm_ms": ms_dg, "layer_ms": ms_layer,
                 "gemm1_ms": ms_g1, "gemm2_ms": ms_g2, "dispatch_gemm_tflops": tflops(g1f, ms_dg),
                 "layer_tflops": tflops(g1f + g2f, ms_layer)}
            if best is None or ms_dg + ms_layer < best["dispatch_gemm_ms"] + best["layer_ms"]:
                best = r
            sys.stdout.flush()
        if best is not None:
            results.append(best)
        del xs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.tandem and os.path.exists(args.tandem):
        with open(args.tandem) as f:
            tandem = {c["case"]: c for c in json.load(f)["cases"]}
        print(f"\ntandem vs PyTorch (speedup = PyTorch ms / tandem ms; TFLOP/s count 2 rows n k per GEMM):")
        print(f"{'case':<10} {'dispatch+GEMM':>13} {'TFLOP/s t/pt':>13} {'FFN layer':>10} {'TFLOP/s t/pt':>13} "
              f"{'2 GEMMs/FFN':>11}")
        for r in results:
            t = tandem.get(r["case"])
            if t is None:
                continue
            rows = r["tokens"] * TOPK
            g1f = 2.0 * rows * HIDDEN * 2 * FFN
            g2f = 2.0 * rows * FFN * HIDDEN
            print(f"{r['case']:<10} {r['dispatch_gemm_ms'] / t['dispatch_gemm_ms']:12.3f}x "
                  f"{tflops(g1f, t['dispatch_gemm_ms']):6.0f}/{r['dispatch_gemm_tflops']:<6.0f} "
                  f"{r['layer_ms'] / t['ffn_ms']:9.3f}x "
                  f"{tflops(g1f + g2f, t['ffn_ms']):6.0f}/{r['layer_tflops']:<6.0f} "
                  f"{(t['gemm1_swiglu_ms'] + t['gemm2_ms']) / t['ffn_ms']:10.3f}")


if __name__ == "__main__":
    main()
