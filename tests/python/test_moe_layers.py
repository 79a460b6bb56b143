"""tandem.nn's expert-parallel MoE at 1, 2 and 4 ranks as processes against a real tandemd (cpu backend): the gradients
of moe_ffn (x, topk_weights, w1, w2) and of the MoE layer (with the router's, and with a capacity) against the same
layer in plain PyTorch autograd in one process, float32 and bf16, with uniform, skewed and sparse routing, ranks with
no tokens, experts that receive nothing and top-k from 1 to 8; the backward repeated bit for bit; saved activations,
counted and with a fixed saved_rows bound (one too small failing alone); torch.compile (fullgraph=True); a bad expert id failing the backward op with the communicator still usable; and the MoE training
example."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moechecks
import tandem
from conftest import run_ranks

# tokens per rank: the second rank (when there is one) has none.
TOKENS = {1: [9], 2: [7, 0], 4: [6, 0, 9, 3]}


def _functional(rank, nranks, cases, dtype, save_activations=False):
    comm = tandem.Communicator(op_timeout_ms=60000)
    ran = sum(moechecks.check_functional(comm, dtype, kind, topk, TOKENS[nranks], experts_per_rank=per_rank,
                                         save_activations=save_activations)
              for kind, topk, per_rank in cases)
    comm.close()
    return ran


# (routing, topk, experts per rank): top-k 1 to 8; experts = experts per rank * ranks
CASES = {
    1: [("uniform", 1, 4), ("uniform", 4, 8), ("skewed", 2, 4), ("sparse", 3, 8), ("uniform", 8, 8)],
    2: [("uniform", 1, 2), ("uniform", 3, 4), ("skewed", 2, 2), ("sparse", 2, 4), ("uniform", 8, 4)],
    4: [("uniform", 2, 2), ("skewed", 5, 2), ("sparse", 1, 2), ("sparse", 4, 2), ("uniform", 8, 2)],
}


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_moe_ffn_gradients_match_torch_autograd_float32(daemon, nranks):
    cases = CASES[nranks]
    assert run_ranks(_functional, nranks, daemon.socket, cases, torch.float32, timeout_s=240) == [len(cases)] * nranks


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_moe_ffn_gradients_match_torch_autograd_bf16(daemon, nranks):
    cases = CASES[nranks][:3]
    assert run_ranks(_functional, nranks, daemon.socket, cases, torch.bfloat16, timeout_s=240) == [len(cases)] * nranks


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_with_saved_activations_matches_torch_autograd(daemon, nranks, dtype):
    cases = CASES[nranks][:3]
    assert run_ranks(_functional, nranks, daemon.socket, cases, dtype, True, timeout_s=240) == [len(cases)] * nranks


def _bounded(rank, nranks):
    """save_activations with a fixed saved_rows bound: the gradients as before (eager, and compiled: a static shape);
    a bound below the rows routed here fails the forward naming them, and the communicator goes on."""
    comm = tandem.Communicator(op_timeout_ms=60000)
    tokens = TOKENS[nranks]
    bound = sum(tokens) * 2  # every (token, slot) pair of every rank could be routed to this rank's experts
    ran = moechecks.check_functional(comm, torch.float32, "uniform", 2, tokens, save_activations=True, saved_rows=bound)
    ran += moechecks.check_functional(comm, torch.float32, "skewed", 2, tokens, save_activations=True,
                                      saved_rows=bound, compiled=nranks == 2)
    x = torch.ones(tokens[rank], 8)
    ids = torch.zeros(tokens[rank], 2, dtype=torch.int32)
    ids[:, 1] = 1  # every pair to rank 0's two experts
    w1, w2 = torch.full((2, 12, 8), 0.1), torch.full((2, 8, 6), 0.1)
    msg = "no error"
    try:
        tandem.nn.functional.moe_ffn(x, ids, torch.full((tokens[rank], 2), 0.5), w1, w2, comm, save_activations=True,
                                     saved_rows=1)
        comm.synchronize()
    except tandem.TandemError as e:
        msg = str(e)
    routed = 2 * sum(tokens)
    if rank == 0:
        assert "saved" in msg and str(routed) in msg, f"rank 0 (receives {routed} rows, bound 1): {msg}"
    with pytest.raises(ValueError, match="saved_rows"):
        tandem.nn.functional.moe_ffn(x, ids, torch.ones(tokens[rank], 2), w1, w2, comm, saved_rows=4)
    ran += moechecks.check_functional(comm, torch.float32, "uniform", 1, tokens)  # the communicator goes on
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_moe_ffn_saved_activations_with_a_fixed_bound(daemon, nranks):
    assert run_ranks(_bounded, nranks, daemon.socket, timeout_s=300) == [3] * nranks


def _layer(rank, nranks, compiled):
    comm = tandem.Communicator(op_timeout_ms=60000)
    tokens = TOKENS[nranks]
    ran = moechecks.check_layer(comm, tokens, topk=2, compiled=compiled)
    if not compiled:
        ran += moechecks.check_layer(comm, tokens, topk=2, capacity_factor=0.75)
        ran += moechecks.check_layer(comm, tokens, topk=1, capacity_factor=1.0)
        ran += moechecks.check_layer(comm, tokens, topk=2, save_activations=True)
    comm.close()
    return ran


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_moe_layer_matches_the_one_process_layer(daemon, nranks):
    assert run_ranks(_layer, nranks, daemon.socket, False, timeout_s=240) == [4] * nranks


def _compiled(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    ran = moechecks.check_functional(comm, torch.float32, "uniform", 2, TOKENS[nranks], compiled=True)
    ran += moechecks.check_functional(comm, torch.float32, "uniform", 2, TOKENS[nranks], compiled=True,
                                      save_activations=True)
    ran += moechecks.check_layer(comm, TOKENS[nranks], topk=2, compiled=True)
    comm.close()
    return ran


def test_moe_under_torch_compile_fullgraph(daemon):
    assert run_ranks(_compiled, 2, daemon.socket, timeout_s=300) == [3, 3]


def _bad_expert(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    x, g = torch.ones(3, 8), torch.ones(3, 8)
    w1, w2 = torch.full((2, 12, 8), 0.1), torch.full((2, 8, 6), 0.1)
    wts = torch.full((3, 2), 0.5)
    bad = torch.tensor([[0, 1], [2, 3], [1, 99 if rank == 1 else 0]], dtype=torch.int32)
    msg = "no error"
    try:
        comm.moe_ffn_backward(x, bad, wts, w1, w2, g)
    except tandem.TandemError as e:
        msg = str(e)
    repeated = torch.tensor([[0, 1], [2, 2], [1, 0]], dtype=torch.int32)
    msg2 = "no error"
    try:
        comm.moe_ffn_backward(x, repeated, wts, w1, w2, g)
    except tandem.TandemError as e:
        msg2 = str(e)
    good = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    dx, dwts, dw1, dw2 = comm.moe_ffn_backward(x, good, wts, w1, w2, g)  # the communicator still works
    ok = bool(torch.isfinite(dx).all() and dw1.abs().sum() > 0)
    comm.close()
    return msg, msg2, ok


def test_a_bad_expert_id_fails_the_backward_and_the_communicator_goes_on(daemon):
    for msg, msg2, ok in run_ranks(_bad_expert, 2, daemon.socket, timeout_s=120):
        assert "moe-ffn-backward: rank 1 topk_ids[2][1] = 99 is out of range [0, 4)" in msg, msg
        assert "names expert 2 twice" in msg2, msg2
        assert ok


def _saved_errors(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    x, g = torch.ones(3, 8), torch.ones(3, 8)
    w1, w2 = torch.full((2, 12, 8), 0.1), torch.full((2, 8, 6), 0.1)
    wts = torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)  # rank 0's experts 0, 1 get 4 rows of each rank
    msgs = []
    for call in (lambda: comm.moe_ffn(x, ids, wts, w1, w2, saved=torch.zeros(3, 12)),
                 lambda: comm.moe_ffn_backward(x, ids, wts, w1, w2, g, saved=torch.zeros(3, 12))):
        try:
            call()
            msgs.append("no error")
        except tandem.TandemError as e:
            msgs.append(str(e))
    for call in (lambda: comm.moe_ffn(x, ids, wts, w1, w2, saved=torch.zeros(8, 12, dtype=torch.bfloat16)),
                 lambda: comm.moe_ffn_backward(x, ids, wts, w1, w2, g, saved=torch.zeros(8, 10))):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    saved = torch.zeros(8, 12)
    comm.moe_ffn(x, ids, wts, w1, w2, saved=saved)  # the communicator still works, and the rows fit
    dx, *_ = comm.moe_ffn_backward(x, ids, wts, w1, w2, g, saved=saved)
    comm.close()
    return msgs, bool(torch.isfinite(dx).all())


def test_saved_activations_that_do_not_fit_fail_the_op_alone(daemon):
    for msgs, ok in run_ranks(_saved_errors, 2, daemon.socket, timeout_s=120):
        want = "rank 0 receives 8 rows but its saved tensor holds saved_rows = 3"
        assert "moe-dispatch-ffn-combine: " + want in msgs[0], msgs[0]
        assert "moe-ffn-backward: " + want in msgs[1], msgs[1]
        assert "argument 'saved' must have dtype torch.float32" in msgs[2], msgs[2]
        assert "argument 'saved' must have shape [8, 12]" in msgs[3], msgs[3]
        assert ok


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket)
    yield c
    c.close()


def test_bad_arguments_name_themselves(comm):
    F = tandem.nn.functional
    x, ids, wts = torch.ones(3, 8), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    w1, w2 = torch.ones(2, 12, 8), torch.ones(2, 8, 6)
    with pytest.raises(ValueError, match=r"'topk_ids' and 'topk_weights' must both be \[3, topk\]"):
        F.moe_ffn(x, ids[:2], wts, w1, w2, comm)
    with pytest.raises(ValueError, match=r"argument 'w2' must have dtype torch.float32"):
        F.moe_ffn(x, ids, wts, w1, w2.bfloat16(), comm)
    with pytest.raises(TypeError, match=r"argument 'comm' must be a tandem.Communicator"):
        F.moe_ffn(x, ids, wts, w1, w2, 3)
    with pytest.raises(ValueError, match=r"argument 'topk' \(5\) must be in \[1, experts = 4\]"):
        tandem.nn.MoE(8, 6, 4, 5, comm)


def test_the_training_example_matches_pytorch_at_2_ranks(daemon):
    example = Path(__file__).resolve().parents[2] / "python" / "examples" / "moe_train.py"
    env = dict(os.environ, TANDEM_SOCKET=daemon.socket)
    help_run = subprocess.run([sys.executable, str(example), "--help"], capture_output=True, text=True, env=env,
                              timeout=60)
    assert help_run.returncode == 0 and "--ranks" in help_run.stdout
    run = subprocess.run([sys.executable, str(example), "--ranks", "2", "--steps", "4"], capture_output=True,
                         text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("step ") >= 4 and "PASS" in run.stdout, run.stdout
