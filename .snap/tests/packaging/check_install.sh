#!/usr/bin/env bash
# Installs the build tree into a temporary prefix (cmake --install) and builds a small consumer against it twice:
# with CMake's find_package(tandem) and with pkg-config (tandem.pc); runs both. CTest: packaging_consumer.
#   check_install.sh BUILD_DIR CONSUMER_SOURCE_DIR
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" > "$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
for f in include/tandem/tandem.h include/tandem/tandem.hpp; do
  [[ -f $prefix/$f ]] || { echo "FAIL: $f was not installed"; exit 1; }
done
pc=$(find "$prefix" -name tandem.pc | head -1)
config=$(find "$prefix" -name tandemConfig.cmake | head -1)
[[ -n $pc ]] || { echo "FAIL: no tandem.pc under $prefix"; exit 1; }
[[ -n $config ]] || { echo "FAIL: no tandemConfig.cmake under $prefix"; exit 1; }
libdir=$(dirname "$(find "$prefix" -name 'libtandem.so*' | head -1)")

echo "== find_package(tandem)"
cmake -S "$src" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release > "$tmp/cmake.log" 2>&1 \
  || { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake-build" > "$tmp/cmake-build.log" 2>&1 || { cat "$tmp/cmake-build.log"; exit 1; }
"$tmp/cmake-build/consumer_c"
"$tmp/cmake-build/consumer_cxx"

echo "== pkg-config tandem"
export PKG_CONFIG_PATH=$(dirname "$pc")
echo "pkg-config --cflags --libs tandem: $(pkg-config --cflags --libs tandem)"
[[ $(pkg-config --modversion tandem) == "$(sed -n 's/^Version: //p' "$pc")" ]]
# shellcheck disable=SC2046
cc -o "$tmp/consumer_pc" "$src/main.c" $(pkg-config --cflags --libs tandem)
# shellcheck disable=SC2046
c++ -std=c++17 -o "$tmp/consumer_pc_cxx" "$src/main.cpp" $(pkg-config --cflags --libs tandem)
LD_LIBRARY_PATH=$libdir "$tmp/consumer_pc"
LD_LIBRARY_PATH=$libdir "$tmp/consumer_pc_cxx"
echo "PASS: an installed tree serves find_package(tandem) and pkg-config"
