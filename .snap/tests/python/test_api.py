"""The package's contract on the cpu backend: errors, bad tensors, daemon memory and its reuse, DLPack, bootstrap."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tandem
from conftest import Daemon, run_ranks


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket, op_timeout_ms=30000)
    yield c
    c.close()


# ---- errors ------------------------------------------------------------------------------------------------------

def test_no_daemon_raises_unavailable_with_the_c_status_and_message(tmp_path):
    with pytest.raises(tandem.Unavailable) as e:
        tandem.Communicator(socket=str(tmp_path / "nobody.sock"))
    assert e.value.status == 12 and e.value.status_name == "TANDEM_ERROR_UNAVAILABLE"
    assert "nobody.sock" in str(e.value) and isinstance(e.value, ConnectionError)


def test_every_status_has_its_exception():
    assert {c.status for c in tandem.TandemError.__subclasses__()} == set(range(1, 15))
    assert issubclass(tandem.InvalidArgument, ValueError) and issubclass(tandem.Timeout, TimeoutError)
    assert tandem.PeerLost.status_name == "TANDEM_ERROR_PEER_LOST"


def test_an_op_the_daemon_refuses_raises_with_its_message(comm):
    # Routed rows beyond capacity: the daemon fails the op and says how many rows were needed.
    x = torch.ones(4, 8)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    w = torch.ones(2, 3, 8)
    with pytest.raises(tandem.TandemError) as e:
        comm.moe_dispatch_gemm(x, ids, torch.ones(4, 2), w, capacity=2)
    assert e.value.status in (1, 11) and "capacity" in str(e.value)


def _peer_leaves(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=30000)
    comm.barrier()
    if rank == 1:
        comm.close()  # leaves: the other rank's next op fails with PEER_LOST
        return "left"
    with pytest.raises(tandem.PeerLost) as e:
        for _ in range(100):  # the departure reaches the daemon asynchronously; the next op sees it
            comm.barrier()
    assert e.value.status == 8
    return "saw PeerLost"


def test_a_departed_peer_raises_peer_lost(daemon):
    assert run_ranks(_peer_leaves, 2, daemon.socket) == ["saw PeerLost", "left"]


def test_a_dead_daemon_raises_daemon_lost():
    d = Daemon()
    try:
        comm = tandem.Communicator(socket=d.socket, op_timeout_ms=30000)
        comm.barrier()
        d.kill()
        with pytest.raises(tandem.DaemonLost) as e:
            comm.barrier()
        assert e.value.status == 9
    finally:
        d.kill()


# ---- bad tensors: ValueError naming the argument and the rule ----------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: (torch.ones(4, 8), torch.ones(3, 8, dtype=torch.float64)), r"argument 'b' must have dtype torch\.float32"),
    (lambda: (torch.ones(4, 8, dtype=torch.int64), torch.ones(3, 8)), r"dtype torch\.int64 is not supported"),
    (lambda: (torch.ones(8, 4).T, torch.ones(3, 8)), r"argument 'a' must be contiguous"),
    (lambda: (torch.ones(4, 8), torch.ones(3, 7)), r"argument 'b' must have shape \[n, 8\]"),
    (lambda: (torch.ones(4, 8, device="meta"), torch.ones(3, 8)), r"argument 'a' must be on the CPU"),
    (lambda: (torch.ones(4), torch.ones(3, 8)), r"argument 'a' must be 2-D"),
])
def test_bad_tensors_raise_value_error_naming_argument_and_rule(comm, make, match):
    a, b = make()
    with pytest.raises(ValueError, match=match):
        comm.gemm_ar(a, b)


def test_bad_out_shape_names_out(comm):
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[4, 3\]"):
        comm.gemm_ar(torch.ones(4, 8), torch.ones(3, 8), out=torch.empty(3, 4))


def test_wrong_topk_dtype_names_topk_ids(comm):
    with pytest.raises(ValueError, match=r"argument 'topk_ids' must have dtype torch\.int32"):
        comm.moe_ffn(torch.ones(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), torch.ones(1, 4, 4),
                     torch.ones(1, 4, 2))


def test_ring_attention_rejects_a_bad_layout_and_a_bad_lse(comm):
    q = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match=r"argument 'layout' must be 'contiguous' \(0\) or 'zigzag' \(1\), got 'snake'"):
        comm.ring_attention(q, q, q, layout="snake")
    with pytest.raises(ValueError, match=r"argument 'lse' must have shape \[2, 3\] \(\[heads, seq\] float32\)"):
        comm.ring_attention(q, q, q, lse=torch.empty(3, 2))
    with pytest.raises(ValueError, match=r"argument 'lse' must have dtype torch\.float32"):
        comm.ring_attention(q, q, q, lse=torch.empty(2, 3, dtype=torch.float64))


def test_ring_attention_lse_at_one_rank_is_the_rows_logsumexp(comm):
    q, k, v = (torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out, lse = comm.ring_attention(q, k, v, causal=True, return_lse=True)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * 8 ** -0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double(), torch.einsum("hij,jhd->ihd", scores.softmax(-1), v.double()),
                               atol=1e-4, rtol=1e-4)
    assert comm.ring_attention(q, k, v, causal=True).shape == q.shape  # without lse: the output alone


# ---- daemon memory, staging, and reuse of freed memory ----------------------------------------------------------

def test_empty_is_daemon_memory_and_ops_on_it_need_no_staging(comm):
    a, b = tandem.empty((4, 8)), tandem.empty((3, 8))
    a.fill_(1.0)
    b.fill_(2.0)
    c = comm.gemm_ar(a, b)
    assert comm._staging is None, "tensors in daemon memory must not be staged"
    assert comm.session.lookup(c.data_ptr(), c.nbytes) is not None, "outputs are allocated in daemon memory"
    torch.testing.assert_close(c, torch.full((4, 3), 16.0))


def test_plain_torch_tensors_are_staged_and_outputs_copied_back(comm):
    a, b, out = torch.ones(4, 8), torch.full((3, 8), 2.0), torch.zeros(4, 3)
    assert comm.session.lookup(a.data_ptr(), a.nbytes) is None
    got = comm.gemm_ar(a, b, out=out)
    assert got is out
    torch.testing.assert_close(out, torch.full((4, 3), 16.0))
    assert comm._staging is not None


def test_freed_daemon_memory_is_forgotten_before_its_address_is_reused(comm):
    session = comm.session
    gc.collect()
    before = len(session._starts)
    seen = set()
    for i in range(20):
        # Each round allocates, uses and drops its tensors; the next round's buffers often land at the same
        # addresses. The op must use the new memory (fresh values), and the table must hold only live buffers.
        a = tandem.empty((64, 8))
        b = tandem.empty((16, 8))
        a.fill_(float(i))
        b.fill_(1.0)
        seen.add(a.data_ptr())
        c = comm.gemm_ar(a, b)
        torch.testing.assert_close(c, torch.full((64, 16), 8.0 * i))
        del a, b, c
        gc.collect()
    assert len(seen) < 20, "no address was reused: this test did not exercise reuse"
    assert len(session._starts) == before, f"{len(session._starts) - before} freed buffers are still resolvable"


def test_a_view_into_daemon_memory_resolves_at_its_offset(comm):
    big = tandem.empty((10, 8))
    big.copy_(torch.arange(80, dtype=torch.float32).reshape(10, 8))
    b = torch.eye(8)
    c = comm.gemm_ar(big[4:8], tandem.empty_like(b).copy_(b))
    assert comm._staging is None
    torch.testing.assert_close(c, big[4:8])


def test_tensors_outlive_the_python_buffer_object(comm):
    t = tandem.empty((1000,), torch.float32)
    t.fill_(3.0)
    ptr = t.data_ptr()
    gc.collect()
    assert comm.session.lookup(ptr, 4000) is not None
    v = t[10:20]
    del t
    gc.collect()
    assert comm.session.lookup(ptr, 4000) is not None, "a view still uses the memory"
    assert float(v.sum()) == 30.0
    del v
    gc.collect()
    assert comm.session.lookup(ptr, 4000) is None


# ---- DLPack ------------------------------------------------------------------------------------------------------

def test_numpy_sees_daemon_memory_through_dlpack_without_a_copy(daemon):
    t = tandem.empty((4, 5), torch.float32, socket=daemon.socket)
    t.fill_(1.5)
    arr = np.from_dlpack(t)
    arr[2, 3] = 7.0
    assert float(t[2, 3]) == 7.0 and arr.ctypes.data == t.data_ptr()


def test_a_buffer_exports_itself_through_dlpack(daemon):
    buf = tandem.Buffer(tandem.Session.get(daemon.socket), 16)
    raw = np.from_dlpack(buf)
    assert raw.dtype == np.uint8 and raw.shape == (16,) and raw.ctypes.data == buf.ptr
    t = buf.tensor((4,), torch.int32)
    t[:] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert raw[4] == 2
    del buf, raw, t
    gc.collect()


def test_empty_supports_every_op_dtype_and_bool(daemon):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool):
        t = tandem.empty((3, 2), dtype, socket=daemon.socket)
        assert t.dtype == dtype and t.shape == (3, 2) and t.is_contiguous()


# ---- bootstrap ---------------------------------------------------------------------------------------------------

def _through_torch_distributed(rank, nranks, store_path):
    import torch.distributed as dist
    store = dist.FileStore(store_path, nranks)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nranks)
    del os.environ["TANDEM_ID"]  # the id must come through the group's store
    comm = tandem.Communicator()
    other = tandem.Communicator(dist.group.WORLD)  # a second communicator of the same group: its own id
    got = comm.allgather(torch.tensor([rank], dtype=torch.int32))
    got2 = other.allgather(torch.tensor([10 + rank], dtype=torch.int32))
    dist.destroy_process_group()
    return got.tolist(), got2.tolist()


def test_bootstrap_through_the_torch_distributed_store(daemon, tmp_path):
    out = run_ranks(_through_torch_distributed, 2, daemon.socket, str(tmp_path / "store"))
    assert out == [([0, 1], [10, 11])] * 2


def test_several_ranks_without_an_id_get_a_clear_error(daemon, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TANDEM_ID", raising=False)
    with pytest.raises(ValueError, match="set TANDEM_ID"):
        tandem.Communicator(socket=daemon.socket)


def test_a_bad_tandem_id_is_refused(daemon, monkeypatch):
    monkeypatch.setenv("TANDEM_ID", "not-hex")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="32 hex digits"):
        tandem.Communicator(socket=daemon.socket)


def test_tandem_socket_is_used_when_no_socket_is_named(daemon, monkeypatch):
    monkeypatch.setenv("TANDEM_SOCKET", daemon.socket)
    code = subprocess.run([sys.executable, "-c", "import tandem; c = tandem.Communicator(); print(c.backend)"],
                          capture_output=True, text=True, timeout=120)
    assert code.returncode == 0 and code.stdout.strip() == "cpu", code.stderr


def test_a_missing_library_is_reported_with_every_place_tried(tmp_path):
    env = dict(os.environ, TANDEM_LIBRARY=str(tmp_path / "libtandem.so.0.2"))
    r = subprocess.run([sys.executable, "-c", "import tandem"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "TANDEM_LIBRARY" in r.stderr and "no such file" in r.stderr


def test_the_readme_torchrun_example_runs_and_checks_its_results(daemon):
    example = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples", "torchrun_example.py")
    env = dict(os.environ, TANDEM_SOCKET=daemon.socket, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        example], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": OK") == 2, r.stdout


def test_the_hot_path_calls_through_fastcall_where_built_and_ctypes_otherwise(daemon):
    from tandem import _capi
    built = os.environ.get("TANDEM_FASTCALL_DIR")
    if built and os.path.isdir(built):
        assert _capi.fastcall is not None, f"_tandem_fastcall was built in {built} but not loaded"
        assert _capi.Hot is not None, f"_tandem_fastcall in {built} has no Hot (the C fast path)"
        c = tandem.Communicator(socket=daemon.socket)
        assert type(c._hot) is _capi.Hot
        c.close()
    code = ("import torch, tandem; from tandem import _capi; assert _capi.fastcall is None and _capi.Hot is None; "
            "c = tandem.Communicator(); assert type(c._hot).__name__ == '_PyHot'; "
            "a = tandem.empty((2, 8)).fill_(1); "
            "assert c.gemm_ar(a, tandem.empty((3, 8)).fill_(1)).eq(8).all(); c.barrier(); print('ok')")
    env = dict(os.environ, TANDEM_NO_FASTCALL="1", TANDEM_SOCKET=daemon.socket)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_declared_workspace_over_the_session_quota_fails_the_join_naming_the_key(daemon):
    # 1 PiB per rank: far over limits.max_session_bytes (64 GiB by default), so the join fails before anything is
    # allocated, naming the key and the bytes; the daemon and later communicators are unaffected.
    with pytest.raises(tandem.TandemError) as e:
        tandem.Communicator(socket=daemon.socket, workspace_bytes=1 << 50)
    assert "limits.max_session_bytes" in str(e.value) and str(1 << 50) in str(e.value)
    comm = tandem.Communicator(socket=daemon.socket, workspace_bytes=1 << 20)
    comm.barrier()
    comm.close()
