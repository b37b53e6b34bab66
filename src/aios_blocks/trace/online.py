"""``blocks trace replay --online --in-process``: the trace's tasks arrive at their
``creation_time`` and run for ``deletion_time - creation_time`` once placed, on a contended
cluster, in a discrete-event simulation of trace time (no wall clock; events in time order,
departures before arrivals at the same instant). Issue 36, docs/priority.md "Online replay".

The decisions are the system's own, pure: each placement goes through the offline replay's policy
path (``handlers.controller.plan`` with the resourceAllocator through ``PolicyRuntime``,
``trace.replay``); the pending queue through ``handlers.queue.walk`` (priority then age, backfill
of blocks that fit now); victims through ``builtin:preempt-min`` (``policies.builtin.preempt``)
with its input built by ``handlers.preemption.preempt_input``. A victim loses the work it did
(counted in GPU-seconds), waits with ``preempted_by`` set, never preempts, and runs its whole
duration again once placed.

Modes: ``preemption`` (the default), ``no-preemption`` (the queue without the planner), ``fifo``
(the queue by age only, no priority, no preemption). Pure but for reading the CSV.
"""

from __future__ import annotations

import bisect
import csv
import heapq
import itertools
import random
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..handlers import preemption as pre
from ..handlers import queue
from ..policies import capacity
from ..policies.builtin import preempt
from ..schemas.records import BlockIR, BlockRecord, ClusterRecord, Needs, NodeView
from ..schemas.spec import Node
from . import qos as qosmod
from .replay import DEFAULT_POLICY, block_id, labels, setup_of, views_of
from .workload import UNITS, Task, load_tasks

#: how many waiting blocks one walk reads (the head of the queue, priority then age)
HEAD = 64
#: the preemption plans one capacity event may ask for (the walker's budget per event)
MAX_PLANS = 4
#: the default minimum priority gap of a preemption (``AIOS_PREEMPT_MIN_DELTA``)
MIN_DELTA = preempt.DEFAULT_MIN_DELTA
#: the steady state starts after this share of the trace's span (the empty cluster filling up)
WARMUP = 0.1
CLUSTER = "trace"


def shrink(nodes: list[Node], share: float, seed: int) -> list[Node]:
    """A seeded sample of ``share`` of the nodes, per GPU model (at least one of each): the trace's
    own cluster is never contended by its tasks (docs/priority.md "Online replay")."""
    if share >= 1:
        return list(nodes)
    rng = random.Random(seed)
    by_model: dict[str, list[Node]] = {}
    for n in nodes:
        by_model.setdefault(n.gpus[0].model if n.gpus else "", []).append(n)
    keep: set[str] = set()
    for _model, ns in sorted(by_model.items()):
        keep |= {n.id for n in rng.sample(ns, max(1, round(share * len(ns))))}
    return [n for n in nodes if n.id in keep]


class Mode(StrEnum):
    PREEMPTION = "preemption"
    NO_PREEMPTION = "no-preemption"
    FIFO = "fifo"


@dataclass(frozen=True)
class Timed:
    """A task with its trace times (seconds of trace time)."""

    task: Task
    created: float
    duration: float


def load_timed(path: Path, seed: int = 42) -> tuple[list[Timed], int]:
    """The tasks of a pod list with their ``creation_time``/``deletion_time``. A list without those
    columns (``multigpu*``: the default's tasks plus added multi-GPU ones) takes the times and QoS
    of the same-named task in ``openb_pod_list_default.csv`` beside it, and each added task a
    seeded draw of another's. Returns the tasks and how many had their times drawn."""
    tasks = load_tasks(path)
    rows = _rows(path)
    if not any(r.get("creation_time") not in (None, "") for r in rows.values()):
        rows = _rows(path.with_name("openb_pod_list_default.csv"))
    known = [(float(r["creation_time"]), float(r["deletion_time"]), str(r.get("qos") or ""))
             for r in rows.values() if r.get("creation_time") not in (None, "") and r.get("deletion_time") not in (None, "")]
    if not known:
        raise ValueError(f"{path}: no creation_time/deletion_time (nor in openb_pod_list_default.csv beside it)")
    rng = random.Random(seed)
    out, drawn = [], 0
    for t in tasks:
        r = rows.get(t.name)
        if r is not None and r.get("creation_time") not in (None, "") and r.get("deletion_time") not in (None, ""):
            c, d, q = float(r["creation_time"]), float(r["deletion_time"]), str(r.get("qos") or "")
        else:
            c, d, q = known[rng.randrange(len(known))]
            drawn += 1
        if not t.qos and q:
            t = Task(t.name, t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli, t.gpu_spec, q)
        out.append(Timed(t, c, max(0.0, d - c)))
    return out, drawn


