"""What the step benchmarks share: starting this process's rank (one GPU, or one rank of a torchrun job) with its tandem
communicator, and timing: the median over runs of one step, CUDA events on GPUs, the host clock on CPUs."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import tandem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def start_rank(name: str, cuda: bool, **comm_kwargs):
    """This process's rank: (world, rank, comm), or None after saying why (`--device cuda` without a GPU). Under
    torchrun (RANK, WORLD_SIZE, LOCAL_RANK) it takes LOCAL_RANK's GPU and starts torch.distributed over nccl (gloo on
    the cpu backend), which the PyTorch baselines use and tandem bootstraps over; alone it is one rank."""
    if cuda and not torch.cuda.is_available():
        print(f"{name}: no GPU here; pass --device cpu to check the program on the cpu backend", file=sys.stderr)
        return None
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    group = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if cuda else "gloo")
        group = dist.group.WORLD
    return world, rank, tandem.Communicator(group, **comm_kwargs)


def timed(step, iters: int, warmup: int, cuda: bool = True) -> float:
    """Median ms of `step` over `iters` runs after `warmup`: each run bracketed by CUDA events on the current stream,
    or by the host clock without a GPU."""
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
