"""The tail of one class's waits in the online replay (docs/priority.md "The LS+G waits of
multigpu50 x150"): which tasks make a class's p99, when they arrived, when they were placed and
whether that was after the window's end (the last arrival; a task still waiting then counts its
wait to its placement, however late), with their shape.

    .venv/bin/python -m bench.trace_online_tail --workload default --load 300 --cluster-share 0.2 --qos burstable
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aios_blocks.trace import online
from aios_blocks.trace.inventory import load_nodes

from .trace_online import code_version, pods


async def run(a: argparse.Namespace) -> dict[str, Any]:
    nodes = online.shrink(load_nodes(pods("default").with_name("openb_node_list_gpu_node.csv"), "trace"),
                          a.cluster_share, a.seed)
    timed, _ = online.load_timed(pods(a.workload), a.seed)
    timed = [replace(t, created=t.created / a.load) for t in timed]
    sim = online.Sim(nodes, timed, online.Mode(a.mode), a.policy, a.seed, 0, online.HEAD, online.MIN_DELTA, a.workload)
    t0 = time.process_time()
    res = await sim.run()
    jobs = [j for j in sim.jobs.values() if j.qos_class == a.qos]
    rows = []
    for j in jobs:
        t = j.timed.task
        w = j.first_wait if j.first_wait is not None else max(0.0, sim.last_t - j.timed.created)
        placed_at = None if j.first_wait is None else j.timed.created + j.first_wait
        rows.append({"task": t.name, "arrival": round(j.timed.created, 1), "wait": round(w, 1),
                     "placed_at": None if placed_at is None else round(placed_at, 1),
                     "after_window": placed_at is None or placed_at > sim.span, "victim_times": j.victim_times,
                     "gpus": t.num_gpu, "gpu_milli": t.gpu_milli, "models": t.gpu_spec, "cpu": t.cpu_milli / 1000,
                     "mem": t.memory_mib})
    rows.sort(key=lambda r: -r["wait"])
    d = res.as_dict()
    n = len(rows)
    return {"code": code_version(), "workload": a.workload, "mode": a.mode, "load": a.load, "qos": a.qos,
            "cpu_s": round(time.process_time() - t0, 1), "span_s": sim.span, "n": n,
            "p99_index": min(n - 1, int(n * 0.99)) if n else None, "wait": d["wait"].get(a.qos),
            "preemptions": res.preemptions, "pending_end_by_class": d["pending_end_by_class"],
            "waiting_at_window_end": sum(1 for r in rows if r["after_window"]),
            "placed_after_window": sum(1 for r in rows if r["after_window"] and r["placed_at"] is not None),
            "top": rows[: a.top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="default")
    ap.add_argument("--mode", default="preemption")
    ap.add_argument("--load", type=float, default=300)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--policy", default=online.DEFAULT_POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--qos", default="burstable")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = asyncio.run(run(a))
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
