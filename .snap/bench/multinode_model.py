#!/usr/bin/env python3
"""A model of the fused GEMMs across 2-16 nodes of 8 H200s with 8x400 Gb/s NICs per node (docs/MULTINODE_MODEL.md).

It predicts, per op and shape, the time of the unfused path (the collective, then the GEMM, or the GEMM then the
collective) and of tandem's hierarchical fused path (NVLink inside the node, one aggregated payload per node pair over
the NICs, GPU-issued transfer commands through the proxy FIFO), from per-link rates. The inputs that can be measured on
one H200 are measured (bench/RESULTS.md; ../shared/GPU.md, outside this repository); the NIC rates are assumptions, stated below and
in the doc, to be replaced by a real cluster's measurements (--nic-gbps, --nic-eff, --nic-latency-us).

  python3 bench/multinode_model.py [--nodes 2,4,8,16] [--json FILE] [--nic-gbps 400] [--nic-eff 0.85] ...

Prints one table per op: nodes, predicted unfused and fused time, the speedup, and which resource bounds the fused
path (compute, nvlink, nic).
"""
import argparse
import json
import math

GPUS_PER_NODE = 8
# Measured on one H200 (bench/RESULTS.md): the GEMM core at large shapes, bf16.
GEMM_TFLOPS = 720.0
# ../shared/GPU.md (nvidia-h200-x2, 2026-11-29): SM-driven peer copies reach 324 GB/s with 32 blocks; copier warps
# inside the fused kernels (the winning "copy" transport) move partials at well under that without slowing the GEMM.
NVLINK_GBS = 324.0
# proxy_push_bench on one H200 (bench/RESULTS.md): a GPU producer's signalled command round trip to the proxy,
# p50 3.36 us with the FIFO head in device memory; the proxy drains 23-27 M commands/s per thread.
PROXY_RTT_US = 3.36
PROXY_MCMDS = 23.0
# Per-chunk transfer command granularity tandem uses between nodes (one command per chunk, one flag per destination
# batch).
CHUNK_BYTES = 4 << 20


def gemm_ms(m, n, k):
    return 2.0 * m * n * k / (GEMM_TFLOPS * 1e12) * 1e3


def xfer_ms(nbytes, gbs, latency_us=0.0):
    return nbytes / (gbs * 1e9) * 1e3 + latency_us * 1e-3


