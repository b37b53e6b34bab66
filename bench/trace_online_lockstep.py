"""Same decisions, live and in process (issue 36, docs/priority.md "Same decisions live and in
process"): a sample of consecutive tasks of a trace replayed online in trace time through a real
system (``trace.online_live.replay_online_lockstep``: servers and the placement workers started
here with ``LOCKSTEP_ENV``) and by ``trace.online.Sim``; every placement (block, trace instant,
node, GPUs) and preemption (preemptor, victims) compared per trace instant, and the figures.

    .venv/bin/python -m bench.trace_online_lockstep --nodes 16 --tasks 200 --start 0.85 --load 300 --one-gpu
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from aios_blocks.trace import live, online
from aios_blocks.trace import online_live as ol
from aios_blocks.trace.inventory import node_from_row

from .trace_online import code_version

TRACE = Path(__file__).resolve().parent / "traces" / "openb-2023" / "openb_pod_list_default.csv"
FIGURES = ("placed", "preemptions", "victims", "cascades", "gpu_s_lost", "pending_end", "pending_end_by_class", "wait")


def sample(out: Path, n: int, start: float, one_gpu: bool) -> Path:
    """``n`` consecutive tasks (no model pin; one GPU, or one or less) from ``start`` of the span on."""
    with TRACE.open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["creation_time"] and r["deletion_time"] and not r["gpu_spec"]
                and (int(r["num_gpu"]) == 1 if one_gpu else int(r["num_gpu"]) <= 1)]
    rows.sort(key=lambda r: float(r["creation_time"]))
    span = float(rows[-1]["creation_time"])
    i = next(k for k, r in enumerate(rows) if float(r["creation_time"]) >= start * span)
    with out.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows[i:i + n])
    return out


def by_instant(log: list[Any]) -> dict[float, list[str]]:
    out: dict[float, list[str]] = {}
    for x in log:
        row = [x[0], x[2], *([sorted(x[3])] if x[0] == "preempt" else [x[3], sorted(x[4])])]
        out.setdefault(round(float(x[1]), 6), []).append(repr(row))
    return {t: sorted(v) for t, v in out.items()}


async def main(a: argparse.Namespace) -> dict[str, Any]:
    from aios_blocks.cli.client import Client

    nodes = [node_from_row({"sn": f"n{i:02d}", "cpu_milli": 96000, "memory_mib": 786432, "gpu": a.gpus, "model": "V100M32"},
                           "trace", "t") for i in range(a.nodes)]
    with tempfile.TemporaryDirectory() as d:
        timed, _ = online.load_timed(sample(Path(d) / "pods.csv", a.tasks, a.start, a.one_gpu))
    sim = online.Sim(nodes, [online.replace(t, created=t.created / a.load) for t in timed], online.Mode.PREEMPTION,
                     a.policy, 42, 0, online.HEAD, online.MIN_DELTA, "default")
    want = (await sim.run()).as_dict()
    for k, v in ol.LOCKSTEP_ENV.items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    async with live.own_system() as (nats_url, redis_url, _):
        client = await Client.open(nats_url, redis_url)
        try:
            got = await ol.replay_online_lockstep(client, nodes, timed, a.policy, 42, a.load, workload="default")
        finally:
            await client.close()
    wall = time.perf_counter() - t0
    a_, b_ = by_instant(sim.log), by_instant(got["log"])
    differ = sorted(t for t in set(a_) | set(b_) if a_.get(t) != b_.get(t))
    return {"code": code_version(), "load_avg": os.getloadavg(), "lockstep_wall_s": round(wall, 1), "instants": len(set(a_) | set(b_)),
            "instants_differ": len(differ), "first_differ": differ[:1] and {"sim": a_.get(differ[0]), "live": b_.get(differ[0])},
            "in_process": {k: want[k] for k in FIGURES}, "live": {k: got[k] for k in FIGURES},
            "figures_equal": all(want[k] == got[k] for k in FIGURES)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node (V100M32)")
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--start", type=float, default=0.85, help="the share of the trace's span the sample starts at")
    ap.add_argument("--load", type=float, default=300.0)
    ap.add_argument("--one-gpu", action="store_true", help="tasks of exactly one GPU (else one or less: CPU-only too)")
    ap.add_argument("--policy", default="fgd-plus")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    r = asyncio.run(main(args))
    print(json.dumps(r, indent=1))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
