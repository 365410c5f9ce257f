#!/usr/bin/env bash
# Produce docs/results.md and README.md's Results section from measurements, in one go:
#   1. `routepack simulate --json` on the bundled example and on generated traces of the
#      small scale (examples/gen-results-small.json) with seeds the defaults were not tuned
#      on (21: 8 steps, 22: 24 steps), every default policy, compared against the best
#      baseline on step + migration (docs/cli.md);
#   1c. both execution.sync settings with and without overlap on a config of 4 EP groups
#      (scripts/results/structure.py: section-structure.md);
#   1d. the parallel layouts of issue 19 (LAYOUTS below: config-qwen3-30b-tp4.json, TP 4,
#      EP 8, ETP 1; config-qwen3-30b-pp2.json, the same with PP 2 x VPP 2 interleaved;
#      config-qwen3-30b-cp2.json, TP 2 x CP 2 on long rollouts (gen-qwen3-30b-long.json);
#      config-qwen3-30b-tp4-mb4.json, TP 4 with 4 mini-batches a rollout batch;
#      config-deepseek-v3-pp.json, EP 64 over 8 nodes, PP 4; config-qwen3-30b-slime.json,
#      slime's own recipe on one node, where slime's packing joins the baselines), each on its generated batch
#      with seeds 1 and 2, every default policy (scripts/results/layouts.py:
#      section-tp-pp-layouts.md);
#   1e. the planner against the per-forward balancer (issue 35; PLANNER below: 8 GPUs in
#      one EP group, 64 GPUs in 8 EP groups, EP 64 across 8 nodes), on unseen seeds,
#      routepack with and without the balancer's candidate (scripts/results/planner.py:
#      section-vs-balancer.md); --planner runs it alone and splices its section in;
#   2. the horizon and persistence sweep the routepack policy's defaults were chosen by
#      (tuning seed 11: 2, 8 and 24 steps, and the bundled example): routepack with its
#      params set otherwise, as policy files in the work folder (novx: without the
#      per-forward balancer's candidate);
#   3. optionally the single-step benchmark (tests/bench/bench_policies --markdown);
#   4. the planning overhead per rank (tests/bench/bench_overhead --json, issue 16);
#   then scripts/results.py renders the figures into the two files.
# Other issues add a section by adding a step here that writes markdown to
# $work/section-NAME.md (appended in name order), or a renderer in scripts/results.py
# (SECTIONS there).
#
# Usage: scripts/results.sh [--quick] [--reference] [--bench small|all|none] [BUILD_DIR]
#        scripts/results.sh --layouts [BUILD_DIR]
#        scripts/results.sh --planner [BUILD_DIR]
#        scripts/results.sh --fidelity [BUILD_DIR]
#        scripts/results.sh --overhead [BUILD_DIR]
#   --layouts    step 1d alone (minutes a layout): its section replaces (or joins)
#                the one in the existing docs/results.md, where a full run puts it
#                (scripts/results.py --splice); every other section stays as it is
#   --planner    step 1e alone (minutes), spliced in as --layouts is
#   --fidelity   "Measured on CPU" (issue 30) alone, spliced in as --layouts is: the
#                fidelity check on the CPU substrate (docs/calibration.md), the cells of
#                examples/cpu timed twice on two pinned one-thread workers
#                (scripts/results/cpu_fidelity.py; 10-30 minutes, more under load); needs
#                torch ($PYTHON, default BUILD_DIR/python-venv/bin/python)
#   --overhead   step 4 alone (a minute): bench_overhead's section ("Planning overhead
#                per rank") replaces the one in the existing docs/results.md, and README's
#                sentence on it in its Results block; time it on a quiet machine (the
#                load average before and after is printed with the figures), for
#                example under `nice -n -10 taskset -c 1` (one pinned core)
#   --quick      the 24-step traces become 8 steps (minutes less; for a look, not for the docs)
#   --reference  also the reference shape (config-reference.json) with a reduced batch
#                (gen-reference.json at 32 prompts x 8), 8 steps, seed 21
#   --bench      bench_policies scale to run (default none: keep its section out)
# Work files (traces, JSON) go to $RP_RESULTS_DIR (default /tmp/routepack-results);
# traces already there with the same settings are reused.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quick=0 reference=0 bench=none layouts_only=0 planner_only=0 fidelity_only=0 overhead_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --reference) reference=1 ;;
    --layouts) layouts_only=1 ;;
    --planner) planner_only=1 ;;
    --fidelity) fidelity_only=1 ;;
    --overhead) overhead_only=1 ;;
    --bench) bench=$2; shift ;;
    -h|--help) sed -n '2,56p' "$0"; exit 0 ;;
    -*) echo "results.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
