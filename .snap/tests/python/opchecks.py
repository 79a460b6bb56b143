"""Every op from Python, checked against the same math in PyTorch (float64).

Each rank regenerates every rank's inputs from (op, rank) seeds, so it computes the reference of its own outputs
without any communication, and compares. Used by the cpu-backend tests (test_ops.py) and, with device="cuda", by
the GPU tests (gpu_run.py).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

import tandem

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}
LOWP_FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # absolute error allowed beyond twice torch's own


def within_torch_error(got, want64, torch_lowp, dtype, what):
    """A 16-bit result against float64: its largest error at most twice that of torch's own computation of the same
    math in `dtype` (`torch_lowp`), plus a small floor (FlashAttention's rule: no worse than PyTorch at the same
    precision)."""
    got = got.detach().to("cpu", torch.float64)
    err = (got - want64).abs().max().item() if got.numel() else 0.0
    theirs = (torch_lowp.detach().to("cpu", torch.float64) - want64).abs().max().item() if got.numel() else 0.0
    assert err <= 2 * theirs + LOWP_FLOOR[dtype], (f"{what}: max error {err:.3g} against float64, more than twice "
                                                   f"torch's own {dtype} error {theirs:.3g} + {LOWP_FLOOR[dtype]}")


def gen(tag: str, rank: int, shape, dtype=torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def topk_ids(tag: str, rank: int, tokens: int, experts: int, topk: int):
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/ids/{rank}".encode()))
    rows = [torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]
    return (torch.stack(rows) if rows else torch.empty((0, topk), dtype=torch.int64)).to(torch.int32)


class Placer:
    """Where a check puts its tensors: 'torch' (PyTorch's allocator: staged on the cpu backend, registered by
    segment on cuda) or 'tandem' (tandem.empty: daemon memory), on `device`."""

    def __init__(self, mem: str, device):
        self.mem, self.device = mem, torch.device(device)

    def put(self, t):
        if self.mem == "tandem":
            out = tandem.empty(tuple(t.shape), t.dtype, device=self.device if self.device.type == "cuda" else None)
            out.copy_(t)
            return out
        return t.to(self.device).contiguous()

    def empty(self, shape, dtype):
        if self.mem == "tandem":
            return tandem.empty(shape, dtype, device=self.device if self.device.type == "cuda" else None)
        return torch.empty(shape, dtype=dtype, device=self.device)


def close(got, want, dtype, what):
    torch.testing.assert_close(got.detach().to("cpu", torch.float64), want.to(torch.float64), **TOL[dtype],
                               msg=lambda m: f"{what}: {m}")


def check_ag_gemm(comm, dtype, place: Placer, use_out: bool):
    r, n = comm.rank, comm.world_size
    m, nn, k = 2 * n + 1, 8, 8  # m % n != 0 for n > 1: shards of different sizes (n, k: the GPU kernels' multiple of 8)
    shards = [gen("ag.a", q, (tandem.rows_of(m, q, n)[1], k), dtype) for q in range(n)]
    b = gen("ag.b", r, (nn, k), dtype)
    full = torch.cat(shards).double()
    want = full @ b.double().T
    a_t, b_t = place.put(shards[r]), place.put(b)
    if use_out:
        out, gathered = place.empty((m, nn), dtype), place.empty((m, k), dtype)
        got = comm.ag_gemm(a_t, b_t, out=out, m=m, a_gathered=gathered)
        assert got is out
        close(gathered, full, dtype, "ag_gemm a_gathered")
    else:
        got = comm.ag_gemm(a_t, b_t, m=m)
    assert got.shape == (m, nn) and got.dtype == dtype
    close(got, want, dtype, "ag_gemm out")


def _gemm_reduce_inputs(tag, n, dtype):
    m, nn = 2 * n + 1, 8
    ks = [8 * (1 + q % 2) for q in range(n)]  # neighbouring ranks' K slices differ
    a = [gen(tag + ".a", q, (m, ks[q]), dtype) for q in range(n)]
    b = [gen(tag + ".b", q, (nn, ks[q]), dtype) for q in range(n)]
    c = sum(a[q].double() @ b[q].double().T for q in range(n))
    return m, nn, a, b, c


def check_gemm_rs(comm, dtype, place, use_out):
    r, n = comm.rank, comm.world_size
    m, nn, a, b, c = _gemm_reduce_inputs("rs", n, dtype)
    first, rows = tandem.rows_of(m, r, n)
    args = (place.put(a[r]), place.put(b[r]))
    got = comm.gemm_rs(*args, out=place.empty((rows, nn), dtype)) if use_out else comm.gemm_rs(*args)
    assert got.shape == (rows, nn)
    close(got, c[first:first + rows], dtype, "gemm_rs out")


def check_gemm_ar(comm, dtype, place, use_out):
    r, n = comm.rank, comm.world_size
    m, nn, a, b, c = _gemm_reduce_inputs("ar", n, dtype)
    args = (place.put(a[r]), place.put(b[r]))
    got = comm.gemm_ar(*args, out=place.empty((m, nn), dtype)) if use_out else comm.gemm_ar(*args)
    assert got.shape == (m, nn)
    close(got, c, dtype, "gemm_ar out")


def _moe_inputs(tag, n, hidden, dtype, topk=2, experts_per_rank=2):
    experts = experts_per_rank * n
    tokens = [3 + q for q in range(n)]
    x = [gen(tag + ".x", q, (tokens[q], hidden), dtype) for q in range(n)]
    ids = [topk_ids(tag, q, tokens[q], experts, min(topk, experts)) for q in range(n)]
    wts = [gen(tag + ".wt", q, (tokens[q], ids[q].shape[1])).abs() for q in range(n)]
    return experts, experts_per_rank, tokens, x, ids, wts


def check_moe_dispatch_gemm(comm, dtype, place, use_out, hidden=8, n_out=5):
    r, n = comm.rank, comm.world_size
    experts, local, tokens, x, ids, wts = _moe_inputs("md", n, hidden, dtype)
    w = [gen(f"md.w{hidden}.{n_out}", q, (local, n_out, hidden), dtype) for q in range(n)]
    rows, info = [], []
    counts = []
    for le in range(local):
        e = r * local + le
        c = 0
        for s in range(n):
            for t in range(tokens[s]):
                for j in range(ids[s].shape[1]):
                    if int(ids[s][t, j]) == e:
                        rows.append(x[s][t].double() @ w[r][le].double().T)
                        info.append((s, t, j, e))
                        c += 1
        counts.append(c)
    capacity = sum(tokens) * 2
    args = (place.put(x[r]), place.put(ids[r]), place.put(wts[r]), place.put(w[r]))
    if use_out:
        out, ri, ec = place.empty((capacity, n_out), dtype), place.empty((capacity, 4), torch.int32), \
            place.empty((local,), torch.int32)
        got = comm.moe_dispatch_gemm(*args, out=out, row_info=ri, expert_counts=ec)
        assert got[0] is out and got[1] is ri and got[2] is ec
    else:
        got = comm.moe_dispatch_gemm(*args, capacity=capacity)
    out, ri, ec = got
    assert out.shape == (capacity, n_out) and ri.shape == (capacity, 4) and ec.shape == (local,)
    assert ec.cpu().tolist() == counts, f"expert_counts {ec.tolist()} != {counts}"
    k = len(rows)
    assert [tuple(v) for v in ri[:k].cpu().tolist()] == info
    if k:
        close(out[:k], torch.stack(rows), dtype, "moe_dispatch_gemm out")


def check_moe_ffn(comm, dtype, place, use_out, hidden=8, ffn=6, round_y=False):
    """round_y: the cuda backend rounds each expert's y to dtype before the weighted sum (tandem.h); the
    reference does too there."""
    r, n = comm.rank, comm.world_size
    experts, local, tokens, x, ids, wts = _moe_inputs("mf", n, hidden, dtype)
    w1 = [gen(f"mf.w1.{hidden}.{ffn}", q, (local, 2 * ffn, hidden), dtype, 0.5) for q in range(n)]
    w2 = [gen(f"mf.w2.{hidden}.{ffn}", q, (local, hidden, ffn), dtype, 0.5) for q in range(n)]
    want = torch.zeros((tokens[r], hidden), dtype=torch.float64)
    for t in range(tokens[r]):
        xt = x[r][t].double()
        for j in range(ids[r].shape[1]):
            e = int(ids[r][t, j])
            d, le = divmod(e, local)
            gate = xt @ w1[d][le][:ffn].double().T
            up = xt @ w1[d][le][ffn:].double().T
            h = (F.silu(gate) * up).float().to(dtype).double()  # tandem.h: h is rounded to dtype
            y = h @ w2[d][le].double().T
            if round_y:
                y = y.float().to(dtype).double()
            want[t] += float(wts[r][t, j]) * y
    args = (place.put(x[r]), place.put(ids[r]), place.put(wts[r]), place.put(w1[r]), place.put(w2[r]))
    got = comm.moe_ffn(*args, out=place.empty((tokens[r], hidden), dtype)) if use_out else comm.moe_ffn(*args)
    assert got.shape == (tokens[r], hidden)
    close(got, want, dtype, "moe_ffn out")


def moe_whole(x, ids, wts, w1, w2, local, dtype, grad):
    """The MoE layer over every rank's tokens in float64 with torch.autograd, h rounded to dtype as tandem.h says
    (its gradient passed through): (out per rank, dx per rank, dtopk_weights per rank, dw1 per rank, dw2 per rank)."""
    n = len(x)
    xs = [t.double().requires_grad_() for t in x]
    ws = [t.double().requires_grad_() for t in wts]
    w1s = [t.double().requires_grad_() for t in w1]
    w2s = [t.double().requires_grad_() for t in w2]
    ffn = w1[0].shape[1] // 2
    outs, loss = [], 0
    for s in range(n):
        rows = []
        for t in range(x[s].shape[0]):
            o = torch.zeros(x[s].shape[1], dtype=torch.float64)
            for j in range(ids[s].shape[1]):
                d, le = divmod(int(ids[s][t, j]), local)
                gate_up = w1s[d][le] @ xs[s][t]
                h = F.silu(gate_up[:ffn]) * gate_up[ffn:]
                h = h + (h.detach().float().to(dtype).double() - h.detach())
                o = o + ws[s][t, j] * (w2s[d][le] @ h)
            rows.append(o)
        out = torch.stack(rows) if rows else torch.zeros((0, x[s].shape[1]), dtype=torch.float64)
        outs.append(out)
        loss = loss + (out * grad[s].double()).sum()
    if isinstance(loss, torch.Tensor) and loss.requires_grad:  # no token anywhere: every gradient is 0
        loss.backward()

    def grads(ts):
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in ts]
    return outs, grads(xs), grads(ws), grads(w1s), grads(w2s)


def check_moe_ffn_backward(comm, dtype, place, use_out, hidden=8, ffn=6, topk=2, tokens=None):
    """The MoE layer's backward through the op table's generic path (no hand-written method), against
    torch.autograd of the whole layer over every rank's tokens in float64."""
    r, n = comm.rank, comm.world_size
    experts, local, toks, x, ids, wts = _moe_inputs("mfb", n, hidden, dtype, topk=topk)
    if tokens is not None:
        toks = tokens
        x = [gen("mfb.x", q, (toks[q], hidden), dtype) for q in range(n)]
        ids = [topk_ids("mfb", q, toks[q], experts, min(topk, experts)) for q in range(n)]
        wts = [gen("mfb.wt", q, (toks[q], ids[q].shape[1])).abs() for q in range(n)]
    w1 = [gen(f"mfb.w1.{hidden}.{ffn}", q, (local, 2 * ffn, hidden), dtype, 0.5) for q in range(n)]
    w2 = [gen(f"mfb.w2.{hidden}.{ffn}", q, (local, hidden, ffn), dtype, 0.5) for q in range(n)]
    g = [gen("mfb.g", q, (toks[q], hidden), dtype) for q in range(n)]
    _, dx, dwts, dw1, dw2 = moe_whole(x, ids, wts, w1, w2, local, dtype, g)
    args = [place.put(t) for t in (x[r], ids[r], wts[r], w1[r], w2[r], g[r])]
    outs = {}
    if use_out:
        outs = dict(out=place.empty(tuple(x[r].shape), dtype), dtopk_weights=place.empty(tuple(wts[r].shape),
                                                                                        torch.float32),
                    dw1=place.empty(tuple(w1[r].shape), dtype), dw2=place.empty(tuple(w2[r].shape), dtype))
    got = comm.moe_ffn_backward(*args, **outs)
    if use_out:
        assert got[0] is outs["out"] and got[1] is outs["dtopk_weights"] and got[2] is outs["dw1"]
    assert got[1].dtype == torch.float32
    what = f"moe_ffn_backward (tokens={toks}, topk={topk})"
    for name, gt, want in zip(("dx", "dtopk_weights", "dw1", "dw2"), got, (dx[r], dwts[r], dw1[r], dw2[r])):
        close(gt, want, dtype, f"{what} {name}")


