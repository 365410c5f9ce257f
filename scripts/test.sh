#!/usr/bin/env bash
# Builds (if needed) and runs RoutePack's test suite: the TAP programs under prove, then
# the Python binding's tests under pytest (in a venv inside the build directory).
# Usage: scripts/test.sh [BUILD_DIR]   (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
case $build in /*) ;; *) build="$root/$build" ;; esac
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" >/dev/null
fi
cmake --build "$build" -j"$(nproc)" >/dev/null
(cd "$build" && prove --failures -j"$(nproc)" tests/)
"$root/scripts/test-python.sh" "$build"
