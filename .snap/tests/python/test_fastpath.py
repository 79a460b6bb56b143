"""The fast path of the GEMM ops, allgather and barrier (tandem/_fastpath.py; in C: _tandem_fastcall.Hot) against the
full path it stands in for: the same results, the same ValueError for a bad tensor (also when its data pointer is
already cached), and no stale cache entry after daemon memory is freed and its address reused.

Every test runs twice in one process: with the C fast path (where _tandem_fastcall is built: the CTest suite builds
it) and with the Python one (what TANDEM_NO_FASTCALL=1 or an install without a compiler runs)."""

import gc

import pytest
import torch

import tandem
from tandem import _capi, _fastpath


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
    # The struct layout it writes: every field an 8-byte slot (the check _fastpath makes before using Hot).
    assert _fastpath._HOT_FITS


def test_hot_in_cuda_mode_with_stand_ins_for_libtandem_and_the_driver_query(comm):
    """The cuda backend's steps of the C fast path, which CI (no GPU) cannot reach otherwise: one driver query per
    distinct registered segment, a changed buffer id clearing the cache and leaving the fast path, the stream's raw
    handle in the struct, the capture query only for a stream other than 0, a poll every 16 ops, and the struct
    slots of each op. libtandem's op entry and cuPointerGetAttribute are Python stand-ins here; on the GPU,
    tests/python/gpu_run.py's 'hot' section runs the same through the real ones."""
    import ctypes
    import struct
    if type(comm._hot).__name__ != "Hot":
        pytest.skip("the C fast path only")
    ops = _fastpath._HOT_OPS
    bufs = {n: ctypes.create_string_buffer(256) for n in ops}
    op = _capi.Op()
    submitted, queries, bids, polls, resolved = [], [], {}, [], []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_capi.Op))
    def submit(comm_handle, args, op_out):
        submitted.append(args)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
    def ptr_attr(value, attribute, ptr):
        queries.append((attribute, ptr))
        if ptr not in bids:
            return 1  # CUDA_ERROR_INVALID_VALUE: no allocation there
        ctypes.c_uint64.from_address(value).value = bids[ptr]
        return 0

    hot, hits, stream, capturing = _capi.Hot(), {}, [0], [False]
    fn = _capi.address(submit)
    hot.configure(comm=1, fns=(fn,) * len(ops), args=tuple(ctypes.addressof(bufs[n]) for n in ops),
                  sizes=tuple(_fastpath._HOT_SIZES[n] for n in ops), op=ctypes.addressof(op), wait=fn,
                  ptr_attr=_capi.address(ptr_attr), cuda=True, devidx=0, rank=0, nranks=1, timeout_ms=-1,
                  poll_every=16, keep=(bufs, op), hits=hits, resolve=lambda p, n: resolved.append(p),
                  alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype),
                  poll=lambda: (polls.append(1), setattr(hot, "since_poll", 0)), raise_status=_fastpath._raise_status,
                  raw_stream=lambda dev: stream[0], capturing=lambda: capturing[0],
                  tensor_types=(torch.Tensor, torch.nn.Parameter),
                  dtypes=tuple((d, c, _fastpath._ELSIZE[d]) for d, c in _fastpath._DTYPES.items()),
                  descriptors=_fastpath._TENSOR_DESCRIPTORS)
    bf = torch.bfloat16
    a, b, o, g = torch.zeros(4, 8, dtype=bf), torch.zeros(3, 8, dtype=bf), torch.zeros(4, 3, dtype=bf), \
        torch.zeros(4, 8, dtype=bf)
    seg_a, seg_o = object(), object()
    hits[a.data_ptr()] = (11, 0, 1 << 20, seg_a, 1000, 7)
    hits[b.data_ptr()] = (11, 64, 1 << 20, seg_a, 1000, 7)  # a's segment: no second query
    hits[o.data_ptr()] = (22, 8, 1 << 20, seg_o, 2000, 9)
    bids.update({1000: 7, 2000: 9})
    stream[0] = 0xABC
    assert hot.gemm_ar(a, b, o) is o
    assert struct.unpack("12Q", bufs["gemm_ar"].raw[:96]) == (96, _capi.DTYPE_BF16, 4, 3, 8, 11, 0, 11, 64, 22, 8,
                                                             0xABC)
    assert queries == [(7, 1000), (7, 2000)]  # CU_POINTER_ATTRIBUTE_BUFFER_ID at each segment's base
    for _ in range(31):
        hot.gemm_ar(a, b, o)
    assert (hot.since_poll, len(polls), len(submitted)) == (0, 2, 32)
    capturing[0] = True  # a side stream being captured: the Python path records the op into the graph
    assert hot.gemm_ar(a, b, o) is None and len(submitted) == 32
    capturing[0] = False
    bids[2000] = 10  # o's segment freed and its address re-allocated: another buffer id
    assert hot.gemm_ar(a, b, o) is None and hits == {} and len(submitted) == 32
    assert hot.gemm_ar(a, b, o) is None and resolved == [a.data_ptr()]  # not cached: resolve() says None
    for t, e in ((a, (11, 0)), (b, (11, 64)), (o, (22, 8)), (g, (33, 0))):  # daemon memory: nothing to query
        hits[t.data_ptr()] = (*e, 1 << 20, None, 0, 0)
    stream[0], capturing[0], queries[:] = 0, True, []
    assert hot.gemm_ar(a, b, o) is o and queries == []  # the legacy stream is never captured: no capture query
    assert hot.ag_gemm(a, b, o, None, g) is o
    assert struct.unpack("14Q", bufs["ag_gemm"].raw[:112]) == (112, _capi.DTYPE_BF16, 4, 3, 8, 11, 0, 11, 64, 22, 8,
                                                              33, 0, 0)
    assert hot.allgather(a, g) is g
    assert struct.unpack("7Q", bufs["allgather"].raw[:56]) == (56, 11, 0, 33, 0, 64, 0)
    assert hot.barrier() is True and struct.unpack("2Q", bufs["barrier"].raw[:16]) == (16, 0)
