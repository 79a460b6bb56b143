"""tandem.nn's context-parallel attention at 1 to 4 ranks as processes against a real tandemd (cpu backend): out, dq,
dk and dv against torch.autograd of the whole sequence in float64 (both layouts, causal and not, grouped-query
attention with 1, 2 and 4 query heads per KV head, uneven shares and a rank with no rows, a custom scale, bf16 against
torch's own bf16 error); ContextParallelAttention on a sequence sharded by context_parallel_positions;
torch.compile(fullgraph=True) of forward and backward; the errors bad input raises; and the training example."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpchecks
import tandem
from conftest import run_ranks

HEADS = 4


def _gradients(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=60000)
    seqs = [3 + q for q in range(nranks)]  # odd and even: zigzag halves of unequal length
    checked = 0
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            for kv_heads in (HEADS, HEADS // 2, HEADS // 4):  # groups of 1, 2 and 4 query heads
                checked += cpchecks.check_gradients(comm, seqs, layout, causal, HEADS, kv_heads)
    checked += cpchecks.check_gradients(comm, seqs, "zigzag", True, HEADS, 2, scale=0.3)
    if nranks > 1:  # rank 1 holds no rows
        empty = [0 if q == 1 else 4 + q for q in range(nranks)]
        checked += cpchecks.check_gradients(comm, empty, "zigzag", True, HEADS, 2)
        checked += cpchecks.check_gradients(comm, empty, "contiguous", False, HEADS, 1)
    checked += cpchecks.check_gradients(comm, seqs, "zigzag", True, HEADS, 2, dtype=torch.bfloat16)
    for layout in ("contiguous", "zigzag"):
        checked += cpchecks.check_module_on_a_sharded_sequence(comm, layout)
    comm.barrier()
    comm.close()
    return checked


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_gradients_match_the_whole_sequence(daemon, nranks):
    per_rank = 4 * (12 + 1 + (2 if nranks > 1 else 0) + 1 + 2)
    assert run_ranks(_gradients, nranks, daemon.socket, timeout_s=240) == [per_rank] * nranks


def _compiled(rank, nranks):
    comm = tandem.Communicator(op_timeout_ms=120000)
    seqs = [5 + q for q in range(nranks)]
    checked = cpchecks.check_gradients(comm, seqs, "zigzag", True, HEADS, 2, compiled=True)
    checked += cpchecks.check_gradients(comm, seqs, "contiguous", False, HEADS, 1, compiled=True, module=True)
    comm.barrier()
    comm.close()
    return checked


def test_forward_and_backward_under_torch_compile_fullgraph(daemon):
    assert run_ranks(_compiled, 2, daemon.socket, timeout_s=300) == [8, 8]


@pytest.fixture
def comm(daemon):
    c = tandem.Communicator(socket=daemon.socket)
    yield c
    c.close()


def test_bad_arguments_name_themselves(comm):
    F = tandem.nn.functional
    q, kv = torch.ones(3, 4, 8), torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match=r"k and v have 3 heads, which does not divide q's 4 heads"):
        F.ring_attention(q, torch.ones(3, 3, 8), torch.ones(3, 3, 8), comm)
    with pytest.raises(ValueError, match=r"argument 'v' must have shape \[3, 2, 8\]"):
        F.ring_attention(q, kv, torch.ones(3, 2, 4), comm)
    with pytest.raises(ValueError, match=r"argument 'k' must have shape \[3, 2, 8\]"):
        F.ring_attention(q, torch.ones(2, 2, 8), kv, comm)
    with pytest.raises(ValueError, match=r"argument 'q' must be 3-D"):
        F.ring_attention(torch.ones(3, 32), kv, kv, comm)
    with pytest.raises(ValueError, match=r"argument 'k' must have dtype torch.float32"):
        F.ring_attention(q, kv.bfloat16(), kv, comm)
    with pytest.raises(ValueError, match=r"argument 'layout' must be one of 'contiguous', 'zigzag', got 'striped'"):
        F.ring_attention(q, kv, kv, comm, layout="striped")
    with pytest.raises(ValueError, match=r"argument 'scale' must be finite and > 0"):
        F.ring_attention(q, kv, kv, comm, scale=0.0)
    with pytest.raises(TypeError, match=r"argument 'comm' must be a tandem.Communicator"):
        F.ring_attention(q, kv, kv, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        tandem.nn.ContextParallelAttention(comm, 4, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"argument 'k' must have shape \[seq, 1, 8\]"):
        tandem.nn.ContextParallelAttention(comm, 4, 8, num_kv_heads=1)(q, kv, kv)


def test_what_the_library_refuses_it_reports_itself(comm):
    # float64 is no dtype of the library's: the op's own message comes through unchanged
    q = torch.ones(3, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tandem.ring_attention: dtype torch.float64 is not supported"):
        tandem.nn.functional.ring_attention(q, q, q, comm)


def test_a_backward_whose_saved_tensor_was_freed_names_it(comm):
    q = torch.randn(3, 4, 8, requires_grad=True)
    k, v = torch.randn(3, 2, 8, requires_grad=True), torch.randn(3, 2, 8, requires_grad=True)
    out = tandem.nn.functional.ring_attention(q, k, v, comm, causal=True)
    q.detach().untyped_storage().resize_(0)  # what memory savers do to a tensor they offload
    with pytest.raises(RuntimeError, match=r"saved tensor 'q' \(\[3, 4, 8\]\) was freed"):
        out.sum().backward()


def test_a_backward_run_twice_says_so(comm):
    q = torch.randn(3, 4, 8, requires_grad=True)
    out = tandem.nn.ContextParallelAttention(comm, 4, 8)(q, q.detach(), q.detach())
    out.sum().backward()
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time"):
        out.sum().backward()


def test_only_the_gradients_asked_for(comm):
    q = torch.randn(3, 4, 8, requires_grad=True)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8, requires_grad=True)
    tandem.nn.functional.ring_attention(q, k, v, comm).sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_cp_attention_training_example_at_2_ranks(daemon):
    example = Path(__file__).resolve().parents[2] / "python" / "examples" / "cp_attention_train.py"
    env = dict(os.environ, TANDEM_SOCKET=daemon.socket)
    p = subprocess.run([sys.executable, str(example), "--ranks", "2", "--steps", "3", "--layout", "zigzag"], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("step ") == 3 and "PASS" in p.stdout, p.stdout