def _rows(path: Path) -> dict[str, dict[str, str]]:
    try:
        with path.open(encoding="utf-8") as f:
            return {r["name"]: r for r in csv.DictReader(f)}
    except OSError:
        return {}


def release(node: NodeView, gpu_ids: list[str], needs: Needs, share: bool) -> NodeView:
    """The inverse of ``capacity.take``: a copy of the node view with one instance gone."""
    out = capacity.copy_node(node)
    out["cpu_free"] = round(out["cpu_free"] + needs.get("cpu", 0), 6)
    out["memory_free"] += needs.get("memory", 0)
    units = capacity.share_units(needs) if share else 0
    for g in out["gpus"]:
        if g["id"] in gpu_ids:
            used = g["memory"] if not share else needs.get("gpuMemory", 0)
            g["memory_used"] -= used
            g["memory_free"] += used
            g["instances"] -= 1
            if not share:
                g["exclusive"] = False
            if units:
                g["share_free"] = g.get("share_free", capacity.SHARE_UNITS) + units
    capacity.take(out, [], {}, share)  # changes nothing; drops what was derived from the dict's id
    return out


@dataclass
class Job:
    timed: Timed
    ir: BlockIR
    qos_class: str
    since: float  # when it last started waiting
    first_wait: float | None = None  # arrival -> first placement
    start: float = 0.0
    place: tuple[str, list[str]] | None = None
    epoch: int = 0  # bumped at each placement: a departure of an older run is stale
    preempted_by: str = ""
    victim_times: int = 0
    #: its place in the queue's order (``Sim.qkey``: kept until ``since`` changes) and its task's
    #: resources (the task never changes): computed once, not per walk
    qkey: tuple[Any, ...] = ()
    needs: Needs | None = None
    #: its place in the arrival order: the age the planner reads (``created``; the live system's
    #: is the create's stream sequence: the same order, not the time it was last placed)
    order: int = 0


