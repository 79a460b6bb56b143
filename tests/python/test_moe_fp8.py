"""moe_ffn and moe_dispatch_gemm with FP8 weights (torch.float8_e4m3fn weights with float32 128 x 128 block scales)
from Python, at 1, 2 and 3 ranks (moe_dispatch_gemm: 1 and 2) as processes against a real tandemd (cpu backend):
against float64 torch math of the quantised ops (tandem.h: x, and the FFN's h, quantised per 1 x 128 block, the weights
dequantised), uneven tokens and a rank with none; and the errors a missing, misshapen or per-expert scale, bf16 scales
with FP8 weights, a non-bf16 x and the autograd layer raise before submission."""

import pytest
import torch

import moechecks
import tandem
from conftest import run_ranks


def _fp8_moe(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    # hidden and ffn off the 128 blocks (partial last blocks), then on them; rank 1 (of several) without tokens.
    tokens = [0 if (q == 1 and nranks > 1) else 5 + 3 * q for q in range(nranks)]
    ran = moechecks.check_fp8(comm, 300, 136, 2, 2, tokens) + moechecks.check_fp8(comm, 256, 128, 4, 3, tokens)
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
    w1, w1s, _ = moechecks.fp8_weights("f8chk.w1", experts, 2 * ffn, hidden)
    w2, w2s, _ = moechecks.fp8_weights("f8chk.w2", experts, hidden, ffn)
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


def _fp8_dispatch_gemm(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    # hidden and n_out off the 128 blocks (partial last blocks), then on them; rank 1 (of several) without tokens.
    tokens = [0 if (q == 1 and nranks > 1) else 5 + 3 * q for q in range(nranks)]
    ran = (moechecks.check_fp8_dispatch_gemm(comm, 300, 136, 2, 2, tokens)
           + moechecks.check_fp8_dispatch_gemm(comm, 256, 128, 3, 3, tokens))
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2])
def test_moe_dispatch_gemm_with_fp8_weights_matches_the_quantised_op(daemon, nranks):
    assert run_ranks(_fp8_dispatch_gemm, nranks, daemon.socket, timeout_s=180) == [2] * nranks


def test_moe_dispatch_gemm_fp8_arguments_are_checked_before_submission(comm):
    hidden, n_out, experts, topk, tokens = 300, 136, 2, 1, 3
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.zeros(tokens, topk, dtype=torch.int32)
    wts = torch.ones(tokens, topk)
    w, ws, _ = moechecks.fp8_weights("f8dgchk.w", experts, n_out, hidden)
    with pytest.raises(ValueError, match=r"argument 'w_scale' is required with torch.float8_e4m3fn weights"):
        comm.moe_dispatch_gemm(x, ids, wts, w)
    with pytest.raises(ValueError, match=r"argument 'w_scale' must have shape \[2, 2, 3\].*got \[2, 1, 3\]"):
        comm.moe_dispatch_gemm(x, ids, wts, w, w_scale=ws[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"for one scale per expert pass scale.view\(-1, 1, 1\).expand\(2, 2, 3\)"):
        comm.moe_dispatch_gemm(x, ids, wts, w, w_scale=torch.ones(experts))
    with pytest.raises(ValueError, match=r"argument 'w_scale'.*float32"):
        comm.moe_dispatch_gemm(x, ids, wts, w, w_scale=ws.bfloat16())
    with pytest.raises(ValueError, match=r"FP8 weights need torch.bfloat16 x"):
        comm.moe_dispatch_gemm(x.half(), ids, wts, w, w_scale=ws)
    with pytest.raises(ValueError, match=r"must be torch.float8_e4m3fn, got torch.float8_e5m2"):
        comm.moe_dispatch_gemm(x, ids, wts, w.to(torch.float8_e5m2), w_scale=ws)
    with pytest.raises(ValueError, match=r"argument 'w_scale' applies to FP8 weights"):
        comm.moe_dispatch_gemm(x, ids, wts, w.bfloat16(), w_scale=ws)
    # The communicator still runs the op, and the module-level form takes the same keywords.
    out, info, counts = tandem.moe_dispatch_gemm(comm, x, ids, wts, w, w_scale=ws)
    assert counts.tolist() == [tokens, 0] and torch.isfinite(out[:tokens].float()).all()
