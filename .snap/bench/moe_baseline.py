#!/usr/bin/env python3
"""PyTorch baselines for the MoE FFN layer (bench/moe_bench.cu), one GPU, on the routings, weights and inputs that
moe_bench used, forward and backward.

moe_bench --routing-dir DIR writes per case DIR/<model>.<case>.json (shapes; the seed every input was drawn from with
bench_kernels.cuh's fillUniform, and probe values of each), .ids (int32 [tokens, topk]), .wts (fp32 [tokens, topk])
and, after its backward, tandem's gradient samples (.dx, .dtopk, .dw1, .dw2). This script draws the same inputs again
(bit for bit: the probes are compared, and a mismatch stops the run) and times, per case:
  permute+gmm  route (stable argsort, bincount, cumsum), permute x by gather, torch._grouped_mm with w1 (tandem's
               dispatch+GEMM, routing and permutation included on both sides);
  layer        the same, then SwiGLU, torch._grouped_mm with w2 and the weighted un-permute (index_add in fp32, as
               tandem combines): the forward, without autograd;
  fwd+bwd      the layer under autograd: torch.autograd.grad of its output with moe_bench's dout against x, the topk
               weights, w1 and w2 (backward = autograd's: the grouped GEMMs' own backward, SwiGLU's, the gather's);
  bwd          the backward alone (autograd.grad on a retained graph of one forward);
  gemm1/gemm2  the two forward GEMMs alone on rows already permuted.
Weights are passed as transposed views of nn.Linear's [E, n, k] layout (as tandem reads them) and as contiguous
[E, k, n]; the faster layout (by fwd+bwd, else layer) is the baseline. Timing: CUDA events, 3 warm-up calls, median
of --iters, two input sets (x, dout) rotated.
Check (cases moe_bench ran its backward on): autograd's dx (moe_bench's sampled tokens), d(topk weights) (all),
dw1 and dw2 (the sampled rows of every expert) against tandem's, relative error sqrt(sum (t - p)^2 / sum p^2)
printed; above 2e-2 (bf16 tolerance) the run fails (exit 1).
With --tandem FILE (moe_bench's --json) it prints tandem's speed-up over these (forward+backward target >= 1.5x; with
moe_bench --saved also that of tandem's backward from saved activations and forward+backward that way) and
the backward's time over its grouped GEMMs alone (target <= 1.10).

  python3 bench/moe_baseline.py --routing-dir DIR [--iters 30] [--json FILE] [--tandem FILE] [--device cuda|cpu]

--device cpu runs on the CPU (a per-expert loop where torch._grouped_mm has no CPU backward) to show the script
works on small shapes; its times are no claim. Exits 77 without a CUDA device (cuda), 2 on bad inputs.
"""
import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SETS = 2
WARM = 3
TOLERANCE = 2e-2  # moe_bench.cu kTolerance


def _s64(v):
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


GOLDEN, MIX1, MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xFF51AFD7ED558CCD), _s64(0xC4CEB9FE1A85EC53)


def _shr(x, n):
    """Logical right shift of uint64 bits held in int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def fill_uniform(numel, seed, device, chunk=1 << 25):
    """bench_kernels.cuh fillUniform: element i = bf16(2 * (mix(i * golden + seed) >> 40) / 2^24 - 1), int64 math
    wrapping as uint64 does."""
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        x = torch.arange(start, start + n, dtype=torch.int64, device=device) * GOLDEN + seed
        x ^= _shr(x, 33)
        x *= MIX1
        x ^= _shr(x, 33)
        x *= MIX2
        x ^= _shr(x, 33)
        u = _shr(x, 40).to(torch.float32) * (1.0 / 16777216.0)
        out[start:start + n] = (2.0 * u - 1.0).to(torch.bfloat16)
    return out


def die(message):
    print(f"moe_baseline: {message}", file=sys.stderr)
    sys.exit(2)


def load(path, dtype, shape, device):
    """A binary file moe_bench wrote, checked for its size."""
    n = math.prod(shape)
    if not os.path.exists(path) or os.path.getsize(path) != n * dtype.itemsize:
        die(f"{path} is missing or not {n * dtype.itemsize} bytes ({dtype} {list(shape)}); run moe_bench --routing-dir "
            f"again")
    return torch.from_file(path, dtype=dtype, size=n).view(*shape).to(device)


def drawn(meta, name, shape, device):
    """The input `name` of a moe_bench case, drawn again from its seed and checked against moe_bench's probes."""
    spec = meta["inputs"][name]
    t = fill_uniform(spec["numel"], spec["seed"], device)
    got = t[torch.tensor(spec["index"], device=device)].view(torch.int16).to(torch.int32).bitwise_and(0xFFFF)
    if got.tolist() != spec["bits"]:
        die(f"{meta['model']}.{meta['case']}: input {name} drawn from seed {spec['seed']} differs from moe_bench's "
            f"(probe bits {got.tolist()} vs {spec['bits']}); bench_kernels.cuh fillUniform and fill_uniform here "
            f"must match")
    return t.view(*shape)


