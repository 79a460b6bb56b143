"""The fast path of the GEMM ops, allgather and barrier (tandem/_comm.py; in C: _tandem_fastcall.Hot) against the
full path it stands in for: the same results, the same ValueError for a bad tensor (also when its data pointer is
already cached), and no stale cache entry after daemon memory is freed and its address reused.

Every test runs twice in one process: with the C fast path (where _tandem_fastcall is built: the CTest suite builds
it) and with the Python one (what TANDEM_NO_FASTCALL=1 or an install without a compiler runs)."""

import gc

import pytest
import torch

import tandem
from tandem import _capi, _comm


@pytest.fixture(params=["c", "python"])
def comm(request, daemon, monkeypatch):
    if request.param == "c":
        if _capi.Hot is None:
            pytest.skip("_tandem_fastcall (with Hot) is not built for this Python")
    else:
        monkeypatch.setattr(_capi, "Hot", None)  # what a Communicator sees without the C module
    c = tandem.Communicator(socket=daemon.socket, op_timeout_ms=30000)
    assert (type(c._hot).__name__ == "Hot") == (request.param == "c")
    yield c
    c.close()


def served_fast(comm, monkeypatch):
    """From here on a call that leaves the fast path fails the test: the full paths raise AssertionError."""
    def full(*args, **kwargs):
        raise AssertionError("the op left the fast path")
    for name in ("_eager_gemm_ar", "_eager_gemm_rs", "_eager_ag_gemm", "_eager_allgather", "_barrier_fast"):
        monkeypatch.setattr(comm, name, full)


def daemon_tensor(t):
    return tandem.empty(tuple(t.shape), t.dtype).copy_(t)


def test_the_common_cases_stay_on_the_fast_path_and_match_torch(comm, monkeypatch):
    a = daemon_tensor(torch.arange(32, dtype=torch.float32).reshape(4, 8) / 8)
    b = daemon_tensor(torch.ones(3, 8))
    out, gathered, big = tandem.empty((4, 3)), tandem.empty((4, 8)), tandem.empty((8, 4))
    w = torch.nn.Parameter(torch.empty(3, 8), requires_grad=False)  # weights are Parameters: served too
    w.data = b
    for _ in range(2):  # the first call of each caches the pointers; the second takes them from the cache
        comm.gemm_ar(a, b, out=out)
        comm.gemm_rs(a, w, out=out)
        comm.ag_gemm(a, b, out=out, a_gathered=gathered)
        comm.ag_gemm(a, b, out=out, m=4)
        comm.allgather(a, out=big.view(4, 8))
        comm.barrier()
    served_fast(comm, monkeypatch)
    want = a @ b.T
    torch.testing.assert_close(comm.gemm_ar(a, b, out=out), want)
    torch.testing.assert_close(comm.gemm_rs(a, w, out=out), want)
    assert comm.ag_gemm(a, b, out=out, a_gathered=gathered) is out
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(gathered, a)
    assert comm.allgather(a, out=big) is big
    torch.testing.assert_close(big, a.reshape(8, 4))
    assert comm.barrier() is None
    # out=None: the output is made by the fast path too (daemon memory on the cpu backend).
    got = comm.gemm_ar(a, b)
    torch.testing.assert_close(got, want)
    assert comm.session.lookup(got.data_ptr(), got.nbytes) is not None
    scalar = daemon_tensor(torch.tensor(5, dtype=torch.int32))
    assert comm.allgather(scalar).tolist() == [5]


def _bad_calls():
    """(name, call(comm, a, b, out, big)): a bad argument whose memory is the same daemon memory the warm-up used, so
    its data pointer is in the cache; the rule only the tensor's metadata breaks."""
    return [
        ("b dtype", lambda c, a, b, o, g: c.gemm_ar(a, b.view(torch.int32), out=o)),
        ("a dtype", lambda c, a, b, o, g: c.gemm_ar(a.view(torch.int32), b.view(torch.int32), out=o)),
        ("a non-contiguous", lambda c, a, b, o, g: c.gemm_ar(g.T, b, out=o)),
        ("b shape", lambda c, a, b, o, g: c.gemm_ar(a, b.view(4, 6), out=o)),
        ("out shape", lambda c, a, b, o, g: c.gemm_ar(a, b, out=o.view(3, 4))),
        ("out dtype", lambda c, a, b, o, g: c.gemm_rs(a, b, out=o.view(torch.int32))),
        ("out non-contiguous", lambda c, a, b, o, g: c.gemm_ar(a, b, out=g[:, :3])),
        ("a 1-D", lambda c, a, b, o, g: c.gemm_ar(a.view(-1), b, out=o)),
        ("ag_gemm m", lambda c, a, b, o, g: c.ag_gemm(a, b, out=o, m=5)),
        ("ag_gemm a_gathered shape", lambda c, a, b, o, g: c.ag_gemm(a, b, out=o, a_gathered=g.view(8, 4))),
        ("allgather out numel", lambda c, a, b, o, g: c.allgather(a, out=o)),
        ("allgather out dtype", lambda c, a, b, o, g: c.allgather(a, out=g.view(torch.int32))),
        ("allgather x non-contiguous", lambda c, a, b, o, g: c.allgather(g.T, out=g)),
        ("a on meta", lambda c, a, b, o, g: c.gemm_ar(torch.empty(4, 8, device="meta"), b, out=o)),
    ]


