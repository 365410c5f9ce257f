#!/usr/bin/env bash
# Rewrite the example outputs in docs/*.md and README.md with what the tool prints now.
# Usage: scripts/regen-docs.sh [--check] [BUILD_DIR]   (default build; builds it first)
# --check changes nothing and exits 1 when a doc is out of date (wall times masked);
# CI checks the same through python/tests/test_docs_examples.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
check=()
if [ "${1:-}" = "--check" ]; then check=(--check); shift; fi
build=${1:-build}
case $build in /*) ;; *) build="$root/$build" ;; esac
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" >/dev/null
cmake --build "$build" -j"$(nproc)" --target routepack_cli >/dev/null
exec python3 "$root/scripts/regen_docs.py" "${check[@]}" "$build/routepack"