build=${1:-build}
case $build in /*) ;; *) build="$root/$build" ;; esac
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" -DRP_WITH_CUDA=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target routepack_cli >/dev/null
if [ "$bench" != none ]; then cmake --build "$build" -j"$(nproc)" --target bench_policies >/dev/null; fi
rp="$build/routepack"
work=${RP_RESULTS_DIR:-/tmp/routepack-results}
mkdir -p "$work"
ex="$root/examples"
long=24
[ $quick = 1 ] && long=8

# trace NAME SETTINGS SEED STEPS: generated once per settings file content and seed
trace() {
  local name=$1 settings=$2 seed=$3 steps=$4
  local key
  key=$(cat "$settings" | cksum | cut -d' ' -f1)
  local out="$work/$name-$key-s$seed-n$steps.rpt"
  if [ ! -f "$out" ]; then
    echo "results: generating $name seed $seed, $steps steps" >&2
    "$rp" trace gen "$settings" --out "$out.part" --steps "$steps" --seed "$seed" >/dev/null
    mv "$out.part" "$out"
  fi
  echo "$out"
}

# simulate RUN ARGS...: JSON into $work/RUN.json, the table into $work/RUN.txt
simulate() {
  local run=$1; shift
  echo "results: simulate $run" >&2
  "$rp" simulate --json "$@" > "$work/$run.json"
}

# 1d. the parallel layouts (issue 19), one line a layout: NAME CONFIG GEN (both in
# examples/) STEPS; add a layout by adding its line. Each runs once a seed of
# LAYOUT_SEEDS, from the root so each JSON names its config as examples/...;
# scripts/results/layouts.py reads the layout (TP, ETP, PP, ...) from it and pools the seeds.
LAYOUTS="
qwen3-30b-tp4 config-qwen3-30b-tp4.json gen-qwen3-30b-tp4.json 8
qwen3-30b-pp2 config-qwen3-30b-pp2.json gen-qwen3-30b-tp4.json 8
qwen3-30b-cp2 config-qwen3-30b-cp2.json gen-qwen3-30b-long.json 8
qwen3-30b-tp4-mb4 config-qwen3-30b-tp4-mb4.json gen-qwen3-30b-tp4.json 8
deepseek-v3-pp config-deepseek-v3-pp.json gen-deepseek-v3.json 4
qwen3-30b-slime config-qwen3-30b-slime.json gen-qwen3-30b-slime.json 8
"
LAYOUT_SEEDS="1 2"
layouts() {
  local name config gen steps seed t
  : > "$work/layouts.tsv.part"
  while read -r name config gen steps; do
    [ -n "$name" ] || continue
    for seed in $LAYOUT_SEEDS; do
      # one trace a gen file, seed and length: layouts of one batch share it
      t=$(trace "layout-$(basename "$gen" .json | sed 's/^gen-//')" "$ex/$gen" "$seed" "$steps")
      echo "results: simulate layout-$name seed $seed ($steps steps)" >&2
      (cd "$root" && "$rp" simulate --json --config "examples/$config" --trace "$t") \
        > "$work/layout-$name-s$seed.json"
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "examples/$config" "examples/$gen" "$seed" "$steps" \
        "layout-$name-s$seed.json" >> "$work/layouts.tsv.part"
    done
  done <<< "$LAYOUTS"
  mv "$work/layouts.tsv.part" "$work/layouts.tsv"
  python3 "$root/scripts/results/layouts.py" "$work" "$root" > "$work/section-tp-pp-layouts.md"
}
if [ $layouts_only = 1 ]; then
  layouts
  python3 "$root/scripts/results.py" "$work" "$root" --splice tp-pp-layouts
  exit 0
fi

# 1e. the planner against the per-forward balancer (issue 35), one line a run: NAME CONFIG
# (in examples/) GEN (in examples/; reference-reduced: gen-reference.json at 32 prompts x 8)
# SEED STEPS BALANCER (yes: the config admits Megatron's balancer, so token_kk+virtual_experts
# joins). Seeds the defaults were not tuned on.
PLANNER="
small-8gpu config-small.json gen-results-small.json 23 8 yes
reference-64gpu-8groups config-reference.json reference-reduced 23 6 yes
deepseek-v3-ep64-8nodes config-deepseek-v3-pp.json gen-deepseek-v3.json 3 4 no
deepseek-v3-ep64-8nodes-s1 config-deepseek-v3-pp.json gen-deepseek-v3.json 1 4 no
deepseek-v3-ep64-8nodes-s2 config-deepseek-v3-pp.json gen-deepseek-v3.json 2 4 no
glm-air-ep64-8nodes config-large.json gen-large.json 1 4 no
"
planner() {
  local name config gen seed steps vx settings t policies
  : > "$work/planner.tsv.part"
  while read -r name config gen seed steps vx; do
    [ -n "$name" ] || continue
    settings="$ex/$gen"
    if [ "$gen" = reference-reduced ]; then
      settings="$work/gen-reference-reduced.json"
      python3 - "$ex/gen-reference.json" "$settings" "$ex" <<'EOF2'
import json, sys
g = json.load(open(sys.argv[1]))
g["num_prompts"] = 32
g["experts"]["counts_file"] = sys.argv[3] + "/" + g["experts"]["counts_file"]
g["lengths"]["prompt"]["csv"] = sys.argv[3] + "/" + g["lengths"]["prompt"]["csv"]
json.dump(g, open(sys.argv[2], "w"))
EOF2
    fi
    t=$(trace "planner-$(basename "$settings" .json)" "$settings" "$seed" "$steps")
    policies=token_kk+contiguous,token_kk+eplb,token_kk+eplb_periodic,verl_kk+eplb,attn_kk+eplb
    policies=$policies,routepack,routepack:virtual_experts=false
    echo "results: simulate planner-$name seed $seed ($steps steps)" >&2
    (cd "$root" && "$rp" simulate --json --config "examples/$config" --trace "$t" --policies "$policies") \
      > "$work/planner-$name.json"
    bal=-
    if [ "$vx" = yes ]; then
      # the trainer that runs the balancer: Megatron-Core with it (megatron_balancer),
      # every expert once per EP group; token_kk+virtual_experts and routepack packing for it
      bal="planner-$name-balancer.json"
      python3 - "$ex/$config" "$work/planner-$name-balancer-config.json" <<'EOF2'
import json, sys
c = json.load(open(sys.argv[1]))
t = c["topology"]
t["slots_per_gpu"] = c["model"]["num_experts"] // t["ep_size"]
t["comment"] = "Megatron holds every expert once per EP group"
c.setdefault("execution", {})["executor"] = "megatron_balancer"
json.dump(c, open(sys.argv[2], "w"))
EOF2
      echo "results: simulate planner-$name on megatron_balancer" >&2
      "$rp" simulate --json --config "$work/planner-$name-balancer-config.json" --trace "$t" \
        --policies token_kk+virtual_experts,routepack > "$work/$bal"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "examples/$config" "$gen" "$seed" "$steps" \
      "planner-$name.json" "$bal" >> "$work/planner.tsv.part"
  done <<< "$PLANNER"
  mv "$work/planner.tsv.part" "$work/planner.tsv"
  python3 "$root/scripts/results/planner.py" "$work" "$root" > "$work/section-vs-balancer.md"
}
if [ $planner_only = 1 ]; then
  planner
  python3 "$root/scripts/results.py" "$work" "$root" --splice vs-balancer
  exit 0
fi

# "Measured on CPU" (issue 30): the cost model against this machine's CPU, in its own
# section; run alone (--fidelity), as it takes long and needs torch
cpu_fidelity() {
  local py=${PYTHON:-$build/python-venv/bin/python}
  echo "results: the fidelity check on the CPU substrate ($(uptime))" >&2
  (cd "$root" && PYTHONPATH="$root/python" ROUTEPACK_LIBRARY="$build/core/libroutepack.so" ROUTEPACK_CLI="$rp" \
    "$py" "$root/scripts/results/cpu_fidelity.py" "$work" "$root")
}
if [ $fidelity_only = 1 ]; then
  cpu_fidelity
  python3 "$root/scripts/results.py" "$work" "$root" --splice measured-cpu
  exit 0
fi

# 4. the planning overhead per rank at the reference scale (issue 16): a minute or two,
# one thread (OMP_NUM_THREADS=1); the load average before and after goes beside the
# figures (bench-overhead.load)
overhead() {
  echo "results: bench_overhead ($(uptime))" >&2
  cmake --build "$build" -j"$(nproc)" --target bench_overhead >/dev/null
  local before
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  OMP_NUM_THREADS=1 "$build/bench/bench_overhead" --reps 3 --json > "$work/bench-overhead.out.part"
  mv "$work/bench-overhead.out.part" "$work/bench-overhead.out"
  echo "$before / $(cut -d' ' -f1-3 /proc/loadavg)" > "$work/bench-overhead.load"
}
if [ $overhead_only = 1 ]; then
  overhead
  python3 "$root/scripts/results.py" "$work" "$root" --splice overhead
  exit 0
fi

# 1. the comparison on unseen seeds
simulate example
small8=$(trace small "$ex/gen-results-small.json" 21 8)
small24=$(trace small "$ex/gen-results-small.json" 22 "$long")
simulate small-8 --config "$ex/config-small.json" --trace "$small8"
simulate small-$long --config "$ex/config-small.json" --trace "$small24"
if [ $reference = 1 ]; then
  python3 - "$ex/gen-reference.json" "$work/gen-reference-reduced.json" "$ex" <<'EOF'
import json, sys
g = json.load(open(sys.argv[1]))
g["num_prompts"] = 32
for k in ("counts_file",):
    g["experts"][k] = sys.argv[3] + "/" + g["experts"][k]
g["lengths"]["prompt"]["csv"] = sys.argv[3] + "/" + g["lengths"]["prompt"]["csv"]
json.dump(g, open(sys.argv[2], "w"))
EOF
  ref8=$(trace reference "$work/gen-reference-reduced.json" 21 8)
  simulate reference-8 --config "$ex/config-reference.json" --trace "$ref8"
fi

# 1b. beside Megatron's per-forward virtual-expert balancer (issue 20): the same 8-step trace
# under a config that says the trainer runs it (the joint policy then packs for it): a
# Megatron-Core with its balancer (execution.executor megatron_balancer), which holds
# every expert once (8 slots a GPU, no spare slot); and the bundled example on that
# trainer, every default policy (issue 30: both figures, the trainer's own layer and
# Megatron's balancer)
python3 - "$ex/config-small.json" "$work/config-small-vexp.json" "$work/config-small-balancer.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["topology"]["slots_per_gpu"] = 8
c["topology"]["comment"] = "Megatron holds every expert once per EP group: 8 slots a GPU"
c["execution"] = {"executor": "megatron_balancer"}
json.dump(c, open(sys.argv[3], "w"))
c["execution"]["per_forward_balancing"] = "virtual_experts"
json.dump(c, open(sys.argv[2], "w"))
EOF
simulate vexp-small-8 --config "$work/config-small-vexp.json" --trace "$small8" \
  --policies token_kk+eplb_periodic,token_kk+virtual_experts,routepack
simulate example-balancer --config "$work/config-small-balancer.json" --gen "$ex/gen-example.json"

# 1c. both sync settings, with and without overlap (issue 14): the same 8-step trace on
# config-small.json spread over 4 nodes (4 EP groups of 8, one a node), under each
# (sync, overlap); scripts/results/structure.py renders section-structure.md
for s in "group none" "group layer" "global none" "global layer"; do
  set -- $s
  python3 - "$ex/config-small.json" "$work/config-small-4groups-$1-$2.json" "$1" "$2" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["topology"]["num_nodes"] = 4
c.setdefault("execution", {}).update(sync=sys.argv[3], overlap=sys.argv[4])
json.dump(c, open(sys.argv[2], "w"))
EOF
  simulate structure-$1-$2 --config "$work/config-small-4groups-$1-$2.json" --trace "$small8"
done
python3 "$root/scripts/results/structure.py" "$work" > "$work/section-structure.md"
layouts
planner

# 2. the sweep: routepack with other horizon / persistence settings, as policy files
variants=()
# NAME HORIZON PERSISTENCE [PRIOR [VIRTUAL_EXPERTS]] (- keeps the default)
for v in "h1 1 -1" "h3 3 -1" "h10 10 -1" "h10-rho1 10 1" "h10-prior1 10 -1 1" "novx 3 -1 - false"; do
  set -- $v
  file="$work/routepack-$1.lua"
  python3 - "$root/policies/routepack.lua" "$file" "$2" "$3" "${4:-}" "${5:-}" <<'EOF'
import re, sys
src = open(sys.argv[1]).read()
def default(text, param, value):
    pat = r"(\n    %s = \{\n      type = \"[a-z]+\", default = )([-0-9.a-z]+)" % param
    new, n = re.subn(pat, lambda m: m.group(1) + value, text)
    if n != 1:
        sys.exit("results.sh: cannot set the default of %s in routepack.lua" % param)
    return new
src = default(src, "horizon", sys.argv[3])
src = default(src, "persistence", sys.argv[4])
if sys.argv[5] and sys.argv[5] != "-":
    src = default(src, "persistence_prior", sys.argv[5])
if sys.argv[6]:
    src = default(src, "virtual_experts", sys.argv[6])
open(sys.argv[2], "w").write(src)
EOF
  variants+=("$file")
done
# (no token_kk+virtual_experts: the bundled config's trainer, routepack_torch, has no
# per-forward balancer; novx then equals h3)
list=$(IFS=,; echo "token_kk+contiguous,token_kk+eplb_periodic,routepack,${variants[*]}")
tune24=$(trace small "$ex/gen-results-small.json" 11 "$long")
simulate sweep-example --policies "$list"
simulate sweep-small-2 --config "$ex/config-small.json" --trace "$tune24" --steps 2 --policies "$list"
simulate sweep-small-8 --config "$ex/config-small.json" --trace "$tune24" --steps 8 --policies "$list"
[ $quick = 1 ] || simulate sweep-small-24 --config "$ex/config-small.json" --trace "$tune24" --policies "$list"

# 3. the single-step benchmark
if [ "$bench" != none ]; then
  echo "results: bench_policies --scale $bench" >&2
  "$build/bench/bench_policies" --scale "$bench" --markdown "$work/bench.md" > "$work/bench.txt"
fi

# 4. the planning overhead per rank (overhead above)
overhead

python3 "$root/scripts/results.py" "$work" "$root" --long "$long" \
  $( [ $reference = 1 ] && echo --reference ) $( [ "$bench" != none ] && echo --bench "$bench" )
