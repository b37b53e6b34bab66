"""The one adapter of allocation (Nomad's plan/apply): read a snapshot, ask the pure
``handlers.allocation.plan_allocation`` for the reservation, commit it with compare-and-set in
Redis (``Store.reserve_gang``, all or nothing: never double-booked) and, on a conflict, read the
touched nodes again and plan again (bounded by ``commit_retries``). ``start`` commits a
``StartInstances``: the records in one round trip, then the placement and create commands. A step
that starts what it reserves (``allocate``'s ``then``, the gang's) sends the reservation and the
records as one script on one Redis server (``Store.reserve_then_start``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from ..handlers import allocation as al
from ..handlers import queue as hq
from ..policies import node_digest
from ..policies import quota as qp
from ..schemas.errors import PlacementFailed
from ..schemas.events import Decision
from ..schemas.lifecycle import Step
from ..schemas.records import BlockIR, BlockRecord, NodeView
from ..state.queue import Nominations
from . import queue
from .base import LaterDigests, Worker
from .vcluster import ensure_job_cluster

log = structlog.get_logger("aios.controller")

_locks: dict[str, asyncio.Lock] = {}
#: id(worker) -> (when read, the suspect nodes then, node -> why): read at most once a second
_suspect_cache: dict[int, tuple[float, dict[str, str]]] = {}
SUSPECT_CACHE_S = 1.0


#: the suspect nodes and the nominated preemptors, as a step read them together with its own
#: first read (``controller.on_allocation``): one Redis exchange with it, not one each after it
Ahead = tuple[dict[str, str], list[hq.Nominee]]
#: one instance's reservation (None: none), as a step read it with its own first read: the
#: gang's first member's, ``controller.on_allocation``
Reserved = tuple[str, dict[str, str] | None]
#: what starting a step's placements takes, given them, the attempts and the nodes' views
#: (``allocation.start_effects`` with the step's own arguments): ``allocate``'s ``then``
StartOf = Callable[[list[dict[str, Any]], int, Mapping[str, NodeView]], al.StartInstances]


class Turn:
    """An allocation step's place among this process's steps of one cluster, taken when the step
    is delivered (before its first await: a batch's handlers start in delivery order). The step
    plans once the one delivered before it holds the cluster's lock (first in, first out) or has
    left, so a process plans a cluster's requests in the order they came, whatever its reads
    took: a preempted block placed again reads its reservations in one exchange more than a new
    block, and a later request of the same batch planned before it (the blocks one queue walk
    releases at one instant planned in another order than the walk's, as the in-process replay
    plans them: tests/integration/test_trace_online_lockstep.py failed about 1 run in 2 when the
    walk's requests reached the controller in one batch)."""

    def __init__(self, cid: str) -> None:
        self.cid = cid
        loop = asyncio.get_running_loop()
        before = _turns.get(cid)
        # a step of an event loop that is gone (a worker stopped with steps in flight, its loop
        # closed before their ``finally`` ran) never passes: nobody of this loop waits for it
        self.before = before if before is not None and before.get_loop() is loop else None
        self.passed: asyncio.Future[None] = loop.create_future()
        _turns[cid] = self.passed

    async def wait(self) -> None:
        """Until the step delivered before this one holds the lock or has left."""
        before = self.before
        if before is not None and not before.done():
            await asyncio.wait([before])  # not cancelled with this step
        self.before = None

    def leave(self) -> None:
        """This step holds the lock (or will not plan): the next one may take it. A step that
        leaves before its turn passes on its own once the one before it has."""
        before, self.before = self.before, None
        if before is not None and not before.done():
            before.add_done_callback(lambda _f: self.leave())
            return
        if not self.passed.done():
            self.passed.set_result(None)
        if _turns.get(self.cid) is self.passed:
            del _turns[self.cid]


#: per cluster: the last allocation step of this process to take its turn (``Turn``)
_turns: dict[str, asyncio.Future[None]] = {}


async def allocate(
    w: Worker, req: al.Request, instances: dict[str, Any] | None = None, trace: list[Decision] | None = None,
    ahead: Ahead | None = None, reserved: Reserved | None = None, turn: Turn | None = None,
    then: StartOf | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Placements for ``req`` and the attempts it took (0: a redelivered step found its
    reservations already made and reuses them). The policy calls' records go into ``trace``.
    ``ahead``: the suspect nodes and the nominees (``suspect_nodes``, ``queue.nominees``) as the
    step read them (neither depends on the block), else read here. ``reserved``: the first
    instance's reservation as the step read it (``_reservations``). ``turn``: the step's place in
    its delivery order (``Turn``; the caller leaves it when the step ends). ``then``: the
    placements are started here too (``commit_start`` of what it makes), as ``start`` would after
    this; on one Redis server the records go in the reservation's own script, written only if it
    reserves (``Store.reserve_then_start``: one exchange, not two one after the other; what a
    crash leaves is what one after today's second exchange left, or nothing).
    Raises PlacementFailed with the reason."""
    cid = req.cluster_id
    held = al.reused(req.iids, await _reservations(w, cid, req.iids, reserved))
    if held is not None:
        if then is not None:
            await commit_start(w, then(held, 0, await w.inventory.nodes(cid)))
        return held, 0
    await ensure_job_cluster(w, req.ir, cid)  # seed 003: a job-cluster block's own nodes, carved first
    clusters = await w.inventory.clusters()
    cluster = clusters.get(cid, {"id": cid, "labels": {}})
    suspects, nominated = ahead if ahead is not None else await asyncio.gather(suspect_nodes(w), queue.nominees(w))
    invoke = w.invoker(req.ir, "resourceAllocator", trace)
    # the room a preemption freed is its preemptor's until it is placed (docs/priority.md): not
    # for a block of its priority or lower (a held view is a copy: the cache re-reads that node)
    reason = ""
    for attempt in range(1, w.settings.commit_retries + 1):
        # the decision records' digests, like the placement's events below, are computed while the
        # reservation's script is in flight (``LaterDigests``), finished before anything is published
        later = LaterDigests()
        try:
            if turn is not None:
                await turn.wait()
            async with _cluster_lock(cid):
                if turn is not None:
                    turn.leave()
                nodes = await w.inventory.nodes(cid)
                if nominated:
                    nodes = dict(hq.held(str(req.ir["blockId"]), req.ir, cid, cluster, nodes, nominated))
                snap = al.Snapshot(cluster, nodes, instances, await w.affinity_index(req.ir), suspects)
                with later:
                    (reserve,) = await al.plan_allocation(snap, req, invoke)
                # our view takes the reservation now, as the script will, and the script is sent before
                # the lock goes: the next plan of this cluster starts on this one's result without
                # waiting for its round trip (one plan per Redis round trip per cluster was the bound
                # of a scale burst); a reservation that fails re-reads its nodes
                w.inventory.apply(cid, reserve.taken, {nid: snap.nodes[nid] for nid in reserve.touched})
                # each with what it adds to its tenant's quota usage (the script counts it in the same call)
                records = qp.with_quota(req.ir, reserve.placements, snap.nodes)
                # the start the reservation makes, sent with it where one script may (its racks are
                # the nodes' labels: a reservation does not change them)
                started = then(list(reserve.placements), attempt, snap.nodes) if then is not None and w.store.one_server else None
                if started is not None and started.limit is not None:  # (a bound is ADD_INSTANCES' first)
                    started = None
                reserving = asyncio.ensure_future(_reserve(w, cid, records, started))
                await asyncio.sleep(0)  # the script queued (autopipeline) before the next plan's
            # the script's exchange is written on this turn of the loop: what follows overlaps its
            # round trip (the placement's events are dropped if it does not reserve)
            await asyncio.sleep(0)
        finally:
            later.finish()
        prepared = await _prepare(w, started) if started is not None else None
        ok, reason, node, nominated_held = await _applied(w, reserve, reserving)
        if ok:
            if started is not None:
                await _started(w, started, [], nominated_held, prepared)
            elif then is not None:
                await commit_start(w, then(list(reserve.placements), attempt, await w.inventory.nodes(cid)))
            # what every placement's input reads of the view (the node map's root, the totals, the
            # healthy ids), caught up with this one's change once its events are stored: off the
            # next placement's path (``node_digest.settle``)
            await w.bus.after_commit(lambda: _settle(w, cid))
            return list(reserve.placements), attempt
        w.inventory.invalidate(cid, reserve.touched + ([node] if node else []))
        await asyncio.sleep(random.uniform(0, 0.01 * attempt))  # de-synchronise competing controllers
    raise PlacementFailed(f"reservation conflict after {w.settings.commit_retries} attempts: {reason}")


async def _prepare(w: Worker, s: al.StartInstances) -> list[Any] | None:
    """``s``'s events (``allocation.announce`` of every placement: the one-script start refuses
    none) made now (``Bus.prepare``), once the reservation's script is written (the autopipeline
    sends it on the next turn of the loop), so that they are made while its answer is on its
    way. None for a bus that does not prepare (they are made when published)."""
    prepare = getattr(w.bus, "prepare", None)
    if prepare is None:
        return None
    got: list[Any] = await prepare(al.announce(s, s.placements))
    return got


async def _settle(w: Worker, cid: str) -> None:
    """``node_digest.settle`` of the cluster's view, if it is loaded and current (never a read)."""
    nodes = w.inventory.loaded(cid)
    if nodes is not None:
        node_digest.settle(nodes)


async def _reservations(w: Worker, cid: str, iids: Sequence[str], ahead: Reserved | None) -> list[dict[str, str] | None]:
    """The reservations ``iids`` hold (None where none), for ``al.reused``: a redelivered step's
    check. ``ahead``, the first instance's read with the step's own first read (one Redis exchange
    with the block's, not one more after it), answers it where it can: the only instance's, or a
    first instance without one (``reused`` wants every instance reserved, so the others' do not
    matter); else every instance's is read here, as without it."""
    if ahead is not None and iids and ahead[0] == iids[0] and (ahead[1] is None or len(iids) == 1):
        return [ahead[1], *[None] * (len(iids) - 1)]
    return await w.store.reservations_of(cid, list(iids))


async def _reserve(w: Worker, cid: str, records: Sequence[dict[str, Any]], started: al.StartInstances | None
                   ) -> tuple[bool, str, str, bool]:
    """The reservation (``Store.reserve_gang``), and with ``started`` its records in the same
    script (``Store.reserve_then_start``): (ok, reason, node, whether a nomination was dropped)."""
    if started is None:
        ok, reason, node = await w.store.reserve_gang(cid, records)
        return ok, reason, node, False
    s = started
    return await w.store.reserve_then_start(cid, records, s.block_id, s.records, list(s.index), s.step, _drops_nomination(s))


async def _applied(w: Worker, reserve: al.Reserve, reserving: asyncio.Future[tuple[bool, str, str, bool]]
                   ) -> tuple[bool, str, str, bool]:
    """The compare-and-set's outcome; the caches are told what it took."""
    cid, touched = reserve.cluster_id, reserve.touched
    try:
        ok, reason, node, held = await reserving
    except BaseException:  # not known to be taken (Redis failed us): re-read rather than trust the view
        w.inventory.invalidate(cid, touched)
        raise
    if ok:
        if reason != "ok":  # reserved before (a redelivery), not by this plan: re-read what it took
            w.inventory.invalidate(cid, touched)
        await w.hint(cid, touched, applied=reason == "ok")
    return ok, reason, node, held


async def suspect_nodes(w: Worker, read: Mapping[str, str] | Exception | None = None) -> dict[str, str]:
    """The nodes suspect now (node -> why; docs/health.md "Suspect nodes"), cached a second per
    process; Redis away costs the exclusion, never the placement. ``read``: the marks as the
    caller read them (``first_reads``; its error if the read failed), else read here when the
    copy is older than a second."""
    now = time.monotonic()
    hit = _suspect_cache.get(id(w))
    if read is None and hit is not None and now - hit[0] < SUSPECT_CACHE_S:
        return hit[1]
    try:
        if isinstance(read, Exception):
            raise read
        marks = {nid: f"suspect: {d.get('reason', '')}" for nid, d in (await w.store.health.suspects(read)).items()}
    except Exception as exc:
        log.warning("controller.suspects_unavailable", error=repr(exc))
        marks = hit[1] if hit is not None else {}
    _suspect_cache[id(w)] = (now, marks)
    return marks


async def first_reads(w: Worker, bid: str, cid: str, first: str) -> tuple[BlockRecord | None, Ahead, dict[str, str] | None]:
    """An allocation step's first reads: the block, the suspect nodes (``suspect_nodes``: the
    marks read when the process's copy is older than a second), the nominees (``queue.nominees``:
    the nominations read, then the block of each, if any) and ``first``'s reservation (the
    redelivery check's, ``_reservations``), as one pipeline: one exchange, with no task each (a
    gather's tasks cost a loop turn before it)."""
    now = time.monotonic()
    hit = _suspect_cache.get(id(w))
    fresh = hit is not None and now - hit[0] < SUSPECT_CACHE_S
    block, reserved, nominated, marks = await w.store.allocation_reads(bid, cid, first, suspects=not fresh)
    suspects = hit[1] if fresh and hit is not None else await suspect_nodes(w, marks)
    return block, (suspects, await queue.nominees(w, read=nominated)), reserved


def _cluster_lock(cid: str) -> asyncio.Lock:
    """Plans of one cluster are made one at a time inside a process, each on the view the one
    before left, so concurrent messages do not all plan from the same snapshot and collide; other
    processes are the atomic script's job."""
    return _locks.setdefault(cid, asyncio.Lock())


async def start(
    w: Worker, ir: BlockIR, gen: int, cid: str, action: str, placements: Sequence[dict[str, Any]],
    attempts: int, key: str, replaces: str = "", trace: list[Decision] | None = None,
    step: tuple[Step, dict[str, Any]] | None = None, limit: int | None = None,
) -> list[str]:
    """Start reserved placements (``allocation.start_effects``, committed by ``commit_start``).
    Returns the instances refused past ``limit``."""
    nodes = await w.inventory.nodes(cid)
    effect = al.start_effects(ir, gen, cid, action, placements, nodes, time.time(), attempts=attempts, key=key,
                              replaces=replaces, trace=trace or (), step=step, limit=limit)
    return await commit_start(w, effect)


async def commit_start(w: Worker, s: al.StartInstances) -> list[str]:
    """Record the instances (and the block's step) in one round trip; release what the limit
    refused; publish the placement and the create commands of the rest."""
    placed = _drops_nomination(s)
    if placed:  # the nomination's HDEL in the same Redis exchange, after the records (it reads nothing of them)
        refused, held = await asyncio.gather(
            w.store.start_instances(s.block_id, s.records, list(s.index), s.step, limit=s.limit),
            Nominations(w.store.r).drop(s.block_id))
    else:
        refused, held = await w.store.start_instances(s.block_id, s.records, list(s.index), s.step, limit=s.limit), False
    return await _started(w, s, refused, held)


def _drops_nomination(s: al.StartInstances) -> bool:
    """Whether recording ``s`` drops its block's nomination (the gang's step: it is placed)."""
    return s.step is not None and s.step[1] is Step.RESERVE


async def _started(w: Worker, s: al.StartInstances, refused: list[str], held: bool,
                   prepared: list[Any] | None = None) -> list[str]:
    """After ``s``'s records (``refused``: past its limit; ``held``: a nomination was dropped):
    release what the limit refused, publish the placement and the create commands of the rest
    (``prepared``: those of every placement, made before: ``_prepare``)."""
    gone = [p for p in s.placements if p["iid"] in refused]
    for p in gone:
        await w.store.release(s.cluster_id, p["node"], p["iid"])
    if gone:
        await w.hint(s.cluster_id, sorted({p["node"] for p in gone}))
    kept = [p for p in s.placements if p["iid"] not in refused]
    if kept:
        await w.bus.emit_all(prepared if prepared is not None and not gone else al.announce(s, kept))
    if held:
        # a preemptor placed: the room held for it is its instances' now; the walker looks again
        # (the blocks held back by a nominated take other than the one its placement chose)
        queue.poke(w)
    return refused
