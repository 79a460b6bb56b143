"""Timing for the step benchmarks: the median over runs of one step, CUDA events on GPUs, the host clock on CPUs."""

from __future__ import annotations

import statistics
import time

import torch


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