def model(op, m, n, k, nodes, a):
    """Times in ms for one op on `nodes` nodes x 8 GPUs, bf16 (2 bytes per element)."""
    ranks = nodes * GPUS_PER_NODE
    nic_gbs = a.nic_gbps / 8.0 * a.nic_eff  # one NIC per GPU, GPUDirect RDMA into GPU memory
    es = 2
    if op == "ag-gemm":
        # A [m, k] sharded by rows over every rank; every rank computes C = A_gathered . B_r^T, [m, n].
        compute = gemm_ms(m, n, k)
        shard = m // ranks * k * es
        nvl = xfer_ms(shard * (GPUS_PER_NODE - 1), NVLINK_GBS)
        # Hierarchical: each GPU receives the shards of its counterpart on every other node over its own NIC (one
        # aggregated payload per node pair, spread over the 8 NIC rails), then shares them over NVLink.
        remote = shard * (nodes - 1) * GPUS_PER_NODE
        nic = xfer_ms(remote / GPUS_PER_NODE, nic_gbs, a.nic_latency_us) if nodes > 1 else 0.0
        nvl += xfer_ms(remote * (GPUS_PER_NODE - 1) / GPUS_PER_NODE, NVLINK_GBS)
        # Unfused: NCCL's ring AllGather with one ring per NIC rail: each rail's node crossing carries (R-1)/R of the
        # data / 8, each rank receives R-1 shards; then the GEMM.
        total = m * k * es
        coll = max(xfer_ms(total * (ranks - 1) / ranks / GPUS_PER_NODE, nic_gbs, a.nic_latency_us * (nodes - 1))
                   if nodes > 1 else 0.0, xfer_ms(shard * (ranks - 1), NVLINK_GBS))
        # Local shards are consumed first: the first remote chunk is exposed only past the node-local share of the GEMM.
        first = max(0.0, xfer_ms(min(shard, CHUNK_BYTES), nic_gbs, a.nic_latency_us) - compute / nodes) if nodes > 1 else 0.0
        cmds = math.ceil(remote / CHUNK_BYTES)
        proxy = cmds / (PROXY_MCMDS * 1e6) * 1e3 + PROXY_RTT_US * 1e-3 if nodes > 1 else 0.0
    elif op in ("gemm-rs", "gemm-ar"):
        # K split over every rank: partial C_r = A_r . B_r^T [m, n], then the reduction (rs: each rank keeps m/ranks
        # rows; ar: every rank gets every row, two-shot).
        compute = gemm_ms(m, n, k / ranks)
        part = m * n * es
        share = part / ranks
        factor = 1.0 if op == "gemm-rs" else 2.0  # two-shot all-reduce = reduce-scatter + all-gather
        nvl = factor * xfer_ms(share * (GPUS_PER_NODE - 1), NVLINK_GBS)
        # Between nodes: the node's reduced partial of the rows other nodes own, one payload per node pair, over 8 rails.
        remote = factor * part * (nodes - 1) / nodes
        nic = xfer_ms(remote / GPUS_PER_NODE, nic_gbs, a.nic_latency_us) if nodes > 1 else 0.0
        # Unfused: NCCL's ring ReduceScatter / AllReduce, one ring per rail, as for ag-gemm.
        coll = max(xfer_ms(factor * part * (ranks - 1) / ranks / GPUS_PER_NODE, nic_gbs,
                           a.nic_latency_us * (nodes - 1)) if nodes > 1 else 0.0,
                   factor * xfer_ms(share * (ranks - 1), NVLINK_GBS))
        # The last tiles' partials leave only after they are computed: that tail is not hidden.
        first = xfer_ms(CHUNK_BYTES, nic_gbs, a.nic_latency_us) if nodes > 1 else 0.0  # the last chunk's tail
        cmds = math.ceil(remote / CHUNK_BYTES)
        proxy = cmds / (PROXY_MCMDS * 1e6) * 1e3 + PROXY_RTT_US * 1e-3 if nodes > 1 else 0.0
    else:
        raise ValueError(op)
    unfused = compute + coll
    bound = max(("compute", compute), ("nvlink", nvl), ("nic", nic), key=lambda t: t[1])
    # Fused: the slowest resource, plus what cannot overlap (the first remote chunk, the proxy's command round trip),
    # plus the SMs the communication roles take from the GEMM (8 SMs measured free, ../shared/GPU.md).
    fused = bound[1] + first + proxy + (compute * a.comm_sm_cost)
    return {"op": op, "m": m, "n": n, "k": k, "nodes": nodes, "ranks": ranks, "compute_ms": compute,
            "nvlink_ms": nvl, "nic_ms": nic, "unfused_ms": unfused, "fused_ms": fused,
            "speedup": unfused / fused, "bound": bound[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="per NIC, Gb/s (8 per node)")
    ap.add_argument("--nic-eff", type=float, default=0.85, help="achieved fraction of the NIC line rate")
    ap.add_argument("--nic-latency-us", type=float, default=3.0, help="one RDMA write + flag, us")
    ap.add_argument("--comm-sm-cost", type=float, default=0.0,
                    help="fraction of GEMM time lost to communication SMs (0 for <= 8 SMs, 0.16 for 16)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = {"ag-gemm": [(8192, 8192, 8192), (16384, 14336, 8192)],
              "gemm-rs": [(8192, 8192, 8192 * 8), (16384, 14336, 8192 * 8)],
              "gemm-ar": [(8192, 8192, 8192 * 8), (16384, 14336, 8192 * 8)]}
    rows = []
    for op, list_ in shapes.items():
        print(f"\n{op} (bf16; ag-gemm: M x N x K with A row-sharded; rs/ar: K split over every rank)")
        print("| M x N x K | nodes | GEMM ms | NVLink ms | NIC ms | unfused ms | fused ms | fused speedup | bound |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (m, n, k) in list_:
            for nodes in [int(x) for x in a.nodes.split(",")]:
                r = model(op, m, n, k, nodes, a)
                rows.append(r)
                print(f"| {m}x{n}x{k} | {nodes} | {r['compute_ms']:.3f} | {r['nvlink_ms']:.3f} | {r['nic_ms']:.3f} | "
                      f"{r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | {r['speedup']:.2f}x | {r['bound']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"inputs": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
