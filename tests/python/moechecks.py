"""tandem.nn's expert-parallel MoE (moe_ffn and the MoE layer) against the same layer in plain PyTorch autograd over
every rank's tokens in one process, which every rank computes itself from the same seeded tensors.

Routing cases: uniform (each token's top-k drawn at random), skewed (most tokens pick the same few experts) and sparse
(every token picks among the first topk + 1 experts, so the other experts, whole ranks' worth, receive nothing).
"""

from __future__ import annotations

import math
import zlib

import torch

import opchecks
import tandem

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _close(got, want, dtype, what):
    torch.testing.assert_close(got.detach().double().cpu(), want.detach().double().cpu(), **TOL[dtype],
                               msg=lambda m: f"{what}: {m}")


def routing(kind: str, tag: str, rank: int, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """topk_ids [tokens, topk] int32 for rank `rank`: distinct experts per row."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{kind}/{rank}".encode()))
    rows = []
    for t in range(tokens):
        if kind == "uniform":
            row = torch.randperm(experts, generator=g)[:topk]
        elif kind == "skewed":  # 3 tokens in 4 take experts 0..topk-1 (in some order), the rest at random
            pick = torch.randperm(topk, generator=g) if t % 4 else torch.randperm(experts, generator=g)[:topk]
            row = pick
        elif kind == "sparse":  # only experts 0..topk: the others receive nothing
            row = torch.randperm(min(topk + 1, experts), generator=g)[:topk]
        else:
            raise ValueError(kind)
        rows.append(row)
    return (torch.stack(rows) if rows else torch.empty((0, topk), dtype=torch.int64)).to(torch.int32)


def _inputs(tag, n, tokens, hidden, ffn, experts, topk, kind, dtype):
    x = [opchecks.gen(f"{tag}.x", q, (tokens[q], hidden), dtype) for q in range(n)]
    ids = [routing(kind, tag, q, tokens[q], experts, topk) for q in range(n)]
    wts = [torch.softmax(opchecks.gen(f"{tag}.wt", q, (tokens[q], topk)), -1) for q in range(n)]
    w1 = opchecks.gen(f"{tag}.w1", 0, (experts, 2 * ffn, hidden), dtype, hidden ** -0.5)
    w2 = opchecks.gen(f"{tag}.w2", 0, (experts, hidden, ffn), dtype, ffn ** -0.5)
    g = [opchecks.gen(f"{tag}.g", q, (tokens[q], hidden), dtype) for q in range(n)]
    return x, ids, wts, w1, w2, g


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _tandem_grads(comm, x, ids, wts, w1, w2, g, fn=None, device="cpu"):
    xl, wl, w1l, w2l = (_leaf(t.to(device)) for t in (x, wts, w1, w2))
    out = (fn or tandem.nn.functional.moe_ffn)(xl, ids.to(device), wl, w1l, w2l, comm)
    (out.float() * g.to(device).float()).sum().backward()
    return out.detach(), xl.grad, wl.grad, w1l.grad, w2l.grad


def check_functional(comm, dtype, kind, topk, tokens, hidden=8, ffn=6, experts_per_rank=2, compiled=False,
                     device="cpu", save_activations=False, saved_rows=None):
    """moe_ffn's output and gradients (x, topk_weights, w1, w2) at this rank against torch autograd of
    moe_ffn_torch over every rank's tokens; the backward repeated gives the same bits. The op's tensors live on
    `device` (the cuda backend takes GPU tensors). save_activations: the forward saves gate|up for the backward;
    in float32 on the cpu backend (where rounding to the dtype changes nothing) its results are then also the
    recomputing path's, bit for bit. saved_rows: the saved tensor's fixed bound (moe_ffn). Returns 1."""
    r, n = comm.rank, comm.world_size
    experts = experts_per_rank * n
    tag = f"moe.{kind}.{topk}.{n}"
    x, ids, wts, w1, w2, g = _inputs(tag, n, tokens, hidden, ffn, experts, topk, kind, dtype)
    # The reference: all tokens and all experts in one process, float64 from the same values.
    xs = torch.cat(x).double().requires_grad_()
    ws = torch.cat(wts).double().requires_grad_()
    w1s, w2s = w1.double().requires_grad_(), w2.double().requires_grad_()
    want = tandem.nn.moe_ffn_torch(xs, torch.cat(ids), ws, w1s, w2s)
    (want * torch.cat(g).double()).sum().backward()
    lo = sum(tokens[:r])
    mine = slice(lo, lo + tokens[r])
    shard = slice(r * experts_per_rank, (r + 1) * experts_per_rank)
    lowp = None
    if device != "cpu" and dtype != torch.float32:
        # On a GPU the experts' GEMMs run in `dtype` with their intermediates rounded to it (tandem.h), so the yardstick
        # is torch's own autograd of the same layer in that dtype on the same device, against float64.
        xl, wl = torch.cat(x).to(device).requires_grad_(), torch.cat(wts).to(device).requires_grad_()
        w1l, w2l = w1.to(device).requires_grad_(), w2.to(device).requires_grad_()
        ol = tandem.nn.moe_ffn_torch(xl, torch.cat(ids).to(device), wl, w1l, w2l)
        (ol.float() * torch.cat(g).to(device).float()).sum().backward()
        lowp = (ol[mine], xl.grad[mine], wl.grad[mine], w1l.grad[shard], w2l.grad[shard])

    def layer(*args):
        return tandem.nn.functional.moe_ffn(*args, save_activations=save_activations, saved_rows=saved_rows)

    fn = layer
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True)
    got = _tandem_grads(comm, x[r], ids[r], wts[r], w1[shard], w2[shard], g[r], fn, device)
    what = (f"moe_ffn ({kind}, topk={topk}, tokens={tokens}, ranks={n}, {dtype}{', compiled' if compiled else ''}"
            f"{', saved activations' if save_activations else ''}"
            f"{f', saved_rows={saved_rows}' if saved_rows is not None else ''})")
    wants = (want[mine], xs.grad[mine], ws.grad[mine], w1s.grad[shard], w2s.grad[shard])
    for i, (name, gt, w) in enumerate(zip(("out", "dx", "dtopk_weights", "dw1", "dw2"), got, wants)):
        assert gt is not None, f"{what}: no gradient for {name}"
        if lowp is None:
            _close(gt, w, dtype, f"{what} {name}")
        else:
            opchecks.within_torch_error(gt, w.detach(), lowp[i], dtype, f"{what} {name}")
    again = _tandem_grads(comm, x[r], ids[r], wts[r], w1[shard], w2[shard], g[r], fn, device)
    for name, a, b in zip(("out", "dx", "dtopk_weights", "dw1", "dw2"), got, again):
        assert torch.equal(a, b), f"{what}: {name} differs between two identical runs"
    if save_activations and dtype == torch.float32 and device == "cpu":
        plain = _tandem_grads(comm, x[r], ids[r], wts[r], w1[shard], w2[shard], g[r], None, device)
        for name, a, b in zip(("out", "dx", "dtopk_weights", "dw1", "dw2"), got, plain):
            assert torch.equal(a, b), f"{what}: {name} differs from the recomputing backward's"
    return 1


def reference_route(x, router, topk):
    """The MoE layer's routing in plain PyTorch: float32 softmax of the router's logits, top-k, renormalised."""
    probs = torch.softmax((x @ router.T).float(), -1)
    weights, ids = probs.topk(topk, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def capacity_keep(ids, experts, capacity_factor):
    """1.0 where the expert keeps the (token, slot) pair: at most ceil(factor * tokens * topk / experts) per expert,
    slot 0 of every token first, in token order."""
    tokens, topk = ids.shape
    cap = math.ceil(capacity_factor * tokens * topk / experts)
    keep = torch.zeros((tokens, topk))
    used = [0] * experts
    for j in range(topk):
        for t in range(tokens):
            e = int(ids[t, j])
            if used[e] < cap:
                used[e] += 1
                keep[t, j] = 1.0
    return keep


def check_layer(comm, tokens, topk=2, capacity_factor=None, hidden=8, ffn=6, experts_per_rank=2, compiled=False,
                save_activations=False):
    """tandem.nn.MoE (router, top-k softmax weights, capacity; saved activations or not) against the same layer in
    one process: output and the gradients of x, the router (summed over ranks by reduce_router_grad), w1 and w2.
    Returns 1."""
    r, n = comm.rank, comm.world_size
    experts = experts_per_rank * n
    tag = f"moelayer.{n}.{topk}.{capacity_factor}"
    x = [opchecks.gen(f"{tag}.x", q, (tokens[q], hidden)) for q in range(n)]
    g = [opchecks.gen(f"{tag}.g", q, (tokens[q], hidden)) for q in range(n)]
    router = opchecks.gen(f"{tag}.router", 0, (experts, hidden), scale=hidden ** -0.5)
    w1 = opchecks.gen(f"{tag}.w1", 0, (experts, 2 * ffn, hidden), scale=hidden ** -0.5)
    w2 = opchecks.gen(f"{tag}.w2", 0, (experts, hidden, ffn), scale=ffn ** -0.5)

    moe = tandem.nn.MoE(hidden, ffn, experts, topk, comm, capacity_factor=capacity_factor,
                        save_activations=save_activations)
    moe.load_full(router, w1, w2)
    xl = x[r].clone().requires_grad_()
    layer = torch.compile(moe, fullgraph=True) if compiled else moe
    if compiled:
        torch._dynamo.reset()
    y = layer(xl)
    (y * g[r]).sum().backward()
    moe.reduce_router_grad()

    # The reference: each rank's routing (capacity is per source rank), then every token through all experts.
    rl, w1l, w2l = router.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xs = [t.clone().requires_grad_() for t in x]
    total = 0
    outs = []
    for q in range(n):
        ids, weights = reference_route(xs[q], rl, topk)
        if capacity_factor is not None:
            weights = weights * capacity_keep(ids, experts, capacity_factor)
        out = tandem.nn.moe_ffn_torch(xs[q], ids, weights, w1l, w2l)
        outs.append(out)
        total = total + (out * g[q]).sum()
    total.backward()
    shard = slice(r * experts_per_rank, (r + 1) * experts_per_rank)
    what = (f"MoE (tokens={tokens}, topk={topk}, capacity_factor={capacity_factor}{', compiled' if compiled else ''}"
            f"{', saved activations' if save_activations else ''})")
    _close(y, outs[r], torch.float32, f"{what} out")
    # A rank with no tokens: its (empty) input reaches no output, so the reference gives it no gradient.
    _close(xl.grad, xs[r].grad if xs[r].grad is not None else torch.zeros_like(xs[r]), torch.float32, f"{what} dx")
    _close(moe.router.weight.grad, rl.grad, torch.float32, f"{what} router grad")
    _close(moe.w1.grad, w1l.grad[shard], torch.float32, f"{what} dw1")
    _close(moe.w2.grad, w2l.grad[shard], torch.float32, f"{what} dw2")
    return 1


# ---- moe_ffn with FP8 weights (tandem.h: x and h quantised per 1 x 128 block, e4m3 weights with 128 x 128 scales)

FP8_BLOCK = 128
# The cuda backend quantises h after its fp8 tensor-core sums, this reference after float64 ones: an h value near an
# e4m3 rounding boundary rounds the other way there (common/reference.cpp's FP8 MoE tolerance); the cpu backend's
# float32 sums are close enough for bf16's.
FP8_TOL = {"cpu": 1e-2, "cuda": 3e-2}


def quantize_rows_e4m3(v):
    """v [rows, cols] float32, each 1 x 128 block quantised as the op does: a = max(amax, 1e-30), e4m3(v * (448 / a)),
    scale a / 448; returns the dequantised values (float32, as the op's next GEMM takes them)."""
    out = torch.empty_like(v)
    for c in range(0, v.shape[1], FP8_BLOCK):
        blk = v[:, c:c + FP8_BLOCK]
        a = blk.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        # Divisions of tensor by tensor: torch turns `448.0 / a` into a reciprocal times 448 (and may multiply by the
        # reciprocal of a scalar divisor), which rounds otherwise than the op's fp32 division.
        top = torch.full_like(a, 448.0)
        out[:, c:c + FP8_BLOCK] = (blk * (top / a)).to(torch.float8_e4m3fn).float() * (a / top)
    return out


def fp8_weights(tag, experts, rows, cols):
    """(e4m3 [experts, rows, cols], float32 block scales [experts, ceil(rows/128), ceil(cols/128)], dequantised
    float64), on the CPU."""
    q = (opchecks.gen(tag, 0, (experts, rows, cols)).clamp(-3, 3) * 32).to(torch.float8_e4m3fn)  # |q| <= 96
    rb, cb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    # Scales around 1 / (32 sqrt(cols)), a different one per block, so the dequantised weights are about 1/sqrt(cols).
    s = (0.5 + torch.arange(experts * rb * cb, dtype=torch.float32).reshape(experts, rb, cb) / (experts * rb * cb)) / \
        (32 * cols ** 0.5)
    full = s.repeat_interleave(FP8_BLOCK, 1)[:, :rows].repeat_interleave(FP8_BLOCK, 2)[:, :, :cols]
    return q, s.contiguous(), q.double() * full.double()


def fp8_reference(x, ids, wts, w1, w2):
    """out of one rank's tokens (x [tokens, hidden] bf16, its ids and weights) through the dequantised weights of every
    expert (w1 [E, 2 ffn, hidden], w2 [E, hidden, ffn] float64), float64 but for the quantisation (float32)."""
    ffn = w1.shape[1] // 2
    xq = quantize_rows_e4m3(x.float()).double()
    out = torch.zeros((x.shape[0], w1.shape[2]), dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = xq[t] @ w1[e].T
            h = torch.nn.functional.silu(gu[:ffn]) * gu[ffn:]
            hq = quantize_rows_e4m3(h.float().unsqueeze(0)).double()[0]
            out[t] += float(wts[t, j]) * (hq @ w2[e].T)
    return out


def check_fp8(comm, hidden, ffn, experts_per_rank, topk, tokens, device="cpu", kind="uniform"):
    """comm.moe_ffn with FP8 weights on this rank's tokens (tokens[rank]) against fp8_reference; the op repeated,
    bitwise alike. Returns 1."""
    n, r = comm.world_size, comm.rank
    experts = experts_per_rank * n
    tag = f"f8moe.{hidden}.{ffn}.{topk}.{kind}"
    x = opchecks.gen(f"{tag}.x", r, (tokens[r], hidden), torch.bfloat16)
    ids = routing(kind, tag, r, tokens[r], experts, topk)
    wts = torch.softmax(opchecks.gen(f"{tag}.wt", r, (tokens[r], topk)), -1)
    w1q, w1s, w1d = fp8_weights(f"{tag}.w1", experts, 2 * ffn, hidden)
    w2q, w2s, w2d = fp8_weights(f"{tag}.w2", experts, hidden, ffn)
    mine = slice(r * experts_per_rank, (r + 1) * experts_per_rank)
    args = [t.to(device) for t in (x, ids, wts, w1q[mine].contiguous(), w2q[mine].contiguous())]
    scales = dict(w1_scale=w1s[mine].contiguous().to(device), w2_scale=w2s[mine].contiguous().to(device))
    got = comm.moe_ffn(*args, **scales)
    again = comm.moe_ffn(*args, **scales)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (tokens[r], hidden)
    assert torch.equal(got.view(torch.int16), again.view(torch.int16)), "FP8 moe_ffn: a second run differs"
    if tokens[r]:
        want = fp8_reference(x, ids, wts, w1d, w2d)
        err = ((got.double().cpu() - want).norm() / want.norm()).item()
        tol = FP8_TOL["cuda" if str(device).startswith("cuda") else "cpu"]
        assert err < tol, f"FP8 moe_ffn ({tag}, tokens {tokens}): relative error {err} > {tol} vs the quantised layer"
    return 1


def check_fp8_dispatch_gemm(comm, hidden, n_out, experts_per_rank, topk, tokens, device="cpu", kind="uniform"):
    """comm.moe_dispatch_gemm with FP8 weights (w e4m3 with float32 128 x 128 block scales) on this rank's tokens
    (tokens[rank]) against float64 torch math of the quantised op (tandem.h: x quantised per 1 x 128 block, w
    dequantised), from every rank's seeded inputs: expert_counts and row_info exactly, out within FP8_TOL's cpu bound
    (one GEMM, no h to round: 1e-2 on both backends); the op repeated, bitwise alike. Returns 1."""
    n, r = comm.world_size, comm.rank
    experts = experts_per_rank * n
    tag = f"f8dg.{hidden}.{n_out}.{topk}.{kind}"
    xs = [opchecks.gen(f"{tag}.x", q, (tokens[q], hidden), torch.bfloat16) for q in range(n)]
    ids = [routing(kind, tag, q, tokens[q], experts, topk) for q in range(n)]
    wts = torch.softmax(opchecks.gen(f"{tag}.wt", r, (tokens[r], topk)), -1)
    wq, ws, wd = fp8_weights(f"{tag}.w", experts, n_out, hidden)
    mine = slice(r * experts_per_rank, (r + 1) * experts_per_rank)
    args = [t.to(device) for t in (xs[r], ids[r], wts, wq[mine].contiguous())]
    w_scale = ws[mine].contiguous().to(device)
    capacity = sum(tokens) * topk  # the most rows any rank receives (a rank without tokens receives some too)
    out, info, counts = comm.moe_dispatch_gemm(*args, capacity=capacity, w_scale=w_scale)
    again, _, _ = comm.moe_dispatch_gemm(*args, capacity=capacity, w_scale=w_scale)
    # The rows routed here: per local expert, by source rank, token and slot (tandem.h).
    want_info, want_rows, want_counts = [], [], []
    xq = [quantize_rows_e4m3(x.float()).double() for x in xs]
    for e in range(r * experts_per_rank, (r + 1) * experts_per_rank):
        count = 0
        for q in range(n):
            for t in range(tokens[q]):
                for j in range(topk):
                    if int(ids[q][t, j]) == e:
                        want_info.append([q, t, j, e])
                        want_rows.append(xq[q][t] @ wd[e].T)
                        count += 1
        want_counts.append(count)
    rows = len(want_info)
    assert out.dtype == torch.bfloat16 and out.shape[1] == n_out
    assert counts.cpu().tolist() == want_counts, f"FP8 moe_dispatch_gemm ({tag}): expert_counts {counts.tolist()}"
    assert info[:rows].cpu().tolist() == want_info, f"FP8 moe_dispatch_gemm ({tag}): row_info differs"
    assert torch.equal(out[:rows].view(torch.int16), again[:rows].view(torch.int16)), \
        "FP8 moe_dispatch_gemm: a second run differs"
    if rows:
        want = torch.stack(want_rows)
        err = ((out[:rows].double().cpu() - want).norm() / want.norm()).item()
        assert err < FP8_TOL["cpu"], f"FP8 moe_dispatch_gemm ({tag}, tokens {tokens}): relative error {err} > " \
                                     f"{FP8_TOL['cpu']} vs the quantised op"
    return 1
