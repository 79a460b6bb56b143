"""The fused GEMM ops (ag_gemm, gemm_rs, gemm_ar) in every operand layout from Python, at 1-4 ranks as processes
against a real tandemd (cpu backend), against float64 torch math: through the methods (names and codes), the
op table's generic path and the torch.library ops; and the errors a wrong layout or a shape that does not fit it
raises."""

import re

import pytest
import torch

import opchecks
import tandem
from conftest import run_ranks

LAYOUTS = ("nt", "nn", "tn")


def _store_a(a, layout):
    """op(A) = a [m, k] as the layout stores it."""
    return a.T.contiguous() if layout == "tn" else a


def _store_b(b, layout):
    """op(B) = b.T with b [n, k] as the layout stores it: [n, k] in nt, [k, n] in nn and tn."""
    return b if layout == "nt" else b.T.contiguous()


def _every_layout(rank, nranks, table_path):
    comm = tandem.Communicator(op_timeout_ms=60000)
    run = (lambda name, *t, **kw: comm._eager_table_op(name, t, kw)) if table_path else \
        (lambda name, *t, **kw: getattr(comm, name)(*t, **kw))
    ran = 0
    for dtype in (torch.float32, torch.bfloat16):  # against float64 math
        for li, layout in enumerate(LAYOUTS):
            lay = layout if li % 2 == 0 else li  # the name and the code
            # ag_gemm: op(A) [m, k] sharded by rows (m % nranks != 0 for nranks > 1), b this rank's [n, k] as op(B)
            m, n, k = 2 * nranks + 1, 6, 5
            shards = [opchecks.gen("lay.ag.a", q, (tandem.rows_of(m, q, nranks)[1], k), dtype) for q in range(nranks)]
            b = opchecks.gen("lay.ag.b", rank, (n, k), dtype)
            want = torch.cat(shards).double() @ b.double().T
            gathered = torch.empty((m, k), dtype=dtype)
            got = run("ag_gemm", _store_a(shards[rank], layout), _store_b(b, layout), m=m, a_gathered=gathered,
                      layout=lay)
            got = got[0] if isinstance(got, tuple) else got
            opchecks.close(got, want, dtype, f"ag_gemm {layout}")
            stored = torch.cat([_store_a(s, layout).reshape(-1) for s in shards])
            assert torch.equal(gathered.reshape(-1), stored), f"ag_gemm {layout}: a_gathered is not the shards as stored"
            # gemm_rs / gemm_ar: k sliced over the ranks (slices differ), C = sum of op(a_r) op(b_r)
            ks = [3 + q % 2 for q in range(nranks)]
            a_r = [opchecks.gen("lay.red.a", q, (m, ks[q]), dtype) for q in range(nranks)]
            b_r = [opchecks.gen("lay.red.b", q, (n, ks[q]), dtype) for q in range(nranks)]
            c = sum(a_r[q].double() @ b_r[q].double().T for q in range(nranks))
            args = (_store_a(a_r[rank], layout), _store_b(b_r[rank], layout))
            first, rows = tandem.rows_of(m, rank, nranks)
            opchecks.close(run("gemm_ar", *args, layout=lay), c, dtype, f"gemm_ar {layout}")
            opchecks.close(run("gemm_rs", *args, layout=lay), c[first:first + rows], dtype, f"gemm_rs {layout}")
            out = torch.full((rows, n), float("nan"), dtype=dtype)
            assert run("gemm_rs", *args, out=out, layout=lay) is out
            opchecks.close(out, c[first:first + rows], dtype, f"gemm_rs {layout} out=")
            ran += 4
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_every_layout_matches_torch(daemon, nranks):
    assert run_ranks(_every_layout, nranks, daemon.socket, False, timeout_s=120) == [24] * nranks


@pytest.mark.parametrize("nranks", [1, 2])
def test_every_layout_from_the_table_alone(daemon, nranks):
    assert run_ranks(_every_layout, nranks, daemon.socket, True, timeout_s=120) == [24] * nranks


def _compiled_layouts(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    m, n, k = 2 * nranks, 6, 4

    def f(x, w, dy):
        y = comm.ag_gemm(x, w)                               # forward: gather(X) W^T
        dx = comm.gemm_rs(dy, w, layout="nn")                # input gradient, scattered: sum_r dY_r W_r
        dw = comm.gemm_ar(dy, y, layout="tn")                # dY^T Y, summed over ranks
        g = torch.empty((m, k))
        y2 = comm.ag_gemm(x.T.contiguous(), w.T.contiguous(), layout=2, a_gathered=g)
        return y, dx, dw, y2, g

    x = opchecks.gen("cl.x", rank, (m // nranks, k))
    w = opchecks.gen("cl.w", rank, (n, k))
    dy = opchecks.gen("cl.dy", rank, (m, n))
    want = f(x, w, dy)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, dy)
    for g_, w_, what in zip(got, want, ("y", "dx", "dw", "y2", "a_gathered")):
        assert torch.equal(g_, w_), what
    xs = [opchecks.gen("cl.x", q, (m // nranks, k)) for q in range(nranks)]
    torch.testing.assert_close(got[0], torch.cat(xs) @ w.T)
    comm.close()
    return True


@pytest.mark.parametrize("nranks", [1, 2])
def test_layouts_under_torch_compile(daemon, nranks):
    assert run_ranks(_compiled_layouts, nranks, daemon.socket, timeout_s=300) == [True] * nranks


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket)
    yield c
    c.close()


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_a_bad_layout_names_the_argument_and_the_choices(comm, op):
    a, b = torch.ones(4, 8), torch.ones(3, 8)
    for bad in ("xt", 3, -1, True, 1.0, None):
        with pytest.raises(ValueError, match=re.escape(f"tandem.{op}: argument 'layout' must be 'nt' (0), 'nn' (1) or "
                                                       f"'tn' (2), got {bad!r}")):
            getattr(comm, op)(a, b, layout=bad)
    assert getattr(comm, op)(a, b, layout="NT").shape[1] == 3  # names are case-insensitive


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_a_shape_that_does_not_fit_the_layout_names_the_tensor_and_the_shape(comm, op):
    a = torch.ones(4, 8)
    with pytest.raises(ValueError, match=rf"tandem\.{op}: argument 'b' must have shape \[8, n\] \(layout 'nn'"):
        getattr(comm, op)(a, torch.ones(3, 8), layout="nn")  # nn: b is [k, n]
    with pytest.raises(ValueError, match=rf"tandem\.{op}: argument 'b' must have shape \[4, n\] \(layout 'tn'"):
        getattr(comm, op)(a, torch.ones(8, 3), layout="tn")  # tn: a is [k, m], so k = 4
    with pytest.raises(ValueError, match=rf"tandem\.{op}: argument 'b' must have shape \[n, 8\] \(layout 'nt'"):
        getattr(comm, op)(a, torch.ones(8, 3))


def test_ag_gemm_tn_names_the_shard_shape(comm):
    with pytest.raises(ValueError, match=r"argument 'a' must have shape \[4, 3\] \(layout 'tn'.*got \[4, 2\]"):
        comm.ag_gemm(torch.ones(4, 2), torch.ones(4, 5), m=3, layout="tn")
