"""Two processes, one node: torchrun --nproc-per-node 2 python/examples/torchrun_example.py

GEMM + AllReduce with K split over the ranks, and AllGather + GEMM with A split by rows, checked against the
same math on the whole matrices. Runs on whatever backend the node's tandemd has: cuda (tensors on the GPU,
ops ordered on torch.cuda.current_stream()) or cpu (host tensors, synchronous ops).
"""

import os

import torch
import torch.distributed as dist

import tandem

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
dist.init_process_group("gloo")  # only to bootstrap: tandem's communicator id travels through its store
rank, world = dist.get_rank(), dist.get_world_size()

comm = tandem.Communicator()  # joins the node's tandemd: $TANDEM_SOCKET or the default socket
dev = comm.device             # cuda backend: the current GPU; cpu backend: cpu
dtype = torch.bfloat16 if comm.is_cuda else torch.float32

g = torch.Generator().manual_seed(0)  # every rank makes the same whole matrices, then takes its part
m, n, k = 256, 512, 1024
A = torch.randn(m, k, generator=g).to(dtype)
B = torch.randn(n, k, generator=g).to(dtype)

# GEMM + AllReduce: this rank multiplies its K slice; every rank receives the sum, A @ B.T.
ks = k // world
a = A[:, rank * ks:(rank + 1) * ks].contiguous().to(dev)  # ops take contiguous (row-major) tensors
b = B[:, rank * ks:(rank + 1) * ks].contiguous().to(dev)
c = comm.gemm_ar(a, b)

# AllGather + GEMM: this rank holds rows_of(m, rank) of A; every rank receives gather(A) @ b.T.
first, rows = tandem.rows_of(m, rank, world)
c2 = comm.ag_gemm(A[first:first + rows].to(dev), B.to(dev))

comm.synchronize()  # cuda: the ops ran on the current stream; wait for them before reading on the host
want = A.double() @ B.double().T
err = max((c.double().cpu() - want).abs().max().item(), (c2.double().cpu() - want).abs().max().item())
tol = 0.05 * want.abs().max().item() if dtype == torch.bfloat16 else 1e-3
print(f"rank {rank}/{world} ({comm.backend}): gemm_ar and ag_gemm, max error {err:.3g}: {'OK' if err < tol else 'FAIL'}")
comm.close()
dist.destroy_process_group()
raise SystemExit(0 if err < tol else 1)
