#!/usr/bin/env bash
# bench.targets of two trees alternated in one window, plus Ray placement groups on the same
# workload (docs/benchmarks.md "Stop 22"): on a shared box only alternated runs compare.
#
#   git worktree add /tmp/base <rev>
#   bash bench/ab_targets.sh /tmp/base [ROUNDS] [--quick|--full]   # ray: RAY_PYTHON=/path/to/python with ray
#
# stop 23's table (docs/benchmarks.md):
#   SIDES="base grouped" BASE_GROUPED=1 BASE_NO_HIREDIS=1 RAY_PYTHON=/work/rayvenv/bin/python \
#     bash bench/ab_targets.sh /tmp/base 3 --full
#
# Each round runs base, head (a process per kind) and head grouped (AIOS_BENCH_GROUPED=1, as
# `blocks up` runs the kinds), then Ray if RAY_PYTHON is set.
#   SIDES="base grouped"   the sides to run (default: base head grouped)
#   BASE_GROUPED=1         run the base grouped too
#   BASE_NO_HIREDIS=1      run the base without hiredis (as a revision from before it was a dependency installed)
set -euo pipefail
base=${1:?the base tree (a worktree of the revision to compare with)}
rounds=${2:-2}
flag=${3:---quick}
head=$(cd "$(dirname "$0")/.." && pwd)
py="$head/.venv/bin/python"
shim=""
if [ "${BASE_NO_HIREDIS:-0}" = 1 ]; then  # redis-py then finds no hiredis and parses in Python
  shim=$(mktemp -d)
  echo "import sys; sys.modules['hiredis'] = None" > "$shim/sitecustomize.py"
  shim="$shim:"
fi
for i in $(seq 1 "$rounds"); do
  for side in ${SIDES:-base head grouped}; do
    dir=$head; grouped=0; path="$head/src"
    [ "$side" = base ] && dir=$base && path="$shim$base/src" && grouped=${BASE_GROUPED:-0}
    [ "$side" = grouped ] && grouped=1
    echo "== $side, round $i ($(uptime | sed 's/.*load/load/'))"
    (cd "$dir" && AIOS_BENCH_NO_PEER=1 AIOS_BENCH_GROUPED=$grouped PYTHONPATH="$path" "$py" -m bench.targets "$flag" 2>/dev/null \
      | grep -E "│ 2 core|│    " | sed -E 's/ +/ /g')
  done
  if [ -n "${RAY_PYTHON:-}" ]; then
    echo "== ray, round $i"
    if [ "$flag" = --quick ]; then sizes="10 150"; else sizes="30 600"; fi
    "$RAY_PYTHON" "$head/bench/ray_groups.py" $sizes
  fi
done
