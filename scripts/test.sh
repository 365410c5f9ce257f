#!/usr/bin/env bash
# Builds (if needed) and runs RoutePack's test suite: the TAP programs under prove, then
# the Python binding's tests under pytest (in a venv inside the build directory; the
# routepack.torch tests run whenever torch is importable there, and
# ROUTEPACK_TEST_TORCH=1 installs it). After prove's and pytest's own closing lines, one
# summary names what was skipped and why (no GPU, no torch, no Chromium, ...) with the
# command that would run it (scripts/test_summary.py). Exits with prove's status when
# the TAP programs fail, else with pytest's.
# Usage: scripts/test.sh [BUILD_DIR]   (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_arg=${1:-build}
build=$build_arg
case $build in /*) ;; *) build="$root/$build" ;; esac
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" >/dev/null
fi
cmake --build "$build" -j"$(nproc)" >/dev/null
# each TAP program's output, kept for the summary (scripts/tap-log.sh)
logs="$build/test-logs"
rm -rf "$logs"
mkdir -p "$logs"
export RP_TAP_LOG_DIR="$logs"
set +e
(cd "$build" && prove --failures -j"$(nproc)" --exec "$root/scripts/tap-log.sh" tests/)
rc=$?
if [ $rc -eq 0 ]; then
  "$root/scripts/test-python.sh" "$build" --junitxml="$logs/pytest.xml"
  rc=$?
fi
set -e
python3 "$root/scripts/test_summary.py" "$logs" "$build_arg" || true
exit $rc
