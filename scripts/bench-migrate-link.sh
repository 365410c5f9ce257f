#!/bin/sh
# bench-migrate-link.sh GBIT [bench_migrate.py arguments]: examples/torch/bench_migrate.py
# over a loopback capped at GBIT gigabits a second (a token bucket on lo, taken off on
# exit), the model of ranks on hosts joined by a link of that rate: the transfer then
# waits on the link, not on the cores' copies, as it does between GPUs. On the bare
# loopback gloo's transfer is itself a memory copy, which the executor's checksum and
# commit passes compete with for the same memory.
#
# Needs root (tc) and an idle loopback: every process that talks over lo shares the cap
# while it runs, and an existing qdisc on lo is left alone (the script refuses). NPROC
# ranks (default 2); TORCHRUN (default: torchrun on PATH); PYTHON's routepack.
set -eu
rate=${1:?usage: scripts/bench-migrate-link.sh GBIT [bench_migrate.py arguments]}
shift
case $rate in
    *[!0-9.]* | "") echo "bench-migrate-link.sh: GBIT must be a number, got '$rate'" >&2; exit 2 ;;
esac
if ! tc qdisc show dev lo | grep -q '^qdisc noqueue'; then
    echo "bench-migrate-link.sh: lo already has a qdisc ($(tc qdisc show dev lo | head -1)); not touching it" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
tc qdisc add dev lo root tbf rate "${rate}gbit" burst 8mb latency 100ms
trap 'tc qdisc del dev lo root 2>/dev/null || true' EXIT INT TERM
echo "# loopback capped at $rate Gbit/s: $(tc qdisc show dev lo | head -1)"
OMP_NUM_THREADS=1 ${TORCHRUN:-torchrun} --nproc-per-node "${NPROC:-2}" "$here/examples/torch/bench_migrate.py" "$@"
