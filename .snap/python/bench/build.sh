#!/usr/bin/env bash
# Builds the per-call overhead comparison into OUTDIR: the C baseline (against libtandem's header; it links the
# library given), the no-op stand-ins (libtandem_noop.so) and, where pybind11 is importable by PYTHON, the pybind11
# floor module.
# usage: python/bench/build.sh LIBTANDEM OUTDIR [PYTHON]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
lib=$1; out=$2; py=${3:-python3}
mkdir -p "$out"
cc -O2 -std=c11 -I"$repo/client/include" "$here/overhead_baseline.c" "$lib" -Wl,-rpath,"$(dirname "$lib")" \
   -o "$out/overhead_baseline"
cc -O2 -std=c11 -shared -fPIC "$here/overhead_noop.c" -o "$out/libtandem_noop.so"
if inc=$("$py" -m pybind11 --includes 2>/dev/null); then
  ext=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  # shellcheck disable=SC2086
  c++ -O2 -std=c++17 -shared -fPIC $inc -I"$repo/client/include" "$here/overhead_pybind.cpp" -ldl \
      -o "$out/tandem_overhead_pybind$ext"
else
  echo "build.sh: pybind11 is not importable by $py; the comparison runs without the pybind11 row" >&2
fi
