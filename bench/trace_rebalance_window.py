"""The online replay with or without the rebalancer (issue 38, docs/rebalance.md "Online replay"),
printing the figures at the window's end (the last arrival: ``Sim.snapshot``) as well as at the end
of the run: the whole run's tail (the departures after the window, each a capacity event with up
to 4 plans) is long with the rebalancer. The same settings as
``blocks trace replay NODES PODS --in-process --online --no-preemption --rebalance --load 300 --cluster-share 0.2``.

    .venv/bin/python -m bench.trace_rebalance_window PODS [--no-rebalance] [--json out.json]
        [--frag-threshold 0.1 | --no-frag-round] [--max-moves 8] [--frag-moves N] [--any-priority]
        [--window-only] [--sources N] [--subsets N] [--max-plans N] [--aged-plans N --age-s S]
        [--param key=json ...] [--top N]

Also prints ``bound_last_third``: what the allocation of the last third could be at most if
every pending task that fits some node by its GPU count were placed at once (allocated + the
smaller of the free GPU compute and those tasks' demand, time-weighted like ``alloc_last_third``):
defragmentation cannot place more than is free nor more than waits.

And ``zero_wait_last_third``: the allocation of the last third if every task that fits some node
by its GPU count were placed the instant it arrived and ran its trace duration (no wait at all:
a figure of the trace and the sampled nodes alone, the same for every run), with ``by_gpus``: the
last third's allocation per task GPU count, this run's against the zero-wait one (percentage
points of the cluster; ``by_priority``: the multi-GPU tasks by GPU count and priority), and
``spill``: the points the run's tasks add to the last third beyond their zero-wait share (delayed into it) and lose below it (waiting in it, or still waiting).
``ceiling_last_third``: the most any schedule could put in the last third, capacity ignored (each
task started at the best instant at or after its arrival: a task that arrived before the third
may gain by being delayed into it); no scheduler, with or without moves, allocates more.
``--sources``, ``--subsets``, ``--max-plans``: experiments with the planner's search limits
(``rebalance.SOURCES``, ``SUBSETS``) and the replay's plans per capacity event (``MAX_PLANS``).
``--param key=json``: a parameter added to the resourceAllocator's (fgd-plus's ``hostPressure=1``);
``--top N``: the N longest multi-GPU waits at the window's end (wait, GPUs, CPUs, priority, placed).
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
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import load_nodes

NODES = Path(__file__).resolve().parent / "traces" / "openb-2023" / "openb_node_list_gpu_node.csv"


class _WindowEnd(Exception):
    """``--window-only``: the figures at the window's end are printed; the run stops there."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pods", type=Path)
    ap.add_argument("--no-rebalance", action="store_true")
    ap.add_argument("--load", type=float, default=300)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--frag-threshold", type=float, default=orb.FRAG_THRESHOLD)
    ap.add_argument("--no-frag-round", action="store_true", help="the worker's periodic round not modelled")
    ap.add_argument("--max-moves", type=int, default=orb.MAX_MOVES)
    ap.add_argument("--frag-moves", type=int, default=None)
    ap.add_argument("--frag-wait", type=float, default=orb.FRAG_WAIT_S)
    ap.add_argument("--progress", type=int, default=0, help="print the counters every N placements")
    ap.add_argument("--any-priority", action="store_true",
                    help="experiment: a pending block's moves may take blocks of any priority (the rule: its own or lower)")
    ap.add_argument("--window-only", action="store_true", help="stop at the window's end (its figures only)")
    ap.add_argument("--sources", type=int, default=None, help="experiment: rebalance.SOURCES")
    ap.add_argument("--subsets", type=int, default=None, help="experiment: rebalance.SUBSETS")
    ap.add_argument("--max-plans", type=int, default=None, help="experiment: online_rebalance.MAX_PLANS")
    ap.add_argument("--aged-plans", type=int, default=0,
                    help="experiment: plans per capacity event for the longest-waiting multi-GPU blocks")
    ap.add_argument("--age-s", type=float, default=0.0, help="with --aged-plans: the least wait (trace s)")
    ap.add_argument("--top", type=int, default=0, help="print the N longest multi-GPU waits at the window's end")
    ap.add_argument("--param", action="append", default=[],
                    help="a policy parameter added to the resourceAllocator's, key=json (repeatable; e.g. hostPressure=1)")
    a = ap.parse_args()
    extra = {k: json.loads(v) for k, v in (p.split("=", 1) for p in a.param)}
    if extra:
        setup_of = online.setup_of

        def with_params(*args: Any, **kw: Any) -> Any:
            st = setup_of(*args, **kw)
            rule = st.rule
            st.rule = lambda share: {**rule(share), "parameters": {**rule(share)["parameters"], **extra}}  # type: ignore[method-assign]
            return st

        online.setup_of = with_params
    for mod, name, value in ((orb.rb, "SOURCES", a.sources), (orb.rb, "SUBSETS", a.subsets), (orb, "MAX_PLANS", a.max_plans)):
        if value is not None:
            setattr(mod, name, value)
    if a.any_priority:
        movable = orb.MoveIndex.movable
        orb.MoveIndex.movable = lambda self, ceiling: movable(self, None)
    nodes = online.shrink(load_nodes(NODES, "trace"), a.cluster_share, a.seed)
    timed, drawn = online.load_timed(a.pods, a.seed)
    timed = [replace(t, created=t.created / a.load) for t in timed]
    t0, c0 = time.perf_counter(), time.process_time()
    base: type[online.Sim] = online.Sim if a.no_rebalance else orb.RebalanceSim

    class Windowed(base):
        bound_area = 0.0
        _most: dict[tuple[str, ...], int] = {}

        def most_gpus(self, models: tuple[str, ...]) -> int:
            """The most GPUs (of these models) one node has: a task asking more fits nowhere."""
            if models not in self._most:
                self._most[models] = max((sum(1 for g in v["gpus"] if not models or g.get("model") in models)
                                          for v in self.views.values()), default=0)
            return self._most[models]

        def bound_now(self) -> float:
            free = 0
            for v in self.views.values():
                for g in v["gpus"]:
                    if int(g.get("instances") or 0) == 0:
                        free += online.UNITS
                    elif not g.get("exclusive"):
                        free += int(g.get("share_free", 0))
            want = sum(j.timed.task.milli_total for j in self.pending.values()
                       if j.timed.task.num_gpu <= self.most_gpus(tuple(sorted(j.timed.task.resources().get("gpuModels") or ()))))
            return self.allocated + min(free, want)

        def tick(self, now: float) -> None:
            lo = 2 * self.span / 3
            t0, t1 = max(self.last_t, lo), min(now, self.span)
            if t1 > t0:
                self.bound_area += (t1 - t0) * self.bound_now()
            super().tick(now)

        def bound_last_third(self) -> float:
            third = self.span / 3
            return round(100 * self.bound_area / (self.cluster_milli * third), 3) if third > 0 else 0.0

        async def place(self, j: online.Job, now: float) -> bool:
            ok = await super().place(j, now)
            if ok and a.progress and self.res.placed % a.progress == 0:  # where a long run stands
                print(json.dumps({"at": round(now, 1), "of": round(self.span, 1), "placed": self.res.placed,
                                  "moves": getattr(self, "moves", 0), "frag_round_moves": getattr(self, "frag_round_moves", 0),
                                  "rounds": dict(getattr(self, "rounds", {})), "pending": len(self.pending),
                                  "cpu_s": round(time.process_time() - c0, 1)}), flush=True)
            return ok

        def by_gpus(self) -> dict[str, Any]:
            """This run's last-third allocation per task GPU count against the zero-wait one
            (module docstring), in points of the cluster, and what waiting shifted."""
            lo, third = 2 * self.span / 3, self.span / 3
            pts = 100 / (self.cluster_milli * third) if third > 0 else 0.0
            run: dict[int, float] = {}
            ideal: dict[int, float] = {}
            prio: dict[str, list[float]] = {}  # "GPUs/priority" of the multi-GPU tasks -> [run, zero wait]
            gained = lost = ceiling = 0.0
            for j in self.jobs.values():
                t = j.timed.task
                if t.num_gpu > self.most_gpus(tuple(sorted(t.resources().get("gpuModels") or ()))):
                    continue
                zero = max(0.0, min(j.timed.created + j.timed.duration, self.span) - max(j.timed.created, lo))
                # the most any start at or after its arrival (before the window's end) gives it
                if j.timed.created < self.span:
                    ceiling += min(j.timed.duration, self.span - max(j.timed.created, lo)) * t.milli_total * pts
                ran = 0.0
                if j.first_wait is not None:
                    s0 = j.timed.created + j.first_wait
                    ran = max(0.0, min(s0 + j.timed.duration, self.span) - max(s0, lo))
                ideal[t.num_gpu] = ideal.get(t.num_gpu, 0.0) + zero * t.milli_total * pts
                run[t.num_gpu] = run.get(t.num_gpu, 0.0) + ran * t.milli_total * pts
                if t.num_gpu > 1:
                    k = prio.setdefault(f"{t.num_gpu}/{int(j.ir['priority'])}", [0.0, 0.0])
                    k[0] += ran * t.milli_total * pts
                    k[1] += zero * t.milli_total * pts
                gained += max(0.0, ran - zero) * t.milli_total * pts
                lost += max(0.0, zero - ran) * t.milli_total * pts
            return {"zero_wait_last_third": round(sum(ideal.values()), 3), "ceiling_last_third": round(ceiling, 3),
                    "by_gpus": {str(g): [round(run.get(g, 0.0), 3), round(ideal[g], 3)] for g in sorted(ideal)},
                    "by_priority": {k: [round(v[0], 3), round(v[1], 3)] for k, v in sorted(prio.items())},
                    "spill": {"delayed_in": round(gained, 3), "lost": round(lost, 3)}}

        def snapshot(self) -> None:
            super().snapshot()
            self.window = self.by_gpus()
            s = sorted(orb.multi_gpu_waits(self))  # the ones never placed yet: counted to now
            print(json.dumps({"at": "window end", "placed": self.res.placed, "moves": getattr(self, "moves", 0),
                              "aged_moves": getattr(self, "aged_moves", 0),
                              "alloc_last_third": round(orb.last_third(self), 3), "bound_last_third": self.bound_last_third(),
                              "rounds": dict(getattr(self, "rounds", {})), "frag_round_moves": getattr(self, "frag_round_moves", 0),
                              "multi_gpu_wait": {"n": len(s), "p50": round(s[int(len(s) * 0.5)], 3) if s else 0.0,
                                                 "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3) if s else 0.0},
                              **self.window, "pending": len(self.pending), "run_s": round(time.perf_counter() - t0, 1),
                              "cpu_s": round(time.process_time() - c0, 1)}), flush=True)
            if a.top:  # the longest-waiting multi-GPU tasks: shape, priority, wait, placed or not
                rows = []
                for j in self.jobs.values():
                    t = j.timed.task
                    if t.num_gpu > 1 and j.timed.created <= self.last_t:
                        w = j.first_wait if j.first_wait is not None else max(0.0, self.last_t - j.timed.created)
                        rows.append((round(w, 1), t.num_gpu, t.cpu_milli / 1000, int(j.ir["priority"]),
                                     j.first_wait is not None))
                print(json.dumps({"top_multi_gpu_waits": sorted(rows, reverse=True)[:a.top]}), flush=True)
            if a.window_only:
                raise _WindowEnd

    args = (nodes, timed, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, a.seed, 0, online.HEAD, online.MIN_DELTA,
            a.pods.stem.removeprefix("openb_pod_list_"))
    kw: dict[str, object] = {} if a.no_rebalance else {
        "max_moves": a.max_moves, "frag_moves": a.frag_moves, "frag_threshold": None if a.no_frag_round else a.frag_threshold,
        "frag_wait_s": a.frag_wait, "aged_plans": a.aged_plans, "age_s": a.age_s}
    sim = Windowed(*args, **kw)
    sim.res.drawn_times, sim.res.load, sim.res.cluster_share = drawn, a.load, a.cluster_share
    try:
        asyncio.run(sim.run())
    except _WindowEnd:
        return
    d = orb.figures(sim)
    d["run_s"], d["cpu_s"] = round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1)
    if a.json:
        a.json.write_text(json.dumps(d) + "\n")
    d["bound_last_third"] = sim.bound_last_third()
    keys = ("mode", "placed", "moves", "moves_per_placement", "alloc_last_third", "bound_last_third", "multi_gpu_wait",
            "rounds", "frag_round_moves", "run_s", "cpu_s")
    print(json.dumps({k: d.get(k) for k in keys}), flush=True)


if __name__ == "__main__":
    main()
