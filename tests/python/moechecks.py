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
                     device="cpu", save_activations=False):
    """moe_ffn's output and gradients (x, topk_weights, w1, w2) at this rank against torch autograd of
    moe_ffn_torch over every rank's tokens; the backward repeated gives the same bits. The op's tensors live on
    `device` (the cuda backend takes GPU tensors). save_activations: the forward saves gate|up for the backward;
    in float32 on the cpu backend (where rounding to the dtype changes nothing) its results are then also the
    recomputing path's, bit for bit. Returns 1."""
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
        return tandem.nn.functional.moe_ffn(*args, save_activations=save_activations)

    fn = layer
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True)
    got = _tandem_grads(comm, x[r], ids[r], wts[r], w1[shard], w2[shard], g[r], fn, device)
    what = (f"moe_ffn ({kind}, topk={topk}, tokens={tokens}, ranks={n}, {dtype}{', compiled' if compiled else ''}"
            f"{', saved activations' if save_activations else ''})")
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
