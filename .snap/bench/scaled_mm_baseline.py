#!/usr/bin/env python3
"""PyTorch's FP8 GEMM (torch._scaled_mm, cuBLASLt underneath) at the FP8 bench's shapes: the baseline that
bench/gemm_fp8_bench.cu's per-tensor kernel is held against.

C [M, N] bf16 = (A [M, K] e4m3 * B [N, K]^T e4m3) * scale_a * scale_b, per-tensor fp32 scales, with and without
use_fast_accum. CUDA events around each call, median of --iters after warm-up, two input sets alternated (together
larger than L2). Prints TFLOP/s per shape.

    python3 bench/scaled_mm_baseline.py [--iters 30]
"""
import argparse
import statistics

import torch

SHAPES = [(8192, 8192, 8192), (4096, 8192, 8192), (16384, 14336, 8192)]


def random_e4m3(rows, cols, device):
    # Magnitudes 2^-4 .. 2^5 as the C++ bench's fill; never NaN.
    x = torch.randn(rows, cols, device=device) * 4
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def time_ms(fn, sets, iters):
    for i in range(3):
        fn(*sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    iters = max(20, args.iters)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    scale_a = torch.tensor(0.37, device=dev)
    scale_b = torch.tensor(1.9, device=dev)
    print(f"{'M x N x K':21s} {'fast ms':>9s} {'fast TF':>9s} {'dflt ms':>9s} {'dflt TF':>9s}")
    for m, n, k in SHAPES:
        sets = [(random_e4m3(m, k, dev), random_e4m3(n, k, dev)) for _ in range(2)]
        flops = 2.0 * m * n * k
        row = []
        for fast in (True, False):
            def gemm(a, b, fast=fast):
                # b.t(): B [N, K] row-major is the column-major [K, N] operand _scaled_mm requires.
                return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            ms = time_ms(gemm, sets, iters)
            row += [ms, flops / (ms * 1e9)]
        print(f"{f'{m}x{n}x{k}':21s} {row[0]:9.4f} {row[1]:9.0f} {row[2]:9.4f} {row[3]:9.0f}")
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
