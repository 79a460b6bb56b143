"""The communicating layers of an inference server's decode step, through tandem's fused ops, against PyTorch's
unfused path in the same process (NCCL over torch.distributed), each eager and replayed from a CUDA graph:

- tp: tensor-parallel linear layers at M = 1..256 tokens. gemm_ar is a row-parallel layer (weight [N, K/TP]: K is
  sliced, every rank gets the summed [M, N]) against torch.matmul + all_reduce; ag_gemm a column-parallel layer
  whose input is sharded by rows (weight [N/TP, K]: N is sliced; each rank holds rows_of(M) rows and gets [M, N/TP])
  against all_gather_into_tensor + torch.matmul (shards padded to ceil(M/TP) rows, as all_gather needs equal
  shards). At one rank the baseline is the matmul alone. Then the cost of a captured gemm_ar at M = 16 against the
  same GEMM alone, both as graphs of --replay-ops back-to-back ops (per op, launch amortised) and of one op.
- moe: expert-parallel MoE decode with DeepSeek-V3's experts (hidden 7168, ffn 2048, 32 experts over the ranks,
  top-8) at 1, 8, 32, 128 tokens per rank: tandem's moe_ffn (dispatch + SwiGLU FFN + combine in one op) against
  PyTorch's unfused chain on the same routing and weights: sort the (token, slot) pairs by expert, all_to_all them
  to their experts' ranks (NCCL), sort by local expert, torch._grouped_mm (a loop of matmuls where it is missing or
  the dtype is not bf16), SwiGLU, torch._grouped_mm, all_to_all back, weighted combine. Eager, the all_to_all sends
  exact splits (the counts are read on the host first); graph-replayed, where nothing may read the device, it sends
  a fixed capacity per destination rank (tokens * topk rows unless --moe-capacity-factor says less; pairs over it
  are dropped). Where tandem refuses an op in a CUDA graph (any op under the daemon executor), the refusal's text is
  printed and the program goes on.

usage (one GPU, a tandemd on the cuda backend at $TANDEM_SOCKET):
    python python/bench/decode_step.py [--only tp|moe] [--tokens 1,8,32] [--iters 50] [--warmup 10]
several GPUs of one node (tandemd on the node, daemon.executor client for the graphs; NCCL for the baseline):
    torchrun --nproc-per-node N python/bench/decode_step.py ...
torchrun sets RANK, WORLD_SIZE and MASTER_ADDR/PORT; tandem bootstraps over the same torch.distributed group.
Prints one line per (op, shape, tokens) with the median ms of each variant (CUDA events), tandem's result checked
against the baseline's, and one JSON line. --device cpu runs it on the cpu backend with gloo, eager only and at
small shapes (TP (N, K) 256x256, 512x256, 256x512, 384x128; MoE hidden 256, ffn 128, 8 experts, top-2): a check
that the program works, not a speed claim. Exits 1 if a result of tandem's differs from the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import tandem
from _steptime import DTYPES, start_rank, timed

GPU_SHAPES = "8192x8192,28672x8192,8192x28672,14336x4096"
CPU_SHAPES = "256x256,512x256,256x512,384x128"
TP_TOKENS = "1,2,4,8,16,32,64,128,256"
MOE_TOKENS = "1,8,32,128"
GPU_MOE = dict(hidden=7168, ffn=2048, experts=32, topk=8)  # DeepSeek-V3's routed experts
CPU_MOE = dict(hidden=256, ffn=128, experts=8, topk=2)
REPLAY_COST_M = 16


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0


def graph_of(fn, reps: int = 1):
    """A CUDA graph of `reps` calls of fn, captured after one eager call on a side stream (the warm-up: it registers
    tandem's segments and creates NCCL's and cuBLAS's state, none of which may happen inside a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # thread_local: other threads (NCCL's watchdog, libtandem's) may query streams while this one captures.
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return g


def kernel_breakdown(label: str, fn, reps: int = 20) -> str:
    """Where one call of fn (a graph replay) spends its time on the GPU: torch.profiler's kernel records of `reps`
    calls, grouped by position in the call; per kernel its mean duration and the mean idle gap before it (the gap
    before the first kernel is not counted: it is the host's). Returns the printable table."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name and "Memcpy" not in e.name
                 and "Memset" not in e.name), key=lambda e: e.time_range.start)
    if not ks or len(ks) % reps:
        return f"  {label}: profile: {len(ks)} kernel records for {reps} calls; no breakdown"
    per = len(ks) // reps
    rows, spans = [], []
    for i in range(per):
        durs = [ks[r * per + i].time_range.elapsed_us() for r in range(reps)]
        gaps = [ks[r * per + i].time_range.start - ks[r * per + i - 1].time_range.end for r in range(reps)] if i else []
        rows.append((ks[i].name, sum(durs) / reps, sum(gaps) / reps if gaps else 0.0))
    for r in range(reps):
        spans.append(ks[r * per + per - 1].time_range.end - ks[r * per].time_range.start)
    busy = sum(d for _, d, _ in rows)
    lines = [f"  {label}: {per} kernels, first start to last end {sum(spans) / reps:.1f} us (mean of {reps}), "
             f"kernels busy {busy:.1f} us, gaps {sum(g for _, _, g in rows):.1f} us"]
    lines += [f"    {d:8.1f} us  gap {g:6.1f} us  {n[:110]}" for n, d, g in rows]
    return "\n".join(lines)


class Bench:
    """The run's settings and what it measured: rows for the JSON line, refusals, wrong results."""

    def __init__(self, args, comm, world, rank, dtype):
        self.args, self.comm, self.world, self.rank, self.dtype = args, comm, world, rank, dtype
        self.cuda = args.device == "cuda"
        self.dev = comm.device
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.rows: dict[str, list] = {"tp": [], "moe": [], "replay_cost": []}
        self.wrong: list[str] = []

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def time(self, fn) -> float:
        return timed(fn, self.args.iters, self.args.warmup, self.cuda)

    def variants(self, label: str, fns: dict, graphs: dict) -> dict:
        """Times each eager fn, then (cuda) each graph of it: {"<name>_eager_ms": ms, "<name>_graph_ms": ms or None}.
        `graphs` maps a name to False (not graphed), a reason string (printed instead), or True. A capture that
        raises is printed with the error's text and left out."""
        out = {}
        for name, fn in fns.items():
            out[f"{name}_eager_ms"] = self.time(fn)
        if not self.cuda:
            return out
        for name, fn in fns.items():
            how = graphs.get(name, True)
            out[f"{name}_graph_ms"] = None
            if isinstance(how, str):
                self.say(f"  {label} {name} graph: not captured: {how}")
                continue
            try:
                g = graph_of(fn)
            except Exception as e:  # tandem's refusal (tandem.Unsupported) or the capture's own error
                self.say(f"  {label} {name} graph: refused: {type(e).__name__}: {e}")
                continue
            out[f"{name}_graph_ms"] = self.time(g.replay)
            if self.args.profile:
                self.say(kernel_breakdown(f"{label} {name} graph", g.replay))
            del g
        return out

    def check(self, label: str, got, want, tol: float) -> float:
        err = rel_err(got, want)
        if err > tol:
            self.wrong.append(f"{label}: tandem differs from the baseline by {err:.3g} (relative; limit {tol})")
        return err


def fmt(ms) -> str:
    return f"{ms:9.4f}" if ms is not None else "        -"


def randn(g, *shape, scale=1.0, device, dtype):
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def tp_part(b: Bench, shapes, tokens) -> None:
    import torch.distributed as dist
    comm, world, rank, dev, dt = b.comm, b.world, b.rank, b.dev, b.dtype
    tol = 1e-3 if dt == torch.float32 else 2e-2
    mmax = max(tokens)
    b.say(f"tp: ms per call (median of {b.args.iters}); gemm_ar: row-parallel, K/{world} per rank; ag_gemm: "
          f"column-parallel, N/{world} per rank, input rows sharded")
    b.say(f"  {'op':8s} {'N':>6s} {'K':>6s} {'M':>4s}  {'tandem':>9s} {'graph':>9s}  {'torch':>9s} {'graph':>9s}"
          f"  torch/tandem eager, graph")
    for n, k in shapes:
        if n % world or k % world:
            b.say(f"  {n}x{k}: N and K must be multiples of the {world} ranks; skipped")
            continue
        kr, nr = k // world, n // world
        g = torch.Generator().manual_seed(10 + rank)
        w_row = randn(g, n, kr, scale=kr ** -0.5, device=dev, dtype=dt)   # row-parallel weight: K sliced
        w_col = randn(g, nr, k, scale=k ** -0.5, device=dev, dtype=dt)    # column-parallel weight: N sliced
        shard = -(-mmax // world)
        x_row = randn(g, mmax, kr, device=dev, dtype=dt)
        x_col = randn(g, shard, k, device=dev, dtype=dt)
        c_row = torch.empty(mmax, n, device=dev, dtype=dt)
        t_row = torch.empty(mmax, n, device=dev, dtype=dt)
        c_col = torch.empty(mmax, nr, device=dev, dtype=dt)
        gathered = torch.empty(world * shard, k, device=dev, dtype=dt)
        t_col = torch.empty(world * shard, nr, device=dev, dtype=dt)
        for m in tokens:
            # gemm_ar (row-parallel): C [m, n] = sum over ranks of x_r @ w_r.T
            a, c, tc = x_row[:m], c_row[:m], t_row[:m]

            def tandem_ar(a=a, c=c):
                comm.gemm_ar(a, w_row, out=c)

            def torch_ar(a=a, tc=tc):
                torch.matmul(a, w_row.T, out=tc)
                if world > 1:
                    dist.all_reduce(tc)

            tandem_ar()
            torch_ar()
            b.sync()
            err = b.check(f"gemm_ar {n}x{k} M={m}", c, tc, tol)
            report(b, "gemm_ar", n, k, m, err, b.variants(f"gemm_ar {n}x{k} M={m}",
                                                         {"tandem": tandem_ar, "torch": torch_ar}, {}))
            # ag_gemm (column-parallel): C [m, n/world] = all rows of x @ w_r.T; this rank holds rows_of(m) rows
            first, rows = tandem.rows_of(m, rank, world)
            sh = -(-m // world)
            a, c = x_col[:rows], c_col[:m]
            gat, tc = gathered[:world * sh], t_col[:world * sh]

            def tandem_ag(a=a, c=c, m=m):
                comm.ag_gemm(a, w_col, out=c, m=m)

            def torch_ag(sh=sh, gat=gat, tc=tc):
                if world > 1:
                    dist.all_gather_into_tensor(gat, x_col[:sh])
                    torch.matmul(gat, w_col.T, out=tc)
                else:
                    torch.matmul(x_col[:sh], w_col.T, out=tc)

            tandem_ag()
            torch_ag()
            b.sync()
            # The baseline's shards are padded to sh rows; each rank's tandem shard is the first rows of its block.
            want = torch.cat([tc[q * sh:q * sh + tandem.rows_of(m, q, world)[1]] for q in range(world)])
            err = b.check(f"ag_gemm {n}x{k} M={m}", c, want, tol)
            report(b, "ag_gemm", n, k, m, err, b.variants(f"ag_gemm {n}x{k} M={m}",
                                                         {"tandem": tandem_ag, "torch": torch_ag}, {}))
        if b.cuda:
            replay_cost(b, n, k, w_row, x_row, c_row, t_row)
        del w_row, w_col, x_row, x_col, c_row, t_row, c_col, gathered, t_col


def report(b: Bench, op, n, k, m, err, res) -> None:
    row = {"op": op, "n": n, "k": k, "m": m, "rel_err": err, **res}
    b.rows["tp"].append(row)
    te, tg, pe, pg = (res.get(f"{w}_{v}_ms") for w in ("tandem", "torch") for v in ("eager", "graph"))
    ratios = f"{pe / te:6.3f}x" + (f" {pg / tg:6.3f}x" if tg and pg else "")
    b.say(f"  {op:8s} {n:6d} {k:6d} {m:4d}  {fmt(te)} {fmt(tg)}  {fmt(pe)} {fmt(pg)}  {ratios}")


def replay_cost(b: Bench, n, k, w_row, x_row, c_row, t_row) -> None:
    """A captured gemm_ar at M = 16 against the same GEMM alone (no communication) and torch's matmul + all_reduce:
    per op in a graph of --replay-ops ops, and one op per graph (launch included)."""
    import torch.distributed as dist
    m, comm, world = REPLAY_COST_M, b.comm, b.world
    if x_row.shape[0] < m:
        return
    a, c, tc = x_row[:m], c_row[:m], t_row[:m]
    fns = {"gemm_ar": lambda: comm.gemm_ar(a, w_row, out=c),
           "gemm": lambda: torch.matmul(a, w_row.T, out=tc)}
    if world > 1:
        def torch_ar():
            torch.matmul(a, w_row.T, out=tc)
            dist.all_reduce(tc)
        fns["torch_ar"] = torch_ar
    row = {"n": n, "k": k, "m": m, "replay_ops": b.args.replay_ops}
    for name, fn in fns.items():
        for reps in (b.args.replay_ops, 1):
            key = f"{name}_us_per_op" if reps > 1 else f"{name}_us_one_op_graph"
            try:
                g = graph_of(fn, reps)
            except Exception as e:
                b.say(f"  replay cost {n}x{k} M={m} {name}: graph refused: {type(e).__name__}: {e}")
                row[key] = None
                continue
            row[key] = b.time(g.replay) * 1e3 / reps
            del g
    b.rows["replay_cost"].append(row)
    us = lambda key: f"{row[key]:8.2f}" if row.get(key) is not None else "       -"  # noqa: E731
    extra = "" if world == 1 else f"; torch matmul+all_reduce {us('torch_ar_us_per_op')} us"
    over = (f"{row['gemm_ar_us_per_op'] - row['gemm_us_per_op']:+8.2f}"
            if row.get("gemm_ar_us_per_op") is not None and row.get("gemm_us_per_op") is not None else "       -")
    b.say(f"  replay cost N={n} K={k}/{world} M={m}: captured gemm_ar {us('gemm_ar_us_per_op')} us/op, GEMM alone "
          f"{us('gemm_us_per_op')} us/op (gemm_ar - GEMM {over} us){extra}; one-op graphs: gemm_ar "
          f"{us('gemm_ar_us_one_op_graph')} us, GEMM {us('gemm_us_one_op_graph')} us")


def grouped_ok(x) -> bool:
    return hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16


def experts(xe, counts, w1, w2):
    """SwiGLU experts on rows sorted by local expert: counts [local] (device) rows each, rows past their sum unused."""
    ffn = w2.shape[2]
    if grouped_ok(xe):
        offs = counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(xe, w1.transpose(1, 2), offs=offs)
        return torch._grouped_mm(F.silu(gu[:, :ffn]) * gu[:, ffn:], w2.transpose(1, 2), offs=offs)
    y, at = torch.zeros(xe.shape[0], w2.shape[1], device=xe.device, dtype=xe.dtype), 0
    for e, cnt in enumerate(counts.tolist()):  # reads the counts on the host: not capturable
        gu = xe[at:at + cnt] @ w1[e].T
        y[at:at + cnt] = (F.silu(gu[:, :ffn]) * gu[:, ffn:]) @ w2[e].T
        at += cnt
    return y


def count(ids, bins: int):
    """Rows per bin, on the device without a host read (torch.bincount on CUDA reads the maximum on the host)."""
    return torch.zeros(bins, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def torch_moe(x, ids, weights, w1, w2, world: int, capacity: int | None):
    """PyTorch's unfused MoE layer for this rank's tokens; experts [rank * local, (rank + 1) * local) are this
    rank's. capacity None: all_to_all with exact splits (counts read on the host); else a fixed capacity rows per
    destination rank (capturable; pairs over it dropped)."""
    import torch.distributed as dist
    tokens, topk = ids.shape
    local, hidden = w1.shape[0], x.shape[1]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)  # the (token, slot) pairs by expert, so by destination rank
    tok = order // topk
    expert = flat[order]
    if world == 1:
        y = experts(x[tok], count(expert, local), w1, w2)
    else:
        dest, lexp = expert // local, expert % local
        sends = count(dest, world)
        if capacity is None:
            recvs = torch.empty_like(sends)
            dist.all_to_all_single(recvs, sends)
            sc, rc = sends.tolist(), recvs.tolist()
            rx = x.new_empty(sum(rc), hidden)
            rexp = lexp.new_empty(sum(rc))
            dist.all_to_all_single(rx, x[tok], rc, sc)
            dist.all_to_all_single(rexp, lexp, rc, sc)
            o2 = rexp.argsort(stable=True)
            ry = torch.empty_like(rx)
            ry[o2] = experts(rx[o2], count(rexp, local), w1, w2)
            y = x.new_empty(tokens * topk, hidden)
            dist.all_to_all_single(y, ry, sc, rc)
        else:
            pos = torch.arange(tokens * topk, device=x.device) - (sends.cumsum(0) - sends)[dest]
            cell = torch.where(pos < capacity, dest * capacity + pos, world * capacity)  # the last row: dropped
            sx = x.new_zeros(world * capacity + 1, hidden)
            sx[cell] = x[tok]
            sexp = torch.full((world * capacity + 1,), local, dtype=torch.long, device=x.device)  # local: empty
            sexp[cell] = lexp
            rx, rexp = torch.empty_like(sx[:-1]), torch.empty_like(sexp[:-1])
            dist.all_to_all_single(rx, sx[:-1])
            dist.all_to_all_single(rexp, sexp[:-1])
            o2 = rexp.argsort(stable=True)  # empty rows (expert `local`) last, past the counts' sum
            ry = torch.empty_like(rx)
            ry[o2] = experts(rx[o2], count(rexp, local + 1)[:local], w1, w2)
            back = x.new_zeros(world * capacity + 1, hidden)
            dist.all_to_all_single(back[:-1], ry)
            y = back[cell]
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def moe_part(b: Bench, tokens, shape) -> None:
    world, rank, dev, dt, comm = b.world, b.rank, b.dev, b.dtype, b.comm
    hidden, ffn, n_exp, topk = shape["hidden"], shape["ffn"], shape["experts"], shape["topk"]
    if n_exp % world:
        b.say(f"moe: {n_exp} experts do not split over {world} ranks; skipped")
        return
    local = n_exp // world
    tol = 1e-3 if dt == torch.float32 else 3e-2
    gw = torch.Generator().manual_seed(100 + rank)
    w1 = randn(gw, local, 2 * ffn, hidden, scale=hidden ** -0.5, device=dev, dtype=dt)
    w2 = randn(gw, local, hidden, ffn, scale=ffn ** -0.5, device=dev, dtype=dt)
    b.say(f"moe: ms per layer (median of {b.args.iters}); hidden {hidden}, ffn {ffn}, {n_exp} experts ({local} per "
          f"rank), top-{topk}; torch: {'torch._grouped_mm' if grouped_ok(w1) else 'a loop of matmuls'}")
    b.say(f"  {'tokens':>6s}  {'tandem':>9s} {'graph':>9s}  {'torch':>9s} {'graph':>9s}  torch/tandem eager, graph")
    for t in tokens:
        g = torch.Generator().manual_seed(1 + rank + 1000 * t)
        x = randn(g, t, hidden, scale=0.5, device=dev, dtype=dt)
        top = torch.randn(t, n_exp, generator=g).softmax(-1).topk(topk, dim=-1)
        ids = top.indices.to(dev, torch.int32)
        weights = (top.values / top.values.sum(-1, keepdim=True)).to(dev, torch.float32)
        out = torch.empty(t, hidden, device=dev, dtype=dt)
        full = t * topk
        cap = full if not b.args.moe_capacity_factor else \
            min(full, -(-int(b.args.moe_capacity_factor * full) // world))

        def tandem_moe(x=x, ids=ids, weights=weights, out=out):
            comm.moe_ffn(x, ids, weights, w1, w2, out=out)

        def torch_eager(x=x, ids=ids, weights=weights):
            return torch_moe(x, ids, weights, w1, w2, world, None)

        def torch_graph(x=x, ids=ids, weights=weights, cap=cap):
            return torch_moe(x, ids, weights, w1, w2, world, cap)

        want = torch_eager()
        try:  # e.g. refused for want of workspace: the message names the bytes to pass as --workspace-bytes
            tandem_moe()
            b.sync()
        except tandem.TandemError as e:
            b.say(f"  moe tokens={t} tandem: refused: {type(e).__name__}: {e}")
            continue
        err = b.check(f"moe tokens={t}", out, want, tol)
        # The eager baseline reads its counts on the host; its graph form is the fixed-capacity chain.
        fns = {"tandem": tandem_moe, "torch": torch_eager}
        graphs = {"torch": "the exact-split all_to_all reads counts on the host; see torch_fixed_capacity"}
        if world > 1:
            fns["torch_fixed_capacity"] = torch_graph
        else:
            graphs = {}
        if b.cuda and not grouped_ok(x):
            graphs = {k: "the per-expert matmul loop reads counts on the host (torch._grouped_mm needs bf16)"
                      for k in fns if k != "tandem"}
        res = b.variants(f"moe tokens={t}", fns, graphs)
        row = {"tokens": t, "rel_err": err, "capacity": cap if world > 1 else None, **res}
        b.rows["moe"].append(row)
        te, tg, pe = res.get("tandem_eager_ms"), res.get("tandem_graph_ms"), res.get("torch_eager_ms")
        pg = res.get("torch_fixed_capacity_graph_ms") if world > 1 else res.get("torch_graph_ms")
        ratios = f"{pe / te:6.3f}x" + (f" {pg / tg:6.3f}x" if tg and pg else "")
        b.say(f"  {t:6d}  {fmt(te)} {fmt(tg)}  {fmt(pe)} {fmt(pg)}  {ratios}"
              + (f"   (torch fixed-capacity eager {fmt(res.get('torch_fixed_capacity_eager_ms')).strip()} ms, "
                 f"capacity {cap} rows per rank)" if world > 1 else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--only", choices=("tp", "moe"), help="run one part (default: both)")
    ap.add_argument("--tokens", help=f"comma-separated token counts (per rank for moe); default tp {TP_TOKENS}, "
                                     f"moe {MOE_TOKENS}")
    ap.add_argument("--shapes", help=f"tp (N, K) pairs as NxK,...; default {GPU_SHAPES} (cpu: {CPU_SHAPES})")
    ap.add_argument("--moe-shape", help="moe hidden,ffn,experts,topk; default 7168,2048,32,8 (cpu: 256,128,8,2)")
    ap.add_argument("--moe-capacity-factor", type=float, default=0.0,
                    help="the graph-replayed torch MoE sends ceil(factor * tokens * topk / ranks) rows per rank; "
                         "0 (default): tokens * topk, which never drops a pair")
    ap.add_argument("--replay-ops", type=int, default=20, help="ops per graph for the replay cost (default 20)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each graph, break one replay down kernel by kernel (torch.profiler): each "
                         "kernel's mean duration and the idle gap before it")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the cpu backend with gloo, eager only, small default shapes (a check that the program "
                         "works, not a speed claim)")
    ap.add_argument("--workspace-bytes", type=int, default=0,
                    help="tandem GPU workspace per rank (0: tandemd's cuda.workspace_bytes)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per variant (default 50; cpu 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 10; cpu 1)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    started = start_rank("decode_step", cuda, workspace_bytes=args.workspace_bytes)
    if started is None:
        return 2
    world, rank, comm = started
    args.iters = args.iters or (50 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    dtype = DTYPES[args.dtype]
    b = Bench(args, comm, world, rank, dtype)
    card = torch.cuda.get_device_name() if cuda else "cpu"
    b.say(f"decode_step: {world} rank(s), {card}, {args.dtype}; {'eager and CUDA-graph replay' if cuda else 'eager'}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES))
              .split(",")]
    if args.only in (None, "tp"):
        tp_part(b, shapes, ints(args.tokens or TP_TOKENS))
    if args.only in (None, "moe"):
        moe = dict(GPU_MOE if cuda else CPU_MOE)
        if args.moe_shape:
            moe = dict(zip(("hidden", "ffn", "experts", "topk"), ints(args.moe_shape)))
        moe_part(b, ints(args.tokens or MOE_TOKENS), moe)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
    for w in b.wrong:
        b.say(f"WRONG {w}")
    b.say(json.dumps({"bench": "decode_step", "card": card, "world": world, "dtype": args.dtype,
                      "iters": args.iters, **{k: v for k, v in b.rows.items() if v}}))
    comm.barrier()
    comm.close()
    return 1 if b.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
