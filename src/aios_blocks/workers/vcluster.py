"""Virtual clusters (seed 003) in the controller process: create / update / remove requests, job
clusters made for blocks and destroyed with them, and the sweep that replenishes dead nodes and
destroys job clusters left behind (the seed's lazy destruction).

Each change is decided by ``handlers.vcluster`` from a snapshot (the inventory's node views and
the cluster's records), applied by one Lua script that re-checks it (``state.vcluster``), then
announced: an inventory hint for the nodes that moved (every placing worker re-reads them before
its next placement) and a stored ``vcluster.changed`` event, or ``vcluster.flushed`` for a change
seed 003 stores without publishing (``blocks recover`` rebuilds from both). A refusal is a stored
``vcluster.refused`` event with the reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.router import Inbound, Router
from ..handlers import vcluster as h
from ..runtime.ticker import Ticker
from ..schemas.errors import PlacementFailed
from ..schemas.events import BlockStatusReport
from ..schemas.priority import Pending
from ..schemas.records import BlockIR, NodeView
from ..schemas.vcluster import (
    VClusterChanged,
    VClusterCreate,
    VClusterKind,
    VClusterOp,
    VClusterRecord,
    VClusterRemove,
    VClusterUpdate,
    job_cluster_id,
)
from ..state.vcluster import VClusterStore
from .base import Worker, bound

log = structlog.get_logger("aios.vcluster")

#: plans made again after a node moved under one (another change, a placement)
PLAN_TRIES = 4
#: an outbox entry this old lost its controller: the sweep publishes it
OUTBOX_GRACE_S = 5.0
#: blocks in these statuses hold their job clusters
HOLDING = ("parsed", "selecting", "allocating", "placing", "ready", "deleting")

Planner = Callable[[dict[str, NodeView], dict[str, VClusterRecord]], "h.Plan | h.Refusal"]


def store_of(w: Worker) -> VClusterStore:
    vs: VClusterStore | None = getattr(w, "_vcluster_store", None)
    if vs is None or vs.store is not w.store:
        vs = VClusterStore(w.store)
        w._vcluster_store = vs  # type: ignore[attr-defined]
    return vs


def announcement(ev: VClusterChanged) -> Emit:
    """Seed 003's "flush and publish" vs "flush without publishing": a published change goes on
    ``vcluster.{vid}.changed``, the subject subscribers to virtual clusters listen on; one stored
    only (a divisible cluster's replenish) on ``vcluster.{vid}.flushed``: in the stream for the
    history and ``blocks recover``, told to nobody."""
    return Emit(E.vcluster_changed if ev.published else E.vcluster_flushed, ev)


def _oid(plan: h.Plan) -> str:
    """The outbox id of a change: its request's id, else its first event's id."""
    if not plan.events:
        return ""
    ev = plan.events[0]
    return ev.request_id or f"vc:{ev.vcluster_id}:{ev.gen}:r{ev.revision}"


async def _announce(w: Worker, cid: str, plan: h.Plan, index: int) -> None:
    """After the commit: hint the moved nodes (placing workers re-read them), store the events,
    then clear the change from the outbox (a controller that dies before that leaves it there
    for the sweep, or the request's redelivery, to publish)."""
    for ev in plan.events:
        ev.index = index
    if plan.nodes:
        await w.hint(cid, plan.nodes)
    await w.bus.emit_all([announcement(ev) for ev in plan.events])
    if plan.events:
        await store_of(w).outbox_done(cid, _oid(plan))


async def flush_outbox(w: Worker, cid: str, only: str | None = None, older_than: float = 0.0) -> int:
    """Publish changes committed in ``cid`` whose events were not published (their controller
    died in between): same message ids, so one already stored is deduplicated. ``only``: that
    outbox id. Returns how many changes were published."""
    vs = store_of(w)
    done = 0
    for oid, (index, raw) in (await vs.outbox_pending(cid)).items():
        if only is not None and oid != only:
            continue
        events = msgspec.json.decode(raw, type=list[VClusterChanged])
        if older_than and events and time.time() - events[0].at < older_than:
            continue  # its controller is probably publishing it right now
        for ev in events:
            ev.index = index
        nodes = sorted({n for ev in events for n in ev.moved})
        if nodes:
            await w.hint(cid, nodes)
        await w.bus.emit_all([announcement(ev) for ev in events])
        await vs.outbox_done(cid, oid)
        done += 1
    return done


async def _refuse(w: Worker, vid: str, op: VClusterOp, r: h.Refusal, request_id: str, cid: str = "") -> None:
    log.info("vcluster.refused", vcluster=vid, op=op.value, reason=r.reason)
    await w.bus.emit(E.vcluster_refused, h.refusal(vid, op, r, request_id, cid))


async def apply(w: Worker, cid: str, plan_fn: Planner, drop_claim: str = "") -> h.Plan | h.Refusal:
    """Plan from a snapshot and commit atomically; a node that moved meanwhile refreshes the
    snapshot and plans again (bounded). Returns the plan applied, or why not. ``drop_claim``: a
    virtual cluster id the change removes (its index entry goes before the change is announced)."""
    vs = store_of(w)
    reason = ""
    for _ in range(PLAN_TRIES):
        records = await vs.records(cid)
        nodes = await w.inventory.nodes(cid)
        plan = plan_fn(nodes, records)
        if isinstance(plan, h.Refusal):
            return plan
        now = time.time()
        for ev in plan.events:
            ev.at = now
        outbox = (_oid(plan), msgspec.json.encode(plan.events).decode()) if plan.events else ("", "")
        res = await vs.commit(cid, plan.writes, plan.moves, outbox)
        if res.ok:
            if drop_claim:
                await vs.release_claim(drop_claim, cid)
            await _announce(w, cid, plan, res.index)
            return plan
        if res.kind == "revision":
            return h.Refusal(res.reason, res.revision)
        reason = res.reason
        w.inventory.invalidate(cid, plan.nodes)
    return h.Refusal(f"nodes kept changing under the plan ({reason})")


def bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.VCLUSTER)
    router.add(E.vcluster_create, bound(on_create, w))
    router.add(E.vcluster_update, bound(on_update, w))
    router.add(E.vcluster_remove, bound(on_remove, w))
    router.add(E.block_deleted, bound(on_block_end, w))
    router.add(E.block_failed, bound(on_block_end, w))
    router.add(E.block_pending, bound(on_block_pending, w))
    return [router.binding()]


async def redelivered(w: Worker, cid: str, vid: str, op: VClusterOp, request_id: str) -> bool:
    """A request already applied: publish its outcome (again: same id). From the outbox when
    its first run died before publishing, else rebuilt from its record."""
    if await flush_outbox(w, cid, only=request_id):
        return True
    vs = store_of(w)
    rec = (await vs.records(cid)).get(vid)
    if rec is None or rec.request_id != request_id:
        return False
    # its nodes as the record has them, at the cluster's index now: what a lost first
    # publication (a crash after the commit) would have said
    ev = h._changed(rec, op, [], request_id)
    nodes = await w.inventory.nodes(cid)
    ev.moved = {nid: ["", vid] for nid in rec.nodes if nid in nodes and h.place(nodes[nid]) == vid}
    ev.index = await vs.index_of(cid)
    await w.bus.emit(E.vcluster_changed, ev)
    return True


async def mismatch(w: Worker, m: Inbound[Any], op: VClusterOp) -> bool:
    """The body names another virtual cluster than the subject: refused (on the subject's)."""
    vid = m.tokens.get("vid", "")
    if vid == m.data.vcluster_id:
        return False
    why = f"the subject names virtual cluster {vid!r}, the body {m.data.vcluster_id!r}"
    await w.bus.emit(E.vcluster_refused, h.refusal(vid, op, h.Refusal(why), m.data.request_id))
    return True


async def on_create(w: Worker, m: Inbound[VClusterCreate]) -> None:
    req = m.data
    if await mismatch(w, m, VClusterOp.CREATE):
        return
    vs = store_of(w)
    vid, cid = req.vcluster_id, req.cluster_id
    clusters = await w.inventory.clusters()
    if not h.id_problem(vid) and cid in clusters:
        held = await vs.claim(vid, cid)
        if held == cid and await redelivered(w, cid, vid, VClusterOp.CREATE, req.request_id):
            return
    else:
        held = None
    out = await apply(w, cid, lambda nodes, records: h.plan_create(req, m.stream_seq, clusters, nodes, records, held))
    if isinstance(out, h.Refusal):
        if held == cid:
            await vs.release_claim(vid, cid)
        await _refuse(w, vid, VClusterOp.CREATE, out, req.request_id, cid)


async def on_update(w: Worker, m: Inbound[VClusterUpdate]) -> None:
    req = m.data
    if await mismatch(w, m, VClusterOp.UPDATE):
        return
    cid = await store_of(w).cluster_of(req.vcluster_id) if not h.id_problem(req.vcluster_id) else None
    if cid is None:
        why = h.id_problem(req.vcluster_id) or f"no virtual cluster {req.vcluster_id!r}"
        await _refuse(w, req.vcluster_id, VClusterOp.UPDATE, h.Refusal(why), req.request_id)
        return
    if await redelivered(w, cid, req.vcluster_id, VClusterOp.UPDATE, req.request_id):
        return
    out = await apply(w, cid, lambda nodes, records: h.plan_update(req, nodes, records))
    if isinstance(out, h.Refusal):
        await _refuse(w, req.vcluster_id, VClusterOp.UPDATE, out, req.request_id, cid)


async def on_remove(w: Worker, m: Inbound[VClusterRemove]) -> None:
    req = m.data
    if await mismatch(w, m, VClusterOp.REMOVE):
        return
    vs = store_of(w)
    cid = await vs.cluster_of(req.vcluster_id) if not h.id_problem(req.vcluster_id) else None
    if cid is None:
        # a redelivered remove whose first run committed and died before publishing: the
        # record and its index entry are gone, its outcome waits in its cluster's outbox
        for c in sorted(await w.inventory.clusters()):
            if await flush_outbox(w, c, only=req.request_id):
                return
        why = h.id_problem(req.vcluster_id) or f"no virtual cluster {req.vcluster_id!r}"
        await _refuse(w, req.vcluster_id, VClusterOp.REMOVE, h.Refusal(why), req.request_id)
        return
    # a block placed inside lives there with or without instances (those with instances the
    # plan refuses by their nodes): one scaled to zero would be left "ready" in a virtual
    # cluster that no longer exists, holding its tasks until they time out
    placed = await w.store.blocks_at_zero(lambda b: (b.get("ir") or {}).get("virtualClusterId") == req.vcluster_id)
    if placed:
        rec = await vs.get(req.vcluster_id)
        why = (f"{req.vcluster_id} still holds blocks scaled to zero (delete them first): " + ", ".join(placed[:10])
               + (" ..." if len(placed) > 10 else ""))
        await _refuse(w, req.vcluster_id, VClusterOp.REMOVE, h.Refusal(why, rec.revision if rec else 0), req.request_id, cid)
        return
    out = await apply(w, cid, lambda nodes, records: h.plan_remove(req, nodes, records), drop_claim=req.vcluster_id)
    if isinstance(out, h.Refusal):
        await _refuse(w, req.vcluster_id, VClusterOp.REMOVE, out, req.request_id, cid)


async def on_block_end(w: Worker, m: Inbound[BlockStatusReport]) -> None:
    """A block deleted or failed: its job cluster goes (a failed one may grow its virtual cluster first)."""
    ev = m.data
    if m.event is E.block_failed:
        await grow_for(w, ev.block_id, ev.gen, ev.reason)
    jid = job_cluster_id(ev.block_id)
    cid = await store_of(w).cluster_of(jid)
    if cid is None:
        return
    await destroy_job(w, cid, jid, ev.block_id, ev.gen, f"block {ev.block_id} {ev.status}")


async def on_block_pending(w: Worker, m: Inbound[Pending]) -> None:
    """A block that fits nowhere waits (docs/priority.md): its virtual cluster may grow for it, as
    for a failed one (once per block generation); a waiting victim of a preemption does not grow it."""
    ev = m.data
    if not ev.preempted_by:
        await grow_for(w, ev.block_id, ev.gen, ev.reason)


async def grow_for(w: Worker, bid: str, gen: int, reason: str) -> None:
    """Autoscaling (beyond the seed): a block of an indivisible virtual cluster with ``limits``
    could not be placed: grow it by one node that fits the block, below the type's max. The
    change (or why not) is an event with the block and its failure as the reason."""
    from ..handlers.gateway import share_of

    block = await w.store.get_block(bid)
    ir = block.get("ir") if block else None
    if not isinstance(ir, dict) or int(block.get("gen", 0)) != gen or ir.get("jobCluster"):  # type: ignore[union-attr]
        return
    vid = ir.get("virtualClusterId")
    vs = store_of(w)
    cid = await vs.cluster_of(vid) if vid else None
    if cid is None:
        return
    rec = (await vs.records(cid)).get(str(vid))
    if rec is None or not rec.limits or rec.kind != VClusterKind.INDIVISIBLE:
        return
    rid = f"autoscale-{bid}-{gen}"
    why = f"block {bid} could not be placed: {reason}"

    def plan_fn(nodes: dict[str, NodeView], records: dict[str, VClusterRecord]) -> h.Plan | h.Refusal:
        cur = records.get(str(vid))
        if cur is None:
            return h.Refusal("gone")
        if cur.request_id == rid:
            return h.Refusal("done")  # a redelivered failure: grown once already
        return h.plan_grow(cur, nodes, records, ir.get("resources") or {}, share_of(ir), rid, why)

    out = await apply(w, cid, plan_fn)
    if isinstance(out, h.Refusal) and out.reason not in ("gone", "done"):
        await _refuse(w, str(vid), VClusterOp.AUTOSCALE, h.Refusal(f"{out.reason} ({why})", rec.revision), rid, cid)


def _idle_long(w: Worker, rec: VClusterRecord, nodes: dict[str, NodeView], now: float) -> set[str]:
    """The nodes of ``rec`` idle for ``vcluster_idle_s`` (this controller's own clock: a
    restarted controller starts counting again)."""
    since: dict[tuple[str, str], float] = getattr(w, "_vcluster_idle", None) or {}
    w._vcluster_idle = since  # type: ignore[attr-defined]
    out = set()
    for nid in rec.nodes:
        v = nodes.get(nid)
        key = (rec.id, nid)
        if v is None or not v.get("healthy") or h.place(v) != rec.id or not h.idle(v):
            since.pop(key, None)
            continue
        if now - since.setdefault(key, now) >= w.settings.vcluster_idle_s:
            out.add(nid)
    return out


async def destroy_job(w: Worker, cid: str, jid: str, bid: str, gen: int | None, why: str) -> bool:
    """Destroy block ``bid``'s job cluster ``jid`` (of generation ``gen``; None: any). Left in place
    while an instance is still on one of its nodes: the sweep tries again (lazy destruction)."""

    def plan_fn(nodes: dict[str, NodeView], records: dict[str, VClusterRecord]) -> h.Plan | h.Refusal:
        rec = records.get(jid)
        if rec is None or rec.kind != VClusterKind.JOB or rec.block != bid or (gen is not None and rec.gen != gen):
            return h.Refusal("gone")
        return h.plan_job_remove(rec, nodes, why)

    out = await apply(w, cid, plan_fn, drop_claim=jid)
    if isinstance(out, h.Refusal):
        if out.reason != "gone":
            log.info("vcluster.job_kept", job=jid, reason=out.reason)
        return False
    return True


async def ensure_job_cluster(w: Worker, ir: BlockIR, cid: str) -> None:
    """Before a block with a job-cluster spec is placed: its job cluster exists, carved from its
    divisible cluster's undivided nodes (raises PlacementFailed with the reason when it cannot)."""
    job = ir.get("jobCluster")
    vid = ir.get("virtualClusterId")
    if not job or not vid:
        return
    vs = store_of(w)
    bid = str(ir["blockId"])
    jid = job_cluster_id(bid)
    records = await vs.records(cid)
    if jid in records:
        return
    block = await w.store.get_block(bid)
    gen = int(block["gen"]) if block else 0
    held = await vs.claim(jid, cid)
    if held != cid:
        raise PlacementFailed(f"job cluster {jid} exists in cluster {held}")

    def plan_fn(nodes: dict[str, NodeView], records: dict[str, VClusterRecord]) -> h.Plan | h.Refusal:
        if jid in records:
            return h.Plan()  # made meanwhile (a concurrent step of the same block)
        return h.plan_job_create(bid, gen, str(vid), job.get("replicaSets") or {}, cid, nodes, records)

    out = await apply(w, cid, plan_fn)
    if isinstance(out, h.Refusal):
        if out.revision:  # created meanwhile by another copy
            return
        await vs.release_claim(jid, cid)
        raise PlacementFailed(out.reason)


async def sweep(w: Worker) -> int:
    """One pass over every virtual cluster: replenish dead nodes (seed 003's four cases: the
    primary's own dead nodes are left as they are), destroy job clusters whose block ended.
    Returns the changes made."""
    vs = store_of(w)
    done = 0
    clusters = set((await vs.index()).values()) | set(await w.store.clusters())
    for cid in sorted(clusters):
        done += await flush_outbox(w, cid, older_than=OUTBOX_GRACE_S)
    for cid in sorted(set((await vs.index()).values())):
        records = await vs.records(cid)
        for rec in sorted(records.values(), key=lambda r: (r.kind != VClusterKind.JOB, r.id)):
            if rec.kind == VClusterKind.JOB:
                block = await w.store.get_block(rec.block)
                if block is None or block.get("status") not in HOLDING or int(block.get("gen", 0)) != rec.gen:
                    if await destroy_job(w, cid, rec.id, rec.block, rec.gen, f"block {rec.block} is gone (lazy destruction)"):
                        done += 1
                    continue
            vid = rec.id
            if rec.limits and rec.kind == VClusterKind.INDIVISIBLE:
                long_idle = _idle_long(w, rec, await w.inventory.nodes(cid), time.time())
                if long_idle:
                    rid = f"autoscale-{rec.id}-r{rec.revision}"

                    def shrink(nodes: dict[str, NodeView], records: dict[str, VClusterRecord], vid: str = vid,
                               long_idle: set[str] = long_idle, rid: str = rid) -> h.Plan | h.Refusal:
                        cur = records.get(vid)
                        got = h.plan_shrink(cur, nodes, records, long_idle, rid) if cur is not None else None
                        return got if got is not None else h.Refusal("nothing to do")

                    if isinstance(await apply(w, cid, shrink), h.Plan):
                        done += 1
                        continue

            def plan_fn(nodes: dict[str, NodeView], records: dict[str, VClusterRecord], vid: str = vid) -> h.Plan | h.Refusal:
                cur = records.get(vid)
                got = h.plan_replenish(cur, nodes, records) if cur is not None else None
                return got if got is not None else h.Refusal("nothing to do")

            out = await apply(w, cid, plan_fn)
            if isinstance(out, h.Plan):
                log.info("vcluster.replenished", vcluster=vid, moved={m.node: [m.src, m.dst] for m in out.moves})
                done += 1
    return done


async def run_sweeps(w: Worker, stop: asyncio.Event, guard: Any, every_s: float | None = None) -> None:
    """The periodic sweep (every controller copy runs it; the Lua commit lets one change win)."""
    every = w.settings.vcluster_sweep_s if every_s is None else every_s
    await Ticker(every, "vcluster.sweep_failed", log, guard=guard).run(lambda: sweep(w), stop)
