"""``blocks trace replay --online --live``: the online replay (``trace.online``) through a running
system instead of the in-process simulation (issue 36, docs/priority.md "Online replay"). Each task
is submitted as a block at its ``creation_time`` and, once ready, deleted ``deletion_time -
creation_time`` later, both compressed by ``speed`` (trace seconds per wall second); the system's
own pending queue, priority classes (the trace's QoS mapped by ``trace.qos``, registered first)
and preemption decide. A victim's deletion is put off: it runs its whole duration again once
ready again, as in the simulation.

The figures come from the blocks' events (a core NATS subscription, no consumer per block): wait
(submit to the first ``ready``, in trace seconds) p50/p99 per class, preemptions (``preempting``)
and victims (``preempted``), cascades (a preemptor that had been a victim), GPU-seconds lost (a
victim's GPUs times the trace time it had run), and the blocks waiting (``pending``) once the last
task has arrived and ``settle_s`` passed. Wall-clock timing: small samples only (each task is a
real block through the whole system).

``replay_online_lockstep`` (``--online --live --lockstep``): the same trace in *trace* time, the
way ``trace.online.Sim`` steps it, so that the two make the same decisions: one event at a time
(arrivals and departures in the simulation's order, departures first at one instant), each
followed by a wait for the system to be quiet (every block ready, waiting with no instance left,
failed or deleted, no block event for ``quiet_s``) before the next; a block's departure is its
``ready``'s trace time plus its duration. Run against workers with ``LOCKSTEP_ENV`` (no periodic
queue pass, no moves before preemption, no drain grace, the queue's head as wide as the
simulation's): docs/priority.md "Same decisions live and in process"."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from ..schemas.spec import Cluster, Node
from . import qos as qosmod
from .live import CLUSTER, LiveError, block_spec, components
from .online import Timed, shrink
from .replay import block_id, policy_uri, setup_of
from .workload import UNITS

EVENTS = ("ready", "preempted", "preempting", "failed", "rejected")


@dataclass
class Track:
    """One task's block as the events show it (wall times: ``time.perf_counter``)."""

    timed: Timed
    qos_class: str
    submitted: float = 0.0
    first_ready: float | None = None
    ready_at: float | None = None
    victim: bool = False
    failed: str = ""
    delete: asyncio.Task[None] | None = None


@dataclass
class LiveOnline:
    tracks: dict[str, Track] = field(default_factory=dict)
    preemptions: int = 0
    victims: int = 0
    cascades: int = 0
    gpu_s_lost: float = 0.0


async def _register(client: Any, nodes: list[Node], timed: list[Timed], policy: str, seed: int) -> None:
    from ..bus.catalog import E
    from ..schemas.priority import PriorityClassRegistered
    from ..state.priority import PriorityStore

    if await client.store.clusters():
        raise LiveError("the system already has clusters: an online live replay needs one of its own (start a fresh "
                        "`blocks up --data-dir DIR`, or let the command start its own servers)")
    for rec in qosmod.records():
        await client.bus.emit(E.priority_class_registered, PriorityClassRegistered(rec["name"], rec),
                              msg_id=f"priorityclass:trace-online:{rec['name']}")
        await PriorityStore(client.store.r).put_class(rec)
    tasks = [t.task for t in timed]
    st = setup_of(policy, seed, 0, tasks, tasks, sum(len(n.gpus) for n in nodes) * UNITS)
    for comp in components(st):
        await client.add_component(comp)
    await client.import_nodes(Cluster(id=CLUSTER), [n.model_copy(update={"cluster": CLUSTER}) for n in nodes])


def spec_of(t: Timed) -> dict[str, Any]:
    """The task's block: waits in the queue (no ``maxPendingS``), its QoS's class, preemptible and
    movable as its class says (the offline replay's blocks are neither: ``live.block_spec``)."""
    spec = {k: v for k, v in block_spec(t.task).items() if k not in ("queue", "preemptible")}
    spec["priorityClass"] = qosmod.class_of(t.task.qos)
    spec["maxPendingS"] = 0
    return spec


