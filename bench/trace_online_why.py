"""Why latency-sensitive blocks wait in the online replay (issue 36, docs/priority.md "Why LS
gangs wait"): each time the walker asks the preemption planner for a waiting LS+Guaranteed block
and gets no victim, the state is classified, from the planner's own rules (victims only
``minDelta`` lower, whole GPUs for a multi-GPU task, the block's GPU models, its CPU and memory):

* ``one_node``: some node fits it once its lower-priority instances are gone (the planner said no
  for another reason: its bound on GPUs freed, a gang);
* ``frag_free``: no node does, but the eligible nodes' idle whole GPUs add up to the need:
  fragmentation of free capacity (moves of anything would make room);
* ``frag_lower``: idle + lower-priority GPUs add up to the need across nodes, not on one: moves
  plus preemption would make room;
* ``same_priority``: even every lower-priority GPU evicted everywhere leaves fewer than the need:
  the GPUs are held by blocks of its own priority (or higher);
* ``cpu_mem``: the GPUs would be there on a node but not its CPU or memory.

Only the nodes whose whole CPU and memory can hold the task count (``too_small``: those that have
the GPUs but not that much CPU or memory in all, e.g. an 8-GPU task of 120 cores on a 96-core
node). Before, such nodes made ``cpu_mem`` (the GPUs there, the CPU never), so a task only the
few largest nodes can take, whose GPUs LS blocks held, was counted as CPU held by others.

It also counts the LS waits by GPUs asked and the share of the eligible GPUs LS holds.

    .venv/bin/python -m bench.trace_online_why --workload multigpu50 --load 300 --cluster-share 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace import qos as qosmod
from aios_blocks.trace.inventory import load_nodes

from .trace_online import code_version, pods


def classify(sim: online.Sim, j: online.Job) -> tuple[str, dict[str, Any]]:
    t = j.timed.task
    need = t.num_gpu
    prio = int(j.ir["priority"])
    floor = prio - sim.min_delta
    models = set(t.models() or ())
    cpu, mem = t.cpu_milli / 1000, t.memory_mib
    # per node: GPUs held by a block of at least floor+1 priority (not evictable)
    hard: dict[str, set[str]] = {}
    low_cpu: dict[str, float] = {}
    low_mem: dict[str, int] = {}
    for r in sim.running.values():
        if r.place is None:
            continue
        nid, gpus = r.place
        if int(r.ir["priority"]) > floor:
            hard.setdefault(nid, set()).update(gpus)
        else:
            low_cpu[nid] = low_cpu.get(nid, 0.0) + r.timed.task.cpu_milli / 1000
            low_mem[nid] = low_mem.get(nid, 0) + r.timed.task.memory_mib
    tot_free = tot_avail = ls_held = eligible = 0
    best_avail = 0
    gpu_ok_node = False
    too_small = 0
    for nid, v in sim.views.items():
        gs = [g for g in v["gpus"] if not models or g["model"] in models]
        if len(gs) < need:
            continue
        if float(v.get("cpu") or 0) + 1e-9 < cpu or int(v.get("memory") or 0) < mem:
            too_small += 1  # its whole CPU or memory is less than the task asks: never a host
            continue
        eligible += len(gs)
        free = sum(1 for g in gs if g["instances"] == 0 and not g["exclusive"])
        avail = sum(1 for g in gs if g["id"] not in hard.get(nid, ()))
        ls_held += len(gs) - avail
        tot_free += free
        tot_avail += avail
        best_avail = max(best_avail, avail)
        if avail >= need:
            gpu_ok_node = True
            if v["cpu_free"] + low_cpu.get(nid, 0.0) + 1e-9 >= cpu and v["memory_free"] + low_mem.get(nid, 0) >= mem:
                return "one_node", {}
    info = {"need": need, "free": tot_free, "avail": tot_avail, "best": best_avail, "held_hi": ls_held,
            "eligible": eligible, "too_small": too_small}
    if gpu_ok_node:
        return "cpu_mem", info
    if tot_free >= need:
        return "frag_free", info
    if tot_avail >= need:
        return "frag_lower", info
    return "same_priority", info


def holders(sim: online.Sim, j: online.Job) -> dict[str, Any]:
    """For a ``cpu_mem`` state: the node with the GPUs (once the lower blocks go) that comes closest
    to the CPU, and who holds its CPU and memory: blocks the planner may take (``lo_*``: GPU holders
    and CPU-only ones) and blocks it may not (``hi_*``: its own priority or higher), in cores / MiB."""
    t = j.timed.task
    floor = int(j.ir["priority"]) - sim.min_delta
    models = set(t.models() or ())
    best: tuple[float, dict[str, Any]] | None = None
    for nid, v in sim.views.items():
        gs = [g for g in v["gpus"] if not models or g["model"] in models]
        if len(gs) < t.num_gpu or float(v.get("cpu") or 0) + 1e-9 < t.cpu_milli / 1000 \
                or int(v.get("memory") or 0) < t.memory_mib:
            continue
        held: dict[str, float] = {"lo_gpu_cpu": 0.0, "lo_cpu_cpu": 0.0, "hi_gpu_cpu": 0.0, "hi_cpu_cpu": 0.0,
                                  "lo_mem": 0.0, "hi_gpu_mem": 0.0, "hi_cpu_mem": 0.0, "hi_cpu_n": 0}
        hard: set[str] = set()
        for r in sim.running.values():
            if r.place is None or r.place[0] != nid:
                continue
            rt, hi = r.timed.task, int(r.ir["priority"]) > floor
            kind = ("hi" if hi else "lo") + ("_gpu" if rt.num_gpu or rt.gpu_milli else "_cpu")
            held[kind + "_cpu"] += rt.cpu_milli / 1000
            held[kind + "_mem" if hi else "lo_mem"] += rt.memory_mib
            if hi:
                hard.update(r.place[1])
                held["hi_cpu_n"] += kind == "hi_cpu"
        if sum(1 for g in gs if g["id"] not in hard) < t.num_gpu:
            continue
        short = t.cpu_milli / 1000 - (v["cpu_free"] + held["lo_gpu_cpu"] + held["lo_cpu_cpu"])
        row = {"node": nid, "gpus": t.num_gpu, "need_cpu": t.cpu_milli / 1000, "need_mem": t.memory_mib,
               "cpu_free": v["cpu_free"], "mem_free": v["memory_free"], **held}
        if best is None or short < best[0]:
            best = (short, row)
    return best[1] if best else {}


class Stop(Exception):
    pass


class Why(online.Sim):
    def __init__(self, *a: Any, until: float = 0.0, **kw: Any):
        super().__init__(*a, **kw)
        self.until = until
        self.why: Counter[str] = Counter()
        self.why_gpus: Counter[tuple[str, int]] = Counter()
        self.samples: list[dict[str, Any]] = []
        self.waiting_ls: Counter[str] = Counter()

    def tick(self, now: float) -> None:
        if self.until and now > self.until:
            raise Stop
        super().tick(now)

    async def drain(self, now: float) -> None:
        await super().drain(now)
        # every 50th capacity event, each waiting LS block (the standing queue, not only plans)
        self.seq_drains = getattr(self, "seq_drains", 0) + 1
        if self.seq_drains % 50 == 0 and now <= self.span:
            for j in self.pending.values():
                if j.qos_class == qosmod.LATENCY_SENSITIVE and not j.preempted_by:
                    c, _ = classify(self, j)
                    self.waiting_ls[c] += 1

    async def preempt(self, j: online.Job, now: float, key: Any = None) -> bool:
        ok = await super().preempt(j, now, key)
        if not ok and j.qos_class == qosmod.LATENCY_SENSITIVE:
            c, info = classify(self, j)
            self.why[c] += 1
            self.why_gpus[(c, j.timed.task.num_gpu)] += 1
            if info and len(self.samples) < 4000:
                self.samples.append({"t": round(now, 1), "class": c, **info,
                                     **({"holders": holders(self, j)} if c == "cpu_mem" else {})})
        return ok


class WhyMoves(Why, orb.RebalanceSim):
    """``Why`` on the replay with the rebalancer (moves before preemption, the worker's rounds)."""


async def run(a: argparse.Namespace) -> dict[str, Any]:
    nodes = load_nodes(pods("default").with_name("openb_node_list_gpu_node.csv"), "trace")
    timed, _ = online.load_timed(pods(a.workload), a.seed)
    nodes = online.shrink(nodes, a.cluster_share, a.seed)
    if a.only_ls:  # the bound of any preemption: every lower-priority task gone for good
        timed = [t for t in timed if qosmod.class_of(t.task.qos) == qosmod.LATENCY_SENSITIVE]
    timed = [replace(t, created=t.created / a.load) for t in timed]
    args = (nodes, timed, online.Mode(a.mode), a.policy, a.seed, 0, online.HEAD, online.MIN_DELTA, a.workload)
    sim = WhyMoves(*args, until=a.until, max_moves=a.max_moves, frag_threshold=orb.FRAG_THRESHOLD) if a.rebalance \
        else Why(*args, until=a.until)
    t0 = time.process_time()
    stopped = False
    if a.cpu_limit:  # stop after this much CPU time: the figures up to the trace time reached
        def stop(*_: Any) -> None:
            raise Stop

        signal.signal(signal.SIGVTALRM, stop)
        signal.setitimer(signal.ITIMER_VIRTUAL, a.cpu_limit)
    try:
        res = await sim.run()
    except Stop:
        stopped = True
        res = sim.res
    d = res.as_dict()
    by_gpus: dict[int, list[float]] = {}
    ls: list[float] = []
    for j in sim.jobs.values():  # arrived by the time reached; one never placed waits to that time
        if j.qos_class == qosmod.LATENCY_SENSITIVE and online.WARMUP * sim.span <= j.timed.created <= sim.last_t:
            w = j.first_wait if j.first_wait is not None else max(0.0, sim.last_t - j.timed.created)
            by_gpus.setdefault(j.timed.task.num_gpu, []).append(w)
            ls.append(w)

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return round(s[min(len(s) - 1, int(len(s) * q))], 1) if s else 0.0

    gpus_per_node = Counter(len(n.gpus) for n in nodes)
    return {"code": code_version(), "workload": a.workload, "mode": a.mode, "only_ls": a.only_ls, "load": a.load, "cluster_share": a.cluster_share,
            "cpu_s": round(time.process_time() - t0, 1), "stopped_at": round(sim.last_t, 1) if stopped else None,
            "span_s": sim.span, "rebalance": a.rebalance, "moves": getattr(sim, "moves", 0),
            "ls_steady_so_far": {"n": len(ls), "waited_over_2s": sum(1 for x in ls if x > 2), "p50": pct(ls, 0.5),
                                 "p90": pct(ls, 0.9), "p99": pct(ls, 0.99)}, "preemptions": res.preemptions, "placed": res.placed, "pending_now": len(sim.pending), "ls_wait_p99_steady": d["ls_wait_p99_steady"],
            "nodes_by_gpus": dict(sorted(gpus_per_node.items())),
            "no_victim_plans": dict(sim.why), "no_victim_plans_by_gpus": {f"{c}/{g}": n for (c, g), n in sorted(sim.why_gpus.items())},
            "waiting_ls_sampled": dict(sim.waiting_ls),
            "ls_steady_wait_by_gpus": {g: {"n": len(w), "waited": sum(1 for x in w if x > 2), "p50": pct(w, 0.5),
                                           "p99": pct(w, 0.99)} for g, w in sorted(by_gpus.items())},
            "cpu_mem_holders_mean": _mean_holders(sim.samples),
            "samples": sim.samples[:: max(1, len(sim.samples) // 40)]}


def _mean_holders(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of each ``holders`` figure over the ``cpu_mem`` samples (cores, MiB, counts)."""
    rows = [s["holders"] for s in samples if s.get("holders")]
    keys = [k for k in (rows[0] if rows else {}) if k != "node"]
    return {"n": len(rows), **{k: round(sum(float(r[k]) for r in rows) / len(rows), 1) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="multigpu50")
    ap.add_argument("--mode", default="preemption")
    ap.add_argument("--load", type=float, default=300)
    ap.add_argument("--cluster-share", type=float, default=0.2)
    ap.add_argument("--policy", default=online.DEFAULT_POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-limit", type=float, default=0.0, help="stop after this many CPU seconds (figures so far)")
    ap.add_argument("--only-ls", action="store_true", help="replay only the LS+Guaranteed tasks (what a perfect "
                    "preemption of every lower task would leave them)")
    ap.add_argument("--rebalance", action="store_true", help="with the rebalancer (trace/online_rebalance.py)")
    ap.add_argument("--max-moves", type=int, default=orb.MAX_MOVES)
    ap.add_argument("--until", type=float, default=0.0, help="stop at this trace time (figures up to it)")
    ap.add_argument("--profile", type=Path, help="write a cProfile of the run here")
    a = ap.parse_args()
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        out = prof.runcall(asyncio.run, run(a))
        prof.dump_stats(str(a.profile))
    else:
        out = asyncio.run(run(a))
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
