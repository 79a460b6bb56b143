"""Every op from Python at 1-4 ranks, as real processes against a real tandemd (cpu backend), against PyTorch math."""

import pytest
import torch

import opchecks
import tandem
from conftest import run_ranks


def _all_ops(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)  # bootstrap from RANK, WORLD_SIZE, TANDEM_ID, TANDEM_SOCKET
    assert (comm.rank, comm.world_size, comm.backend) == (rank, nranks, "cpu")
    ran = opchecks.run_all(comm)
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_every_op_matches_torch_at_n_ranks(daemon, nranks):
    ran = run_ranks(_all_ops, nranks, daemon.socket, timeout_s=120)
    assert ran == [ran[0]] * nranks and ran[0] >= 8 * 7


def _uneven_shards(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    m, k, n = 10, 8, 8
    first, rows = tandem.rows_of(m, rank, nranks)
    a = torch.arange(m * k, dtype=torch.float32).reshape(m, k) / 50
    b = torch.ones(n, k)
    c = comm.ag_gemm(a[first:first + rows].clone(), b, m=m)
    torch.testing.assert_close(c, a @ b.T)
    return rows


def test_ag_gemm_takes_m_for_uneven_shards(daemon):
    assert run_ranks(_uneven_shards, 3, daemon.socket) == [4, 3, 3]


class _TablePath:
    """A Communicator whose every op takes the path an op with no hand-written method takes
    (Communicator._eager_table_op: checked, shaped and packed from the library's op table alone)."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name not in tandem._capi.OPS:
            return getattr(self._comm, name)

        def op(*inputs, **kw):
            got = self._comm._eager_table_op(name, inputs, kw)
            # ag_gemm's own method returns out alone, a_gathered= or not; the generic path returns each output given.
            return got[0] if name == "ag_gemm" and isinstance(got, tuple) else got
        return op


def _all_ops_from_the_table(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    ran = opchecks.run_all(_TablePath(comm), dtypes=(torch.float32,), mems=("torch",))
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 3])
def test_every_op_runs_from_the_table_alone(daemon, nranks):
    ran = run_ranks(_all_ops_from_the_table, nranks, daemon.socket, timeout_s=120)
    assert ran == [ran[0]] * nranks and ran[0] >= 2 * len(tandem._capi.OPS)