async def replay_online_live(client: Any, nodes: list[Node], timed: list[Timed], speed: float = 1.0,
                             policy: str = "builtin:fgd-plus", seed: int = 42, load: float = 1.0, cluster_share: float = 1.0,
                             settle_s: float = 8.0, workload: str = "",
                             progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One online replay through the system ``client`` is connected to (see the module's docstring)."""
    from ..bus import subjects

    nodes = shrink(nodes, cluster_share, seed)
    if load != 1.0:
        timed = [replace(t, created=t.created / load) for t in timed]
    timed = sorted(timed, key=lambda t: (t.created, block_id(t.task)))
    await _register(client, nodes, timed, policy, seed)
    run = LiveOnline({block_id(t.task): Track(t, qosmod.class_of(t.task.qos)) for t in timed})
    start = timed[0].created if timed else 0.0

    async def delete_later(bid: str, after: float) -> None:
        await asyncio.sleep(after)
        with contextlib.suppress(Exception):
            await client.delete(bid)

    async def on_event(msg: Any) -> None:
        parts = msg.subject.split(".")
        bid, kind = parts[2], parts[-1]
        tr = run.tracks.get(bid)
        if tr is None:
            return
        now = time.perf_counter()
        data: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            data = msgspec.json.decode(msg.data).get("data") or {}
        if kind == "ready" and tr.ready_at is None:
            tr.ready_at = now
            if tr.first_ready is None:
                tr.first_ready = now
            # it runs its (whole) duration from now: a victim's earlier run is lost
            tr.delete = asyncio.ensure_future(delete_later(bid, tr.timed.duration / speed))
        elif kind == "preempted":
            run.victims += 1
            if tr.ready_at is not None:
                run.gpu_s_lost += tr.timed.task.milli_total / UNITS * (now - tr.ready_at) * speed
            tr.ready_at, tr.victim = None, True
            if tr.delete is not None:
                tr.delete.cancel()
        elif kind == "preempting":
            run.preemptions += 1
            run.cascades += 1 if tr.victim else 0
        elif kind in ("failed", "rejected"):
            tr.failed = str(data.get("reason") or data.get("errors") or kind)[:200]

    subs = [await client.bus.subscribe(subjects.block_event("*", kind), on_event) for kind in EVENTS]
    await client.bus.nc.flush()
    t0 = time.perf_counter()
    try:
        for t in timed:
            delay = t0 + (t.created - start) / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tr = run.tracks[block_id(t.task)]
            tr.submitted = time.perf_counter()
            await client.create(spec_of(t))
        progress(f"{len(timed)} tasks submitted over {time.perf_counter() - t0:.1f} s")
        await asyncio.sleep(settle_s)
        pending = [bid for bid in run.tracks if ((await client.store.get_block(bid)) or {}).get("status") == "pending"]
    finally:
        for s in subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        for tr in run.tracks.values():
            if tr.delete is not None:
                tr.delete.cancel()
    return figures(run, pending, speed, workload, policy, seed, load, cluster_share, len(nodes))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * q))], 3) if s else 0.0


def figures(run: LiveOnline, pending: list[str], speed: float, workload: str, policy: str, seed: int, load: float,
            cluster_share: float, nodes: int) -> dict[str, Any]:
    """The figures of a live online run; a block never ready counts its wait to the end."""
    end = time.perf_counter()
    waits: dict[str, list[float]] = {}
    for tr in run.tracks.values():
        w = ((tr.first_ready if tr.first_ready is not None else end) - tr.submitted) * speed
        waits.setdefault(tr.qos_class, []).append(max(0.0, w))
    by: dict[str, int] = {}
    for bid in pending:
        c = run.tracks[bid].qos_class
        by[c] = by.get(c, 0) + 1
    return {
        "workload": workload, "mode": "live", "clock": "wall", "policy": policy, "seed": seed, "speed": speed, "load": load,
        "cluster_share": cluster_share, "nodes": nodes, "tasks": len(run.tracks),
        "placed": sum(1 for t in run.tracks.values() if t.first_ready is not None),
        "failed": sum(1 for t in run.tracks.values() if t.failed),
        "preemptions": run.preemptions, "victims": run.victims, "cascades": run.cascades,
        "gpu_s_lost": round(run.gpu_s_lost, 1), "pending_end": len(pending), "pending_end_by_class": dict(sorted(by.items())),
        "wait": {c: {"n": len(w), "p50": _pct(w, 0.5), "p99": _pct(w, 0.99)} for c, w in sorted(waits.items())},
        "ls_wait_p99": _pct(waits.get(qosmod.LATENCY_SENSITIVE, []), 0.99),
        "be_wait_p99": _pct(waits.get(qosmod.BEST_EFFORT, []), 0.99),
    }


