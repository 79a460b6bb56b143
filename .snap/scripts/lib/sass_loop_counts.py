#!/usr/bin/env python3
"""Per kernel of a `cuobjdump -sass` listing: HGMMA, WARPSYNC, R2UR, BSSY and SHFL counts, and UDP (uniform-datapath
instructions: opcodes U*, e.g. the ULOP3 / USHF / UIADD3 that build wgmma descriptors), in the whole function and
in its innermost loop that issues wgmma (the smallest span from a backward branch's target to the branch that holds
an HGMMA: the attention consumer's per-KV-block loop). A loop that ptxas takes for divergent shows a WARPSYNC and
R2UR descriptor moves before its GEMM batches; a warp-uniform one has none.

  cuobjdump -sass OBJ | python3 scripts/lib/sass_loop_counts.py [NAME_REGEX]
"""
import re
import subprocess
import sys

KEYS = ("HGMMA", "WARPSYNC", "R2UR", "BSSY", "SHFL")


UNIFORM = re.compile(r"^(?:@!?U?P\w+\s+)?U[A-Z]")


def counts(instrs):
    c = {k: sum(k in t for _, t in instrs) for k in KEYS}
    c["UDP"] = sum(bool(UNIFORM.match(t)) for _, t in instrs)
    return c


def fmt(c):
    return " ".join(f"{k} {c[k]}" for k in KEYS + ("UDP",))


def main():
    pat = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None
    funcs, name = {}, None
    for line in sys.stdin:
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and name is not None:
            funcs[name].append((int(m.group(1), 16), m.group(2)))
    try:
        names = subprocess.run(["c++filt"], input="\n".join(funcs), capture_output=True, text=True).stdout.split("\n")
    except OSError:
        names = list(funcs)
    for (mangled, instrs), pretty in sorted(zip(funcs.items(), names), key=lambda x: x[1]):
        if pat and not pat.search(pretty):
            continue
        inner = None
        for addr, text in instrs:
            m = re.search(r"BRA (?:\S+, )?0x([0-9a-f]+)", text)
            if not m or int(m.group(1), 16) >= addr:
                continue
            body = [x for x in instrs if int(m.group(1), 16) <= x[0] <= addr]
            if any("HGMMA" in t for _, t in body) and (inner is None or len(body) < len(inner)):
                inner = body
        pretty = pretty.replace("tandem::kernels::attn::", "").replace("(AttnKernelParams)", "")
        loop = f"{len(inner)} instructions, {fmt(counts(inner))}" if inner else "none"
        print(f"{pretty}: {fmt(counts(instrs))} | innermost wgmma loop: {loop}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
