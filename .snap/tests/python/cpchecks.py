"""tandem.nn's context-parallel attention (ring attention with autograd) against the whole sequence's attention in
one process.

Every rank regenerates every rank's q, k, v and output gradient from seeds, so it computes the reference of its own
rows without communication: torch.autograd of the whole sequence in float64 (opchecks.attention_whole), every rank's
rows at their global positions. float32 results must match it closely; a 16-bit run must be within twice the error of
torch's own scaled_dot_product_attention in that dtype (FlashAttention's rule: no worse than PyTorch at the same
precision), plus a small floor. Used by the cpu-backend tests (test_cp_attention.py) and the GPU section (gpu_run.py
cp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import opchecks
import tandem
import tpchecks

TOL32 = dict(atol=2e-5, rtol=1e-4)


def _inputs(seqs, heads, kv_heads, hd, dtype, tag):
    q_ = [opchecks.gen(f"{tag}.q", p, (s, heads, hd), dtype) for p, s in enumerate(seqs)]
    k_ = [opchecks.gen(f"{tag}.k", p, (s, kv_heads, hd), dtype) for p, s in enumerate(seqs)]
    v_ = [opchecks.gen(f"{tag}.v", p, (s, kv_heads, hd), dtype) for p, s in enumerate(seqs)]
    g_ = [opchecks.gen(f"{tag}.g", p, (s, heads, hd), dtype) for p, s in enumerate(seqs)]
    return q_, k_, v_, g_


def torch_sdpa_whole(q_, k_, v_, g_, seqs, causal, scale, layout, dtype, device):
    """torch's scaled_dot_product_attention of the whole sequence (global order) in `dtype` on `device` under
    torch.autograd: (out, dq, dk, dv), every tensor [total, heads or kv_heads, hd] in global order."""
    pos = opchecks.attention_positions(seqs, layout)
    total, heads, kv_heads = sum(seqs), q_[0].shape[1], k_[0].shape[1]
    hd = q_[0].shape[2]

    def whole(parts, h):
        t = torch.zeros((total, h, hd), dtype=dtype)
        for p, part in enumerate(parts):
            if len(pos[p]):
                t[torch.tensor(pos[p])] = part.to(dtype)
        return t.to(device).requires_grad_()

    Q, K, V = whole(q_, heads), whole(k_, kv_heads), whole(v_, kv_heads)
    G = whole(g_, heads).detach()
    group = heads // kv_heads
    o = F.scaled_dot_product_attention(Q.transpose(0, 1), K.repeat_interleave(group, 1).transpose(0, 1),
                                       V.repeat_interleave(group, 1).transpose(0, 1), is_causal=causal,
                                       scale=scale).transpose(0, 1)
    o.backward(G)
    return o.detach(), Q.grad, K.grad, V.grad


def _close(got, want64, dtype, what, torch_lowp=None):
    if dtype == torch.float32:
        got = got.detach().to("cpu", torch.float64)
        torch.testing.assert_close(got, want64, **TOL32, msg=lambda m: f"{what}: {m}")
        return
    opchecks.within_torch_error(got, want64, torch_lowp, dtype, what)


def _recorded(graphs, kind):
    return "\n".join(g for k, g in graphs if k == kind)


def check_gradients(comm, seqs, layout="contiguous", causal=False, heads=4, kv_heads=4, hd=8, scale=None,
                    dtype=torch.float32, device="cpu", compiled=False, module=False):
    """One forward and backward of tandem.nn.functional.ring_attention (module: ContextParallelAttention; compiled:
    under torch.compile(fullgraph=True), whose forward and backward graphs must hold the tandem ops) on this rank's
    rows; out, dq, dk and dv against the whole sequence. seqs: every rank's rows. Returns the tensors checked (4)."""
    r = comm.rank
    tag = f"cp.{heads}.{kv_heads}.{hd}"
    q_, k_, v_, g_ = _inputs(seqs, heads, kv_heads, hd, dtype, tag)
    pos, o64, _, grads64 = opchecks.attention_whole(q_, k_, v_, seqs, causal, scale, layout, grad=g_)
    mine = torch.tensor(pos[r], dtype=torch.long)
    want = [t[mine] for t in (o64, *grads64)]
    lowp = [None] * 4
    if dtype != torch.float32:
        lowp = [t[mine.to(t.device)] for t in torch_sdpa_whole(q_, k_, v_, g_, seqs, causal, scale, layout, dtype,
                                                               device)]
    q, k, v = (t[r].to(device).requires_grad_() for t in (q_, k_, v_))
    g = g_[r].to(device)

    if module:
        attn = tandem.nn.ContextParallelAttention(comm, heads, hd, num_kv_heads=kv_heads, causal=causal, layout=layout,
                                                  scale=scale)
    else:
        def attn(q, k, v):
            return tandem.nn.functional.ring_attention(q, k, v, comm, causal=causal, scale=scale, layout=layout)

    def loss(q, k, v, g):
        out = attn(q, k, v)
        return out, (out * g).sum()

    graphs = []
    if compiled:
        loss = torch.compile(loss, fullgraph=True, backend=tpchecks._recording_backend(graphs))
    out, total = loss(q, k, v, g)
    total.backward()
    if compiled:
        fw, bw = _recorded(graphs, "fw"), _recorded(graphs, "bw")
        assert "tandem.context_parallel_attention.default" in fw, fw
        assert "tandem.context_parallel_attention_backward.default" in bw, bw
    what = (f"ring_attention with autograd (layout={layout}, causal={causal}, heads={heads}/{kv_heads}, hd={hd}, "
            f"scale={scale}, seqs={seqs}, {dtype}{', module' if module else ''}{', compiled' if compiled else ''})")
    assert out.shape == (seqs[r], heads, hd) and out.dtype == dtype, f"{what}: out {out.dtype} {list(out.shape)}"
    for name, got, w, lp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), want, lowp):
        assert got is not None, f"{what}: no {name}"
        _close(got, w, dtype, f"{what} {name}", lp)
    return 4