def time_calls(fns, iters, cuda):
    total = iters + WARM
    if not cuda:
        ms = []
        for i in range(total):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms[WARM:])
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(total)]
    for i in range(total):
        ev[i][0].record()
        fns[i % len(fns)]()
        ev[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev[WARM:])


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def grouped_mm(a, w, offs, counts):
    """a [rows, k] grouped by expert times w [E, k, n] per group."""
    if a.is_cuda:
        return torch._grouped_mm(a, w, offs=offs)
    parts, at = [], 0  # CPU: torch._grouped_mm has no CPU backward
    for e, c in enumerate(counts):
        parts.append(a[at:at + c] @ w[e])
        at += c
    return torch.cat(parts)


class Layer:
    """PyTorch's unfused MoE FFN layer on one routing: route, permute, grouped GEMM, SwiGLU, grouped GEMM, combine."""

    def __init__(self, ids, tokens, hidden, ffn, experts):
        self.tokens, self.hidden, self.ffn, self.experts, self.topk = tokens, hidden, ffn, experts, ids.shape[1]
        self.ids = ids
        self.counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()  # CPU path only

    def route(self):
        flat = self.ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=self.experts), 0, dtype=torch.int32)
        return order, offs

    def dispatch_gemm(self, x, w1t):
        order, offs = self.route()
        return grouped_mm(x.index_select(0, order // self.topk), w1t, offs, self.counts)

    def __call__(self, x, wts, w1t, w2t):
        order, offs = self.route()
        tok = order // self.topk
        gu = grouped_mm(x.index_select(0, tok), w1t, offs, self.counts)
        h = F.silu(gu[:, :self.ffn]) * gu[:, self.ffn:]
        y = grouped_mm(h, w2t, offs, self.counts)
        out = torch.zeros(self.tokens, self.hidden, device=x.device, dtype=torch.float32)
        return out.index_add(0, tok, y.float() * wts.reshape(-1)[order].unsqueeze(1)).to(x.dtype)


def rel_error(got, want):
    got, want = got.double(), want.double()
    return math.sqrt(((got - want) ** 2).sum().item() / max((want ** 2).sum().item(), 1e-30))


def check(meta, prefix, grads, device):
    """Relative errors of tandem's gradient samples against autograd's: {name: err}."""
    hidden, ffn, experts, topk, tokens = meta["hidden"], meta["ffn"], meta["experts"], meta["topk"], meta["tokens"]
    s = meta["samples"]

    dx, dwts, dw1, dw2 = grads
    toks = torch.tensor(s["tokens"], device=device)
    r1 = torch.tensor(s["dw1_rows"], device=device)
    r2 = torch.tensor(s["dw2_rows"], device=device)
    return {
        "dx": rel_error(load(prefix + ".dx", torch.bfloat16, (len(s["tokens"]), hidden), device), dx[toks]),
        "dtopk": rel_error(load(prefix + ".dtopk", torch.float32, (tokens, topk), device), dwts),
        "dw1": rel_error(load(prefix + ".dw1", torch.bfloat16, (experts, len(s["dw1_rows"]), hidden), device),
                         dw1[:, r1]),
        "dw2": rel_error(load(prefix + ".dw2", torch.bfloat16, (experts, len(s["dw2_rows"]), ffn), device), dw2[:, r2]),
    }


def run_case(meta, prefix, w1, w2, args, dev):
    """Times (and checks) one case; returns its result dict (the faster layout's times) and whether its check
    passed."""
    cuda = dev.type == "cuda"
    hidden, ffn, experts, topk, tokens = meta["hidden"], meta["ffn"], meta["experts"], meta["topk"], meta["tokens"]
    backward = "samples" in meta
    ids = load(prefix + ".ids", torch.int32, (tokens, topk), dev).long()
    wts0 = load(prefix + ".wts", torch.float32, (tokens, topk), dev)
    xs = [drawn(meta, f"x{i}", (tokens, hidden), dev) for i in range(SETS)]
    douts = [drawn(meta, f"dout{i}", (tokens, hidden), dev) for i in range(SETS)]
    layer = Layer(ids, tokens, hidden, ffn, experts)
    rows = tokens * topk
    g1f = 2.0 * rows * hidden * 2 * ffn
    g2f = 2.0 * rows * ffn * hidden
    name = f"{meta['model']}.{meta['case']}"
    passed = True
    errs = None
    if backward:
        leaves = [xs[0].clone().requires_grad_(), wts0.clone().requires_grad_(), w1.clone().requires_grad_(),
                  w2.clone().requires_grad_()]
        out = layer(leaves[0], leaves[1], leaves[2].transpose(-2, -1), leaves[3].transpose(-2, -1))
        errs = check(meta, prefix, torch.autograd.grad(out, leaves, douts[0]), dev)
        del leaves, out
        passed = all(e <= TOLERANCE for e in errs.values())
        print(f"{'ok  ' if passed else 'FAIL'} {name}: tandem's gradients vs autograd's, rel_err "
              + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tolerance {TOLERANCE:.0e})")

    layouts = {"k-major": lambda w: w.transpose(-2, -1), "n-major": lambda w: w.transpose(-2, -1).contiguous()}
    best = None
    for layout, view in layouts.items():
        w1t, w2t = view(w1), view(w2)
        r = {"model": meta["model"], "case": meta["case"], "tokens": tokens, "layout": layout}
        try:
            with torch.no_grad():
                r["dispatch_gemm_ms"] = time_calls([lambda i=i: layer.dispatch_gemm(xs[i], w1t) for i in range(SETS)],
                                                   args.iters, cuda)
                r["layer_ms"] = time_calls([lambda i=i: layer(xs[i], wts0, w1t, w2t) for i in range(SETS)],
                                           args.iters, cuda)
                order, offs = layer.route()
                xp = [x.index_select(0, order // topk) for x in xs]
                hh = [F.silu(g[:, :ffn]) * g[:, ffn:] for g in (grouped_mm(x, w1t, offs, layer.counts) for x in xp)]
                r["gemm1_ms"] = time_calls([lambda i=i: grouped_mm(xp[i], w1t, offs, layer.counts)
                                            for i in range(SETS)], args.iters, cuda)
                r["gemm2_ms"] = time_calls([lambda i=i: grouped_mm(hh[i], w2t, offs, layer.counts)
                                            for i in range(SETS)], args.iters, cuda)
                del xp, hh
            if backward:
                w1l, w2l = w1t.detach().requires_grad_(), w2t.detach().requires_grad_()
                sets = [(xs[i].detach().requires_grad_(), wts0.clone().requires_grad_()) for i in range(SETS)]

                def fwd_bwd(i):
                    x, wts = sets[i]
                    torch.autograd.grad(layer(x, wts, w1l, w2l), (x, wts, w1l, w2l), douts[i])

                r["fwd_bwd_ms"] = time_calls([lambda i=i: fwd_bwd(i) for i in range(SETS)], args.iters, cuda)
                outs = [layer(x, wts, w1l, w2l) for x, wts in sets]
                r["bwd_ms"] = time_calls([lambda i=i: torch.autograd.grad(outs[i], (*sets[i], w1l, w2l), douts[i],
                                                                          retain_graph=True) for i in range(SETS)],
                                         args.iters, cuda)
                del outs, sets, w1l, w2l
        except RuntimeError as e:
            print(f"{name:<22} {tokens:>6} {layout:<8} refused: {str(e).splitlines()[0]}")
            continue
        finally:
            del w1t, w2t
        r["dispatch_gemm_tflops"] = tflops(g1f, r["dispatch_gemm_ms"])
        r["layer_tflops"] = tflops(g1f + g2f, r["layer_ms"])
        outside = 1.0 - (r["gemm1_ms"] + r["gemm2_ms"]) / r["layer_ms"]
        print(f"{name:<22} {tokens:>6} {layout:<8} {r['dispatch_gemm_ms']:11.4f} {r['layer_ms']:9.4f} "
              f"{r.get('fwd_bwd_ms', math.nan):9.4f} {r.get('bwd_ms', math.nan):9.4f} {r['gemm1_ms']:9.4f} "
              f"{r['gemm2_ms']:9.4f} {outside * 100:12.1f}%")
        sys.stdout.flush()
        key = "fwd_bwd_ms" if backward else "layer_ms"
        if best is None or r[key] < best[key]:
            best = r
    if best is not None and errs is not None:
        best["check"] = errs
        best["check_ok"] = passed
    return best, passed


def print_ratios(results, tandem_path):
    with open(tandem_path) as f:
        tandem = {(c.get("model", "deepseek-v3"), c["case"]): c for c in json.load(f)["cases"]}
    print("\ntandem vs PyTorch (x = PyTorch ms / tandem ms, above 1: tandem is faster). 2 GEMMs/FFN: tandem's "
          "gemm1+SwiGLU and gemm2 alone over its FFN; bwd / its GEMMs: tandem's backward over its five grouped GEMMs "
          "alone (recompute gate|up, dout·w2, dx, dw2, dw1):")
    saved = any("fwd_bwd_saved_ms" in c for c in tandem.values())
    if saved:
        print("saved: tandem with the forward's gate|up saved for the backward (moe_bench --saved), no recompute GEMM")
    print(f"{'case':<22} {'dispatch+GEMM':>13} {'FFN layer':>10} {'2 GEMMs/FFN':>11} {'backward':>9} "
          f"{'fwd+bwd':>8} {'(>= 1.5)':>8} {'bwd / its GEMMs':>15} {'(<= 1.10)':>9}"
          + (f" {'bwd saved':>9} {'fwd+bwd saved':>13} {'(>= 1.5)':>8}" if saved else ""))
    def num(v, unit=""):
        return "-" if math.isnan(v) else f"{v:.3f}{unit}"

    def verdict(v, met):
        return "" if math.isnan(v) else "met" if met else "not met"

    def over(num_ms, den_ms):
        return num_ms / den_ms if num_ms and den_ms else math.nan

    gemms = ["bwd_recompute_ms", "bwd_dout_w2_ms", "bwd_dx_ms", "bwd_dw2_ms", "bwd_dw1_ms"]
    for r in results:
        t = tandem.get((r["model"], r["case"]))
        if t is None:
            continue
        fb = over(r.get("fwd_bwd_ms"), t.get("fwd_bwd_ms"))
        fbs = over(r.get("fwd_bwd_ms"), t.get("fwd_bwd_saved_ms"))
        bwd_gemms = over(t.get("bwd_ms"), sum(t[g] for g in gemms) if all(g in t for g in gemms) else None)
        overlap = over(t.get("gemm1_swiglu_ms", 0) + t.get("gemm2_ms", 0), t.get("ffn_ms"))
        dg = over(r.get("dispatch_gemm_ms"), t.get("dispatch_gemm_ms"))
        print(f"{r['model'] + '.' + r['case']:<22} {num(dg, 'x'):>13} "
              f"{num(over(r.get('layer_ms'), t.get('ffn_ms')), 'x'):>10} {num(overlap):>11} "
              f"{num(over(r.get('bwd_ms'), t.get('bwd_ms')), 'x'):>9} {num(fb, 'x'):>8} {verdict(fb, fb >= 1.5):>8} "
              f"{num(bwd_gemms):>15} {verdict(bwd_gemms, bwd_gemms <= 1.10):>9}"
              + (f" {num(over(r.get('bwd_ms'), t.get('bwd_saved_ms')), 'x'):>9} {num(fbs, 'x'):>13} "
                 f"{verdict(fbs, fbs >= 1.5):>8}" if saved else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing-dir", required=True)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--tandem", default="")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and args.iters < 20:
        ap.error("--iters must be >= 20 on cuda (a median of fewer says little)")
    if args.iters < 1:
        ap.error("--iters must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(77)
    dev = torch.device(args.device)
    card = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {card}, bf16")

    metas = []
    for path in glob.glob(os.path.join(args.routing_dir, "*.json")):
        with open(path) as f:
            meta = json.load(f)
        if isinstance(meta, dict) and "inputs" in meta:  # a case of moe_bench's, not some other JSON kept there
            metas.append((meta, path[:-len(".json")]))
    if not metas:
        die(f"no <model>.<case>.json of moe_bench's in {args.routing_dir}: run moe_bench --routing-dir first")
    # moe_bench's order: models as listed there, random cases by size, then the skewed one.
    metas.sort(key=lambda m: (m[0]["model"] != "deepseek-v3", not m[0]["case"].startswith("random"), m[0]["tokens"],
                              m[0]["case"]))
    results, ok, model, w1, w2 = [], True, None, None, None
    for meta, prefix in metas:
        if meta["model"] != model:
            model = meta["model"]
            w1 = w2 = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            e, h, f = meta["experts"], meta["hidden"], meta["ffn"]
            w1 = drawn(meta, "w1", (e, 2 * f, h), dev)
            w2 = drawn(meta, "w2", (e, h, f), dev)
            print(f"\n{model}: hidden {h}, ffn {f}, top-{meta['topk']} of {e} experts")
            print(f"{'case':<22} {'tokens':>6} {'layout':<8} {'permute+gmm':>11} {'layer ms':>9} {'fwd+bwd':>9} "
                  f"{'bwd ms':>9} {'gemm1 ms':>9} {'gemm2 ms':>9} {'outside GEMMs':>13}")
        best, passed = run_case(meta, prefix, w1, w2, args, dev)
        ok = ok and passed
        if best is not None:
            results.append(best)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.tandem and os.path.exists(args.tandem):
        print_ratios(results, args.tandem)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
