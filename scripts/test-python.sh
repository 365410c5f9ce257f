#!/usr/bin/env bash
# Tests the Python binding against a CMake build: a venv in BUILD_DIR/python-venv with
# numpy and pytest from PyPI, the package installed from ./python (bundling that build's
# libroutepack), then pytest on python/tests. Exit 0 only when tests ran and passed.
# ROUTEPACK_TEST_TORCH=1 also installs PyTorch (and megatron-core 0.16.1, for the Megatron
# adapter) from PyPI into that venv (once; pip's cache serves later venvs), so the
# routepack.torch and adapter tests run instead of being skipped.
# Usage: scripts/test-python.sh [BUILD_DIR] [PYTEST_ARGS...]   (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
shift || true
case $build in /*) ;; *) build="$root/$build" ;; esac
lib="$build/core/libroutepack.so"
if [ ! -f "$lib" ]; then
  echo "test-python: $lib not found: build the library first (cmake --build $build)" >&2
  exit 1
fi

venv="$build/python-venv"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c 'import numpy, pytest' 2>/dev/null; then
  "${pip[@]}" install numpy pytest
fi
if [ "${ROUTEPACK_TEST_TORCH:-0}" = 1 ] && ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  start=$(date +%s)
  "${pip[@]}" install torch
  echo "test-python: installed torch from PyPI in $(( $(date +%s) - start )) s"
fi
# With torch, the Megatron adapter's test builds the real PackedSeqParams: megatron-core
# pinned to the release docs/adapters.md names (its only other dependency is packaging;
# about 15 s, and it imports without a GPU).
if [ "${ROUTEPACK_TEST_TORCH:-0}" = 1 ] && ! "$venv/bin/python" -c 'import megatron.core' 2>/dev/null; then
  start=$(date +%s)
  "${pip[@]}" install megatron-core==0.16.1
  echo "test-python: installed megatron-core 0.16.1 from PyPI in $(( $(date +%s) - start )) s"
fi
# Always reinstall: the package bundles the library as it is now in $build.
ROUTEPACK_BUILD_DIR="$build" "${pip[@]}" install --force-reinstall --no-deps "$root/python"
# The in-tree build leaves python/build and the egg-info behind (both git-ignored).
rm -rf "$root/python/build" "$root/python/routepack.egg-info"

export ROUTEPACK_SOURCE_DIR="$root"
export ROUTEPACK_CLI="$build/routepack"
unset ROUTEPACK_LIBRARY
# A sanitizer build's library needs its runtime loaded first; Python itself is not
# instrumented, so leak reports would be Python's, not ours.
sanitize=$(sed -n 's/^RP_SANITIZE:STRING=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
if [[ $sanitize == *address* ]]; then
  export LD_PRELOAD="$(${CC:-cc} -print-file-name=libasan.so)"
  # Last so it wins over a caller's detect_leaks=1 (CI sets it for the C tests).
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0:abort_on_error=1"
  export ROUTEPACK_SANITIZED=1
fi
if [[ $sanitize == *undefined* ]]; then
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
fi

# From the repository root, so that `import routepack` is the installed copy, not ./python.
export ROUTEPACK_TEST_INSTALLED=1
cd "$root"
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider "$@" python/tests
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "test-python: pytest collected no tests" >&2
  exit 1
fi
exit $rc