#: the workers' settings a lockstep replay decides with (``trace.online.Sim``'s): the queue is
#: walked on capacity events only (no periodic pass landing between two trace events), its head as
#: wide as the simulation's, no moves before a preemption (the simulation has none without
#: ``--rebalance``), victims drained and instances started at once
LOCKSTEP_ENV = {"AIOS_QUEUE_RESYNC_S": "3600", "AIOS_QUEUE_WINDOW": "64", "AIOS_REBALANCE_MAX_MOVES": "0",
                "AIOS_SCALE_DOWN_GRACE_S": "0", "AIOS_SIM_START_DELAY_S": "0"}
SETTLED = ("ready", "pending", "failed", "rejected", "deleted")


@dataclass
class Step:
    """A lockstep replay's state: the trace clock, the events to come, each block's run."""

    now: float = 0.0
    events: list[tuple[float, int, int, str, int]] = field(default_factory=list)
    seq: int = 0
    epoch: dict[str, int] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # block -> trace time of its current run's ready
    first_wait: dict[str, float] = field(default_factory=dict)
    became_ready: list[str] = field(default_factory=list)  # since the last quiet point
    #: the decisions in order: ("place", trace time, block, node, GPUs) and ("preempt", trace time, preemptor, victims)
    log: list[tuple[Any, ...]] = field(default_factory=list)
    last_event: float = 0.0

    def push(self, at: float, kind: int, bid: str, epoch: int) -> None:
        import heapq

        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, bid, epoch))


async def quiet(client: Any, st: Step, live: list[str], gone: set[str], quiet_s: float, timeout: float) -> None:
    """Wait until the system has nothing left to do for the blocks ``live``: no block event for
    ``quiet_s`` and every one settled (ready with its instance running, waiting with no instance,
    failed; deleted when in ``gone``). Raises ``LiveError`` after ``timeout`` seconds."""
    deadline = time.perf_counter() + timeout
    while True:
        gap = time.perf_counter() - st.last_event
        if gap < quiet_s:
            await asyncio.sleep(quiet_s - gap)
            continue
        mark = st.last_event
        unsettled = [bid for bid, (b, insts) in zip(live, await asyncio.gather(*(client.store.block_view(x) for x in live)),
                                                    strict=True) if not _settled(b, insts, bid in gone)]
        if not unsettled and st.last_event == mark:
            return
        if time.perf_counter() > deadline:
            raise LiveError(f"the system did not settle within {timeout:g} s at trace time {st.now:g}: {unsettled[:5]}")
        await asyncio.sleep(quiet_s / 2)


def _settled(block: Any, insts: dict[str, Any], deleted: bool) -> bool:
    if block is None or deleted:
        return deleted and (block is None or (block.get("status") == "deleted" and not insts))
    status = str(block.get("status"))
    if status not in SETTLED:
        return False
    if status == "ready":
        return bool(insts) and all(r.get("status") == "running" for r in insts.values())
    if status == "pending":
        return not insts and not block.get("preempting")
    return True


