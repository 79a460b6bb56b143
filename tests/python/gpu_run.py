"""The Python package on the cuda backend (scripts/py-gpu-run.sh runs it, under torchrun for 2 ranks).

usage: [torchrun --nproc-per-node N] python gpu_run.py SECTION...   SECTION: ops compile graph cache all
Each section prints one "PASS <section>" or "FAIL <section>: <reason>" line (rank 0, or every rank that failed);
the exit code is the number of failed sections. Needs tandemd (cuda backend) at $TANDEM_SOCKET.
Ranks share the GPU given by LOCAL_RANK % device_count (2 ranks on one H200 share it).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

import opchecks
import tandem

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def say(msg: str) -> None:
    print(f"[rank {RANK}/{WORLD}] {msg}", flush=True)


def section_ops(comm):
    """Every op the cuda backend runs, bf16 and fp16, torch-allocator and tandem.empty tensors, with and without
    out=; MoE and ring attention either run and match, or are refused with tandem.Unsupported."""
    gpu_checks = [opchecks.check_ag_gemm, opchecks.check_gemm_rs, opchecks.check_gemm_ar, opchecks.check_allgather]
    ran = opchecks.run_all(comm, dtypes=(torch.bfloat16, torch.float16), device=comm.device, checks=gpu_checks)
    comm.synchronize()
    notes = [f"{ran} ops matched"]
    place = opchecks.Placer("torch", comm.device)
    for check in (opchecks.check_moe_dispatch_gemm, opchecks.check_moe_ffn, opchecks.check_ring_attention):
        try:
            check(comm, torch.bfloat16, place, False)
            comm.synchronize()
            notes.append(f"{check.__name__[6:]} matched")
        except (tandem.Unsupported, tandem.InvalidArgument) as e:  # e.g. the GPU kernels' head_dim rules
            notes.append(f"{check.__name__[6:]} refused: {type(e).__name__} ({str(e)[:160]})")
    return "; ".join(notes)


def section_compile(comm):
    """torch.compile(fullgraph=True, inductor) around gemm_ar and allgather, against eager."""
    torch._dynamo.reset()
    m, n, k = 64, 64, 64
    a = opchecks.gen("gc.a", RANK, (m, k), torch.bfloat16).to(comm.device)
    b = opchecks.gen("gc.b", RANK, (n, k), torch.bfloat16).to(comm.device)

    def step(a, b):
        c = comm.gemm_ar(torch.relu(a), b)
        return comm.allgather(c * 2)

    want = step(a, b)
    got = torch.compile(step, fullgraph=True)(a, b)
    comm.synchronize()
    torch.testing.assert_close(got, want)
    return "inductor graph matches eager"


def section_graph(comm):
    """A CUDA graph holding gemm_ar (out= tensors made before capture), replayed 100 times with new inputs."""
    m, n, k = 128, 128, 128
    dev = comm.device
    a = torch.zeros((m, k), dtype=torch.bfloat16, device=dev)
    b = opchecks.gen("gg.b", RANK, (n, k), torch.bfloat16).to(dev)
    c = torch.zeros((m, n), dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        comm.gemm_ar(a, b, out=c)  # warm-up outside capture: registers the segments, loads the kernels
    torch.cuda.current_stream(dev).wait_stream(stream)
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.gemm_ar(a, b, out=c)
    comm.synchronize()
    t0 = time.perf_counter()
    for i in range(100):
        a.copy_(opchecks.gen(f"gg.a{i % 4}", RANK, (m, k), torch.bfloat16).to(dev))
        graph.replay()
        if i % 25 == 0 or i == 99:
            torch.cuda.synchronize(dev)
            want = sum(opchecks.gen(f"gg.a{i % 4}", q, (m, k), torch.bfloat16).double() @
                       opchecks.gen("gg.b", q, (n, k), torch.bfloat16).double().T for q in range(WORLD))
            opchecks.close(c, want, torch.bfloat16, f"replay {i}")
    torch.cuda.synchronize(dev)
    return f"100 replays checked ({(time.perf_counter() - t0) * 1e3:.1f} ms)"


def section_cache(comm):
    """Registration by segment: a tensor in a segment PyTorch freed (empty_cache) and re-allocated at the same
    address is registered afresh, and the dead registration is released."""
    seg = comm.session.segments
    dev = comm.device
    b = torch.ones((64, 256), dtype=torch.bfloat16, device=dev)
    ptrs, regs0 = set(), seg.registrations
    for i in range(6):
        # 4 MiB: PyTorch's large pool, a segment of its own that empty_cache() gives back with cudaFree
        a = torch.full((8192, 256), float(i % 3), dtype=torch.bfloat16, device=dev)
        ptrs.add(a.data_ptr())
        out = comm.gemm_ar(a, b)
        comm.synchronize()
        want = torch.full((8192, 64), float(i % 3) * 256 * WORLD, dtype=torch.float64)
        opchecks.close(out, want, torch.bfloat16, f"round {i}")
        del a, out
        torch.cuda.empty_cache()  # cudaFree of the segment: the next round may get the same addresses
    live = len(seg.by_id)
    return (f"{len(ptrs)} distinct addresses over 6 rounds, {seg.registrations - regs0} registrations, "
            f"{seg.releases} released, {live} live")


SECTIONS = {"ops": section_ops, "compile": section_compile, "graph": section_graph, "cache": section_cache}


def main(argv) -> int:
    names = list(SECTIONS) if argv in ([], ["all"]) else argv
    dev = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    import torch.distributed as dist
    if WORLD > 1 and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")  # the id travels through its store (the torchrun path of the README)
    comm = tandem.Communicator(op_timeout_ms=60000)
    say(f"{comm} on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, library {tandem.library_path}")
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            note = SECTIONS[name](comm)
            if RANK == 0:
                say(f"PASS {name} ({time.perf_counter() - t0:.1f} s): {note}")
        except Exception as e:  # noqa: BLE001  (report and go on to the next section)
            failed += 1
            say(f"FAIL {name} ({time.perf_counter() - t0:.1f} s): {type(e).__name__}: {e}")
            traceback.print_exc()
            if isinstance(e, (tandem.PeerLost, tandem.DaemonLost, tandem.Aborted, tandem.Timeout)):
                say("communicator unusable after this failure; skipping the remaining sections")
                failed += len(names) - names.index(name) - 1
                break
    try:  # every rank's ops done before any rank leaves (leaving fails the peers' ops still in flight)
        comm.barrier()
        comm.synchronize()
    except tandem.TandemError as e:
        say(f"final barrier: {type(e).__name__}: {e}")
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