@pytest.mark.parametrize("name, call", _bad_calls(), ids=[n for n, _ in _bad_calls()])
def test_a_bad_tensor_gets_the_full_paths_value_error_even_with_its_pointer_cached(comm, daemon, name, call):
    a, b, out, g = tandem.empty((4, 8)).fill_(1), tandem.empty((3, 8)).fill_(1), tandem.empty((4, 3)), \
        tandem.empty((4, 8))
    comm.gemm_ar(a, b, out=out)
    comm.ag_gemm(a, b, out=out, a_gathered=g)
    comm.allgather(a, out=tandem.empty((4, 8)))
    comm.gemm_ar(g, b, out=out)
    with pytest.raises(ValueError) as fast:
        call(comm, a, b, out, g)
    # The reference: a communicator on the plain Python path, whose cache has never seen these tensors.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_capi, "Hot", None)
        ref = tandem.Communicator(socket=daemon.socket, op_timeout_ms=30000)
    try:
        with pytest.raises(ValueError) as full:
            call(ref, a, b, out, g)
    finally:
        ref.close()
    assert str(fast.value) == str(full.value)
    assert "argument '" in str(fast.value) or "dtype" in str(fast.value)


def test_freed_daemon_memory_reused_at_the_same_address_is_never_taken_from_the_cache(comm):
    """A tensor's pointer cached, its buffer freed, a new buffer at the same address: the op must use the new buffer
    (the session drops every cached pointer before a buffer goes; the C path's parsed-entry memo must not outlive
    that)."""
    b = tandem.empty((2, 8)).fill_(1.0)
    out = tandem.empty((16, 2))
    seen, reused = set(), 0
    for i in range(24):
        a = tandem.empty((16, 8)).fill_(float(i))
        reused += a.data_ptr() in seen
        seen.add(a.data_ptr())
        for _ in range(2):  # the second call takes the pointer from the cache
            torch.testing.assert_close(comm.gemm_ar(a, b, out=out), torch.full((16, 2), 8.0 * i))
        del a
        gc.collect()
    assert reused, "no address was reused: this test did not exercise reuse"


def test_a_closed_communicator_raises_through_the_fast_path(comm):
    a, b = tandem.empty((2, 8)).fill_(1), tandem.empty((2, 8)).fill_(1)
    comm.gemm_ar(a, b)
    comm.close()
    for call in (lambda: comm.gemm_ar(a, b), lambda: comm.gemm_rs(a, b), lambda: comm.ag_gemm(a, b),
                 lambda: comm.allgather(a), comm.barrier):
        with pytest.raises(ValueError, match="this communicator was closed"):
            call()


class _Sub(torch.Tensor):
    pass


def test_a_tensor_subclass_and_plain_torch_memory_take_the_full_path_with_the_same_results(comm):
    a = daemon_tensor(torch.arange(16, dtype=torch.float32).reshape(2, 8))
    b = daemon_tensor(torch.ones(2, 8))
    want = a @ b.T
    torch.testing.assert_close(comm.gemm_ar(a.as_subclass(_Sub), b).as_subclass(torch.Tensor), want)
    torch.testing.assert_close(comm.gemm_ar(a.clone(), b.clone()), want)  # PyTorch's memory: staged
    out = torch.zeros(2, 2)
    assert comm.gemm_ar(a, b, out=out) is out  # staged output, copied back
    torch.testing.assert_close(out, want)


def test_hot_refuses_a_configuration_that_does_not_fit(comm):
    if type(comm._hot).__name__ != "Hot":
        pytest.skip("the C fast path only")
    h = _capi.Hot()
    assert h.closed and h.gemm_ar(None, None, None) is None and h.barrier() is None  # unconfigured: always None
    with pytest.raises(TypeError):
        h.gemm_ar(1, 2)
    # The struct layout it writes: every field an 8-byte slot (the check _comm makes before using Hot).
    assert _comm._HOT_FITS