def check_module_on_a_sharded_sequence(comm, layout, causal=True, heads=4, kv_heads=2, hd=8):
    """ContextParallelAttention (float32, cpu backend) on the rows context_parallel_positions gives this rank of one
    whole sequence: its out and gradients are the whole sequence's at those rows (the helper and the library agree on
    the layout)."""
    r, n = comm.rank, comm.world_size
    total = 4 * n + 1  # uneven shares
    pos = tandem.nn.context_parallel_positions(total, r, n, layout)
    Q = opchecks.gen("cpm.q", 0, (total, heads, hd), torch.float64).requires_grad_()
    K, V = (opchecks.gen(f"cpm.{t}", 0, (total, kv_heads, hd), torch.float64).requires_grad_() for t in "kv")
    G = opchecks.gen("cpm.g", 0, (total, heads, hd), torch.float64)
    group = heads // kv_heads
    o = F.scaled_dot_product_attention(Q.transpose(0, 1), K.repeat_interleave(group, 1).transpose(0, 1),
                                       V.repeat_interleave(group, 1).transpose(0, 1), is_causal=causal).transpose(0, 1)
    o.backward(G)
    attn = tandem.nn.ContextParallelAttention(comm, heads, hd, num_kv_heads=kv_heads, causal=causal, layout=layout)
    q, k, v = (t.detach()[pos].float().requires_grad_() for t in (Q, K, V))
    out = attn(q, k, v)
    (out * G[pos].float()).sum().backward()
    what = f"ContextParallelAttention on rows {pos.tolist()} of {total} ({layout}, causal={causal})"
    for name, got, want in (("out", out, o.detach()[pos]), ("dq", q.grad, Q.grad[pos]), ("dk", k.grad, K.grad[pos]),
                            ("dv", v.grad, V.grad[pos])):
        torch.testing.assert_close(got.detach().to("cpu", torch.float64), want, **TOL32,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")
    return 4
