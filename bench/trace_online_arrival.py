"""Why the LS+Guaranteed blocks that wait more than 2 s wait (issue 36, docs/priority.md "The
LS+G waits of multigpu50 x150"): the online replay (``trace/online.py``, in process) with, for
each LS+G block that does not place at its arrival, the question a preemption planner faces at
that instant: **could it be placed at all by evicting only blocks at least ``minDelta`` lower?**
A lower bound, optimistic for the planner (every lower-priority instance on a node may go at once,
no other rule applies): some node of the block's GPU models, whose whole CPU and memory can hold
it, has

* ``gpus`` GPUs not held by any block of a priority above the floor (priority - ``minDelta``)
  (a sharing task: one GPU whose higher-held share leaves room for its share), and
* its free CPU and memory plus what the lower blocks on it hold >= what the block asks.

The blocks here are one instance each, so the preemption bound (GPUs freed <= need + one node's
GPUs) never binds such a plan: the lower blocks of one node hold at most one node's GPUs.

For a block that could not, the figure is ``min_wait``: the first instant (a departure of a
block above the floor: nothing else can make it feasible) at which it could, i.e. the least wait
any preemption planner could have given it **on the history the replay had** (the equal-priority
blocks where they were). ``bound_p99`` is the p99 of the steady LS+G waits with every block
waiting only that least wait (0 for those that could at arrival): the target (<= 2 s) is out of
reach on this history when it is above 2 s. For the blocks that could at arrival and still waited
over 2 s, the script says whether the walk at that instant asked the planner for them and what it
answered (``asked``: a plan; ``no_victim``; ``not_asked``: the walk's budget of plans went to the
blocks ahead).

    .venv/bin/python -m bench.trace_online_arrival --workload multigpu50 --load 150 --cluster-share 0.2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin import preempt
from aios_blocks.trace import online
from aios_blocks.trace import qos as qosmod
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import block_id
from aios_blocks.trace.workload import UNITS

from .trace_online import code_version, pods


@dataclass
class Holders:
    """Per node, what the blocks above a priority floor hold (never evictable by a block at it)
    and what the blocks at or below it hold (evictable)."""

    hi_whole: dict[str, set[str]] = field(default_factory=dict)  # node -> GPUs held whole
    hi_share: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> GPU -> milli shared
    lo_cpu: dict[str, float] = field(default_factory=dict)
    lo_mem: dict[str, int] = field(default_factory=dict)


def holders(sim: online.Sim, floor: int) -> Holders:
    h = Holders()
    for r in sim.running.values():
        if r.place is None:
            continue
        nid, gpus = r.place
        t = r.timed.task
        if int(r.ir["priority"]) > floor:
            if t.sharing:
                s = h.hi_share.setdefault(nid, {})
                for g in gpus:
                    s[g] = s.get(g, 0) + t.gpu_milli
            else:
                h.hi_whole.setdefault(nid, set()).update(gpus)
        else:
            h.lo_cpu[nid] = h.lo_cpu.get(nid, 0.0) + t.cpu_milli / 1000
            h.lo_mem[nid] = h.lo_mem.get(nid, 0) + t.memory_mib
    return h


def could(sim: online.Sim, j: online.Job, h: Holders) -> tuple[str, dict[str, Any]]:
    """``could`` (some node fits it once every lower block on it is gone), else why not:
    ``no_host`` (no node of its models big enough in all: never placeable), ``gpus`` (on every
    host node blocks above the floor hold too many of the GPUs), ``cpu_mem`` (a host has the GPUs
    once the lower blocks go, not the CPU or memory: blocks above the floor hold it)."""
    t = j.timed.task
    models = set(t.models() or ())
    cpu, mem = t.cpu_milli / 1000, t.memory_mib
    hosts = gpu_ok = 0
    best = 0
    for nid, v in sim.views.items():
        gs = [g for g in v["gpus"] if not models or g["model"] in models]
        if len(gs) < max(1, t.num_gpu) and t.num_gpu:
            continue
        if float(v.get("cpu") or 0) + 1e-9 < cpu or int(v.get("memory") or 0) < mem:
            continue
        hosts += 1
        whole, share = h.hi_whole.get(nid, set()), h.hi_share.get(nid, {})
        if t.sharing:
            avail = sum(1 for g in gs if g["id"] not in whole and share.get(g["id"], 0) + t.gpu_milli <= UNITS)
        else:
            avail = sum(1 for g in gs if g["id"] not in whole and not share.get(g["id"]))
        best = max(best, avail)
        if avail < t.num_gpu:
            continue
        gpu_ok += 1
        if v["cpu_free"] + h.lo_cpu.get(nid, 0.0) + 1e-9 >= cpu and v["memory_free"] + h.lo_mem.get(nid, 0) >= mem:
            return "could", {"node": nid}
    info = {"gpus": t.num_gpu, "cpu": cpu, "mem": mem, "hosts": hosts, "best_avail": best}
    if not hosts:
        return "no_host", info
    return ("cpu_mem" if gpu_ok else "gpus"), info


class Arrival(online.Sim):
    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.cls: dict[str, str] = {}  # LS+G block not placed at arrival -> its class then
        self.info: dict[str, dict[str, Any]] = {}
        self.min_wait: dict[str, float] = {}  # -> the least wait (for "could": 0)
        self.watch: set[str] = set()  # not feasible yet, still waiting
        self.asked: dict[str, str] = {}  # "could" blocks: the planner's answer in the drain at arrival
        self.arriving: str = ""
        self.floor = 0

    async def place(self, j: online.Job, now: float) -> bool:
        ok = await super().place(j, now)
        bid = block_id(j.timed.task)
        if not ok and j.first_wait is None and now == j.timed.created and bid not in self.cls \
                and j.qos_class == qosmod.LATENCY_SENSITIVE:
            self.floor = int(j.ir["priority"]) - self.min_delta
            c, info = could(self, j, holders(self, self.floor))
            t = j.timed.task
            self.cls[bid], self.info[bid] = c, info
            if c == "could":
                self.min_wait[bid] = 0.0
                # the blocks ahead of it in the queue then: its priority, older, the same shape
                shape = (t.num_gpu, t.gpu_milli, t.cpu_milli, t.memory_mib, t.gpu_spec)
                info["ahead_same_shape"] = sum(
                    1 for b, p in self.pending.items() if b != bid and int(p.ir["priority"]) == int(j.ir["priority"])
                    and p.since < now and (p.timed.task.num_gpu, p.timed.task.gpu_milli, p.timed.task.cpu_milli,
                                           p.timed.task.memory_mib, p.timed.task.gpu_spec) == shape)
                info["ahead"] = sum(1 for b, p in self.pending.items()
                                    if b != bid and int(p.ir["priority"]) >= int(j.ir["priority"]))
                self.arriving = bid
                self.asked[bid] = "not_asked"
            else:
                self.watch.add(bid)
        if ok:
            self.watch.discard(bid)
            if bid in self.cls and bid not in self.min_wait:
                self.min_wait[bid] = now - j.timed.created  # placed before a departure made it feasible
        return ok

    async def preempt(self, j: online.Job, now: float, key: Any = None) -> bool:
        ok = await super().preempt(j, now, key)
        bid = block_id(j.timed.task)
        if bid == self.arriving and self.asked.get(bid) == "not_asked":
            self.asked[bid] = "asked" if ok else "no_victim"
        elif self.arriving and ok:  # the drain at its arrival preempted for another block
            self.info[self.arriving]["preempted_for_others"] = self.info[self.arriving].get("preempted_for_others", 0) + 1
        return ok

    async def drain(self, now: float) -> None:
        # a departure (the only event that can make a watched block feasible: one above the floor
        # leaving) or an arrival that did not place: the watched blocks checked on the state after
        await super().drain(now)
        b = self.arriving
        if b and b in self.pending:  # it could, and waits after the walk: what the planner says now
            j = self.jobs[b]
            t = j.timed.task
            key = (capacity.shape(t.resources(), t.sharing), int(j.ir["priority"]))
            out = preempt.plan(self.plan_input(b, j))
            self.info[b].update({"after_walk": "victims" if out.get("victims") else str(out.get("reason") or "none"),
                                 "key_no_victims": key in self.no_victims, "key_no_fit": key in self.no_fit})
        self.arriving = ""
        self.check(now)

    def check(self, now: float) -> None:
        live = [b for b in self.watch if b in self.pending]
        self.watch = set(live)
        if not live:
            return
        h = holders(self, self.floor)
        for b in live:
            j = self.jobs[b]
            if could(self, j, h)[0] == "could":
                self.min_wait[b] = now - j.timed.created
                self.watch.discard(b)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * q))], 3) if s else 0.0


async def run(a: argparse.Namespace) -> dict[str, Any]:
    nodes = load_nodes(pods("default").with_name("openb_node_list_gpu_node.csv"), "trace")
    timed, _ = online.load_timed(pods(a.workload), a.seed)
    nodes = online.shrink(nodes, a.cluster_share, a.seed)
    timed = [replace(t, created=t.created / a.load) for t in timed]
    sim = Arrival(nodes, timed, online.Mode.PREEMPTION, a.policy, a.seed, 0, online.HEAD, online.MIN_DELTA, a.workload)
    if a.max_plans:  # the replay's budget of plans per capacity event (the live walker has none)
        sim.max_plans = a.max_plans
    t0 = time.process_time()
    res = await sim.run()
    d = res.as_dict()
    steady = [j for j in sim.jobs.values()
              if j.qos_class == qosmod.LATENCY_SENSITIVE and j.timed.created >= online.WARMUP * sim.span]

    def wait(j: online.Job) -> float:
        return j.first_wait if j.first_wait is not None else max(0.0, sim.last_t - j.timed.created)

    over = [j for j in steady if wait(j) > 2]
    by_cls: Counter[str] = Counter()
    by_cls_gpus: Counter[str] = Counter()
    rows = []
    for j in over:
        bid = block_id(j.timed.task)
        c = sim.cls.get(bid, "placed_at_arrival")
        key = c + ("/" + sim.asked[bid] if c == "could" else "")
        by_cls[key] += 1
        by_cls_gpus[f"{key}/{j.timed.task.num_gpu}gpu"] += 1
        mw = sim.min_wait.get(bid)
        rows.append({"bid": bid, "arrival": round(j.timed.created, 1), "wait": round(wait(j), 2),
                     "min_wait": None if mw is None else round(mw, 2), "class": key,
                     "gpus": j.timed.task.num_gpu, "cpu": j.timed.task.cpu_milli / 1000,
                     "mem": j.timed.task.memory_mib, "models": j.timed.task.gpu_spec, **sim.info.get(bid, {})})
    # the bound: each steady LS+G block waits only its least wait (0 when it could at arrival)
    bound = []
    for j in steady:
        bid = block_id(j.timed.task)
        if bid not in sim.cls or sim.cls[bid] == "could":
            bound.append(0.0)
        else:
            mw = sim.min_wait.get(bid)
            bound.append(mw if mw is not None else wait(j))
    return {"code": code_version(), "workload": a.workload, "load": a.load, "cluster_share": a.cluster_share,
            "seed": a.seed, "max_plans": sim.max_plans, "cpu_s": round(time.process_time() - t0, 1), "preemptions": res.preemptions,
            "placed": res.placed, "ls_wait_p99_steady": d["ls_wait_p99_steady"],
            "steady_ls": len(steady), "waited_over_2s": len(over),
            "not_placed_at_arrival": len(sim.cls), "classes_at_arrival": dict(Counter(sim.cls.values())),
            "over_2s_by_class": dict(by_cls), "over_2s_by_class_gpus": dict(sorted(by_cls_gpus.items())),
            "bound_p99_steady": pct(bound, 0.99), "bound_over_2s": sum(1 for x in bound if x > 2),
            "over_2s": sorted(rows, key=lambda r: -r["wait"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="multigpu50")
    ap.add_argument("--load", type=float, default=150)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--policy", default=online.DEFAULT_POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max-plans", type=int, default=0,
                    help=f"plans per capacity event (default the replay's {online.MAX_PLANS}; the live walker: no limit)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = asyncio.run(run(a))
    text = json.dumps(out, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "over_2s"}, indent=1))
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