def zigzag_positions(seqs, r):
    """Global positions of rank r's rows under the zigzag layout: chunk r (its first ceil(seq_r / 2) rows) and
    chunk 2n-1-r (the rest) of the sequence cut into 2n chunks, chunk c < n being rank c's first rows."""
    n = len(seqs)
    first = [s - s // 2 for s in seqs]
    head = sum(first[:r])
    tail = sum(first) + sum(seqs[q] // 2 for q in range(r + 1, n))
    return list(range(head, head + first[r])) + list(range(tail, tail + seqs[r] // 2))


def attention_positions(seqs, layout):
    """Global positions of every rank's rows."""
    n = len(seqs)
    if layout == "zigzag":
        return [zigzag_positions(seqs, p) for p in range(n)]
    starts = [sum(seqs[:p]) for p in range(n)]
    return [list(range(starts[p], starts[p] + seqs[p])) for p in range(n)]


def attention_whole(q_, k_, v_, seqs, causal, scale, layout, grad=None):
    """The whole sequence's attention in float64 under torch.autograd, every rank's rows at their global positions:
    (positions, out [total, heads, hd], lse [heads, total]), and with `grad` (every rank's dout) also the gradients
    (dq, dk, dv) of the whole sequence. k and v may have fewer heads (grouped-query attention)."""
    pos = attention_positions(seqs, layout)
    total = sum(seqs)
    heads, kv_heads, hd = q_[0].shape[1], k_[0].shape[1], q_[0].shape[2]
    Q = torch.zeros((total, heads, hd), dtype=torch.float64)
    K, V = (torch.zeros((total, kv_heads, hd), dtype=torch.float64) for _ in range(2))
    for p in range(len(seqs)):
        idx = torch.tensor(pos[p], dtype=torch.long)
        if len(pos[p]):
            Q[idx], K[idx], V[idx] = q_[p].double(), k_[p].double(), v_[p].double()
    for t in (Q, K, V):
        t.requires_grad_(grad is not None)
    s = scale if scale is not None else hd ** -0.5
    group = heads // kv_heads
    scores = torch.einsum("ihd,jhd->hij", Q, K.repeat_interleave(group, dim=1)) * s
    if causal:
        scores = scores.masked_fill(torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), V.repeat_interleave(group, dim=1))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, total]
    if grad is None:
        return pos, o, lse, None
    G = torch.zeros((total, heads, hd), dtype=torch.float64)
    for p in range(len(seqs)):
        if len(pos[p]):
            G[torch.tensor(pos[p], dtype=torch.long)] = grad[p].double()
    o.backward(G)
    return pos, o.detach(), lse.detach(), (Q.grad, K.grad, V.grad)


def attention_reference(q_, k_, v_, seqs, r, causal, scale, layout):
    """out [seq_r, heads, hd] and lse [heads, seq_r] of rank r, in float64, from every rank's q, k, v."""
    pos, o, lse, _ = attention_whole(q_, k_, v_, seqs, causal, scale, layout)
    mine = torch.tensor(pos[r], dtype=torch.long)
    return o[mine], lse[:, mine]


def check_ring_attention(comm, dtype, place, use_out, causal=False, scale=None, layout="contiguous", lse=False,
                         heads=2, hd=8, seqs=None, kv_heads=None):
    r, n = comm.rank, comm.world_size
    seqs = seqs or [2 + q for q in range(n)]  # ranks differ (odd and even: zigzag halves of unequal length)
    kv_heads = kv_heads or heads
    q_ = [gen(f"ra.q.{hd}", p, (seqs[p], heads, hd), dtype) for p in range(n)]
    k_, v_ = ([gen(f"ra.{t}.{hd}", p, (seqs[p], kv_heads, hd), dtype) for p in range(n)] for t in "kv")
    want, want_lse = attention_reference(q_, k_, v_, seqs, r, causal, scale, layout)
    args = (place.put(q_[r]), place.put(k_[r]), place.put(v_[r]))
    out = place.empty(tuple(q_[r].shape), dtype) if use_out else None
    lse_t = place.empty((heads, seqs[r]), torch.float32) if (lse and use_out) else None
    what = (f"ring_attention (causal={causal}, scale={scale}, layout={layout}, hd={hd}, heads={heads}, "
            f"kv_heads={kv_heads}, seqs={seqs})")
    got = comm.ring_attention(*args, causal=causal, scale=scale, out=out, lse=lse_t, return_lse=lse, layout=layout)
    if lse:
        got, got_lse = got
        assert got_lse.shape == (heads, seqs[r]) and got_lse.dtype == torch.float32
        if lse_t is not None:
            assert got_lse is lse_t
        # lse is fp32 math on rounded inputs: its error is the inputs' rounding times |q.k| scale.
        torch.testing.assert_close(got_lse.detach().to("cpu", torch.float64), want_lse,
                                   atol=TOL[dtype]["atol"] * 4, rtol=TOL[dtype]["rtol"],
                                   msg=lambda m: f"{what} lse: {m}")
    if use_out:
        assert got is out
    assert got.shape == q_[r].shape
    close(got, want, dtype, f"{what} out")


def check_ring_attention_backward(comm, dtype, place, use_out, causal=True, layout="contiguous", heads=4, kv_heads=2,
                                  hd=8, scale=None, seqs=None):
    """The backward through the op table's generic path (no hand-written method), against torch.autograd of the
    whole sequence's attention in float64; o and lse are the forward's, rounded as the forward writes them."""
    r, n = comm.rank, comm.world_size
    seqs = seqs or [3 + q for q in range(n)]
    q_ = [gen("rab.q", p, (seqs[p], heads, hd), dtype) for p in range(n)]
    k_, v_ = ([gen(f"rab.{t}", p, (seqs[p], kv_heads, hd), dtype) for p in range(n)] for t in "kv")
    g_ = [gen("rab.g", p, (seqs[p], heads, hd), dtype) for p in range(n)]
    pos, o, lse, (dq, dk, dv) = attention_whole(q_, k_, v_, seqs, causal, scale, layout, grad=g_)
    mine = torch.tensor(pos[r], dtype=torch.long)
    o_r, lse_r = o[mine].to(dtype), lse[:, mine].to(torch.float32).contiguous()
    args = [place.put(t) for t in (q_[r], k_[r], v_[r], o_r, g_[r], lse_r)]
    outs = {}
    if use_out:
        outs = dict(out=place.empty(tuple(q_[r].shape), dtype), dk=place.empty(tuple(k_[r].shape), dtype),
                    dv=place.empty(tuple(k_[r].shape), dtype))
    got = comm.ring_attention_backward(*args, causal=causal, layout=layout, scale=scale, **outs)
    what = f"ring_attention_backward (causal={causal}, layout={layout}, heads={heads}/{kv_heads}, seqs={seqs})"
    if use_out:
        assert got[0] is outs["out"] and got[1] is outs["dk"] and got[2] is outs["dv"]
    for name, g, want in zip(("dq", "dk", "dv"), got, (dq[mine], dk[mine], dv[mine])):
        close(g, want, dtype, f"{what} {name}")


def check_allgather(comm, dtype, place, use_out):
    r, n = comm.rank, comm.world_size
    parts = [gen("gather", q, (3, 5), dtype) for q in range(n)]
    x = place.put(parts[r])
    got = comm.allgather(x, out=place.empty((3 * n, 5), dtype)) if use_out else comm.allgather(x)
    assert got.shape == (3 * n, 5)
    assert torch.equal(got.cpu(), torch.cat(parts)), "allgather must copy bytes exactly"


def check_barrier(comm, dtype, place, use_out):
    comm.barrier()


def _checks():
    """check_<op> for every op of the library's table: an op without one fails here, naming this layer."""
    missing = [name for name in tandem._capi.OPS if "check_" + name not in globals()]
    if missing:
        raise AssertionError(f"tests/python/opchecks.py has no check for {', '.join(missing)}: add check_<op>, so "
                             "the op is checked from Python")
    return [globals()["check_" + name] for name in tandem._capi.OPS]


CHECKS = _checks()


def run_all(comm, dtypes=(torch.float32, torch.bfloat16), mems=("torch", "tandem"), device="cpu", checks=CHECKS):
    """Every check, for each dtype, memory kind and with and without out=; returns how many ops ran."""
    ran = 0
    for dtype in dtypes:
        for mem in mems:
            place = Placer(mem, device)
            for use_out in (False, True):
                for check in checks:
                    check(comm, dtype, place, use_out)
                    ran += 1
                if check_ring_attention in checks:
                    check_ring_attention(comm, dtype, place, use_out, causal=True)
                    check_ring_attention(comm, dtype, place, use_out, causal=True, scale=0.3)
                    check_ring_attention(comm, dtype, place, use_out, causal=True, layout="zigzag", lse=True)
                    check_ring_attention(comm, dtype, place, use_out, layout="zigzag", lse=True)
                    check_ring_attention(comm, dtype, place, use_out, causal=True, lse=True)
                    check_ring_attention(comm, dtype, place, use_out, causal=True, lse=True, heads=4, kv_heads=1)
                    check_ring_attention(comm, dtype, place, use_out, layout="zigzag", heads=4, kv_heads=2)
                    ran += 7
                    if comm.world_size > 1:  # the last rank holds no rows
                        check_ring_attention(comm, dtype, place, use_out, causal=True, layout="zigzag", lse=True,
                                             seqs=[0 if q == comm.world_size - 1 else 3 + q
                                                   for q in range(comm.world_size)])
                        ran += 1
                if check_moe_ffn_backward in checks:
                    check_moe_ffn_backward(comm, dtype, place, use_out, topk=1)
                    check_moe_ffn_backward(comm, dtype, place, use_out, topk=3,
                                           tokens=[0 if q == 0 else 2 + q for q in range(comm.world_size)])
                    ran += 2
                if check_ring_attention_backward in checks:
                    check_ring_attention_backward(comm, dtype, place, use_out, causal=False, layout="zigzag")
                    check_ring_attention_backward(comm, dtype, place, use_out, heads=2, kv_heads=2, scale=0.3)
                    ran += 2
    comm.barrier()
    return ran + 1
