"""What any scheduler could at best give the LS+Guaranteed tasks of an online replay (issue 36,
docs/priority.md "Why the LS+Guaranteed target is out of reach on multigpu50"): the LS+Guaranteed
tasks alone (every lower-priority task gone for good: a perfect preemption) on ONE pool of the
sample's GPUs (no nodes, no GPU models, no CPU or memory: a perfect packing), each started as soon
as the pool has its GPUs, in arrival order with backfill, or smallest first. Also the LS demand:
the GPUs busy if every LS task ran from its arrival, per slice of the window's end. Pure
arithmetic over the CSV (seconds of CPU).

    .venv/bin/python -m bench.trace_online_bound --workload multigpu50 --load 300 --cluster-share 0.2
"""

from __future__ import annotations

import argparse
import heapq
import json
from typing import Any

from aios_blocks.trace import online
from aios_blocks.trace import qos as qosmod
from aios_blocks.trace.inventory import load_nodes

from .trace_online import pods


def pool(tasks: list[tuple[float, int, float]], capacity: int, smallest_first: bool) -> list[tuple[float, float]]:
    """(arrival, wait) of each task on one pool of ``capacity`` thousandths of a GPU."""
    arrivals = sorted(tasks)
    running: list[tuple[float, int]] = []
    waiting: list[tuple[float, int, float]] = []
    free, i, out = capacity, 0, []
    while i < len(arrivals) or running:
        if running and (i >= len(arrivals) or running[0][0] <= arrivals[i][0]):
            now, m = heapq.heappop(running)
            free += m
        else:
            now = arrivals[i][0]
            waiting.append(arrivals[i])
            i += 1
        waiting.sort(key=(lambda w: (w[1], w[0])) if smallest_first else (lambda w: w[0]))
        left = []
        for w in waiting:
            if w[1] <= free:
                free -= w[1]
                heapq.heappush(running, (now + w[2], w[1]))
                out.append((w[0], now - w[0]))
            else:
                left.append(w)
        waiting = left
    return out


def bound(workload: str, load: float, share: float, seed: int) -> dict[str, Any]:
    nodes = online.shrink(load_nodes(pods("default").with_name("openb_node_list_gpu_node.csv"), "trace"), share, seed)
    gpus = sum(len(n.gpus) for n in nodes)
    cpus, mem = sum(n.cpu for n in nodes), sum(n.memory for n in nodes)
    timed, _ = online.load_timed(pods(workload), seed)
    span = max(t.created for t in timed) / load
    ls = [(t.created / load, t.task.milli_total, t.duration) for t in timed
          if qosmod.class_of(t.task.qos) == qosmod.LATENCY_SENSITIVE]
    ls_cm = [(t.created / load, t.task.cpu_milli / 1000, t.task.memory_mib, t.duration) for t in timed
             if qosmod.class_of(t.task.qos) == qosmod.LATENCY_SENSITIVE]
    out: dict[str, Any] = {"workload": workload, "load": load, "cluster_share": share, "gpus": gpus, "cpus": cpus,
                           "memory_mib": mem, "ls_tasks": len(ls)}
    for name, small in (("fifo_backfill", False), ("smallest_first", True)):
        w = sorted(x for c, x in pool(ls, gpus * 1000, small) if c >= online.WARMUP * span)
        out[name] = {"p50": round(w[len(w) // 2], 1), "p99": round(w[int(0.99 * len(w))], 1),
                     "waiting_over_2s": round(sum(1 for x in w if x > 2) / len(w), 4)}
    demand = []
    for a in (span - 9000, span - 6000, span - 3000):
        busy = sum(m / 1000 * max(0.0, min(c + d, a + 3000) - max(c, a)) for c, m, d in ls) / 3000
        # the same for CPU and memory (the pool above has none: a node's CPU or memory can bind first)
        cpu = sum(x * max(0.0, min(c + d, a + 3000) - max(c, a)) for c, x, _m, d in ls_cm) / 3000
        mib = sum(m * max(0.0, min(c + d, a + 3000) - max(c, a)) for c, _x, m, d in ls_cm) / 3000
        demand.append({"from": round(a), "to": round(a + 3000), "ls_gpus_busy": round(busy), "pct": round(100 * busy / gpus),
                       "cpu_pct": round(100 * cpu / cpus), "mem_pct": round(100 * mib / mem)})
    out["ls_demand"] = demand
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="multigpu50")
    ap.add_argument("--load", type=float, default=300)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    print(json.dumps(bound(a.workload, a.load, a.cluster_share, a.seed), indent=1))


if __name__ == "__main__":
    main()
