#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (when present) and runs each for a bounded number of inputs.
# Exits 77 (CTest: Skipped) without clang or libFuzzer; the seeded randomized tests in tests/unit cover those hosts.
set -euo pipefail
src="$1"; out="$2"; runs="${3:-200000}"
command -v clang++ >/dev/null || { echo "SKIPPED fuzzers: clang++ not found; install clang to run them"; exit 77; }
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -I"$src/common/include" -I"$src/client/include")
common=("$src/common/src/error.cpp" "$src/common/src/descriptor.cpp" "$src/common/src/op_spec.cpp")
if ! clang++ "${flags[@]}" "$src/tests/fuzz/frame_fuzzer.cpp" "$src/common/src/framing.cpp" "$src/common/src/fd.cpp" \
      "${common[@]}" -lfmt -o "$out/frame_fuzzer" 2>"$out/build.log"; then
  if grep -q "libclang_rt.fuzzer" "$out/build.log"; then echo "SKIPPED fuzzers: libFuzzer runtime missing"; exit 77; fi
  cat "$out/build.log"; exit 1
fi
clang++ "${flags[@]}" "$src/tests/fuzz/descriptor_fuzzer.cpp" "$src/common/src/validate.cpp" "${common[@]}" -lfmt \
  -o "$out/descriptor_fuzzer"
for f in frame_fuzzer descriptor_fuzzer; do
  echo "== $f: $runs inputs (seed 1)"
  "$out/$f" -runs="$runs" -seed=1 -max_len=2048 2>&1 | tail -n 2
done
