#!/usr/bin/env python3
"""tandem's attention core against torch SDPA (cuDNN, flash) on one GPU.

Two modes.

Logs (no GPU needed): ratios of attention_bench's rows to bench/sdpa_baseline.py --json timed in the same device call.
For every (seq, causal) of the bench log: each tandem configuration's TFLOP/s and its ratio to the faster layout of
cuDNN and of flash, the default configuration (the first row of the shape) marked unless --no-default (a log of
--variants all, which need not start with the default). Lines "| ... |" (markdown).

  python3 bench/attention_vs_sdpa.py [--no-default] BENCH_LOG SDPA_JSON [BENCH_LOG ...]

Run (--run BENCH): one driver process times torch SDPA (sdpa_baseline.py's timing: both layouts, the faster one
counts) and, right after it on the same shape, runs BENCH (attention_bench) with --rounds R: the core's
default configuration R times on the same inputs, each row checked against an fp32 reference. So cuDNN and the core
of one shape are timed back to back, shape by shape. Prints one line per shape as it goes and a table at the end
(the core's TFLOP/s: the mean of its rounds, with their min and max); writes bench logs and ab.json into --out.

  python3 bench/attention_vs_sdpa.py --run BENCH [--seqs 4096,8192,16384,32768] [--causal both|0|1] [--rounds 2]
                                     [--out DIR] [--bench-timeout S]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

# The loop control attention_bench times (the only one built), as its config names end.
BASE = "lane0"
ROW = re.compile(r"^RESULT seq=(\d+) causal=(\d) config=(\S+) median_ms=([\d.]+) .* tflops=([\d.]+) .* (ok|WRONG)$")


def parse_rows(lines):
    """(seq, causal, config, tflops, check) for every RESULT line of attention_bench."""
    rows = []
    for line in lines:
        m = ROW.match(line.strip())
        if m:
            rows.append((int(m[1]), m[2] == "1", m[3], float(m[5]), m[6]))
    return rows


def from_logs(args):
    mark = "--no-default" not in args
    args = [a for a in args if a != "--no-default"]
    if len(args) < 2:
        print("usage: attention_vs_sdpa.py [--no-default] BENCH_LOG SDPA_JSON [BENCH_LOG ...]", file=sys.stderr)
        return 2
    logs = [args[0]] + args[2:]
    with open(args[1]) as f:
        sdpa = json.load(f)
    best = {}
    for r in sdpa:
        key = (r["seq"], bool(r["causal"]), r["backend"])
        best[key] = max(best.get(key, 0.0), r["tflops"])
    print("| log | seq | causal | config | TFLOP/s | / cuDNN | / flash | check |")
    print("|---|---|---|---|---|---|---|---|")
    for log in logs:
        seen = set()
        try:
            lines = open(log).read().splitlines()
        except OSError as e:
            print(f"| {log} | (unreadable: {e}) |")
            continue
        for seq, causal, config, tf, check in parse_rows(lines):
            first = (seq, causal) not in seen
            seen.add((seq, causal))
            cu = best.get((seq, causal, "cudnn"))
            fl = best.get((seq, causal, "flash"))
            ratio = lambda b: f"{tf / b:.3f}" if b else "-"
            name = f"**{config}** (default)" if first and mark else config
            print(f"| {'/'.join(log.split('/')[-2:])} | {seq} | {'yes' if causal else 'no'} | {name} | {tf:.1f} | "
                  f"{ratio(cu)} | {ratio(fl)} | {check} |")
    print()
    print("| seq | causal | cuDNN TFLOP/s | flash TFLOP/s |")
    print("|---|---|---|---|")
    for (seq, causal) in sorted({(k[0], k[1]) for k in best}):
        print(f"| {seq} | {'yes' if causal else 'no'} | {best.get((seq, causal, 'cudnn'), 0):.1f} | "
              f"{best.get((seq, causal, 'flash'), 0):.1f} |")
    return 0


def torch_best(sb, seq, causal, heads, hd, iters, warmup):
    """{backend: best TFLOP/s over the two layouts} for one shape, with sdpa_baseline's sets and timing."""
    import torch

    flops = 4.0 * seq * seq * heads * hd * (0.5 if causal else 1.0)
    set_bytes = 3 * seq * heads * hd * 2
    count = max(2, -(-3 * 60 * 2**20 // set_bytes))
    best = {}
    for layout in ("bshd", "bhsd"):
        sets = sb.make_sets(seq, heads, hd, layout, count, torch.bfloat16)
        for backend in sb.BACKENDS:
            try:
                med, _, _, _ = sb.time_backend(backend, sets, causal, iters, warmup)
            except RuntimeError as e:
                print(f"SKIP seq={seq} causal={int(causal)} backend={backend} layout={layout}: {e}", flush=True)
                continue
            best[backend] = max(best.get(backend, 0.0), flops / (med * 1e-3) / 1e12)
        del sets
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the bench process needs the memory next
    return best


def run(argv):
    ap = argparse.ArgumentParser(prog="attention_vs_sdpa.py --run")
    ap.add_argument("--run", required=True, metavar="BENCH", help="attention_bench binary")
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--out", default=".")
    ap.add_argument("--bench-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(args.out, exist_ok=True)
    try:  # sdpa_baseline's make_sets / time_backend: the same torch timing as the session-5/6 numbers
        import sdpa_baseline as sb
        import torch

        print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}",
              flush=True)
    except Exception as e:  # no torch: the core still runs, without the SDPA columns
        print(f"NO TORCH ({type(e).__name__}: {e}): timing tandem only", flush=True)
        sb = None
    causals = [False, True] if args.causal == "both" else [args.causal == "1"]
    shapes = []
    for seq in [int(s) for s in args.seqs.split(",") if s]:
        for causal in causals:
            t0 = time.time()
            best = {}
            if sb is not None:
                try:
                    best = torch_best(sb, seq, causal, args.heads, args.hd, max(20, args.iters), args.warmup)
                except Exception as e:  # a torch failure costs this shape's SDPA columns, not the core's
                    print(f"SDPA FAILED seq={seq} causal={int(causal)}: {type(e).__name__}: {e}", flush=True)
            cmd = [args.run, "--seqs", str(seq), "--causal", str(int(causal)), "--rounds", str(args.rounds),
                   "--iters", str(args.iters), "--warmup", str(args.warmup), "--heads", str(args.heads), "--hd",
                   str(args.hd)]
            log = os.path.join(args.out, f"bench-{seq}-{'causal' if causal else 'full'}.log")
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
                text, rc = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                text, rc = out + f"\n(timed out after {args.bench_timeout} s)\n", 124
            with open(log, "w") as f:
                f.write(" ".join(cmd) + "\n" + text)
            loops = {BASE: []}
            checks = []
            config = ""
            for _, _, cfg, tf, check in parse_rows(text.splitlines()):
                loop = cfg.rsplit("/", 1)[-1]
                if loop in loops:
                    loops[loop].append(tf)
                    config = cfg.rsplit("/", 1)[0]
                checks.append(check)
            shape = dict(seq=seq, causal=causal, config=config, cudnn=best.get("cudnn"), flash=best.get("flash"),
                         loops=[BASE], base=loops[BASE], bench_rc=rc,
                         check="ok" if checks and all(c == "ok" for c in checks) else "WRONG" if checks else "none")
            shapes.append(shape)
            mean = lambda v: sum(v) / len(v) if v else None
            bm = mean(loops[BASE])
            cu, fl = best.get("cudnn"), best.get("flash")
            print(f"SHAPE seq={seq} causal={int(causal)} cudnn={cu or 0:.1f} "
                  f"flash={fl or 0:.1f} {BASE}={','.join(f'{x:.1f}' for x in loops[BASE])} "
                  f"{BASE}/cudnn={bm / cu if bm and cu else 0:.3f} {BASE}/flash={bm / fl if bm and fl else 0:.3f} "
                  f"rc={rc} check={shape['check']} "
                  f"({time.time() - t0:.1f} s)", flush=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(shapes, f, indent=1)

    def cell(v):
        if not v:
            return "-"
        m = sum(v) / len(v)
        return f"{m:.1f} ({min(v):.1f}-{max(v):.1f})" if len(v) > 1 else f"{m:.1f}"

    def ratio(a, b):
        return f"{a / b:.3f}" if a and b else "-"

    print()
    print(f"| seq | causal | config | cuDNN | flash | {BASE} | {BASE} / cuDNN | {BASE} / flash | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in shapes:
        bm = sum(s["base"]) / len(s["base"]) if s["base"] else None
        print(f"| {s['seq']} | {'yes' if s['causal'] else 'no'} | {s['config']} | {s['cudnn'] or 0:.1f} | "
              f"{s['flash'] or 0:.1f} | {cell(s['base'])} | {ratio(bm, s['cudnn'])} | {ratio(bm, s['flash'])} | "
              f"{s['check']} |")
    bad = [s for s in shapes if s["check"] != "ok" or s["bench_rc"] != 0 or not s["base"]]
    return 1 if bad else 0


def main():
    argv = sys.argv[1:]
    if "--run" in argv:
        return run(argv)
    return from_logs(argv)


if __name__ == "__main__":
    sys.exit(main())
