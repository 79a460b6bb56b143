"""tandem.nn's tensor-parallel layers against the unsharded nn.Linear pair computed in one process.

A column-parallel layer, GELU, then a row-parallel layer (Megatron's MLP), forward and backward, at this rank; the
reference is the same two nn.Linear in plain PyTorch autograd on the whole input, which every rank computes itself.
Used by the cpu-backend tests (test_tp_layers.py, float32) and the GPU section (gpu_run.py tp, bf16 against torch's
own bf16 autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import opchecks
import tandem

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def reference_pair(in_f, hid, out_f, dtype, device, bias=True):
    col, row = torch.nn.Linear(in_f, hid, bias=bias), torch.nn.Linear(hid, out_f, bias=bias)
    with torch.no_grad():
        for name, lin in (("col", col), ("row", row)):
            lin.weight.copy_(opchecks.gen(f"tp.{name}.w", 0, tuple(lin.weight.shape), scale=lin.in_features ** -0.5))
            if bias:
                lin.bias.copy_(opchecks.gen(f"tp.{name}.b", 0, tuple(lin.bias.shape), scale=0.1))
    return col.to(device, dtype), row.to(device, dtype)


def _close(got, want, dtype, what):
    torch.testing.assert_close(got.detach().float().cpu(), want.detach().float().cpu(), **TOL[dtype],
                               msg=lambda m: f"{what}: {m}")


def _recording_backend(graphs):
    """aot_eager that keeps the forward and backward graphs' code."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, _inputs):
            graphs.append((kind, gm.code))
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def _loss(col, row, x, dy):
    y = row(F.gelu(col(x)))
    return y, (y * dy).sum()


def _run(col, row, x, dy, loss=_loss):
    y, total = loss(col, row, x, dy)
    total.backward()
    return y


def check_layers(comm, sequence_parallel: bool, dtype=torch.float32, device="cpu", bias=True, compiled=False):
    """One forward and backward through ColumnParallelLinear -> GELU -> RowParallelLinear against the nn.Linear pair;
    the weight gradients of a second run must be bitwise those of the first. Returns the number of tensors checked."""
    r, n = comm.rank, comm.world_size
    in_f, hid, out_f, seq, batch = 16, 8 * n, 24, 2 * n, 3  # (the cuda GEMMs: n and k multiples of 8)
    ref_col, ref_row = reference_pair(in_f, hid, out_f, dtype, device, bias)
    x = opchecks.gen("tp.x", 0, (seq, batch, in_f)).to(device, dtype).requires_grad_()
    dy = opchecks.gen("tp.dy", 0, (seq, batch, out_f)).to(device, dtype)
    ref_y = _run(ref_col, ref_row, x, dy)

    col = tandem.nn.ColumnParallelLinear.from_linear(ref_col, comm, sequence_parallel=sequence_parallel)
    row = tandem.nn.RowParallelLinear.from_linear(ref_row, comm, sequence_parallel=sequence_parallel)
    s = seq // n
    rows = slice(r * s, (r + 1) * s) if sequence_parallel else slice(None)
    # compiled: forward and loss as one graph (fullgraph), whose backward AOTAutograd compiled with it
    graphs = []
    loss = torch.compile(_loss, fullgraph=True, backend=_recording_backend(graphs)) if compiled else _loss
    grads = []
    for attempt in range(2):
        xl = x.detach()[rows].clone().requires_grad_()
        col.zero_grad(set_to_none=True)
        row.zero_grad(set_to_none=True)
        y = _run(col, row, xl, dy[rows].contiguous(), loss)
        grads.append([p.grad.clone() for p in (*col.parameters(), *row.parameters())])
    _close(y, ref_y[rows], dtype, "y")
    _close(xl.grad, x.grad[rows], dtype, "x.grad")
    if compiled:  # the layers' ops, forward and backward, are in the compiled graphs
        fw, bw = "\n".join(g for k, g in graphs if k == "fw"), "\n".join(g for k, g in graphs if k == "bw")
        for op in ("column_parallel_linear.default", "row_parallel_linear.default"):
            assert f"tandem.{op}" in fw, fw
        for op in ("column_parallel_linear_backward.default", "row_parallel_linear_backward.default"):
            assert f"tandem.{op}" in bw, bw
    c = hid // n
    _close(col.weight.grad, ref_col.weight.grad[r * c:(r + 1) * c], dtype, "column weight.grad")
    _close(row.weight.grad, ref_row.weight.grad[:, r * c:(r + 1) * c], dtype, "row weight.grad")
    checked = 4
    if bias:
        _close(col.bias.grad, ref_col.bias.grad[r * c:(r + 1) * c], dtype, "column bias.grad")
        _close(row.bias.grad, ref_row.bias.grad, dtype, "row bias.grad")
        checked += 2
    for a, b in zip(*grads):
        assert torch.equal(a, b), "weight gradients differ between two identical runs"
    return checked


def check_row_replicated_input(comm, dtype=torch.float32, device="cpu"):
    """RowParallelLinear(input_is_parallel=False): a replicated input split here, its gradient gathered back."""
    r, n = comm.rank, comm.world_size
    hid, out_f = 8 * n, 24
    _, ref_row = reference_pair(4, hid, out_f, dtype, device)
    x = opchecks.gen("tp.xr", 0, (5, hid)).to(device, dtype).requires_grad_()
    dy = opchecks.gen("tp.dyr", 0, (5, out_f)).to(device, dtype)
    row = tandem.nn.RowParallelLinear.from_linear(ref_row, comm, input_is_parallel=False)
    xl = x.detach().clone().requires_grad_()
    y = row(xl)
    (y * dy).sum().backward()
    (ref_row(x) * dy).sum().backward()
    c = hid // n
    _close(y, ref_row(x), dtype, "y")
    _close(xl.grad, x.grad, dtype, "x.grad")
    _close(row.weight.grad, ref_row.weight.grad[:, r * c:(r + 1) * c], dtype, "row weight.grad")
    _close(row.bias.grad, ref_row.bias.grad, dtype, "row bias.grad")
    return 4
