"""The fused GEMM ops with FP8 inputs (torch.float8_e4m3fn, torch.float8_e5m2) from Python, at 1-4 ranks as processes
against a real tandemd (cpu backend): per tensor and block-scaled (K and N off the 128 tile), bf16 and fp32 outputs,
through the methods and the op table's generic path, against float64 torch math on the dequantized inputs; the
errors a missing or misshapen scale, or FP8 where an op has none, raises before submission; and the same calls under
torch.compile(fullgraph=True) (aot_eager, inductor), bitwise equal to eager, their errors raised while tracing."""

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


# ---- under torch.compile(fullgraph=True): the torch.library ops take the same keywords and give the eager results

needs_custom_op = pytest.mark.skipif(not hasattr(torch.library, "custom_op"),
                                     reason=f"torch {torch.__version__} has no torch.library.custom_op (2.4+)")


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _fp8_compiled(rank, nranks, backend):
    """Every FP8 form of the three ops in one compiled step: per tensor and block scales, e4m3 and e5m2, bf16 (the
    default) and fp32 out, functional and out forms, method and module function, layouts nt and tn; bitwise equal to
    the eager step."""
    torch._dynamo.reset()
    comm = tandem.Communicator(op_timeout_ms=300000)  # ranks compile on their own: allow a slow compile
    m, n, k, kr = 2 * nranks + 1, 130, 200, 150 + 7 * rank
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    rows = tandem.rows_of(m, rank, nranks)[1]
    a, b = opchecks.gen("f8c.a", rank, (rows, k)), opchecks.gen("f8c.b", rank, (n, k))
    ra, rb = opchecks.gen("f8c.ra", rank, (m, kr)), opchecks.gen("f8c.rb", rank, (n, kr))
    args = [*_quantize(a, e4, False, False)[:2], *_quantize(b, e4, False, True)[:2],
            *_quantize(a, e4, True, False)[:2], *_quantize(b, e4, True, True)[:2],
            *_quantize(ra, e5, False, False)[:2], *_quantize(rb, e5, False, True)[:2],
            *_quantize(ra, e4, True, False)[:2], *_quantize(rb, e4, True, True)[:2]]
    args += [args[12].T.contiguous(), args[14].T.contiguous()]  # the block-scaled a and b of gemm_rs/ar as "tn" takes

    def step(a_t, sa_t, b_t, sb_t, a_b, sa_b, b_b, sb_b, ra_t, rsa_t, rb_t, rsb_t, ra_b, rsa_b, rb_b, rsb_b, ra_tn,
             rb_tn):
        gathered = torch.empty((m, k), dtype=e4)
        ar_out = torch.empty((m, n), dtype=torch.float32)
        return (comm.ag_gemm(a_t, b_t, m=m, a_scale=sa_t, b_scale=sb_t),
                comm.ag_gemm(a_b, b_b, m=m, a_gathered=gathered, a_scale=sa_b, b_scale=sb_b,
                             out_dtype=torch.float32),
                gathered,
                comm.gemm_rs(ra_t, rb_t, a_scale=rsa_t, b_scale=rsb_t, out_dtype=torch.float32),
                tandem.gemm_rs(comm, ra_b, rb_b, a_scale=rsa_b, b_scale=rsb_b, scaling="block"),
                comm.gemm_ar(ra_b, rb_b, a_scale=rsa_b, b_scale=rsb_b, out=ar_out, out_dtype=torch.float32),
                tandem.gemm_ar(comm, ra_t, rb_t, a_scale=rsa_t, b_scale=rsb_t),
                comm.gemm_rs(ra_tn, rb_tn, layout="tn", a_scale=rsa_b, b_scale=rsb_b, out_dtype=torch.float32))

    want = step(*args)
    assert [t.dtype for t in want] == [torch.bfloat16, torch.float32, e4, torch.float32, torch.bfloat16,
                                       torch.float32, torch.bfloat16, torch.float32]
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for got in (compiled(*args), compiled(*args)):  # the second call runs the cached graph
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
            assert torch.equal(_bits(g), _bits(w)), f"result {i} differs from the eager call's"
    comm.close()
    return True


