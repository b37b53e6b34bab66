#!/usr/bin/env bash
# bench.targets of two trees alternated in one window, plus Ray placement groups on the same
# workload (docs/benchmarks.md "Stop 22"): on a shared box only alternated runs compare.
#
#   git worktree add /tmp/base <rev>
#   bash bench/ab_targets.sh /tmp/base [ROUNDS] [--quick]     # ray: RAY_PYTHON=/path/to/python with ray
#
# Each round runs base, head (a process per kind) and head grouped (AIOS_BENCH_GROUPED=1, as
# `blocks up` runs the kinds), then Ray if RAY_PYTHON is set.
set -euo pipefail
base=${1:?the base tree (a worktree of the revision to compare with)}
rounds=${2:-2}
flag=${3:---quick}
head=$(cd "$(dirname "$0")/.." && pwd)
py="$head/.venv/bin/python"
for i in $(seq 1 "$rounds"); do
  for side in base head grouped; do
    dir=$head; grouped=0
    [ "$side" = base ] && dir=$base
    [ "$side" = grouped ] && grouped=1
    echo "== $side, round $i ($(uptime | sed 's/.*load/load/'))"
    (cd "$dir" && AIOS_BENCH_GROUPED=$grouped PYTHONPATH="$dir/src" "$py" -m bench.targets "$flag" 2>/dev/null \
      | grep -E "│ 2 core|│    " | sed -E 's/ +/ /g')
  done
  if [ -n "${RAY_PYTHON:-}" ]; then
    echo "== ray, round $i"
    "$RAY_PYTHON" "$head/bench/ray_groups.py" 10 150
  fi
done
