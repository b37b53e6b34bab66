"""The GPU trace replay (docs/trace.md): each policy x workload x seed through ``blocks trace
replay --in-process``'s code, against the FGD artifact's published means (``anchor_fgd_atc23.csv``).

    .venv/bin/python -m bench.trace_replay [--workloads default,gpushare40] [--policies fgd,best-fit]
        [--seeds 42,43] [--traces DIR] [--json FILE]

Only the default workload ships in ``bench/traces/openb-2023``; ``--traces DIR`` names a folder
holding the other ``openb_pod_list_*.csv`` files (alibaba/clusterdata, cluster-trace-gpu-v2023).
Not part of ``make test`` or ``make bench``: ``make trace-bench`` (a full replay takes tens of seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import ANCHOR_NAMES, policy_uri, replay
from aios_blocks.trace.workload import load_tasks

HERE = Path(__file__).resolve().parent / "traces" / "openb-2023"
BASELINES = ["random", "dot-product", "gpu-clustering", "gpu-packing", "best-fit", "fgd"]


def anchors(path: Path) -> dict[tuple[str, str], tuple[float, float]]:
    try:
        with path.open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {}
    return {(r["workload"], r["policy"]): (float(r["gpu_alloc_pct_at_100pct_arrived"]), float(r["gpu_alloc_pct_at_130pct_arrived"]))
            for r in rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="default", help="comma-separated, e.g. default,gpushare40,multigpu50,gpuspec33")
    ap.add_argument("--policies", default=",".join([*BASELINES, "fgd-plus"]),
                    help="comma-separated; default: the paper's six and ours (fgd-plus, the replay's default)")
    ap.add_argument("--seeds", default="42")
    ap.add_argument("--inflate", type=float, default=1.3)
    ap.add_argument("--traces", type=Path, default=HERE, help="folder of the node list, the pod lists and the anchor")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures (curves included)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    nodes = load_nodes((args.traces / "openb_node_list_gpu_node.csv") if (args.traces / "openb_node_list_gpu_node.csv").exists()
                       else HERE / "openb_node_list_gpu_node.csv", "openb")
    anchor = anchors(args.traces / "anchor_fgd_atc23.csv") or anchors(HERE / "anchor_fgd_atc23.csv")
    runs: list[dict[str, Any]] = []
    print(f"{'workload':<12} {'policy':<22} {'seeds':>5} {'ours@100':>9} {'paper@100':>9} {'diff':>6} "
          f"{'ours@130':>9} {'paper@130':>9} {'diff':>6} {'s/run':>6}")
    for wl in [w for w in args.workloads.split(",") if w]:
        path = args.traces / f"openb_pod_list_{wl}.csv"
        if not path.exists():
            print(f"{wl:<12} (no {path}: pass --traces DIR)", file=sys.stderr)
            continue
        tasks = load_tasks(path)
        for name in [p for p in args.policies.split(",") if p]:
            uri = policy_uri(name)
            got = [asyncio.run(replay(nodes, tasks, uri, s, args.inflate, 0, wl)).as_dict() for s in seeds]
            runs.extend(got)
            a100 = statistics.mean(r["alloc_at_100"] for r in got)
            a130 = statistics.mean(r["alloc_at_130"] for r in got)
            secs = statistics.mean(r["seconds"] for r in got)
            ref = anchor.get((wl, ANCHOR_NAMES.get(uri, "")))
            p100, p130 = (f"{ref[0]:9.2f}", f"{ref[1]:9.2f}") if ref else (f"{'-':>9}", f"{'-':>9}")
            d100, d130 = (f"{a100 - ref[0]:+6.2f}", f"{a130 - ref[1]:+6.2f}") if ref else (f"{'':>6}", f"{'':>6}")
            print(f"{wl:<12} {uri:<22} {len(seeds):>5} {a100:9.2f} {p100} {d100} {a130:9.2f} {p130} {d130} {secs:6.1f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
