#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, clang, ASan + UBSan, RP_FUZZ=ON), replays
# every seed corpus (tests/fuzz/corpus/<harness>: the seeds and every crash input kept as
# a regression), then fuzzes each harness for its share of the time left. Any crash, leak,
# UB report, timeout or out-of-memory fails the run with the input's path and the report.
# Usage: scripts/fuzz.sh [SECONDS] [BUILD_DIR]
#   SECONDS    wall-clock budget for the whole run, build included (default 180). The time
#              left after the build and the replay is split evenly across the harnesses,
#              RP_FUZZ_JOBS at a time (default: CPUs), at least RP_FUZZ_MIN_S (default 5)
#              seconds each, so a slow build makes the run longer rather than skip fuzzing.
#   BUILD_DIR  default build-fuzz
# Environment: CC (default clang, else clang-14), RP_FUZZ_ONLY (space-separated harness
# names), RP_FUZZ_TIMEOUT_S (one input, default 25, or the harness's tests/fuzz/<h>.timeout:
# fuzz_policy's is 3 s, 10 x its 0.3 s wall-time limit), RP_FUZZ_RSS_MB (default 2048; also the
# largest single allocation). New corpus entries go to BUILD_DIR/fuzz/work/<harness>;
# crash inputs to BUILD_DIR/fuzz/artifacts/. docs/fuzzing.md has the release run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
budget=${1:-180}
build=${2:-build-fuzz}
case $build in /*) ;; *) build="$root/$build" ;; esac
start=$(date +%s)
jobs=${RP_FUZZ_JOBS:-$(nproc)}
min_s=${RP_FUZZ_MIN_S:-5}
timeout_s=${RP_FUZZ_TIMEOUT_S:-25}
rss_mb=${RP_FUZZ_RSS_MB:-2048}
if [ -z "${CC:-}" ]; then
  if command -v clang >/dev/null; then CC=clang; else CC=clang-14; fi
fi
export CC

echo "== fuzz: build ($CC, ASan + UBSan, RP_FUZZ=ON) in $build"
cmake -S "$root" -B "$build" -DRP_FUZZ=ON -DRP_WERROR=ON -DRP_WITH_CUDA=OFF -DRP_WITH_MPI=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target fuzz >/dev/null
built=$(date +%s)
echo "   built in $((built - start)) s"

harnesses=${RP_FUZZ_ONLY:-$(cd "$build/fuzz" && ls fuzz_* | sort)}
count=$(echo "$harnesses" | wc -w)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=0}
# Debian's llvm-14 has llvm-symbolizer only under a versioned name: name it, so reports
# show functions and lines.
if ! command -v llvm-symbolizer >/dev/null && [ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
artifacts="$build/fuzz/artifacts"
mkdir -p "$artifacts" "$build/fuzz/logs"

# Common flags; a harness's dictionary (tests/fuzz/<harness>.dict) when it has one.
flags() {
  local h=$1
  # a harness's own per-input timeout (tests/fuzz/<harness>.timeout, seconds) wins unless
  # RP_FUZZ_TIMEOUT_S is set: fuzz_policy's is 10 x its wall-time limit (0.3 s)
  local t=$timeout_s
  if [ -z "${RP_FUZZ_TIMEOUT_S:-}" ] && [ -f "$root/tests/fuzz/$h.timeout" ]; then t=$(cat "$root/tests/fuzz/$h.timeout"); fi
  local f=(-timeout="$t" -rss_limit_mb="$rss_mb" -artifact_prefix="$artifacts/$h-" -print_final_stats=1)
  if [ -f "$root/tests/fuzz/$h.dict" ]; then f+=(-dict="$root/tests/fuzz/$h.dict"); fi
  echo "${f[@]}"
}

failed=0
report() {
  echo "!! fuzz: $1 failed; its log ($2):" >&2
  grep -E "ERROR|SUMMARY|fuzz:|Test unit written|^    #" "$2" | head -40 >&2 || true
  tail -5 "$2" >&2
  failed=1
}

echo "== fuzz: replay the corpora"
for h in $harnesses; do
  log="$build/fuzz/logs/$h.replay.log"
  # shellcheck disable=SC2046
  if ! "$build/fuzz/$h" $(flags "$h") -runs=0 "$root/tests/fuzz/corpus/$h" >"$log" 2>&1; then
    report "$h (replay)" "$log"
  fi
done
if [ "$failed" -ne 0 ]; then exit 1; fi

now=$(date +%s)
rounds=$(((count + jobs - 1) / jobs))
# libFuzzer's start-up and final corpus pass take a second or two a round beyond
# -max_total_time: keep that, and 5 s, out of the share.
left=$((budget - (now - start) - 5 - 2 * rounds))
per=$((left / rounds))
if [ "$per" -lt "$min_s" ]; then
  echo "   $left s left of the $budget s budget: fuzzing each harness the minimum $min_s s"
  per=$min_s
fi
echo "== fuzz: $count harnesses, $per s each, $jobs at a time"
pids=()
names=()
run_one() {
  local h=$1 work="$build/fuzz/work/$1"
  mkdir -p "$work"
  # shellcheck disable=SC2046
  "$build/fuzz/$h" $(flags "$h") -max_total_time="$per" "$work" "$root/tests/fuzz/corpus/$h" \
    >"$build/fuzz/logs/$h.log" 2>&1
}
for h in $harnesses; do
  run_one "$h" &
  pids+=($!)
  names+=("$h")
  if [ "${#pids[@]}" -ge "$jobs" ]; then
    if ! wait "${pids[0]}"; then report "${names[0]}" "$build/fuzz/logs/${names[0]}.log"; fi
    pids=("${pids[@]:1}")
    names=("${names[@]:1}")
  fi
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then report "${names[$i]}" "$build/fuzz/logs/${names[$i]}.log"; fi
done
for h in $harnesses; do
  runs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$build/fuzz/logs/$h.log" | tail -1 | grep -oE "[0-9]+$" || echo "?")
  echo "   $h: $runs inputs"
done
end=$(date +%s)
echo "== fuzz: done in $((end - start)) s (build $((built - start)) s)"
if [ "$failed" -ne 0 ]; then
  echo "!! fuzz: a harness failed; the input is in $artifacts (replay: BUILD/fuzz/HARNESS INPUT)" >&2
  exit 1
fi
