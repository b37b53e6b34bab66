"""The rebalancer's online replay on a prefix of a workload (the first ``--tasks`` arrivals), with
the digests of its decisions: two revisions of the planner make the same decisions when both
digests match (docs/rebalance.md "The planner's search on multigpu50"). The settings of
``bench.trace_rebalance_window`` (no preemption, load 300, cluster share 0.2, the worker's round).

    .venv/bin/python -m bench.trace_rebalance_prefix PODS [--tasks 4000] [--seed 42] [--no-rebalance]

The run stops at the prefix's last arrival (``--tail``: it goes on through the departures after it).
Prints one JSON line: placements, moves, the sha256 of ``Sim.log`` (every placement: time, block,
node, GPUs) and of ``RebalanceSim.move_log`` (every move), the figures of the prefix and the CPU s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import load_nodes

NODES = Path(__file__).resolve().parent / "traces" / "openb-2023" / "openb_node_list_gpu_node.csv"


class _WindowEnd(Exception):
    """The prefix's last arrival is passed: its figures are taken there (without ``--tail``)."""


def digest(rows: list[tuple[object, ...]]) -> str:
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pods", type=Path)
    ap.add_argument("--tasks", type=int, default=4000, help="the first N arrivals (0: all)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--load", type=float, default=300)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--no-rebalance", action="store_true")
    ap.add_argument("--max-moves", type=int, default=orb.MAX_MOVES)
    ap.add_argument("--dump", type=Path, help="write every placement and move here (one per line)")
    ap.add_argument("--tail", action="store_true", help="run on past the last arrival (the departures after it)")
    a = ap.parse_args()
    nodes = online.shrink(load_nodes(NODES, "trace"), a.cluster_share, a.seed)
    timed, _ = online.load_timed(a.pods, a.seed)
    timed = sorted((replace(t, created=t.created / a.load) for t in timed), key=lambda t: t.created)
    if a.tasks:
        timed = timed[: a.tasks]
    args = (nodes, timed, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, a.seed, 0, online.HEAD, online.MIN_DELTA,
            a.pods.stem.removeprefix("openb_pod_list_"))
    base: type[online.Sim] = online.Sim if a.no_rebalance else orb.RebalanceSim

    class Prefix(base):
        def snapshot(self) -> None:
            super().snapshot()
            if not a.tail:
                raise _WindowEnd

    kw: dict[str, object] = {} if a.no_rebalance else {"max_moves": a.max_moves, "frag_threshold": orb.FRAG_THRESHOLD}
    sim = Prefix(*args, **kw)
    c0 = time.process_time()
    try:
        asyncio.run(sim.run())
    except _WindowEnd:
        pass
    cpu = time.process_time() - c0
    d = orb.figures(sim)
    if a.dump:
        a.dump.write_text("".join(f"{r!r}\n" for r in sorted([*sim.log, *(("move", *m) for m in getattr(sim, "move_log", []))],
                                                               key=lambda r: r[1])))
    print(json.dumps({"tasks": len(timed), "placed": sim.res.placed, "moves": d["moves"],
                      "log": digest(sim.log), "move_log": digest(getattr(sim, "move_log", [])),
                      "alloc_last_third": d["alloc_last_third"], "multi_gpu_wait": d["multi_gpu_wait"],
                      "cpu_s": round(cpu, 1)}), flush=True)


if __name__ == "__main__":
    main()
