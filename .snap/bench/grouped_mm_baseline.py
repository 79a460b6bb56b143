#!/usr/bin/env python3
"""PyTorch baselines for the grouped GEMM (bench/grouped_gemm_bench.cu), on one GPU, same shapes and group sizes.

1. torch._grouped_mm alone on DeepSeek-V3's expert GEMMs (32 experts, hidden 7168, ffn 2048):
   gemm1 x [M, 7168] by w1 [32, 4096, 7168] and gemm2 h [M, 2048] by w2 [32, 7168, 2048], with 256 / 512 / 1024 /
   2048 rows on every expert and the "skew" grouping (16384 rows, 80% on expert 0) of the tandem bench. The weights
   are tried in both layouts: "k-major" (nn.Linear's [E, n, k], passed transposed, as tandem reads them) and
   "n-major" ([E, k, n] contiguous); the faster is the baseline.
2. torch._grouped_mm on the backward's data gradients, the same math as grouped_gemm_bench's dgrad ops (tandem's
   layout kAB): dgrad-h dy [M, hidden] @ w2[e] (w2 [E, hidden, ffn] as the forward stores it, mat_b [E, K, N]) and
   dgrad-x d(gate|up) [M, 2 ffn] @ w1[e] (w1 [E, 2 ffn, hidden]), on DeepSeek-V3 and Mixtral 8x7B (8 experts, hidden
   4096, ffn 14336) at 256 / 512 / 1024 / 2048 / 4096 rows per expert. mat_b is tried as stored ("n-major") and as a
   K-major copy passed transposed ("k-major"); the faster is the baseline, as for the forward.
3. torch._grouped_mm in its k-grouped form (2D x 2D, offs over the rows) on the backward's weight gradients, the same
   math as grouped_gemm_bench's wgrad ops: dw2 [E, hidden, ffn] = _grouped_mm(dy.t(), h, offs) and dw1 [E, 2 ffn,
   hidden] = _grouped_mm(d(gate|up).t(), x, offs), as autograd's backward of _grouped_mm calls it; DeepSeek-V3 and
   Mixtral at 256 / 512 / 1024 / 2048 / 4096 rows per expert. The operands are tried as stored ("as-stored": a.t() a
   transposed view) and as K-major copies made outside the timing ("k-major"); the faster is the baseline.
4. PyTorch's unfused MoE expert layer: random top-8 routing of tokens = rows * 32 / 8; route (argsort + bincount),
   permute by gather, grouped GEMM, SwiGLU, grouped GEMM, weighted index_add_ back (fp32). Timed whole, and its two
   GEMMs alone on the same routing.

Timing: CUDA events around each call, all calls enqueued back to back and synchronised once, 3 warm-up calls, median
of --iters (>= 20), two input sets rotated so L2 does not flatter. TFLOP/s count 2 * rows * n * k per GEMM (2 * rows *
m * n for the weight gradients).

  python3 bench/grouped_mm_baseline.py [--iters 30] [--json FILE] [--counts-out FILE] [--ms-out FILE]
                                       [--skip-forward] [--skip-dgrad] [--skip-wgrad] [--skip-layer] [--decode]
                                       [--fp8]

--decode: instead, torch._grouped_mm at decode sizes (grouped_gemm_bench --decode): 1, 8, 32 and 128 tokens routed
top-8 over the 32 experts, gemm1 and gemm2 (k-major weights), with the GB/s of the routed experts' weights read once
against a device-to-device copy (bytes read + written) measured in the same run.

--fp8: instead, torch._scaled_grouped_mm (where the installed torch has it) on the forward GEMMs of grouped_gemm_bench
--dtype fp8: gemm1 and gemm2 of DeepSeek-V3 and Mixtral at 256 / 512 / 1024 / 2048 / 4096 rows per expert, e4m3 with
rowwise scales (one per row of x, one per output column of each expert's w: the scaling it offers on sm_90, coarser
and cheaper than tandem's 1 x 128 / 128 x 128 blocks), bf16 out. --ms-out then writes ops "gemm1/fp8" and
"gemm2/fp8", which grouped_gemm_bench --dtype fp8 --torch FILE reads.

--counts-out writes the random routings' group sizes as lines "name c0 ... c31", for grouped_gemm_bench --counts.
--ms-out writes the baseline's median ms of 1., 2. and 3. as lines "model case op ms", for grouped_gemm_bench --torch
(which prints torch ms / tandem ms per op).
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

E, HIDDEN, FFN, TOPK = 32, 7168, 2048, 8
# (name as grouped_gemm_bench prints it, experts, hidden, ffn)
MODELS = (("dsv3", E, HIDDEN, FFN), ("mixtral", 8, 4096, 14336))
DGRAD_ROWS = (256, 512, 1024, 2048, 4096)
SETS = 2
WARM = 3


def equal_counts(rows):
    return [rows] * E


def skew_counts():
    # 16384 rows, 80% on expert 0, every count a multiple of 16: 13104 + 19 x 112 + 12 x 96 (as grouped_gemm_bench).
    counts = [96] * E
    counts[0] = 13104
    for e in range(1, 20):
        counts[e] = 112
    return counts


def time_calls(fns, iters):
    """Median ms over iters calls of fns[i % len(fns)], each between its own pair of events."""
    total = iters + WARM
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(total)]
    for i in range(total):
        ev[i][0].record()
        fns[i % len(fns)]()
        ev[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev[WARM:])


def tflops(rows, n, k, ms):
    return 2.0 * rows * n * k / (ms * 1e-3) / 1e12


def grouped_mm_cases(iters, dtype, results):
    cases = [(f"equal{r}", equal_counts(r)) for r in (256, 512, 1024, 2048)] + [("skew", skew_counts())]
    max_rows = max(sum(c) for _, c in cases)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1).to(dtype)

    x = [rnd(max_rows, HIDDEN) for _ in range(SETS)]
    h = [rnd(max_rows, FFN) for _ in range(SETS)]
    w1 = [rnd(E, 2 * FFN, HIDDEN) for _ in range(SETS)]  # k-major (nn.Linear)
    w2 = [rnd(E, HIDDEN, FFN) for _ in range(SETS)]
    layouts = {
        "k-major": ([w.transpose(-2, -1) for w in w1], [w.transpose(-2, -1) for w in w2]),
        "n-major": ([w.transpose(-2, -1).contiguous() for w in w1], [w.transpose(-2, -1).contiguous() for w in w2]),
    }
    # Correctness of the baseline itself: one group against a plain matmul.
    offs = torch.tensor(equal_counts(256), device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = torch._grouped_mm(x[0][:8192], layouts["k-major"][0][0], offs=offs)
    want = x[0][256:512].float() @ w1[0][1].float().t()
    rel = ((got[256:512].float() - want).norm() / want.norm()).item()
    print(f"torch._grouped_mm self-check (group 1 vs fp32 matmul): rel_err {rel:.3e}")
    if not rel < 1e-2:
        print("FAIL: torch._grouped_mm disagrees with matmul")
        sys.exit(1)

    print(f"\ntorch._grouped_mm (median of {iters}, {SETS} rotated input sets):")
    print(f"{'case':<10} {'rows':>7}  {'op':<6} {'layout':<8} {'ms':>9} {'TFLOP/s':>9}")
    for name, counts in cases:
        rows = sum(counts)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for op, n, k in (("gemm1", 2 * FFN, HIDDEN), ("gemm2", HIDDEN, FFN)):
            best = None
            for layout, (l1, l2) in layouts.items():
                a = x if op == "gemm1" else h
                b = l1 if op == "gemm1" else l2
                try:
                    fns = [lambda i=i: torch._grouped_mm(a[i][:rows], b[i], offs=offs) for i in range(SETS)]
                    ms = time_calls(fns, iters)
                except RuntimeError as e:  # a layout this build refuses
                    print(f"{name:<10} {rows:>7}  {op:<6} {layout:<8} refused: {str(e).splitlines()[0]}")
                    continue
                tf = tflops(rows, n, k, ms)
                print(f"{name:<10} {rows:>7}  {op:<6} {layout:<8} {ms:9.4f} {tf:9.1f}")
                if best is None or ms < best[0]:
                    best = (ms, layout)
            if best is not None:
                results["grouped_mm"].append({"model": "dsv3", "case": name, "rows": rows, "op": op, "ms": best[0],
                                              "tflops": tflops(rows, n, k, best[0]), "layout": best[1]})
        sys.stdout.flush()
    del x, h, w1, w2, layouts
    torch.cuda.empty_cache()


def dgrad_cases(iters, dtype, results):
    """torch._grouped_mm(a, w[e]) with w as the forward stores it ([E, K, N]), the dgrad GEMMs of the MoE backward."""
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1).to(dtype)

    for model, experts, hidden, ffn in MODELS:
        max_rows = max(DGRAD_ROWS) * experts
        dy = [rnd(max_rows, hidden) for _ in range(SETS)]
        dgu = [rnd(max_rows, 2 * ffn) for _ in range(SETS)]
        w1 = [rnd(experts, 2 * ffn, hidden) for _ in range(SETS)]  # [E, K, N] for dgrad-x: K = 2 ffn, N = hidden
        w2 = [rnd(experts, hidden, ffn) for _ in range(SETS)]      # [E, K, N] for dgrad-h: K = hidden, N = ffn
        def k_major(ws):  # the same [E, K, N] values, stored [E, N, K]
            return [w.transpose(-2, -1).contiguous().transpose(-2, -1) for w in ws]

        # op -> (a, {layout: mat_b per set}, n, k)
        ops = {
            "dgrad-h": (dy, {"n-major": w2, "k-major": k_major(w2)}, ffn, hidden),
            "dgrad-x": (dgu, {"n-major": w1, "k-major": k_major(w1)}, hidden, 2 * ffn),
        }
        # Correctness of the baseline itself: group 1 of each op against a plain matmul.
        offs = torch.tensor([256] * experts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for op, (a, layouts, n, k) in ops.items():
            for layout, b in layouts.items():
                got = torch._grouped_mm(a[0][:256 * experts], b[0], offs=offs)
                want = a[0][256:512].float() @ b[0][1].float()
                rel = ((got[256:512].float() - want).norm() / want.norm()).item()
                if not rel < 1e-2:
                    print(f"FAIL: torch._grouped_mm {model} {op} {layout} disagrees with matmul: rel_err {rel:.3e}")
                    sys.exit(1)
        print(f"\n{model} ({experts} experts, hidden {hidden}, ffn {ffn}): torch._grouped_mm(a, w[e]), w [E, K, N] "
              f"(median of {iters}, {SETS} rotated input sets; self-check vs fp32 matmul passed):")
        print(f"{'case':<10} {'rows':>7}  {'op':<8} {'layout':<8} {'ms':>9} {'TFLOP/s':>9}")
        for rows_per_expert in DGRAD_ROWS:
            name = f"equal{rows_per_expert}"
            rows = rows_per_expert * experts
            counts = torch.tensor([rows_per_expert] * experts, device="cuda", dtype=torch.int32)
            offs = counts.cumsum(0, dtype=torch.int32)
            for op, (a, layouts, n, k) in ops.items():
                best = None
                for layout, b in layouts.items():
                    try:
                        fns = [lambda i=i: torch._grouped_mm(a[i][:rows], b[i], offs=offs) for i in range(SETS)]
                        ms = time_calls(fns, iters)
                    except RuntimeError as e:  # a layout this build refuses
                        print(f"{name:<10} {rows:>7}  {op:<8} {layout:<8} refused: {str(e).splitlines()[0]}")
                        continue
                    print(f"{name:<10} {rows:>7}  {op:<8} {layout:<8} {ms:9.4f} {tflops(rows, n, k, ms):9.1f}")
                    if best is None or ms < best[0]:
                        best = (ms, layout)
                if best is not None:
                    results["grouped_mm"].append({"model": model, "case": name, "rows": rows, "op": op,
                                                  "ms": best[0], "tflops": tflops(rows, n, k, best[0]),
                                                  "layout": best[1]})
            sys.stdout.flush()
        del dy, dgu, w1, w2, ops
        torch.cuda.empty_cache()


def wgrad_cases(iters, dtype, results):
    """torch._grouped_mm(a.t(), b, offs=offs) -> [E, m, n]: the weight-gradient GEMMs of the MoE backward."""
    gen = torch.Generator(device="cuda").manual_seed(4)

    def rnd(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1).to(dtype)

    for model, experts, hidden, ffn in MODELS:
        max_rows = max(DGRAD_ROWS) * experts
        dy = [rnd(max_rows, hidden) for _ in range(SETS)]
        h = [rnd(max_rows, ffn) for _ in range(SETS)]
        dgu = [rnd(max_rows, 2 * ffn) for _ in range(SETS)]
        x = [rnd(max_rows, hidden) for _ in range(SETS)]
        # op -> (a [rows, m], b [rows, n], m, n): out[e] = a_e^T b_e
        ops = {"dw2": (dy, h, hidden, ffn), "dw1": (dgu, x, 2 * ffn, hidden)}

        def operands(layout, a, b, rows):
            if layout == "as-stored":
                return a[:rows].t(), b[:rows]
            # The same values, stored K-major: a^T [m, rows] contiguous, b [rows, n] with the rows innermost.
            return a[:rows].t().contiguous(), b[:rows].t().contiguous().t()

        # Correctness of the baseline itself: expert 1 of each op against a plain matmul.
        offs = torch.tensor([256] * experts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for op, (a, b, m, n) in ops.items():
            for layout in ("as-stored", "k-major"):
                try:
                    got = torch._grouped_mm(*operands(layout, a[0], b[0], 256 * experts), offs=offs)
                except RuntimeError:
                    continue  # refused here; the timing loop reports it
                want = a[0][256:512].float().t() @ b[0][256:512].float()
                rel = ((got[1].float() - want).norm() / want.norm()).item()
                if not rel < 1e-2:
                    print(f"FAIL: torch._grouped_mm {model} {op} {layout} disagrees with matmul: rel_err {rel:.3e}")
                    sys.exit(1)
        print(f"\n{model} ({experts} experts, hidden {hidden}, ffn {ffn}): torch._grouped_mm(a.t(), b, offs) -> "
              f"[E, m, n] (median of {iters}, {SETS} rotated input sets; self-check vs fp32 matmul passed):")
        print(f"{'case':<10} {'rows':>7}  {'op':<8} {'layout':<9} {'ms':>9} {'TFLOP/s':>9}")
        for rows_per_expert in DGRAD_ROWS:
            name = f"equal{rows_per_expert}"
            rows = rows_per_expert * experts
            offs = torch.tensor([rows_per_expert] * experts, device="cuda", dtype=torch.int32).cumsum(
                0, dtype=torch.int32)
            for op, (a, b, m, n) in ops.items():
                best = None
                for layout in ("as-stored", "k-major"):
                    pairs = [operands(layout, a[i], b[i], rows) for i in range(SETS)]
                    try:
                        fns = [lambda i=i: torch._grouped_mm(pairs[i][0], pairs[i][1], offs=offs)
                               for i in range(SETS)]
                        ms = time_calls(fns, iters)
                    except RuntimeError as e:  # a layout this build refuses
                        print(f"{name:<10} {rows:>7}  {op:<8} {layout:<9} refused: {str(e).splitlines()[0]}")
                        continue
                    print(f"{name:<10} {rows:>7}  {op:<8} {layout:<9} {ms:9.4f} {tflops(rows, m, n, ms):9.1f}")
                    if best is None or ms < best[0]:
                        best = (ms, layout)
                    del pairs, fns
                if best is not None:
                    results["grouped_mm"].append({"model": model, "case": name, "rows": rows, "op": op,
                                                  "ms": best[0], "tflops": tflops(rows, m, n, best[0]),
                                                  "layout": best[1]})
            sys.stdout.flush()
        del dy, h, dgu, x, ops
        torch.cuda.empty_cache()


def moe_layer_cases(iters, dtype, results, counts_out):
    gen = torch.Generator(device="cuda").manual_seed(2)

    def rnd(*shape, scale=1.0):
        return ((torch.rand(*shape, device="cuda", generator=gen) * 2 - 1) * scale).to(dtype)

    w1 = [rnd(E, 2 * FFN, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(SETS)]
    w2 = [rnd(E, HIDDEN, FFN, scale=FFN ** -0.5) for _ in range(SETS)]
    w1t = [w.transpose(-2, -1) for w in w1]
    w2t = [w.transpose(-2, -1) for w in w2]
    lines = []
    print(f"\nPyTorch unfused MoE layer, random top-{TOPK} routing over {E} experts (median of {iters}):")
    print(f"{'rows/exp':>8} {'tokens':>7} {'layer ms':>9} {'TFLOP/s':>8} {'gemm1 ms':>9} {'gemm2 ms':>9} "
          f"{'2 GEMMs ms':>10} {'outside GEMMs':>13}")
    for rows_per_expert in (256, 512, 1024, 2048):
        tokens = rows_per_expert * E // TOPK
        xs, ids, wts = [], [], []
        for _ in range(SETS):
            xs.append(rnd(tokens, HIDDEN))
            ids.append(torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices)
            wts.append(torch.softmax(torch.rand(tokens, TOPK, device="cuda", generator=gen), dim=1))

        def layer(i):
            flat = ids[i].reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            tok = order // TOPK
            xp = xs[i].index_select(0, tok)  # permute by gather
            gu = torch._grouped_mm(xp, w1t[i], offs=offs)
            hh = F.silu(gu[:, :FFN]) * gu[:, FFN:]
            y = torch._grouped_mm(hh, w2t[i], offs=offs)
            out = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.float32)
            out.index_add_(0, tok, y.float() * wts[i].reshape(-1)[order].unsqueeze(1))
            return out

        rows = tokens * TOPK
        layer_ms = time_calls([lambda i=i: layer(i) for i in range(SETS)], iters)
        # The two GEMMs alone on the same routings (inputs permuted once, outside the timing).
        pre = []
        for i in range(SETS):
            flat = ids[i].reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            xp = xs[i].index_select(0, order // TOPK)
            hh = rnd(rows, FFN)
            pre.append((xp, hh, offs))
            lines.append(f"random{rows_per_expert}_{i} " + " ".join(str(int(c)) for c in counts.tolist()))
        g1 = time_calls([lambda i=i: torch._grouped_mm(pre[i][0], w1t[i], offs=pre[i][2]) for i in range(SETS)], iters)
        g2 = time_calls([lambda i=i: torch._grouped_mm(pre[i][1], w2t[i], offs=pre[i][2]) for i in range(SETS)], iters)
        flops = 2.0 * rows * HIDDEN * 2 * FFN + 2.0 * rows * FFN * HIDDEN
        outside = 1.0 - (g1 + g2) / layer_ms
        print(f"{rows_per_expert:>8} {tokens:>7} {layer_ms:9.3f} {flops / (layer_ms * 1e-3) / 1e12:8.1f} {g1:9.3f} "
              f"{g2:9.3f} {g1 + g2:10.3f} {outside * 100:12.1f}%")
        results["moe_layer"].append({"rows_per_expert": rows_per_expert, "tokens": tokens, "layer_ms": layer_ms,
                                     "gemm1_ms": g1, "gemm2_ms": g2,
                                     "gemm1_tflops": tflops(rows, 2 * FFN, HIDDEN, g1),
                                     "gemm2_tflops": tflops(rows, HIDDEN, FFN, g2)})
        sys.stdout.flush()
    if counts_out:
        with open(counts_out, "w") as f:
            # One routing per size (set 0) keeps the tandem bench short.
            f.write("\n".join(line for line in lines if line.split()[0].endswith("_0")) + "\n")


def copy_gbs():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_calls([lambda: dst.copy_(src)], 20)
    return 2.0 * src.numel() / (ms * 1e-3) / 1e9


def decode_cases(iters, dtype, results):
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1).to(dtype)

    copy = copy_gbs()
    w1t = [rnd(E, 2 * FFN, HIDDEN).transpose(-2, -1) for _ in range(SETS)]  # k-major (nn.Linear), as tandem reads
    w2t = [rnd(E, HIDDEN, FFN).transpose(-2, -1) for _ in range(SETS)]
    print(f"\ntorch._grouped_mm at decode sizes, top-{TOPK} over {E} experts (median of {iters}); device-to-device "
          f"copy {copy:.0f} GB/s (read + write); x copy = time / (weight bytes / copy GB/s)")
    print(f"{'tokens':>6} {'rows':>5} {'experts':>7}  {'op':<6} {'ms':>9} {'weight MB':>9} {'GB/s':>8} {'x copy':>7}")
    for tokens in (1, 8, 32, 128):
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = tokens * TOPK
        active = int((counts > 0).sum().item())
        x = [rnd(rows, HIDDEN) for _ in range(SETS)]
        h = [rnd(rows, FFN) for _ in range(SETS)]
        for op, a, b, n, k in (("gemm1", x, w1t, 2 * FFN, HIDDEN), ("gemm2", h, w2t, HIDDEN, FFN)):
            ms = time_calls([lambda i=i: torch._grouped_mm(a[i], b[i], offs=offs) for i in range(SETS)], iters)
            wbytes = active * n * k * 2.0
            gbs = wbytes / (ms * 1e-3) / 1e9
            print(f"{tokens:>6} {rows:>5} {active:>7}  {op:<6} {ms:9.4f} {wbytes / 1e6:9.1f} {gbs:8.0f} "
                  f"{copy / gbs:7.2f}")
            results["decode"].append({"tokens": tokens, "rows": rows, "experts": active, "op": op, "ms": ms,
                                      "weight_gbs": gbs, "copy_gbs": copy})
        sys.stdout.flush()


def fp8_cases(iters, results):
    """torch._scaled_grouped_mm on the forward GEMMs that grouped_gemm_bench --dtype fp8 times."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        print(f"torch {torch.__version__} has no torch._scaled_grouped_mm: no FP8 grouped baseline")
        return
    f8 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(4)

    def rnd8(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1).to(f8)

    def scales(*shape):
        return torch.rand(*shape, device="cuda", generator=gen, dtype=torch.float32) + 0.5

    print(f"\ntorch._scaled_grouped_mm, e4m3, rowwise scales (one per row of x, one per output column of each expert's "
          f"w), bf16 out (median of {iters}, {SETS} rotated input sets):")
    print(f"{'model':<7} {'case':<10} {'rows':>7}  {'op':<9} {'ms':>9} {'TFLOP/s':>9}")
    for model, experts, hidden, ffn in MODELS:
        max_rows = experts * max(DGRAD_ROWS)
        x = [rnd8(max_rows, hidden) for _ in range(SETS)]
        h = [rnd8(max_rows, ffn) for _ in range(SETS)]
        w1 = [rnd8(experts, 2 * ffn, hidden) for _ in range(SETS)]  # [E, n, k], passed transposed (K-major)
        w2 = [rnd8(experts, hidden, ffn) for _ in range(SETS)]
        sx = [scales(max_rows) for _ in range(SETS)]
        sh = [scales(max_rows) for _ in range(SETS)]
        sw1 = [scales(experts, 2 * ffn) for _ in range(SETS)]
        sw2 = [scales(experts, hidden) for _ in range(SETS)]
        ops = (("gemm1/fp8", x, sx, w1, sw1, 2 * ffn, hidden), ("gemm2/fp8", h, sh, w2, sw2, hidden, ffn))
        # Correctness of the baseline itself: group 1 against a plain matmul of the dequantized operands.
        rows_per = DGRAD_ROWS[0]
        offs = torch.tensor([rows_per] * experts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        try:
            got = torch._scaled_grouped_mm(x[0][:rows_per * experts], w1[0].transpose(-2, -1),
                                           sx[0][:rows_per * experts], sw1[0], offs=offs, out_dtype=torch.bfloat16)
        except RuntimeError as e:  # a build or device without the FP8 grouped kernels
            print(f"{model:<7} torch._scaled_grouped_mm refused: {str(e).splitlines()[0]}")
            continue
        a = x[0][rows_per:2 * rows_per].float() * sx[0][rows_per:2 * rows_per, None]
        want = a @ (w1[0][1].float() * sw1[0][1][:, None]).t()
        rel = ((got[rows_per:2 * rows_per].float() - want).norm() / want.norm()).item()
        print(f"{model:<7} torch._scaled_grouped_mm self-check (group 1 vs fp32 matmul): rel_err {rel:.3e}")
        if not rel < 1e-2:
            print("FAIL: torch._scaled_grouped_mm disagrees with matmul")
            sys.exit(1)
        for rows_per in DGRAD_ROWS:
            counts = [rows_per] * experts
            rows = sum(counts)
            offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
            for op, a, sa, b, sb, n, k in ops:
                fns = [lambda i=i: torch._scaled_grouped_mm(a[i][:rows], b[i].transpose(-2, -1), sa[i][:rows], sb[i],
                                                            offs=offs, out_dtype=torch.bfloat16)
                       for i in range(SETS)]
                ms = time_calls(fns, iters)
                tf = tflops(rows, n, k, ms)
                print(f"{model:<7} {'equal' + str(rows_per):<10} {rows:>7}  {op:<9} {ms:9.4f} {tf:9.1f}")
                results["grouped_mm"].append({"model": model, "case": f"equal{rows_per}", "rows": rows, "op": op,
                                              "ms": ms, "tflops": tf, "layout": "k-major, rowwise scales"})
            sys.stdout.flush()
        del x, h, w1, w2, sx, sh, sw1, sw2
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--counts-out", default="")
    ap.add_argument("--ms-out", default="")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--skip-dgrad", action="store_true")
    ap.add_argument("--skip-wgrad", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    if args.iters < 20:
        ap.error("--iters must be >= 20 (median of at least 20)")
    if not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(77)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {'fp8 (e4m3)' if args.fp8 else 'bf16'}")
    results = {"grouped_mm": [], "moe_layer": [], "decode": []}
    if args.fp8:
        fp8_cases(args.iters, results)
        if args.ms_out:
            with open(args.ms_out, "w") as f:
                f.write("".join(f"{r['model']} {r['case']} {r['op']} {r['ms']:.5f}\n" for r in results["grouped_mm"]))
    elif args.decode:
        decode_cases(args.iters, torch.bfloat16, results)
    else:
        if not args.skip_forward:
            grouped_mm_cases(args.iters, torch.bfloat16, results)
        if not args.skip_dgrad:
            dgrad_cases(args.iters, torch.bfloat16, results)
        if not args.skip_wgrad:
            wgrad_cases(args.iters, torch.bfloat16, results)
        if args.ms_out:
            with open(args.ms_out, "w") as f:
                f.write("".join(f"{r['model']} {r['case']} {r['op']} {r['ms']:.5f}\n" for r in results["grouped_mm"]))
    if not args.decode and not args.fp8 and not args.skip_layer:
        moe_layer_cases(args.iters, torch.bfloat16, results, args.counts_out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