class Lockstep:
    """One lockstep replay's figures, kept from the blocks' events and the quiet points."""

    def __init__(self, st: Step, timed: list[Timed], res: Any):
        from .online import WARMUP

        self.st, self.res = st, res
        self.by_bid = {block_id(t.task): t for t in timed}
        self.cls = {bid: qosmod.class_of(t.task.qos) for bid, t in self.by_bid.items()}
        self.span = max((t.created for t in timed), default=0.0)
        self.steady_from = WARMUP * self.span
        self.been_victim: set[str] = set()
        self.live: list[str] = []
        self.gone: set[str] = set()
        self.snapshot = False

    async def on_event(self, msg: Any) -> None:
        parts = msg.subject.split(".")
        bid, kind = parts[2], parts[-1]
        st, res = self.st, self.res
        st.last_event = time.perf_counter()
        t = self.by_bid.get(bid)
        if t is None:
            return
        if kind == "ready":
            st.became_ready.append(bid)
        elif kind == "preempted":
            if bid in st.started:
                res.gpu_s_lost += t.task.milli_total / UNITS * (st.now - st.started.pop(bid))
            st.epoch[bid] += 1  # its departure is stale: it runs its whole duration again
            res.victims += 1
            self.been_victim.add(bid)
        elif kind == "preempting":
            data: dict[str, Any] = {}
            with contextlib.suppress(Exception):
                data = msgspec.json.decode(msg.data).get("data") or {}
            res.cascades += 1 if bid in self.been_victim else 0
            st.log.append(("preempt", st.now, bid, tuple(sorted(str(v) for v in (data.get("victims") or {})))))
            res.preemptions += 1

    def wait(self, bid: str, w: float) -> None:
        self.res.waits.setdefault(self.cls[bid], []).append(w)
        if self.by_bid[bid].created >= self.steady_from:
            self.res.steady_waits.setdefault(self.cls[bid], []).append(w)

    async def placed(self, client: Any, at: float) -> None:
        """The blocks that became ready during the event at ``at``: logged, their departures set."""
        st = self.st
        for rb in st.became_ready:
            rec = None if rb in st.started else next(iter((await client.store.instances(rb)).values()), None)
            if rec is None:
                continue
            st.log.append(("place", at, rb, str(rec["node"]), [str(g) for g in rec.get("gpus") or []]))
            st.started[rb] = at
            self.res.placed += 1
            t = self.by_bid[rb]
            if rb not in st.first_wait:
                st.first_wait[rb] = at - t.created
                self.wait(rb, at - t.created)
            st.push(at + t.duration, 0, rb, st.epoch[rb])
        st.became_ready.clear()

    def take_snapshot(self) -> None:
        """What waits at the end of the window (``Sim.snapshot``)."""
        waiting = [b for b in self.live if b not in self.st.started and b not in self.gone]
        self.res.pending_end = len(waiting)
        for b in waiting:
            self.res.pending_end_by_class[self.cls[b]] = self.res.pending_end_by_class.get(self.cls[b], 0) + 1
        self.snapshot = True

    def figures(self) -> dict[str, Any]:
        if not self.snapshot:
            self.take_snapshot()
        end = min(self.st.now, self.span)
        for bid, t in self.by_bid.items():  # never placed: the wait runs to the end of the window (``Sim.run``)
            if bid not in self.st.first_wait:
                self.wait(bid, max(0.0, end - t.created))
        self.res.span_s = self.span
        d: dict[str, Any] = self.res.as_dict()
        d["mode"], d["clock"], d["log"] = "live", "trace", [list(x) for x in self.st.log]
        return d


async def replay_online_lockstep(client: Any, nodes: list[Node], timed: list[Timed], policy: str = "builtin:fgd-plus",
                                 seed: int = 42, load: float = 1.0, cluster_share: float = 1.0, workload: str = "",
                                 quiet_s: float = 0.5, timeout: float = 120.0,
                                 progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The online replay through the system in trace time, one event at a time (see the module's
    docstring). The figures are ``trace.online.Online``'s, in trace seconds, and ``log`` the
    decisions in order, as ``trace.online.Sim.log`` has them."""
    import heapq

    from ..bus import subjects
    from .online import Online

    nodes = shrink(nodes, cluster_share, seed)
    if load != 1.0:
        timed = [replace(t, created=t.created / load) for t in timed]
    await _register(client, nodes, timed, policy, seed)
    st = Step()
    for t in timed:  # the simulation's order: (time, departures first, the list's order)
        st.push(t.created, 1, block_id(t.task), 0)
        st.epoch[block_id(t.task)] = 0
    res = Online(workload, "live", policy_uri(policy), seed, len(nodes), sum(len(n.gpus) for n in nodes), len(timed))
    res.load, res.cluster_share = load, cluster_share
    run = Lockstep(st, timed, res)
    sub = await client.bus.subscribe(subjects.block_all("*"), run.on_event)
    await client.bus.nc.flush()
    try:
        while st.events:
            at, kind, _seq, bid, epoch = heapq.heappop(st.events)
            if at > run.span and not run.snapshot:
                run.take_snapshot()
            st.now = at
            if kind == 0:
                if epoch != st.epoch[bid] or bid not in st.started:
                    continue
                st.started.pop(bid)
                run.gone.add(bid)
                await client.delete(bid)
            else:
                run.live.append(bid)
                await client.create(spec_of(run.by_bid[bid]))
            st.last_event = time.perf_counter()
            await quiet(client, st, run.live, run.gone, quiet_s, timeout)
            await run.placed(client, at)
            if kind == 1 and len(run.live) % 50 == 0:
                progress(f"{len(run.live)} of {len(timed)} tasks arrived (trace time {at:g} s)")
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return run.figures()
