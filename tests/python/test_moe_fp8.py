"""moe_ffn with FP8 weights (torch.float8_e4m3fn w1 and w2 with float32 128 x 128 block scales) from Python, at 1, 2
and 3 ranks as processes against a real tandemd (cpu backend): against float64 torch math of the quantised layer
(tandem.h: x and h quantised per 1 x 128 block, the weights dequantised), uneven tokens and a rank with none; and the
errors a missing, misshapen or per-expert scale, bf16 scales with FP8 weights, a non-bf16 x and the autograd layer
raise before submission."""

import pytest
import torch

import moechecks
import opchecks
import tandem
from conftest import run_ranks

BLOCK = 128


def _quantize_rows(v):
    """v [rows, cols] float32, each 1 x 128 block quantised as the op does: a = max(amax, 1e-30), e4m3(v * (448 / a)),
    scale a / 448; returns the dequantised values (float32, as the op's next GEMM takes them)."""
    out = torch.empty_like(v)
    for c in range(0, v.shape[1], BLOCK):
        blk = v[:, c:c + BLOCK]
        a = blk.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        # Divisions of tensor by tensor: torch turns `448.0 / a` into a reciprocal times 448 (and may multiply by the
        # reciprocal of a scalar divisor), which rounds otherwise than the op's fp32 division.
        top = torch.full_like(a, 448.0)
        out[:, c:c + BLOCK] = (blk * (top / a)).to(torch.float8_e4m3fn).float() * (a / top)
    return out


def _weights(tag, experts, rows, cols):
    """(e4m3 [experts, rows, cols], float32 block scales [experts, ceil(rows/128), ceil(cols/128)], dequantised
    float64)."""
    q = (opchecks.gen(tag, 0, (experts, rows, cols)).clamp(-3, 3) * 32).to(torch.float8_e4m3fn)  # |q| <= 96
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    # Scales around 1 / (32 sqrt(cols)), a different one per block, so the dequantised weights are about 1/sqrt(cols).
    s = (0.5 + torch.arange(experts * rb * cb, dtype=torch.float32).reshape(experts, rb, cb) / (experts * rb * cb)) / \
        (32 * cols ** 0.5)
    full = s.repeat_interleave(BLOCK, 1)[:, :rows].repeat_interleave(BLOCK, 2)[:, :, :cols]
    return q, s.contiguous(), q.double() * full.double()


def _reference(x, ids, wts, w1, w2, rank, n):
    """out of `rank`'s tokens from every rank's inputs, in float64 but for the quantisation (float32, as the op)."""
    experts, two_ffn, hidden = w1.shape
    ffn = two_ffn // 2
    xq = _quantize_rows(x[rank].float()).double()
    out = torch.zeros((x[rank].shape[0], hidden), dtype=torch.float64)
    for t in range(x[rank].shape[0]):
        for j in range(ids[rank].shape[1]):
            e = int(ids[rank][t, j])
            gu = xq[t] @ w1[e].T
            h = torch.nn.functional.silu(gu[:ffn]) * gu[ffn:]
            hq = _quantize_rows(h.float().unsqueeze(0)).double()[0]
            out[t] += float(wts[rank][t, j]) * (hq @ w2[e].T)
    return out


def _fp8_moe(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    ran = 0
    for hidden, ffn, experts, topk in ((300, 136, 2 * nranks, 2), (256, 128, 4 * nranks, 3)):
        tokens = [0 if (q == 1 and nranks > 1) else 5 + 3 * q for q in range(nranks)]
        tag = f"f8moe.{hidden}"
        x = [opchecks.gen(f"{tag}.x", q, (tokens[q], hidden), torch.bfloat16) for q in range(nranks)]
        ids = [moechecks.routing("uniform", tag, q, tokens[q], experts, topk) for q in range(nranks)]
        wts = [torch.softmax(opchecks.gen(f"{tag}.wt", q, (tokens[q], topk)), -1) for q in range(nranks)]
        w1q, w1s, w1d = _weights(f"{tag}.w1", experts, 2 * ffn, hidden)
        w2q, w2s, w2d = _weights(f"{tag}.w2", experts, hidden, ffn)
        local = experts // nranks
        mine = slice(rank * local, (rank + 1) * local)
        got = comm.moe_ffn(x[rank], ids[rank], wts[rank], w1q[mine].contiguous(), w2q[mine].contiguous(),
                           w1_scale=w1s[mine].contiguous(), w2_scale=w2s[mine].contiguous())
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == (tokens[rank], hidden)
        want = _reference(x, ids, wts, w1d, w2d, rank, nranks)
        if tokens[rank]:
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"relative error {err} against the quantised layer"
        ran += 1
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_moe_ffn_with_fp8_weights_matches_the_quantised_layer(daemon, nranks):
    assert run_ranks(_fp8_moe, nranks, daemon.socket, timeout_s=180) == [2] * nranks


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket)
    yield c
    c.close()


def test_moe_ffn_fp8_arguments_are_checked_before_submission(comm):
    hidden, ffn, experts, topk, tokens = 256, 128, 2, 1, 3
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.zeros(tokens, topk, dtype=torch.int32)
    wts = torch.ones(tokens, topk)
    w1, w1s, _ = _weights("f8chk.w1", experts, 2 * ffn, hidden)
    w2, w2s, _ = _weights("f8chk.w2", experts, hidden, ffn)
    with pytest.raises(ValueError, match=r"argument 'w1_scale' is required with torch.float8_e4m3fn weights"):
        comm.moe_ffn(x, ids, wts, w1, w2, w2_scale=w2s)
    with pytest.raises(ValueError, match=r"argument 'w2_scale' must have shape \[2, 2, 1\].*got \[2, 1, 1\]"):
        comm.moe_ffn(x, ids, wts, w1, w2, w1_scale=w1s, w2_scale=w2s[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"for one scale per expert pass scale.view\(-1, 1, 1\).expand\(2, 2, 2\)"):
        comm.moe_ffn(x, ids, wts, w1, w2, w1_scale=torch.ones(experts), w2_scale=w2s)
    with pytest.raises(ValueError, match=r"argument 'w1_scale'.*float32"):
        comm.moe_ffn(x, ids, wts, w1, w2, w1_scale=w1s.bfloat16(), w2_scale=w2s)
    with pytest.raises(ValueError, match=r"FP8 weights need torch.bfloat16 x"):
        comm.moe_ffn(x.half(), ids, wts, w1, w2, w1_scale=w1s, w2_scale=w2s)
    with pytest.raises(ValueError, match=r"must be torch.float8_e4m3fn, got torch.float8_e5m2"):
        comm.moe_ffn(x, ids, wts, w1.to(torch.float8_e5m2), w2.to(torch.float8_e5m2), w1_scale=w1s, w2_scale=w2s)
    with pytest.raises(ValueError, match=r"argument 'w1_scale' applies to FP8 weights"):
        comm.moe_ffn(x, ids, wts, w1.bfloat16(), w2.bfloat16(), w1_scale=w1s)
    with pytest.raises(ValueError, match=r"FP8 weights run the forward only, without autograd"):
        tandem.nn.functional.moe_ffn(x, ids, wts, w1, w2, comm)
    # The communicator still runs the op.
    out = comm.moe_ffn(x, ids, wts, w1, w2, w1_scale=w1s, w2_scale=w2s)
    assert torch.isfinite(out.float()).all()
