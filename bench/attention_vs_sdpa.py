#!/usr/bin/env python3
"""Ratios of attention_bench's rows to torch SDPA's (bench/sdpa_baseline.py --json) timed in the same device call.

For every (seq, causal) of the bench log: each tandem configuration's TFLOP/s and its ratio to the faster layout of
cuDNN and of flash, the default configuration (the first row of the shape) marked unless --no-default (a log of
--variants all, which need not start with the default). Lines "| ... |" (markdown).

  python3 bench/attention_vs_sdpa.py [--no-default] BENCH_LOG SDPA_JSON [BENCH_LOG ...]
"""
import json
import re
import sys

ROW = re.compile(r"^RESULT seq=(\d+) causal=(\d) config=(\S+) median_ms=([\d.]+) .* tflops=([\d.]+) .* (ok|WRONG)$")


def main():
    args = sys.argv[1:]
    mark = "--no-default" not in args
    args = [a for a in args if a != "--no-default"]
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
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
        for line in lines:
            m = ROW.match(line.strip())
            if not m:
                continue
            seq, causal, config, tf, check = int(m[1]), m[2] == "1", m[3], float(m[5]), m[6]
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


if __name__ == "__main__":
    sys.exit(main())
