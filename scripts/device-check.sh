#!/usr/bin/env bash
# RoutePack device check: on a machine with an NVIDIA GPU, in this order:
#   1. calibration: python -m routepack.calibrate writes calibration.json for the model
#      shapes of the bundled configs (at most 3 minutes; docs/calibration.md);
#   2. build with CUDA (and NCCL when found), run every GPU test, the NCCL migration test
#      and the kernel benchmark;
#   3. fidelity: time each (microbatch, GPU) cell of the plans in
#      examples/fidelity/cells-small.json twice (at most 65 s each), then print Kendall tau,
#      MAPE and plan tau against the cost model's predictions, with the defaults and with
#      the fresh calibration, beside the noise floor (the second timing against the first:
#      the tables of docs/results.md's "Measured on CPU"; communication cannot be measured
#      on one GPU: compute only);
#   4. the torch example on one GPU (torchrun --nproc-per-node 1, NCCL).
#   5. Megatron-Core's MoE layer (examples/megatron/train_moe.py) on one GPU, SequentialMLP
#      and, where transformer_engine imports, TEGroupedMLP: final losses against contiguous.
# Prints every figure. Finishes within 10 minutes: every step's limit is cut to what is
# left of one budget. Sections 1, 3 and 4 need python3 with torch and numpy (the image's).
# calibration.json, its detail and the fidelity files land in BUILD_DIR, and in $OUT too
# when that is set (the device tool brings $OUT back).
#
# Dependencies on a bare, offline GPU machine. The build needs LuaJIT and jansson
# (and pkg-config to find them); a GPU machine with only the CUDA toolkit lacks them.
# We carry Debian's packages instead of building a reduced library, so that the NCCL
# migration test (which needs the whole library) runs too:
#   1. here, with Debian's apt:      scripts/device-check.sh --fetch-deps
#      downloads libluajit-5.1-2/-dev/-common, libjansson4/-dev, pkgconf, pkgconf-bin and
#      libpkgconf3 with `apt-get download` into build-deps/ and unpacks them with
#      `dpkg-deb -x` into build-deps/prefix (about 4 MB; build*/ is git-ignored).
#   2. there:                        scripts/device-check.sh
#      (with the device tool: carry ["build-deps"]). When pkg-config finds luajit and
#      jansson on the machine, the prefix is not used; otherwise the script points
#      pkg-config (the machine's, or the carried pkgconf) at build-deps/prefix, after
#      rewriting the .pc files' prefix; it unpacks build-deps/*.deb itself (dpkg-deb,
#      or ar + tar) when only the .debs travelled. Debian 12's libraries need glibc 2.34.
# NCCL: the CUDA toolkit's, else the one PyTorch's wheels bring (python3 -c 'import
# nvidia.nccl'), else none (the NCCL test then skips and says so).
#
# Usage: scripts/device-check.sh [--fetch-deps] [BUILD_DIR]   (default build-device)
# Exit status: 0 everything ran and passed, or no GPU (it says "no NVIDIA GPU" and
# checks nothing); 1 the build failed or a tool is missing; 2 a test, the benchmark, the
# calibration, the fidelity check or the torch example failed (the summary names it).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/build-deps"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
# The whole check must end within 10 minutes: every step's limit is cut to what is left
# of this budget (570 s, a margin for the summary), so the sum can never exceed it.
budget=${RP_DEVICE_CHECK_BUDGET:-570}
# The build, tests and benchmark leave `reserve` seconds of it to the fidelity check and the
# torch example (RP_DEVICE_CHECK_RESERVE, default 210).
reserve=0
left() { # left LIMIT: the smaller of LIMIT and the seconds left of the budget (at least 1)
  local rest=$((budget - reserve - $(elapsed)))
  [ "$rest" -lt 1 ] && rest=1
  [ "$1" -lt "$rest" ] && echo "$1" || echo "$rest"
}
say() { printf '== %s\n' "$*"; }

debs="libluajit-5.1-2 libluajit-5.1-dev libluajit-5.1-common libjansson4 libjansson-dev pkgconf pkgconf-bin libpkgconf3"

