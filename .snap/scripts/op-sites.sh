#!/usr/bin/env bash
# Where one op is written outside its own kernel files: the places a new op like it touches.
# Usage: scripts/op-sites.sh REGEX [OWN_REGEX]
#   REGEX      the op's identifiers, e.g. 'RingAttention|ringAttention|ring_attention|ring-attention'
#   OWN_REGEX  paths that are the op's own files (its kernels, its own GPU test), left out of the count
# A site is a run of matching lines in one file with no gap over 10 lines. Files are grouped as production
# (common/ client/ daemon/ kernels/ python/tandem/ and CMakeLists), tests (tests/) and docs (README, docs/);
# history (CHANGELOG.md, bench/RESULTS.md) and the GPU run scripts are not places an op must be added to.
set -euo pipefail
cd "$(dirname "$0")/.."
re=$1
own=${2:-'^$'}
git ls-files | grep -Ev '^(CHANGELOG.md|bench/RESULTS.md|scripts/)' | grep -Ev "$own" |
  grep -E '\.(cpp|hpp|h|cu|cuh|c|py|md|txt)$' | while read -r f; do
    lines=$(grep -nE "$re" "$f" | cut -d: -f1 || true)
    [ -z "$lines" ] && continue
    sites=0 prev=-100
    for l in $lines; do
      [ $((l - prev)) -gt 10 ] && sites=$((sites + 1))
      prev=$l
    done
    case $f in
      tests/*) group=tests ;;
      README.md|docs/*|*/README.md) group=docs ;;
      *) group=production ;;
    esac
    echo "$group $sites $f"
  done | sort | awk '{ print; n[$1] += $2; f[$1]++ } END {
    for (g in n) printf "total %-10s %3d sites in %2d files\n", g, n[g], f[g] }'
