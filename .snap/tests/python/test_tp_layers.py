"""tandem.nn's tensor-parallel layers at 1, 2 and 4 ranks as processes against a real tandemd (cpu backend): their
gradients (input, weight, bias) against the unsharded nn.Linear pair in one process, float32, with and without
sequence parallelism; torch.compile(fullgraph=True) of forward and backward; the errors bad input raises; and the
tensor-parallel MLP training example."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem
import tpchecks
from conftest import run_ranks


def _layers(rank, nranks, sequence_parallel, bias, compiled):
    comm = tandem.Communicator(op_timeout_ms=60000)
    checked = tpchecks.check_layers(comm, sequence_parallel, bias=bias, compiled=compiled)
    if not compiled and bias:
        checked += tpchecks.check_row_replicated_input(comm)
    comm.close()
    return checked


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layer_gradients_match_the_unsharded_pair(daemon, nranks, sequence_parallel):
    assert run_ranks(_layers, nranks, daemon.socket, sequence_parallel, True, False, timeout_s=120) == [10] * nranks


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layers_without_bias(daemon, sequence_parallel):
    assert run_ranks(_layers, 2, daemon.socket, sequence_parallel, False, False, timeout_s=120) == [4, 4]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layers_under_torch_compile_fullgraph(daemon, sequence_parallel):
    assert run_ranks(_layers, 2, daemon.socket, sequence_parallel, True, True, timeout_s=300) == [6, 6]


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket)
    yield c
    c.close()


def test_bad_arguments_name_themselves(comm):
    F = tandem.nn.functional
    w = torch.ones(4, 6)
    with pytest.raises(ValueError, match=r"argument 'x' must have shape \[\.\.\., 6\]"):
        F.column_parallel_linear(torch.ones(3, 5), w, None, comm)
    with pytest.raises(ValueError, match=r"argument 'bias' must have shape \[4\]"):
        F.column_parallel_linear(torch.ones(3, 6), w, torch.ones(6), comm)
    with pytest.raises(ValueError, match=r"argument 'weight' must have dtype torch.float32"):
        F.row_parallel_linear(torch.ones(3, 6), w.bfloat16(), None, comm)
    with pytest.raises(TypeError, match=r"argument 'comm' must be a tandem.Communicator"):
        F.row_parallel_linear(torch.ones(3, 6), w, None, 7)
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs input_is_parallel=True"):
        tandem.nn.RowParallelLinear(6, 4, comm, input_is_parallel=False, sequence_parallel=True)


def _uneven(rank, nranks):
    comm = tandem.Communicator()
    try:
        tandem.nn.ColumnParallelLinear(8, 6, comm)
    except ValueError as e:
        return str(e)
    return "no error"


def test_features_that_do_not_split_over_the_ranks(daemon):
    msgs = run_ranks(_uneven, 4, daemon.socket)
    assert all("argument 'out_features' (6) must be a multiple of the communicator's 4 ranks" in m for m in msgs)


def test_a_backward_whose_saved_weight_was_freed_names_it(comm):
    x = torch.randn(3, 6, requires_grad=True)
    w = torch.randn(4, 6, requires_grad=True)
    y = tandem.nn.functional.column_parallel_linear(x, w, None, comm)
    w.detach().untyped_storage().resize_(0)  # what memory savers do to a tensor they offload
    with pytest.raises(RuntimeError, match=r"saved tensor 'weight' \(\[4, 6\]\) was freed"):
        y.sum().backward()


def test_a_backward_run_twice_says_so(comm):
    x = torch.randn(3, 6, requires_grad=True)
    y = tandem.nn.RowParallelLinear(6, 4, comm)(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time"):
        y.sum().backward()


def test_started_op_blocks_the_staging_buffer_until_waited_for(comm):
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    pending = comm._start("gemm_ar", a, b, layout="nn")
    got = pending.wait()
    torch.testing.assert_close(got, a @ b)


def test_tp_mlp_training_example_at_2_ranks(daemon):
    example = Path(__file__).resolve().parents[2] / "python" / "examples" / "tp_mlp_train.py"
    env = dict(os.environ, TANDEM_SOCKET=daemon.socket)
    p = subprocess.run([sys.executable, str(example), "--ranks", "2", "--steps", "3"], env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("step ") == 3 and "PASS" in p.stdout, p.stdout