class Pending(dict[str, Job]):
    """``Sim.pending``: the waiting blocks by id, also kept per group in the queue's order, so the
    walk's head is read without sorting every waiting block at every capacity event (multigpu50
    waits 2,000+ at once). A group is a shape (``capacity.shape``: whether some node fits one
    instance depends on it alone) and whether its blocks are left out of the head when they fit no
    node (``Sim.must_fit``); each group holds its blocks' ``Sim.qkey`` sorted. A block's key and
    group are taken when it is put in (its ``since``, priority and ``preempted_by`` are set before
    and do not change while it waits); ``Sim.head_entries_sorted`` is the computation it replaces
    (tests/unit/test_online_pending.py compares the two)."""

    def __init__(self, sim: Sim):
        super().__init__()
        self.sim = sim
        #: group -> the blocks' queue keys, sorted; group -> (needs, sharing) to judge its fit
        self.groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        self.needs: dict[tuple[Any, ...], tuple[Needs, bool]] = {}
        self._where: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}

    def __setitem__(self, bid: str, j: Job) -> None:
        if bid in self:
            self._drop(bid)
        super().__setitem__(bid, j)
        sim, t = self.sim, j.timed.task
        needs = j.needs
        if needs is None:
            needs = j.needs = t.resources()
        group = (capacity.shape(needs, t.sharing), sim.must_fit(j))
        key = sim.qkey(j)
        keys = self.groups.get(group)
        if keys is None:
            keys = self.groups[group] = []
            self.needs[group] = (needs, t.sharing)
        bisect.insort(keys, key)
        self._where[bid] = (group, key)

    def _drop(self, bid: str) -> None:
        group, key = self._where.pop(bid)
        keys = self.groups[group]
        del keys[bisect.bisect_left(keys, key)]
        if not keys:
            del self.groups[group], self.needs[group]

    def __delitem__(self, bid: str) -> None:
        super().__delitem__(bid)
        self._drop(bid)

    def pop(self, bid: str, *default: Any) -> Any:
        if bid not in self:
            if default:
                return default[0]
            raise KeyError(bid)
        self._drop(bid)
        return super().pop(bid)

    def clear(self) -> None:
        super().clear()
        self.groups.clear()
        self.needs.clear()
        self._where.clear()

    def popitem(self) -> tuple[str, Job]:
        raise NotImplementedError("Pending: pop a block by id")

    def setdefault(self, *args: Any) -> Any:
        raise NotImplementedError("Pending: set a block by id")

    def update(self, *args: Any, **kwargs: Any) -> None:
        for bid, j in dict(*args, **kwargs).items():
            self[bid] = j

    def first(self, n: int) -> list[Job]:
        """The first ``n`` waiting blocks in the queue's order (``Sim.qkey``), every group's: what
        ``sorted(pending.values(), key=sim.qkey)[:n]`` gives, without sorting them all."""
        return [self[key[-1]] for key in itertools.islice(heapq.merge(*self.groups.values()), n)]

    def head(self, views: dict[str, NodeView], n: int) -> list[str]:
        """The first ``n`` waiting blocks in the queue's order, those of a group that must fit and
        fits no node in ``views`` left out (a group is judged when the merge reaches it, as the
        sorted walk judged each block it reached)."""
        heap = [(keys[0], 0, group) for group, keys in self.groups.items()]
        heapq.heapify(heap)
        out: list[str] = []
        while heap and len(out) < n:
            key, i, group = heap[0]
            if i == 0 and group[1] and not capacity.fitting(views, *self.needs[group]):
                heapq.heappop(heap)
                continue
            out.append(key[-1])
            keys = self.groups[group]
            if i + 1 < len(keys):
                heapq.heapreplace(heap, (keys[i + 1], i + 1, group))
            else:
                heapq.heappop(heap)
        return out


