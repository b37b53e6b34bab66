#!/usr/bin/env bash
# Worker scale-out on a machine with cores to spare (docs/benchmarks.md, "Scale-out on 16 cores"):
# bench.scaleout with 1, 2 and 4 copies of gateway and controller, alternated, then with the parser
# and the simulated agents as many copies too, then bench.targets grouped (blocks up's layout).
#
#   bash bench/device_scaleout.sh [--wheels]
#
# --wheels installs ./.whl/*.whl into $SITE (default /tmp/site) first: the device machine has no
# network (bench/device_env.sh). Results and
# the log go to $OUT (default /tmp/scaleout_out). Env: PY (default python3), BLOCKS (1500),
# REPEAT (2), BUDGET_S (whole run, 480).
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/scaleout_out}"
PY="${PY:-python3}"
mkdir -p "$OUT"
exec > >(tee "$OUT/scaleout.log") 2>&1
source "$ROOT/bench/device_env.sh"
echo "== $(date -u +%FT%TZ) $(uname -nrm); $(nproc) cores; $("$PY" --version); nats-server $(nats-server --version 2>&1 | head -1)"
"$PY" -c "import aios_blocks.cli.main, psutil; print('imports ok; load', __import__('os').getloadavg())" || exit 1
deadline=$(( $(date +%s) + ${BUDGET_S:-480} ))
left() { echo $(( deadline - $(date +%s) )); }
run() {  # name, timeout, command...
    local name=$1 t=$2; shift 2
    [ "$(left)" -lt 30 ] && { echo "== skip $name: budget spent"; return; }
    [ "$t" -gt "$(left)" ] && t=$(left)
    echo "== $name ($(date -u +%T), ${t}s at most)"
    timeout -k 10 "$t" "$@"; echo "== $name: exit $?"
    cp bench/results/*.json "$OUT/" 2>/dev/null
}
B=${BLOCKS:-1500}
run scaleout 300 "$PY" -m bench.scaleout --blocks "$B" --clusters 10 --nodes 100 --copies 1,2,4 --repeat "${REPEAT:-2}"
cp bench/results/scaleout.json "$OUT/scaleout-per-kind.json" 2>/dev/null
run scaleout-all-kinds 150 "$PY" -m bench.scaleout --blocks "$B" --clusters 10 --nodes 100 --copies 1,2,4 --all-kinds
cp bench/results/scaleout.json "$OUT/scaleout-all-kinds.json" 2>/dev/null
run targets-grouped 150 env AIOS_BENCH_GROUPED=1 "$PY" -m bench.targets
echo "== done $(date -u +%T)"