unpack_debs() { # unpack every .deb of $deps into $deps/prefix
  mkdir -p "$deps/prefix"
  local f
  for f in "$deps"/*.deb; do
    [ -e "$f" ] || continue
    if command -v dpkg-deb >/dev/null 2>&1; then
      dpkg-deb -x "$f" "$deps/prefix" || return 1
    else # a .deb is an ar archive holding data.tar.*
      local tmp
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$f" && tar -xf data.tar.* -C "$deps/prefix") || { rm -rf "$tmp"; return 1; }
      rm -rf "$tmp"
    fi
  done
}

if [ "${1:-}" = "--fetch-deps" ]; then
  command -v apt-get >/dev/null || { echo "device-check: --fetch-deps needs Debian's apt-get" >&2; exit 1; }
  # the GPU machine is x86-64: packages of another architecture would not load there
  arch_here=$(dpkg --print-architecture 2>/dev/null || echo unknown)
  [ "$arch_here" = amd64 ] || { echo "device-check: this machine's packages are $arch_here; fetch on an amd64 Debian 12 machine" >&2; exit 1; }
  rm -rf "$deps" && mkdir -p "$deps"
  # shellcheck disable=SC2086
  (cd "$deps" && apt-get download $debs) || { echo "device-check: apt-get download failed" >&2; exit 1; }
  unpack_debs || { echo "device-check: unpacking failed" >&2; exit 1; }
  say "fetched into $deps ($(du -sh "$deps" | cut -f1)); carry it to the GPU machine (device tool: carry [\"build-deps\"])"
  exit 0
fi

build=${1:-build-device}
case $build in /*) ;; *) build="$root/$build" ;; esac

# ---- 1. is there a GPU? --------------------------------------------------------------
gpu_line=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_line=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
  [ -n "$gpu_line" ] || gpu_line=$(nvidia-smi -L 2>/dev/null | head -n 1)
fi
if [ -z "$gpu_line" ] && ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  gpu_line="(a /dev/nvidia device; nvidia-smi not available)"
fi
if [ -z "$gpu_line" ]; then
  say "device-check: no NVIDIA GPU on this machine (no nvidia-smi GPU, no /dev/nvidia*): nothing to check."
  say "Run it on a GPU machine (see the top of scripts/device-check.sh); the CPU tests run with scripts/test.sh."
  exit 0
fi
say "GPU: $gpu_line"
mkdir -p "$build"
failed=()
py=${PYTHON:-python3}
keep() { # copy result files into $OUT when the device tool gave one
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && cp -f "$@" "$OUT"/ 2>/dev/null
  return 0
}
have_torch=0
if torch_line=$("$py" -c 'import numpy, torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.is_available())' 2>&1); then
  have_torch=1
  say "python: $("$py" --version 2>&1), $torch_line"
else
  say "python: $py cannot import numpy and torch: calibration, fidelity and the torch example cannot run"
  printf '%s\n' "$torch_line" | tail -n 3 | sed 's/^/  /'
  failed+=("python with torch and numpy (missing)")
fi

# ---- calibration (first, at most 180 s) ------------------------------------------------
calibration="$build/calibration.json"
if [ $have_torch = 1 ]; then
  say "calibration: python -m routepack.calibrate (at most 180 s)"
  cal_configs=()
  for c in "$root"/examples/config-*.json; do cal_configs+=(--config "$c"); done
  rm -f "$calibration"
  cal_limit=$(left 180)
  (cd "$root" && PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" timeout "$cal_limit" "$py" -m routepack.calibrate \
     "${cal_configs[@]}" --out "$calibration" --detail "$build/calibration-detail.json" \
     --budget-s $((cal_limit > 20 ? cal_limit - 15 : 5)))
  rc=$?
  keep "$calibration" "$build/calibration-detail.json"
  if [ $rc -ne 0 ]; then
    failed+=("calibration (exit $rc)")
  else
    say "calibration: wrote $calibration ($(elapsed) s so far)"
  fi
fi

reserve=${RP_DEVICE_CHECK_RESERVE:-210}
# ---- 2. toolchain ----------------------------------------------------------------------
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; }
[ -n "$nvcc" ] || { say "device-check: nvcc not found (PATH or /usr/local/cuda/bin): cannot build the kernels"; exit 1; }
command -v cmake >/dev/null || { say "device-check: cmake not found"; exit 1; }
cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
say "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*' | head -n 1)); $(cmake --version | head -n 1)"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
case $arch in [0-9][0-9]|[0-9][0-9][0-9]) ;; *) arch=90 ;; esac

# ---- 3. LuaJIT and jansson -------------------------------------------------------------
cmake_args=()
# RP_DEVICE_CHECK_CARRIED=1 uses build-deps/ and its pkgconf even where the machine has
# its own (to test the carried path on a machine that has the packages).
carried=${RP_DEVICE_CHECK_CARRIED:-0}
pc_found() { "${PKG_CONFIG:-pkg-config}" --exists luajit jansson 2>/dev/null; }
if [ "$carried" != 1 ] && command -v pkg-config >/dev/null && pc_found; then
  say "LuaJIT and jansson: from this machine"
else
  if [ ! -d "$deps/prefix/usr" ] && ls "$deps"/*.deb >/dev/null 2>&1; then
    say "unpacking the carried .debs into $deps/prefix"
    unpack_debs || { say "device-check: could not unpack $deps/*.deb"; exit 1; }
  fi
  if [ ! -d "$deps/prefix/usr" ]; then
    say "device-check: LuaJIT and jansson are missing and no build-deps/ travelled."
    say "Run 'scripts/device-check.sh --fetch-deps' on a Debian machine and carry build-deps/."
    exit 1
  fi
  prefix="$deps/prefix/usr"
  libdir=$(dirname "$(find "$prefix"/lib -maxdepth 2 -name 'libjansson.so*' 2>/dev/null | head -n 1)")
  pcdir="$build/pkgconfig"
  mkdir -p "$pcdir"
  for pc in "$libdir"/pkgconfig/luajit.pc "$libdir"/pkgconfig/jansson.pc; do
    sed "s|^prefix=.*|prefix=$prefix|" "$pc" >"$pcdir/$(basename "$pc")"
  done
  export PKG_CONFIG_PATH="$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ "$carried" = 1 ] || ! command -v pkg-config >/dev/null; then
    export PKG_CONFIG="$prefix/bin/pkgconf"
    cmake_args+=("-DPKG_CONFIG_EXECUTABLE=$PKG_CONFIG")
  fi
  pc_found || { say "device-check: pkg-config does not find the carried luajit and jansson ($pcdir)"; exit 1; }
  say "LuaJIT and jansson: carried, $prefix"
fi

# ---- 4. NCCL -----------------------------------------------------------------------------
if [ -e "$cuda_home/include/nccl.h" ] || [ -e /usr/include/nccl.h ]; then
  say "NCCL: the system's"
else
  # PyTorch's nvidia-nccl-cu12/-cu13 wheel: nvidia/nccl/{include,lib} (or under nvidia/cu13/)
  nv_dir=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  nccl_h="" nccl_lib=""
  if [ -n "$nv_dir" ]; then
    nccl_h=$(find "$nv_dir" -maxdepth 4 -name nccl.h 2>/dev/null | head -n 1)
    nccl_lib=$(find "$nv_dir" -maxdepth 4 -name 'libnccl.so*' 2>/dev/null | head -n 1)
  fi
  if [ -n "$nccl_h" ] && [ -n "$nccl_lib" ]; then
    cmake_args+=("-DNCCL_INCLUDE_DIR=$(dirname "$nccl_h")" "-DNCCL_LIBRARY=$nccl_lib")
    nccl_libdir=$(dirname "$nccl_lib")
    export LD_LIBRARY_PATH="$nccl_libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "NCCL: from the Python wheel, $nccl_lib"
  else
    say "NCCL: not found (the NCCL migration test will skip)"
  fi
fi

# ---- 5. build ------------------------------------------------------------------------------
gen=() # Ninja for a new build directory when there is one; an existing one keeps its own
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
say "configuring $build (sm_$arch)"
if ! timeout "$(left 120)" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DRP_WITH_MPI=OFF \
     -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch" "${cmake_args[@]}" >"$build/configure.log" 2>&1; then
  tail -n 30 "$build/configure.log"
  say "device-check: configure failed (log: $build/configure.log)"
  exit 1
fi
grep -E '^-- +(CUDA|NCCL|LuaJIT|jansson) ' "$build/configure.log"
grep -q 'CUDA        ON' "$build/configure.log" || { say "device-check: CMake did not enable CUDA"; exit 1; }
targets=(routepack routepack_cli) # the library and the CLI: the Python binding and the fidelity score
for t in test_gpu_stats test_gpu_kernels test_migrate_nccl test_remap test_checksum bench_gpu; do
  if [ -f "$root/tests/$t.c" ] || [ -f "$root/tests/bench/$t.c" ]; then targets+=("$t"); fi
done
say "building ${targets[*]} ($(elapsed) s so far)"
jobs=${RP_DEVICE_CHECK_JOBS:-$(nproc 2>/dev/null || echo 8)}
if ! timeout "$(left 200)" cmake --build "$build" -j"$jobs" --target "${targets[@]}" >"$build/build.log" 2>&1; then
  grep -E 'error|Error' "$build/build.log" | head -n 30
  say "device-check: build failed (log: $build/build.log)"
  exit 1
fi

# ---- 6. tests -------------------------------------------------------------------------------
run_tap() { # run one TAP program, print it, judge it
  local name=$1 exe=$2 limit=$3 out rc
  [ -x "$exe" ] || return 0
  say "$name"
  out=$(cd "$build" && timeout "$(left "$limit")" "$exe" 2>&1)
  rc=$?
  printf '%s\n' "$out" | sed 's/^/  /'
  if [ $rc -ne 0 ] || printf '%s\n' "$out" | grep -q '^not ok'; then
    failed+=("$name (exit $rc)")
  elif [ "$name" != test_remap ] && [ "$name" != test_checksum ] && printf '%s\n' "$out" | grep -q '# SKIP no GPU'; then
    failed+=("$name (skipped its GPU checks on a GPU machine)")
  fi
  say "$name: $(printf '%s\n' "$out" | grep -c '^ok') ok, $(printf '%s\n' "$out" | grep -c '^not ok') not ok, $(printf '%s\n' "$out" | grep -c '# SKIP') skipped, exit $rc"
}
for t in test_gpu_stats test_gpu_kernels test_migrate_nccl test_remap test_checksum; do
  run_tap "$t" "$build/tests/$t.t" 90
done

# ---- 7. benchmark ----------------------------------------------------------------------------
say "bench_gpu ($(elapsed) s so far)"
if [ -x "$build/bench/bench_gpu" ]; then
  bench_out=$(cd "$build" && timeout "$(left 150)" "$build/bench/bench_gpu" 2>&1)
  rc=$?
  printf '%s\n' "$bench_out"
  if [ $rc -ne 0 ]; then
    failed+=("bench_gpu (exit $rc)")
  elif printf '%s\n' "$bench_out" | grep -q 'no GPU'; then
    failed+=("bench_gpu (saw no GPU on a GPU machine)")
  fi
else
  failed+=("bench_gpu (not built)")
fi

# ---- 8. fidelity (at most 2 x 65 s of timing) ----------------------------------------------
# The cells timed twice, as docs/results.md's "Measured on CPU" times its own: the second
# measurement is the noise floor (test-retest tau and MAPE) printed beside the model's
# cell tau, MAPE and plan tau (fidelity score --retest).
reserve=0
export ROUTEPACK_LIBRARY="$build/core/libroutepack.so" ROUTEPACK_CLI="$build/routepack"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
cells="$root/examples/fidelity/cells-small.json"
measured="$build/fidelity-measured.json"
retest="$build/fidelity-retest.json"
if [ $have_torch = 1 ]; then
  rm -f "$measured" "$retest"
  for out in "$measured" "$retest"; do
    say "fidelity: timing the cells of $(basename "$cells") into $(basename "$out") ($(elapsed) s so far)"
    fid_limit=$(left 65)
    (cd "$root" && timeout "$fid_limit" "$py" -m routepack.fidelity measure --cells "$cells" --out "$out" \
       --budget-s $((fid_limit > 20 ? fid_limit - 10 : 5)))
    rc=$?
    keep "$out"
    [ $rc -ne 0 ] && failed+=("fidelity measure $(basename "$out") (exit $rc)")
  done
  if [ -f "$measured" ]; then
    floor=()
    [ -f "$retest" ] && floor=(--retest "$retest")
    say "fidelity with the default hardware figures (the predictions in the cells file)"
    (cd "$root" && timeout "$(left 30)" "$py" -m routepack.fidelity score --cells "$cells" --measured "$measured" \
       "${floor[@]}" --config examples/config-small.json --trace examples/small.rpt \
       --json "$build/fidelity-default.json") || failed+=("fidelity score, defaults")
    if [ -f "$calibration" ]; then
      say "fidelity after calibration (config-small.json + $(basename "$calibration"))"
      (cd "$root" && timeout "$(left 30)" "$py" -m routepack.fidelity score --cells "$cells" --measured "$measured" \
         "${floor[@]}" --config examples/config-small.json --trace examples/small.rpt --calibration "$calibration" \
         --json "$build/fidelity-calibrated.json") || failed+=("fidelity score, calibrated")
    fi
    keep "$build/fidelity-default.json" "$build/fidelity-calibrated.json"
  fi
fi

# ---- 9. the torch example on one GPU -----------------------------------------------------------
if [ $have_torch = 1 ]; then
  say "torch example: torchrun --nproc-per-node 1 examples/torch/train_moe.py ($(elapsed) s so far)"
  ex_out=$(cd "$root" && timeout "$(left 90)" "$py" -m torch.distributed.run --nproc-per-node 1 \
           examples/torch/train_moe.py --steps 6 2>&1)
  rc=$?
  printf '%s\n' "$ex_out" | tail -n 20 | sed 's/^/  /'
  if [ $rc -ne 0 ] || ! printf '%s\n' "$ex_out" | grep -q '^final loss'; then
    failed+=("torch example (exit $rc)")
  fi
fi

# ---- 10. Megatron-Core's own MoE layer on one GPU ------------------------------------------------
# examples/megatron/train_moe.py under NCCL: SequentialMLP and, where Transformer Engine
# imports, TEGroupedMLP (whose weight{i} layout expert_pieces maps; never run on CPU), each
# with token_kk+eplb (replicas in the spare slot, migrations) against token_kk+contiguous:
# the final losses must agree to 1e-5.
if [ $have_torch = 1 ] && "$py" -c 'import megatron.core' 2>/dev/null; then
  specs=local
  if "$py" -c 'import transformer_engine.pytorch' 2>/dev/null; then specs="local te"; fi
  for spec in $specs; do
    losses=()
    for policy in token_kk+eplb token_kk+contiguous; do
      say "megatron example: --spec $spec --policy $policy ($(elapsed) s so far)"
      meg_out=$(cd "$root" && timeout "$(left 30)" "$py" -m torch.distributed.run --nproc-per-node 1 \
                examples/megatron/train_moe.py --steps 3 --spec "$spec" --policy "$policy" 2>&1)
      rc=$?
      printf '%s\n' "$meg_out" | grep -E '^(step|final)' | sed 's/^/  /'
      losses+=("$(printf '%s\n' "$meg_out" | sed -n 's/^final loss //p')")
      [ $rc -eq 0 ] || failed+=("megatron example --spec $spec --policy $policy (exit $rc)")
    done
    if ! "$py" -c 'import sys; a, b = map(float, sys.argv[1:3]); sys.exit(abs(a - b) > 1e-5 * abs(b))' \
         "${losses[0]:-nan}" "${losses[1]:-nan}"; then
      failed+=("megatron example --spec $spec: final losses differ (${losses[0]:-none} vs ${losses[1]:-none})")
    fi
  done
else
  say "megatron example: skipped (megatron.core does not import)"
fi

say "done in $(elapsed) s"
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]}"
  exit 2
fi
say "all GPU checks passed"
exit 0