@dataclass
class Online:
    workload: str
    mode: str
    policy: str
    seed: int
    nodes: int
    gpus: int
    tasks: int = 0
    load: float = 1.0
    cluster_share: float = 1.0
    drawn_times: int = 0
    span_s: float = 0.0
    placed: int = 0
    preemptions: int = 0  # preemption decisions that evicted something
    victims: int = 0  # victim instances evicted
    cascades: int = 0  # preemptions by a block that had been a victim
    gpu_s_lost: float = 0.0
    freed_over_bound: int = 0  # preemptions that freed more GPUs than the need + one node's
    gpus_freed_max_excess: float = 0.0  # the largest (freed - need) over the preemptions
    pending_end: int = 0
    pending_end_by_class: dict[str, int] = field(default_factory=dict)
    waits: dict[str, list[float]] = field(default_factory=dict)
    steady_waits: dict[str, list[float]] = field(default_factory=dict)
    alloc_mean: float = 0.0
    #: (trace time, GPU allocation %, queue length), after each event
    series: list[tuple[float, float, int]] = field(default_factory=list)

    def as_dict(self, points: int = 400) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            s = sorted(xs)
            return round(s[min(len(s) - 1, int(len(s) * q))], 3) if s else 0.0

        ls = self.waits.get(qosmod.LATENCY_SENSITIVE, [])
        step = max(1, len(self.series) // points)
        return {
            "workload": self.workload, "mode": self.mode, "policy": self.policy, "seed": self.seed, "nodes": self.nodes,
            "gpus": self.gpus, "tasks": self.tasks, "load": self.load, "cluster_share": self.cluster_share, "drawn_times": self.drawn_times, "span_s": self.span_s,
            "placed": self.placed, "preemptions": self.preemptions, "victims": self.victims, "cascades": self.cascades,
            "gpu_s_lost": round(self.gpu_s_lost, 1), "freed_over_bound": self.freed_over_bound,
            "gpus_freed_max_excess": round(self.gpus_freed_max_excess, 3),
            "pending_end": self.pending_end, "pending_end_by_class": dict(sorted(self.pending_end_by_class.items())),
            "alloc_mean": round(self.alloc_mean, 3),
            "wait": {c: {"n": len(w), "p50": pct(w, 0.5), "p99": pct(w, 0.99)} for c, w in sorted(self.waits.items())},
            "wait_steady": {c: {"n": len(w), "p50": pct(w, 0.5), "p99": pct(w, 0.99)}
                            for c, w in sorted(self.steady_waits.items())},
            "ls_wait_p99": pct(ls, 0.99),
            "ls_wait_p99_steady": pct(self.steady_waits.get(qosmod.LATENCY_SENSITIVE, []), 0.99),
            "be_wait_p99": pct(self.waits.get(qosmod.BEST_EFFORT, []), 0.99),
            "series": [[round(t, 1), round(a, 3), q] for t, a, q in self.series[::step]],
        }


class Sim:
    """The cluster, the running and the waiting blocks, and the figures (see the module docstring)."""

    def __init__(self, nodes: list[Node], timed: list[Timed], mode: Mode, policy: str, seed: int, sample_nodes: int,
                 head: int, min_delta: int, workload: str, incremental: bool = True):
        from ..policies.runtime import PolicyRuntime

        self.views = views_of(nodes)
        self.cluster_milli = sum(len(n.gpus) for n in nodes) * UNITS
        if not self.cluster_milli:
            raise ValueError("the inventory has no GPU: nothing to measure")
        self.node_gpus = max((len(n.gpus) for n in nodes), default=0)
        self.mode, self.head, self.min_delta, self.max_plans = mode, head, min_delta, MAX_PLANS
        tasks = [t.task for t in timed]
        self.st = setup_of(policy, seed, sample_nodes, tasks, tasks, self.cluster_milli)
        self.runtime = PolicyRuntime(lookup=None)
        self.rules = {s: self.st.rule(s) for s in (False, True)}
        self.clusters: dict[str, ClusterRecord] = {CLUSTER: {"id": CLUSTER, "labels": {}}}
        self.jobs: dict[str, Job] = {}
        self.running: dict[str, Job] = {}
        self.pending: Pending = Pending(self)
        self.allocated = 0
        #: (shape, priority) the planner found no victim for, since nothing that could change its
        #: answer happened: capacity freed (cleared), or a block it could evict placed (its keys
        #: cleared). Less free capacity and no new candidate never turn a "no" into a plan.
        self.no_victims: set[tuple[Any, int]] = set()
        #: ``incremental``: the planner's input kept by ``handlers.preemption.Index`` as blocks come
        #: and go (else rebuilt from every view and running block per plan, as before), and the
        #: planner's ``NO_FIT`` answers (key -> the block's planner row) kept across capacity
        #: freed on a node where even with every evictable instance gone the block still does not
        #: fit (``preempt.node_may_fit``; blocks of one instance). The decisions are the same
        #: (``decisions``; tests/unit/test_online_incremental.py compares both on seeded workloads).
        self.incremental = incremental
        self.index = pre.Index(CLUSTER, self.views) if incremental else None
        self.no_fit: dict[tuple[Any, int], dict[str, Any]] = {}
        #: each preemption: (preemptor, its victims)
        self.decisions: list[tuple[str, tuple[str, ...]]] = []
        #: every decision in order: ("place", trace time, block, node, GPUs), ("preempt", trace time,
        #: preemptor, victims): what ``online_live.replay_online_lockstep`` logs the same way
        self.log: list[tuple[Any, ...]] = []
        self.res = Online(workload, str(mode), self.st.uri, seed, len(nodes), self.cluster_milli // UNITS, len(timed))
        self.events: list[tuple[float, int, int, str, int]] = []  # (time, kind 0 departure / 1 arrival, seq, bid, epoch)
        self.seq = 0
        for t in timed:
            self.push(t.created, 1, block_id(t.task), 0)
            self.jobs[block_id(t.task)] = self.job(t)
        for k, i in enumerate(sorted(range(len(timed)), key=lambda i: (timed[i].created, i))):
            self.jobs[block_id(timed[i].task)].order = k + 1
        #: the window the figures cover: up to the last arrival (a few tasks run for months after it)
        self.span = max((t.created for t in timed), default=0.0)
        self.last_t, self.area = 0.0, 0.0

    def job(self, t: Timed) -> Job:
        cls = qosmod.class_of(t.task.qos)
        prio = 0 if self.mode is Mode.FIFO else qosmod.priority_of(t.task.qos)
        ir: BlockIR = {"blockId": block_id(t.task), "blockComponentURI": "aios://trace/task", "minInstances": 1, "maxInstances": 1,
              "resources": t.task.resources(), "priority": prio, "priorityClass": cls, "labels": labels(t.task),
              "policies": {"resourceAllocator": self.rules[t.task.sharing],
                           "clusterAllocator": {"name": "clusterAllocator", "settings": {"filter": {"capacity": True}}}}}
        return Job(t, ir, cls, t.created)

    def push(self, at: float, kind: int, bid: str, epoch: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, bid, epoch))

    # -- decisions ----------------------------------------------------------------------------
    async def place(self, j: Job, now: float) -> bool:
        """The offline replay's policy path; on success the placement is applied."""
        from ..handlers import controller
        from ..schemas.errors import PlacementFailed

        rule = self.rules[j.timed.task.sharing]

        async def invoke(inp: dict[str, Any]) -> Any:
            return await self.runtime.invoke(rule, "resourceAllocator", inp)

        bid = block_id(j.timed.task)
        try:
            out = await controller.plan(j.ir, self.clusters[CLUSTER], self.views, "allocation",
                                        [controller.instance_id(bid, 0)], invoke)
        except PlacementFailed:
            return False
        nid, gpus = out[0]["node"], list(out[0]["gpus"])
        node = capacity.copy_node(self.views[nid])
        capacity.take(node, gpus, j.timed.task.resources(), j.timed.task.sharing)
        self.views[nid] = node
        self.allocated += j.timed.task.milli_total
        if self.no_victims:
            q = int(j.ir["priority"])
            self.no_victims = {k for k in self.no_victims if k[1] - self.min_delta < q}
        if j.first_wait is None:
            j.first_wait = now - j.timed.created
            self.res.waits.setdefault(j.qos_class, []).append(j.first_wait)
            if j.timed.created >= WARMUP * self.span:
                self.res.steady_waits.setdefault(j.qos_class, []).append(j.first_wait)
        j.place, j.start, j.epoch = (nid, gpus), now, j.epoch + 1
        if self.index is not None:
            self.index.node(nid, node)
            self.index.add(self.row(bid, j))
        self.pending.pop(bid, None)
        self.running[bid] = j
        self.res.placed += 1
        self.log.append(("place", now, bid, nid, gpus))
        self.push(now + j.timed.duration, 0, bid, j.epoch)
        return True

    def unplace(self, bid: str) -> Job:
        j = self.running.pop(bid)
        assert j.place is not None
        nid, gpus = j.place
        self.views[nid] = release(self.views[nid], gpus, j.timed.task.resources(), j.timed.task.sharing)
        self.allocated -= j.timed.task.milli_total
        self.no_victims.clear()
        if self.index is not None:
            self.index.remove(bid)
            self.index.node(nid, self.views[nid])
            if self.no_fit:
                pnode = self.index.nodes.get(nid)
                on = self.index.on_node(nid)
                self.no_fit = {k: b for k, b in self.no_fit.items()
                               if pnode is None or not preempt.node_may_fit(b, nid, pnode, on, self.min_delta)}
        j.place = None
        return j

    def block(self, j: Job) -> BlockRecord:
        return {"status": "pending", "ir": j.ir, "gen": 0, "preempted_by": j.preempted_by}

    def qkey(self, j: Job) -> tuple[Any, ...]:
        """The queue's order: priority desc, then age, then id (FIFO: age, then id)."""
        if not j.qkey or j.qkey[-2] != j.since:
            bid = block_id(j.timed.task)
            j.qkey = (j.since, bid) if self.mode is Mode.FIFO else (-int(j.ir["priority"]), j.since, bid)
        return j.qkey

    def must_fit(self, j: Job) -> bool:
        """Whether the head leaves the block out when its shape fits no node now: it may not
        preempt (the walk passes over it anyway)."""
        return self.mode is not Mode.PREEMPTION or bool(j.preempted_by) or not int(j.ir["priority"])

    def head_entries(self) -> list[queue.Entry]:
        """The queue's head (priority desc then age; FIFO: age), without the blocks whose shape
        fits no node now and that may not preempt: the walk passes over those anyway. Read from
        ``Pending``'s groups; ``head_entries_sorted`` is the same from every waiting block."""
        return [queue.Entry(bid, self.block(self.pending[bid])) for bid in self.pending.head(self.views, self.head)]

    def head_entries_sorted(self) -> list[queue.Entry]:
        """``head_entries`` computed from scratch: every waiting block sorted, then judged."""
        out = []
        for j in sorted(self.pending.values(), key=self.qkey):
            t = j.timed.task
            needs = j.needs
            if needs is None:
                needs = j.needs = t.resources()
            if not capacity.fitting(self.views, needs, t.sharing) and self.must_fit(j):
                continue
            out.append(queue.Entry(block_id(t), self.block(j)))
            if len(out) >= self.head:
                break
        return out

    async def drain(self, now: float) -> None:
        """Walk the queue until it releases nothing and preempts nothing."""
        tried: set[str] = set()
        plans = 0
        while self.pending:
            entries = self.head_entries()
            if not entries:
                return
            if self.mode is not Mode.PREEMPTION:
                tried |= {e.bid for e in entries}
            w = queue.walk(entries, self.clusters, {CLUSTER: self.views}, frozenset(tried), now)
            moved = False
            for bid, _gen, _cid in w.retry:
                moved = await self.place(self.pending[bid], now) or moved
            if w.retry and moved:
                continue
            if not w.preempt:
                return
            bid = w.preempt[0]
            tried.add(bid)
            j = self.pending[bid]
            t = j.timed.task
            key = (capacity.shape(t.resources(), t.sharing), int(j.ir["priority"]))
            if key in self.no_victims:
                continue
            plans += 1  # a plan asked for, or known (``no_fit``) to answer what it answered before
            if key in self.no_fit or not await self.preempt(j, now, key):
                self.no_victims.add(key)
            if plans >= self.max_plans:  # the walker's budget per capacity event
                tried |= {b for b, p in self.pending.items() if int(p.ir["priority"])}

    @staticmethod
    def row(bid: str, r: Job) -> dict[str, Any]:
        """A running block as ``handlers.preemption.candidates`` reads it."""
        assert r.place is not None
        return {"block_id": bid, "ir": r.ir, "created": float(r.order), "gen": 0,
                "instances": {f"{bid}-0": {"node": r.place[0], "gpus": r.place[1]}}}

    def plan_input(self, bid: str, j: Job) -> dict[str, Any]:
        """The planner's input: only the blocks it may take (``minDelta`` lower; it passes over the
        others anyway), from the index, or rebuilt from every view and running block."""
        floor = int(j.ir["priority"]) - self.min_delta
        if self.index is not None:
            return self.index.input(bid, j.ir, self.min_delta, j.preempted_by, floor)
        placed = [self.row(b, r) for b, r in self.running.items() if r.place is not None and int(r.ir["priority"]) <= floor]
        return pre.preempt_input(bid, j.ir, CLUSTER, self.views, placed, self.min_delta, j.preempted_by)

    async def preempt(self, j: Job, now: float, key: tuple[Any, int] | None = None) -> bool:
        bid = block_id(j.timed.task)
        data = self.plan_input(bid, j)
        out = preempt.plan(data)
        victims = sorted({iid.rsplit("-", 1)[0] for ids in (out.get("victims") or {}).values() for iid in ids})
        if not victims:
            if key is not None and self.index is not None and out.get("reason") == preempt.NO_FIT \
                    and int(j.ir.get("minInstances") or 0) <= 1:
                self.no_fit[key] = data["block"]
            return False
        self.decisions.append((bid, tuple(victims)))
        self.log.append(("preempt", now, bid, tuple(victims)))
        self.res.preemptions += 1
        if j.victim_times:
            self.res.cascades += 1
        need = j.timed.task.milli_total / UNITS
        freed = float(out.get("gpus_freed") or 0.0)
        self.res.gpus_freed_max_excess = max(self.res.gpus_freed_max_excess, freed - need)
        if freed > need + self.node_gpus + 1e-9:
            self.res.freed_over_bound += 1
        for v in victims:
            vj = self.unplace(v)
            self.res.victims += 1
            self.res.gpu_s_lost += vj.timed.task.milli_total / UNITS * (now - vj.start)
            vj.preempted_by, vj.since, vj.victim_times = bid, now, vj.victim_times + 1
            vj.epoch += 1  # its departure is stale: it runs its whole duration again
            self.pending[v] = vj
        await self.place(j, now)  # the plan said it fits (a policy that still refuses leaves it waiting)
        return True

    # -- the loop -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        now = min(now, self.span)
        if now > self.last_t:
            self.area += (now - self.last_t) * self.allocated
            self.last_t = now

    def snapshot(self) -> None:
        """What waits at the end of the window."""
        self.res.pending_end = len(self.pending)
        by: dict[str, int] = {}
        for p in self.pending.values():
            by[p.qos_class] = by.get(p.qos_class, 0) + 1
        self.res.pending_end_by_class = by

    async def run(self) -> Online:
        end = self.span
        res = self.res
        snapshot = False
        while self.events:
            now, kind, _seq, bid, epoch = heapq.heappop(self.events)
            if now > end and not snapshot:  # the figures cover the window up to the last arrival
                self.snapshot()
                snapshot = True
            self.tick(now)
            j = self.jobs[bid]
            if kind == 0:
                if bid not in self.running or j.epoch != epoch:
                    continue
                self.unplace(bid)
                j.preempted_by = ""
                await self.drain(now)
            else:
                self.pending[bid] = j
                if not await self.place(j, now):
                    await self.drain(now)
            if now <= end:
                res.series.append((now, 100 * self.allocated / self.cluster_milli, len(self.pending)))
        if not snapshot:
            self.snapshot()
        # the blocks never placed (they fit on no node, ever): their wait runs to the end of the window
        for j in self.jobs.values():
            if j.first_wait is None:
                w = max(0.0, self.last_t - j.timed.created)
                res.waits.setdefault(j.qos_class, []).append(w)
                if j.timed.created >= WARMUP * self.span:
                    res.steady_waits.setdefault(j.qos_class, []).append(w)
        res.span_s = end
        res.alloc_mean = 100 * self.area / (self.cluster_milli * self.last_t) if self.last_t else 0.0
        return res


async def replay_online(nodes: list[Node], timed: list[Timed], mode: Mode = Mode.PREEMPTION, policy: str = DEFAULT_POLICY,
                        seed: int = 42, sample_nodes: int = 0, head: int = HEAD, min_delta: int = MIN_DELTA,
                        workload: str = "", drawn: int = 0, load: float = 1.0, cluster_share: float = 1.0,
                        incremental: bool = True) -> Online:
    """One online replay (see the module's docstring). ``load``: the arrivals' times divided by
    it, the durations kept (the trace's own times keep its cluster nearly idle: docs/priority.md)."""
    nodes = shrink(nodes, cluster_share, seed)
    if load != 1.0:
        timed = [replace(t, created=t.created / load) for t in timed]
    sim = Sim(nodes, timed, mode, policy, seed, sample_nodes, head, min_delta, workload, incremental)
    sim.res.drawn_times, sim.res.load, sim.res.cluster_share = drawn, load, cluster_share
    return await sim.run()


def draw(results: list[dict[str, Any]], path: Path) -> None:
    """GPU allocation (%) and queue length over trace time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in results:
        xs = [p[0] / 3600 for p in r["series"]]
        ax1.plot(xs, [p[1] for p in r["series"]], label=f"{r['workload']} {r['mode']}", linewidth=0.8)
        ax2.plot(xs, [p[2] for p in r["series"]], label=f"{r['workload']} {r['mode']}", linewidth=0.8)
    ax1.set_ylabel("GPU allocation (%)")
    ax1.set_ylim(0, 100)
    ax2.set_ylabel("pending blocks")
    ax2.set_xlabel("trace time (hours)")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle("online replay: allocation and queue over trace time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
