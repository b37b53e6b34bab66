"""The cost of one ``builtin:preempt-min`` call (docs/priority.md): a full cluster of 64 nodes x
8 GPUs held by ~290 blocks of 1-4 GPUs at three priorities, and a preemptor of 1 x 1, 1 x 8 and
4 x 8 GPUs. Pure (no servers): ``python -m bench.preempt``."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from aios_blocks.policies.builtin.preempt import plan

NODES, GPUS, RUNS = 64, 8, 5


def cluster(seed: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = random.Random(seed)
    nodes = {f"n{i}": {"cpu_free": 64, "mem_free": 1 << 20,
                       "gpus": {f"n{i}-g{g}": {"model": "A100", "free": 0.0} for g in range(GPUS)}} for i in range(NODES)}
    cands, k = [], 0
    for i in range(NODES):
        g = 0
        while g < GPUS:
            w = min(rng.choice((1, 1, 2, 4)), GPUS - g)
            cands.append({"block_id": f"b{k}", "priority": rng.choice((0, 100, 1000)), "created": float(k), "minInstances": 1,
                          "instances": {f"b{k}-0": {"node_id": f"n{i}", "gpus": [f"n{i}-g{x}" for x in range(g, g + w)],
                                                    "share": 1.0, "created": float(k)}}})
            g += w
            k += 1
    return nodes, cands


def main() -> None:
    nodes, cands = cluster()
    for gpus, count in ((1, 1), (8, 1), (8, 4)):
        inp = {"action": "preempt", "minDelta": 10, "block": {"priority": 2000, "minInstances": count, "resources": {"gpus": gpus}},
               "cluster": {"nodes": nodes}, "candidates": cands}
        times = []
        for _ in range(RUNS):
            t = time.perf_counter()
            out = plan(inp)
            times.append(time.perf_counter() - t)
        victims = sum(len(v) for v in out["victims"].values())
        print(f"{NODES} nodes x {GPUS} GPUs, {len(cands)} candidates, preemptor {count} x {gpus} GPUs: "
              f"median {statistics.median(times) * 1000:.0f} ms, {victims} victims, {out['gpus_freed']:g} GPUs freed")


if __name__ == "__main__":
    main()
