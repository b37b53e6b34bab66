"""CPU per placement plan of the in-process replay (docs/trace.md "Ranking by node state"),
split by whether the plan's shape had a rank index on the inventory view yet (a shape not seen
before ranks every node; a known one catches up with the views replaced since). CPU time of this
process (``time.process_time``), not the wall clock: a loaded machine inflates the latter.

    .venv/bin/python -m bench.trace_plans [--ratio 1.3] [--policy fgd-plus] [--seed 42]

Compare two trees by running it with ``PYTHONPATH`` set to the other tree's ``src``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import types
from pathlib import Path
from typing import Any

import aios_blocks.trace.replay as replay_mod
from aios_blocks.policies import capacity
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.workload import load_tasks

HERE = Path(__file__).resolve().parent / "traces" / "openb-2023"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace_plans", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=Path, default=HERE / "openb_node_list_gpu_node.csv")
    ap.add_argument("--pods", type=Path, default=HERE / "openb_pod_list_default.csv")
    ap.add_argument("--ratio", type=float, default=1.3)
    ap.add_argument("--policy", default="fgd-plus")
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    nodes, tasks = load_nodes(a.nodes, "trace"), load_tasks(a.pods)
    replay_mod.time = types.SimpleNamespace(perf_counter=time.process_time)  # type: ignore[assignment]
    new_shape: list[bool] = []
    best_fit = capacity.best_fit

    def noting(nodes: Any, skip: Any, fits_key: Any, fits: Any, rank_key: Any, rank: Any, count: int,
               *more: Any, **kw: Any) -> Any:
        new_shape.append(isinstance(nodes, capacity.Nodes) and (fits_key, rank_key) not in nodes._ranked)
        return best_fit(nodes, skip, fits_key, fits, rank_key, rank, count, *more, **kw)

    capacity.best_fit = noting  # type: ignore[assignment]
    c0 = time.process_time()
    res = asyncio.run(replay_mod.replay(nodes, tasks, replay_mod.policy_uri(a.policy), a.seed, a.ratio))
    cpu = time.process_time() - c0
    new = [1000 * x for x, f in zip(res.latencies, new_shape, strict=False) if f]
    known = [1000 * x for x, f in zip(res.latencies, new_shape, strict=False) if not f]
    print(f"{a.policy}, ratio {a.ratio}, seed {a.seed}: {len(res.latencies)} plans, CPU {cpu:.2f} s in all, "
          f"{sum(res.latencies):.2f} s in the plans")
    for name, xs in (("new shape", new), ("known shape", known)):
        if xs:
            print(f"  {name}: {len(xs)} plans, {sum(xs) / 1000:.2f} s, p50 {statistics.median(xs):.2f} ms, "
                  f"mean {statistics.mean(xs):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
