"""The fused GEMM ops with FP8 inputs (torch.float8_e4m3fn, torch.float8_e5m2) from Python, at 1-4 ranks as processes
against a real tandemd (cpu backend): per tensor and block-scaled (K and N off the 128 tile), bf16 and fp32 outputs,
through the methods and the op table's generic path, against float64 torch math on the dequantized inputs; and the
errors a missing or misshapen scale, or FP8 where an op has none, raises before submission."""

import re

import pytest
import torch

import opchecks
import tandem
from conftest import run_ranks

BLOCK = 128


def _quantize(x, dtype, block: bool, rows_major: bool):
    """(fp8 tensor, fp32 scale, dequantized float64) of x [rows, k]: a per-tensor scale, or block scales: per 1x128
    of A as [ceil(k/128), rows] (rows_major False), per 128x128 of B as [ceil(n/128), ceil(k/128)] (rows_major)."""
    rows, k = x.shape
    kb = -(-k // BLOCK)
    if not block:
        s = torch.tensor(x.abs().max().item() / 64.0, dtype=torch.float32)
        q = (x / s).to(dtype)
        return q, s.reshape(1), q.double() * s.double()
    if rows_major:
        rb = -(-rows // BLOCK)
        s = 0.25 + torch.arange(rb * kb, dtype=torch.float32).reshape(rb, kb) / 8
        full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :k]
    else:
        s = 0.5 + torch.arange(kb * rows, dtype=torch.float32).reshape(kb, rows) / (4 * rows)
        full = s.T.repeat_interleave(BLOCK, 1)[:, :k]
    q = (x / full).to(dtype)
    return q, s.contiguous(), q.double() * full.double()


def _fp8_ops(rank, nranks, table_path):
    comm = tandem.Communicator(op_timeout_ms=60000)
    run = (lambda name, *t, **kw: comm._eager_table_op(name, t, kw)) if table_path else \
        (lambda name, *t, **kw: getattr(comm, name)(*t, **kw))
    ran = 0
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for block in (False, True):
            for out_dtype in (torch.bfloat16, torch.float32):
                tol = opchecks.TOL[out_dtype]
                # ag_gemm: m rows sharded (uneven), k = 200 (two k-blocks, the last partial), n = 130
                m, n, k = 2 * nranks + 1, 130, 200
                qs = [_quantize(opchecks.gen("f8.ag.a", q, (tandem.rows_of(m, q, nranks)[1], k)), dtype, block, False)
                      for q in range(nranks)]
                bq, bs, bd = _quantize(opchecks.gen("f8.ag.b", rank, (n, k)), dtype, block, True)
                want = torch.cat([d for _, _, d in qs]) @ bd.T
                gathered = torch.empty((m, k), dtype=dtype)
                got = run("ag_gemm", qs[rank][0], bq, m=m, a_gathered=gathered, a_scale=qs[rank][1], b_scale=bs,
                          out_dtype=out_dtype)
                got = got[0] if isinstance(got, tuple) else got
                assert got.dtype == out_dtype
                torch.testing.assert_close(got.double(), want, **tol)
                assert torch.equal(gathered.view(torch.uint8), torch.cat([q for q, _, _ in qs]).view(torch.uint8))
                # gemm_rs / gemm_ar: k sliced over the ranks, 150 + 7q each (off the tile)
                ks = [150 + 7 * q for q in range(nranks)]
                a_r = [_quantize(opchecks.gen("f8.red.a", q, (m, ks[q])), dtype, block, False) for q in range(nranks)]
                b_r = [_quantize(opchecks.gen("f8.red.b", q, (n, ks[q])), dtype, block, True) for q in range(nranks)]
                c = sum(a_r[q][2] @ b_r[q][2].T for q in range(nranks))
                kw = dict(a_scale=a_r[rank][1], b_scale=b_r[rank][1], out_dtype=out_dtype)
                first, rows = tandem.rows_of(m, rank, nranks)
                torch.testing.assert_close(run("gemm_ar", a_r[rank][0], b_r[rank][0], **kw).double(), c, **tol)
                torch.testing.assert_close(run("gemm_rs", a_r[rank][0], b_r[rank][0], **kw).double(),
                                           c[first:first + rows], **tol)
                ran += 3
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_fp8_gemm_ops_match_torch_on_the_dequantized_inputs(daemon, nranks):
    assert run_ranks(_fp8_ops, nranks, daemon.socket, False, timeout_s=180) == [24] * nranks


@pytest.mark.parametrize("nranks", [1, 2])
def test_fp8_gemm_ops_from_the_table_alone(daemon, nranks):
    assert run_ranks(_fp8_ops, nranks, daemon.socket, True, timeout_s=180) == [24] * nranks


def _errors(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    a = torch.randn(4, 200).to(torch.float8_e4m3fn)
    b = torch.randn(6, 200).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    cases = [
        (dict(b_scale=one), "argument 'a_scale' is required with torch.float8_e4m3fn inputs"),
        (dict(a_scale=one, b_scale=torch.ones(2)), "argument 'b_scale' must hold one value (scaling 'tensor')"),
        (dict(a_scale=torch.ones(2, 4), b_scale=torch.ones(2, 2)),
         "argument 'b_scale' must hold [ceil(n/128), ceil(k/128)] = [1, 2] (scaling 'block'), got shape [2, 2]"),
        (dict(a_scale=torch.ones(1, 4), b_scale=torch.ones(1, 2)),
         "argument 'a_scale' must hold [ceil(k/128), rows] = [2, 4] (scaling 'block'), got shape [1, 4]"),
        (dict(a_scale=one, b_scale=one, out_dtype=torch.float16), "out_dtype must be torch.bfloat16 or torch.float32"),
        (dict(a_scale=one.double(), b_scale=one), "argument 'a_scale' must have dtype torch.float32"),
    ]
    seen = 0
    for table in (False, True):
        for kw, msg in cases:
            with pytest.raises(ValueError, match=re.escape(msg)):
                if table:
                    comm._eager_table_op("gemm_ar", (a, b), kw)
                else:
                    comm.gemm_ar(a, b, **kw)
            seen += 1
    with pytest.raises(ValueError, match=re.escape("argument 'a_scale' applies to FP8 inputs")):
        comm.gemm_ar(torch.randn(4, 8), torch.randn(6, 8), a_scale=one)
    q = torch.randn(4, 2, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=re.escape("dtype torch.float8_e4m3fn is not supported; use torch.bfloat16, "
                                                   "torch.float16 or torch.float32 (FP8 inputs are taken by ag_gemm")):
        comm.ring_attention(q, q, q)
    comm.close()
    return seen


def test_fp8_errors_name_the_argument(daemon):
    assert run_ranks(_errors, 1, daemon.socket) == [12]
