"""What keeps the online replay's pending blocks out in the last third of the window, with the
rebalancer (issue 38, docs/rebalance.md "What blocks the bound"): the settings of
``bench.trace_rebalance_window`` (default trace, seed 42, the worker's round), sampled ``--samples``
times over the last third. At each sample, each pending task whose GPU count some node has
(``bound_last_third`` counts its demand) is put in one class:

* ``fits``: a node has its GPUs free and its CPU and memory (it waits behind the queue's order);
* ``cpu_short``: a node has its GPUs free (whole, or a share's room), none with its CPU/memory too;
* ``gpus_short_le2``: no node has its GPUs free, one is 1-2 GPUs short (moves of 1-GPU instances
  could free them);
* ``gpus_short_more``: every node is 3 or more GPUs short;

with the free GPU compute split in the same go (whole free GPUs on nodes with at least / under the
fewest CPU a pending task asks; the free part of shared GPUs), and the demand each class holds (GPU
thousandths), averaged over the samples. The planner's answers for the pending blocks in the last
third are counted by their reason, and at each sample the queue's first ``--ask`` blocks the plan
with 2 moves has no answer for are asked again with ``--more`` moves (would more moves per plan
make their room?).

    .venv/bin/python -m bench.trace_rebalance_blocked [--samples 60] [--ask 3] [--more 4] [--dump DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pickle
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aios_blocks.handlers import preemption as pre
from aios_blocks.policies.builtin import preempt as bp
from aios_blocks.policies.builtin import rebalance as rb
from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import block_id

HERE = Path(__file__).resolve().parent
NODES = HERE / "traces" / "openb-2023" / "openb_node_list_gpu_node.csv"
PODS = HERE / "traces" / "openb-2023" / "openb_pod_list_default.csv"
UNITS = 1000


@dataclass
class Snapshot:
    """The replay's ``MoveIndex`` at one instant (an ``rb.Prepared``: ``--dump`` pickles it, with the
    pending blocks' inputs, to ask the planner about them again offline; ``wl`` set on loading,
    ``Workload(shapes)``)."""

    nodes: dict[str, bp._Node]
    frags: dict[str, tuple[bp._Node, float]]
    rows: dict[str, tuple[int, list[rb.Inst], int]]
    wl: Any = None

    def movable(self, ceiling: int | None) -> tuple[list[rb.Inst], dict[str, int]]:
        insts: list[rb.Inst] = []
        budget: dict[str, int] = {}
        for bid, (prio, its, left) in self.rows.items():
            if (ceiling is not None and prio > ceiling) or left <= 0:
                continue
            budget[bid] = left
            insts.extend(its)
        return insts, budget


def classify(views: dict[str, Any], t: Any) -> str:
    """The class of one pending task (module docstring)."""
    res = t.resources()
    k = int(res.get("gpus") or 0)
    cpu, mem = float(res.get("cpu") or 0), float(res.get("memory") or 0)
    models = set(res.get("gpuModels") or ())
    share = int(t.gpu_milli) if t.sharing else UNITS
    best_short, gpus_ok = 10**9, False
    for v in views.values():
        usable = [g for g in v["gpus"] if not models or g.get("model") in models]
        if len(usable) < k:
            continue
        room = sum(1 for g in usable if int(g.get("instances") or 0) == 0
                   or (share < UNITS and not g.get("exclusive") and int(g.get("share_free", 0)) >= share))
        if room >= k:
            gpus_ok = True
            if float(v["cpu_free"]) >= cpu - 1e-9 and float(v.get("memory_free", 0)) >= mem - 1e-9:
                return "fits"
        best_short = min(best_short, k - room)
    if gpus_ok:
        return "cpu_short"
    return "gpus_short_le2" if best_short <= 2 else "gpus_short_more"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--ask", type=int, default=3)
    ap.add_argument("--more", type=int, default=4)
    ap.add_argument("--dump", type=Path, default=None, help="pickle the planner's state and the pending blocks at 4 samples")
    a = ap.parse_args()
    nodes = online.shrink(load_nodes(NODES, "trace"), 0.2, 42)
    timed, _ = online.load_timed(PODS, 42)
    timed = [replace(t, created=t.created / 300) for t in timed]
    reasons: collections.Counter[str] = collections.Counter()
    real = rb.plan
    state = {"last_third": False}

    def plan(data: Any, max_moves: int | None = None, prepared: Any = None) -> dict[str, Any]:
        got = real(data, max_moves, prepared)
        if state["last_third"] and data.get("trigger") == "pending":
            reasons["moves" if got["moves"] else re.sub(r"^\S+?(:| does not| fits)", r"\1", got["reason"])] += 1
        return got

    class Diag(orb.RebalanceSim):
        next_sample = 0.0
        samples = 0
        demand: collections.Counter[str] = collections.Counter()
        tasks: collections.Counter[str] = collections.Counter()
        shapes: collections.Counter[str] = collections.Counter()
        free: collections.Counter[str] = collections.Counter()
        more: collections.Counter[str] = collections.Counter()

        def tick(self, now: float) -> None:
            super().tick(now)
            lo = 2 * self.span / 3
            state["last_third"] = lo <= now <= self.span
            if not state["last_third"] or now < self.next_sample:
                return
            self.next_sample = max(now, lo) + (self.span / 3) / a.samples
            self.sample()

        def sample(self) -> None:
            self.samples += 1
            if a.dump and self.samples % max(1, a.samples // 5) == 0:
                a.dump.mkdir(parents=True, exist_ok=True)
                snap = Snapshot(dict(self.move_index.nodes), dict(self.move_index.frags), dict(self.move_index.rows))
                blocks = [(pre.block_input(block_id(j.timed.task), j.ir), classify(self.views, j.timed.task))
                          for j in self.waiting()]
                with (a.dump / f"state{self.samples:03d}.pkl").open("wb") as f:
                    pickle.dump({"shapes": self.st.shapes, "snap": snap, "pending": blocks}, f)
            most = max(len(v["gpus"]) for v in self.views.values())
            waiting = [j for j in self.pending.values() if j.timed.task.num_gpu <= most]
            least_cpu = min((float(j.timed.task.resources().get("cpu") or 0) for j in waiting), default=0.0)
            for v in self.views.values():
                for g in v["gpus"]:
                    if int(g.get("instances") or 0) == 0:
                        self.free["whole_cpu_ok" if float(v["cpu_free"]) >= least_cpu else "whole_cpu_short"] += UNITS
                    elif not g.get("exclusive"):
                        self.free["share_room"] += int(g.get("share_free", 0))
            for j in waiting:
                t = j.timed.task
                c = classify(self.views, t)
                self.demand[c] += t.milli_total
                self.tasks[c] += 1
                self.shapes[f"{c}:{t.num_gpu}x{t.gpu_milli if t.sharing else UNITS}"] += 1
            asked = 0
            for j in self.waiting():
                if asked >= a.ask:
                    break
                if classify(self.views, j.timed.task) == "fits":
                    continue
                asked += 1
                data = {"action": "rebalance", "maxMoves": self.max_moves, "trigger": "pending",
                        "pending": [pre.block_input(block_id(j.timed.task), j.ir)]}
                if real(data, prepared=self.move_index)["moves"]:
                    self.more["plan_with_2"] += 1
                    continue
                got = real({**data, "maxMoves": a.more}, prepared=self.move_index)
                self.more[f"plan_with_{a.more}" if got["moves"] else f"none_with_{a.more}"] += 1

        def snapshot(self) -> None:
            super().snapshot()
            n = max(1, self.samples)
            print(json.dumps({
                "samples": self.samples, "alloc_last_third": round(orb.last_third(self), 3),
                "pending_demand_per_sample": {k: round(v / n / UNITS, 2) for k, v in self.demand.items()},
                "pending_tasks_per_sample": {k: round(v / n, 1) for k, v in self.tasks.items()},
                "free_gpus_per_sample": {k: round(v / n / UNITS, 2) for k, v in self.free.items()},
                "cluster_gpus": self.cluster_milli / UNITS,
                "top_shapes": dict(self.shapes.most_common(12)), "asked_again": dict(self.more),
                "planner_answers_last_third": dict(reasons.most_common(8))}), flush=True)
            raise SystemExit(0)

    sim = Diag(nodes, timed, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, 42, 0, online.HEAD, online.MIN_DELTA,
               "default", max_moves=orb.MAX_MOVES, frag_threshold=orb.FRAG_THRESHOLD)
    rb.plan = plan
    asyncio.run(sim.run())


if __name__ == "__main__":
    main()
