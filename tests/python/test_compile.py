"""The ops under torch.compile(fullgraph=True): registered through torch.library with fake implementations, so
Dynamo keeps every tandem call in one graph, and the compiled function gives the eager results (cpu backend)."""

import pytest
import torch

import opchecks
import tandem
from conftest import run_ranks

if not hasattr(torch.library, "custom_op"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.custom_op (2.4+)", allow_module_level=True)


def _compiled(rank, nranks, backend):
    torch._dynamo.reset()
    # Ranks compile on their own and the first one done waits in its first op for the others: allow for a slow
    # compile on a loaded machine.
    comm = tandem.Communicator(op_timeout_ms=300000)
    n, k, m = 8, 8, 2 * nranks + 1
    first, rows = tandem.rows_of(m, rank, nranks)
    a_full = opchecks.gen("c.a", 0, (m, k))
    b = opchecks.gen("c.b", rank, (n, k))
    b2 = opchecks.gen("c.b2", rank, (8, rows))
    w = opchecks.gen("c.w", rank, (2, 3, 4))
    x = opchecks.gen("c.x", rank, (3, 4))
    ids = opchecks.topk_ids("c", rank, 3, 2 * nranks, 2)
    wts = torch.ones(3, 2)
    q = opchecks.gen("c.q", rank, (2, 2, 4))

    def step(a, b, x, ids, q):
        c = comm.ag_gemm(a, b, m=m)                  # functional form: the op allocates its output
        rs = comm.gemm_rs(torch.relu(c), b)          # ordinary torch ops around it are compiled too
        rs_t = rs.T.contiguous()                     # [n, rows]: K = this rank's rows (ranks differ), M = n
        ar = comm.gemm_ar(rs_t, b2)
        out = torch.empty_like(ar)
        comm.gemm_ar(rs_t, b2, out=out)              # out form: mutates out
        y, info, counts = comm.moe_dispatch_gemm(x, ids, wts, w, capacity=24)
        att = comm.ring_attention(q, q, q, causal=True)
        att_z, lse_z = comm.ring_attention(q, q, q, causal=True, layout="zigzag", return_lse=True)
        lse_o = torch.empty(q.shape[1], q.shape[0])
        att_o, _ = comm.ring_attention(q, q, q, out=torch.empty_like(q), lse=lse_o, layout="zigzag")
        g = comm.allgather(counts)
        comm.barrier()
        return c, rs, ar, out, y, info, counts, att, att_z, lse_z, att_o, lse_o, g

    args = (a_full[first:first + rows].clone(), b, x, ids, q)
    want = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(*args)
    got2 = compiled(*args)  # the second call runs the cached graph
    for w_, g_, g2 in zip(want, got, got2):
        torch.testing.assert_close(g_, w_)
        torch.testing.assert_close(g2, w_)
    comm.close()
    return True


def test_every_op_compiles_with_fullgraph_and_matches_eager(daemon):
    # aot_eager: Dynamo's graph, the fake implementations and functionalization, as inductor sees them.
    assert run_ranks(_compiled, 2, daemon.socket, "aot_eager", timeout_s=400) == [True, True]


def _inductor(rank, nranks):
    torch._dynamo.reset()
    comm = tandem.Communicator(op_timeout_ms=300000)
    a, b = opchecks.gen("i.a", rank, (4, 8)), opchecks.gen("i.b", rank, (8, 8))

    def step(a, b):
        c = comm.gemm_ar(torch.relu(a) + 1, b)
        comm.barrier()
        return comm.allgather(c.sum(dim=0)) * 2

    want = step(a, b)
    got = torch.compile(step, fullgraph=True)(a, b)
    torch.testing.assert_close(got, want)
    comm.close()
    return True


def test_ops_compile_with_inductor(daemon):
    assert run_ranks(_inductor, 1, daemon.socket, timeout_s=400) == [True]


def test_compiled_graphs_of_one_function_at_two_world_sizes_each_get_their_own_shapes(daemon):
    # torch.compile caches compiled graphs on disk for every process of the user; the output shape of allgather comes
    # from the world size, which the graph must carry (the communicator's id), or the 2-rank run would load the
    # 1-rank graph and fail its size check.
    assert run_ranks(_inductor, 1, daemon.socket, timeout_s=400) == [True]
    assert run_ranks(_inductor, 2, daemon.socket, timeout_s=400) == [True, True]


def test_custom_ops_are_registered_with_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for name in ("ag_gemm", "gemm_rs", "gemm_ar", "moe_dispatch_gemm", "moe_ffn", "ring_attention",
                 "ring_attention_lse", "ring_attention_out", "allgather", "barrier", "gemm_ar_out", "ag_gemm_out"):
        assert hasattr(torch.ops.tandem, name), name
    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(3, 8)
        # comm id 0 is never registered: shape-only fakes still need none for gemm_ar and ring attention
        out = torch.ops.tandem.gemm_ar(a, b, 0)
        assert out.shape == (4, 3)
        q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
        o, lse = torch.ops.tandem.ring_attention_lse(q, q, q, 0, True, 0.0, 1)
        assert o.shape == q.shape and o.dtype == q.dtype
        assert lse.shape == (2, 5) and lse.dtype == torch.float32


def test_every_op_of_the_table_has_custom_ops_fakes_a_method_and_a_function():
    """The library's op table drives the Python layer: an op it has without these fails here, naming it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tandem import _capi, _optable
    assert _capi.OPS, "tandem_op_table() listed no ops"
    for name, op in _capi.OPS.items():
        spec = _optable.SPECS[name]
        assert callable(getattr(tandem.Communicator, name, None)), f"tandem.Communicator has no method {name}"
        assert callable(getattr(tandem, name, None)), f"tandem has no function {name}"
        assert _capi.ARG_STRUCTS[name].size == op["struct_size"], name
        forms = [name] + [name + "_" + s.name for s in spec.outputs if s.optional]
        if spec.outputs:
            forms.append(name + "_out")
        for form in forms:
            assert hasattr(torch.ops.tandem, form), f"torch.ops.tandem has no {form} (op {op['name']})"
        # The functional forms' fakes give every output a shape from the table: every dim 2, on FakeTensors (comm id
        # 0 is never registered: a fake that needs the communicator's rank says so, which still proves it ran).
        dims = {i: 2 for i in range(len(spec.dim_names))}
        share = dict(dims)
        args = []
        with FakeTensorMode():
            for s in spec.inputs:
                shape = (8,) if s.type == "raw" else spec.shape(s, dims, share, lambda: 0, lambda: 1)
                args.append(torch.empty(shape, dtype=torch.uint8 if s.type == "raw" else s.dtype(torch.bfloat16)))
            args.append(0)
            args += [2] * len(spec.free_dims)
            args += [0.0 if f["kind"] == "scale" else 0 if f["enum"] else False for f in spec.scalars]
            for form in forms[:1 + sum(s.optional for s in spec.outputs)]:
                try:
                    got = getattr(torch.ops.tandem, form)(*args)
                except ValueError as e:
                    assert "communicator 0 was closed" in str(e), f"{form}: {e}"
                    continue
                got = got if isinstance(got, tuple) else (got,) if got is not None else ()
                want = [s for s in spec.outputs if not s.optional] + [s for s in spec.outputs
                                                                      if form == name + "_" + s.name]
                assert len(got) == len(want), form
