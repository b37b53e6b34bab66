#!/usr/bin/env bash
# Scale-out against the consumers' batch and in-flight bounds (AIOS_CONSUMER_BATCH,
# AIOS_CONSUMER_INFLIGHT), on a machine with cores to spare: bench.scaleout with 1 and 2 copies
# of gateway and controller under each setting in $CONFIGS ("batch inflight" pairs, default
# "64 128" and "256 1024"), alternated $ROUNDS times (default 3).
#
#   bash bench/device_inflight.sh [--wheels]      (env: PY, OUT, BLOCKS=2000, BUDGET_S=330, CONFIGS, ROUNDS, COPIES=1,2)
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/inflight_out}" PY="${PY:-python3}"
mkdir -p "$OUT"
exec > >(tee "$OUT/inflight.log") 2>&1
source "$ROOT/bench/device_env.sh"
echo "== $(date -u +%FT%TZ) $(nproc) cores; $("$PY" --version)"
deadline=$(( $(date +%s) + ${BUDGET_S:-330} ))
B=${BLOCKS:-2000}
IFS=, read -r -a CFGS <<< "${CONFIGS:-64 128,256 1024}"
for round in $(seq 1 "${ROUNDS:-3}"); do
    for cfg in "${CFGS[@]}"; do
        set -- $cfg
        [ $(( deadline - $(date +%s) )) -lt 45 ] && { echo "== budget spent"; break 2; }
        echo "== round $round batch $1 inflight $2 ($(date -u +%T))"
        AIOS_CONSUMER_BATCH=$1 AIOS_CONSUMER_INFLIGHT=$2 timeout -k 10 150 "$PY" -m bench.scaleout --blocks "$B" \
            --clusters 10 --nodes 100 --copies "${COPIES:-1,2}" 2>&1 | grep "^  [0-9]"
        cp bench/results/scaleout.json "$OUT/scaleout-r$round-b$1-i$2.json" 2>/dev/null
    done
done
echo "== done $(date -u +%T)"