@needs_custom_op
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("nranks", [1, 2])
def test_fp8_gemm_ops_compile_with_fullgraph_and_match_eager_bitwise(daemon, nranks, backend):
    assert run_ranks(_fp8_compiled, nranks, daemon.socket, backend, timeout_s=400) == [True] * nranks


def _compiled_errors(rank, nranks):
    """The checks that need no data fail while tracing, with the eager call's message, and submit nothing."""
    comm = tandem.Communicator(op_timeout_ms=60000)
    a = torch.randn(4, 200).to(torch.float8_e4m3fn)
    b = torch.randn(6, 200).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    cases = [
        ("gemm_ar", (a, b), dict(a_scale=one), "argument 'b_scale' is required"),
        ("ag_gemm", (a, b.to(torch.bfloat16)), dict(a_scale=one, b_scale=one), "argument 'b' must have dtype"),
        ("gemm_rs", (a, b), dict(a_scale=torch.ones(2, 4), b_scale=torch.ones(2, 2)),
         "argument 'b_scale' must hold [ceil(n/128), ceil(k/128)] = [1, 2]"),
        ("gemm_ar", (a, b), dict(a_scale=one, b_scale=one, out_dtype=torch.float16),
         "out_dtype must be torch.bfloat16 or torch.float32"),
        ("gemm_ar", (a.float(), b.float()), dict(b_scale=one), "argument 'b_scale' applies to FP8 inputs"),
    ]
    for op, tensors, kw, what in cases:
        with pytest.raises(ValueError, match=re.escape(what)) as eager:
            getattr(comm, op)(*tensors, **kw)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, y: getattr(comm, op)(x, y, **kw), fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception) as compiled:
            fn(*tensors)
        assert str(eager.value) in str(compiled.value), (op, kw, str(compiled.value))
    # Nothing was submitted: the communicator goes on.
    c = comm.gemm_ar(a, b, a_scale=one, b_scale=one, out_dtype=torch.float32)
    torch.testing.assert_close(c, a.float() @ b.float().T, **opchecks.TOL[torch.float32])
    comm.close()
    return len(cases)


@needs_custom_op
def test_fp8_errors_under_compile_name_the_argument_while_tracing(daemon):
    assert run_ranks(_compiled_errors, 1, daemon.socket, timeout_s=300) == [5]


@needs_custom_op
def test_fp8_custom_op_schemas_append_the_fp8_arguments():
    """Scales and codes come last with defaults, so positional calls without them stay valid; the fakes give c the
    out_dtype (tandem_dtype_t codes; None: bf16 with FP8 inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    tail = "Tensor? a_scale=None, Tensor? b_scale=None, int? out_dtype=None, int? scaling=None)"
    for form in ("ag_gemm", "ag_gemm_out", "gemm_rs", "gemm_rs_out", "gemm_ar", "gemm_ar_out"):
        assert str(getattr(torch.ops.tandem, form).default._schema).split(" -> ")[0].endswith(tail), form
    fp32, bf16 = tandem._capi.DTYPE_FP32, tandem._capi.DTYPE_BF16
    with FakeTensorMode():
        a, b = torch.empty(4, 200, dtype=torch.float8_e5m2), torch.empty(6, 200, dtype=torch.float8_e5m2)
        one = torch.empty(1)
        assert torch.ops.tandem.gemm_ar(a, b, 0, 0, one, one).dtype == torch.bfloat16
        assert torch.ops.tandem.gemm_ar(a, b, 0, 0, one, one, bf16).dtype == torch.bfloat16
        c = torch.ops.tandem.gemm_ar(a, b, 0, 0, torch.empty(2, 4), torch.empty(1, 2), fp32, 1)
        assert c.shape == (4, 6) and c.dtype == torch.float32
        assert torch.ops.tandem.gemm_ar(torch.empty(4, 8), torch.empty(3, 8), 0).dtype == torch.float32
        with pytest.raises(ValueError, match=re.escape("argument 'b_scale' is required with torch.float8_e5m2")):
            torch.ops.tandem.gemm_ar(a, b, 0, a_scale=one)
        with pytest.raises(ValueError, match=re.escape("argument 'out' must have dtype torch.float32")):
            torch.ops.tandem.gemm_ar_out(a, b, 0, 0, torch.empty(4, 6, dtype=torch.bfloat16), one, one, fp32)
