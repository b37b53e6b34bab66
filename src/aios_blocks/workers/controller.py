"""Cluster controller: dry_run, allocation (a gang of minInstances), scale, reassignment, and the
block lifecycle facts (instance added/removed, delete) that make a block ready or deleted.

Every handler is a module-level function ``on_*(w, m)``: ``bindings``/``lifecycle_bindings`` only
name them by event (``workers.base.bound`` gives each its worker and keeps its ``__module__`` and
``__qualname__``), so a subject is one jump from its function. Allocation is ``workers/allocate.py`` (the one
plan/apply adapter of the pure ``handlers/allocation.py``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.router import TRIGGER_SEQ, Inbound, Router
from ..bus.runner import Defer
from ..handlers import allocation as al
from ..handlers import controller as h
from ..handlers import faults, scaling
from ..handlers import lifecycle as lc
from ..handlers import queue as hq
from ..handlers import stability as st
from ..handlers.allocation import excluded
from ..handlers.effects import Publish, ReadyIfRunning
from ..handlers.queue import QUOTA_REASON
from ..schemas.errors import PlacementFailed, PolicyFailed
from ..schemas.events import (
    AllocationRequest,
    Dangling,
    Decision,
    DeleteRequest,
    DryRunRequest,
    DryRunResult,
    InstanceCommand,
    InstanceEvent,
    InstanceVerdict,
    NodeInventory,
    NodeRegistered,
    Parsed,
    ReassignRequest,
    ScaleDownChosen,
    ScaleDownRequest,
    ScaleRequest,
    ScaleTarget,
    StepFailed,
)
from ..schemas.lifecycle import LIVE, Step
from ..schemas.priority import Pending, QuotaSet
from ..schemas.records import (
    BlockIR,
    BlockRecord,
    InstanceRecord,
    InstanceSample,
    NodeView,
    ScaleDownCandidate,
    ir_of,
    wire,
    wire_ir,
)
from ..schemas.spec import ID_RE, Cluster, Node
from ..state.queue import Nominations
from . import announce, moves, queue, reconciler
from .allocate import Turn, allocate, first_reads, start, suspect_nodes
from .base import Worker, bound
from .effects import commit, commit_added, release

log = structlog.get_logger("aios.controller")

__all__ = ["bindings", "block_metrics", "excluded", "fault_verdict", "lifecycle_bindings", "scale_down", "scale_target",
           "start", "suspect_nodes"]

def bindings(w: Worker, cluster: str | None = None) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.controller(cluster))
    router.add(E.cluster_dry_run, bound(on_dry_run, w))
    router.add(E.cluster_allocation, bound(on_allocation, w))
    router.add(E.cluster_scale, bound(on_scale, w))
    router.add(E.cluster_scale_down, bound(on_scale_down, w))
    router.add(E.cluster_reassignment, bound(on_reassignment, w))
    return [router.binding()]


def lifecycle_bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.LIFECYCLE)
    router.add(E.instance_added, bound(on_added, w))
    router.add(E.instance_removed, bound(on_removed, w))
    router.add(E.instance_failed, bound(on_fault, w))
    router.add(E.instance_unhealthy, bound(on_fault, w))
    router.add(E.instance_verdict, bound(on_verdict, w))
    router.add(E.node_dangling, bound(on_dangling, w))
    router.add(E.node_inventory, bound(on_inventory, w))
    router.add(E.node_registered, bound(on_registered, w))
    router.add(E.block_scale_target, bound(on_scale_target, w))
    router.add(E.block_delete, bound(on_delete, w))
    router.add(E.quota_set, bound(on_quota, w))
    router.add(E.block_pending, bound(on_pending, w))
    router.add(E.block_move_requested, bound(moves.on_move_requested, w))
    return [router.binding()]


async def block_metrics(w: Worker, bid: str, given: dict[str, Any]) -> dict[str, Any]:
    """The resourceAllocator's ``block_metrics``: the metrics collector's figures for the block
    (``state.metrics``; docs/policies.md), with the request's own (an autoscaler's) on top; ``{}``
    when neither has any. The store being away costs the figures, never the step."""
    try:
        collected = await w.store.metrics.block_metrics(bid)
    except Exception as exc:
        log.warning("controller.block_metrics_unavailable", block=bid, error=repr(exc))
        collected = {}
    return {**collected, **given}


# -- the cluster's steps ---------------------------------------------------------------------------
async def on_dry_run(w: Worker, m: Inbound[DryRunRequest]) -> None:
    ev = m.data
    if ev.at:  # a query has no stream sequence: its decision names the state its round started from
        TRIGGER_SEQ.set(ev.at)
    ir = ir_of(ev.ir) if ev.ir else await w.block_ir(ev.block_id, ev.gen)
    if ir is None:
        return  # the block is gone or was re-created: nobody gathers this answer
    clusters = await w.inventory.clusters()
    cluster_entry = clusters.get(ev.cluster_id, {"id": ev.cluster_id, "labels": {}})
    nodes = await w.inventory.nodes(ev.cluster_id)
    trace: list[Decision] = []
    out = await h.dry_run(ir, cluster_entry, nodes, w.invoker(ir, "resourceAllocator", trace), await w.affinity_index(ir))
    result = DryRunResult(
        ev.block_id, ev.gen, ev.cluster_id, out.score, out.node_info, placeable=out.placeable, shortfall=out.shortfall, error=out.error,
        rejected_nodes=out.rejected_nodes, node_scores=out.node_scores, adapt=out.adapt, attempt=ev.attempt, decisions=trace,
    )
    await w.bus.emit(E.block_dry_run_result, result)


async def on_allocation(w: Worker, m: Inbound[AllocationRequest]) -> None:
    ev = m.data
    # its place among this process's steps of the cluster, taken before the first await: the
    # cluster's requests are planned in the order they were delivered (``allocate.Turn``)
    turn = Turn(ev.cluster_id)
    try:
        # the suspect nodes and nominees the allocation reads go to Redis with the block's read (one
        # exchange, not three one after the other on the create's path), and so does the redelivery
        # check's reservation of the gang's first instance (``allocate._reservations``: the instance
        # ids depend on the block, the first one's is ``{bid}-0`` unless the block was preempted)
        first = h.instance_id(ev.block_id, 0)
        block, (suspects, nominated), reserved = await first_reads(w, ev.block_id, ev.cluster_id, first)
        if block is not None and _reselected(block, ev):
            # this request's reselect step is stored, its events may not be (their publish failed and
            # the request came again): publish them again (the stream deduplicates them by id)
            await _reselect_events(w, block["ir"], ev, "(the first try's reason was not stored)")
            return
        if block is None or block["gen"] != ev.gen or block["status"] not in ("allocating", "placing"):
            return
        if int(block.get("attempt", 0)) != ev.attempt:
            return
        ir = block["ir"]
        # a victim of a preemption placed again (same generation) takes fresh instance ids: the first
        # gang's commands and facts are in the stream under theirs (docs/priority.md)
        keys = [f"r{ev.attempt}-{i}" if block.get("preempted_by") else i for i in range(ir["minInstances"])]
        iids = tuple(h.instance_id(ev.block_id, k) for k in keys)
        if not iids:
            await commit(w, [ReadyIfRunning(ev.block_id, ev.gen, 0, ev.cluster_id, Step.READY_EMPTY)])
            return
        trace: list[Decision] = []
        key = f"gang-r{ev.attempt}" if block.get("preempted_by") else "gang"

        def started(placements: list[dict[str, Any]], attempts: int, nodes: Mapping[str, NodeView]) -> al.StartInstances:
            return al.start_effects(ir, ev.gen, ev.cluster_id, "allocation", placements, nodes, time.time(), attempts=attempts,
                                    key=key, trace=trace, step=(Step.RESERVE, {"cluster": ev.cluster_id}))

        try:
            # the placements started by the allocation itself: on one Redis server the records go
            # in the reservation's script (``allocate``'s ``then``), one exchange fewer on the path
            await allocate(w, al.Request(ir, ev.cluster_id, "allocation", iids), trace=trace, ahead=(suspects, nominated),
                           reserved=(first, reserved), turn=turn, then=started)
        except PlacementFailed as exc:
            await _reselect_or_fail(w, ir, ev, exc, trace)
            return
    finally:
        turn.leave()


def _scale_refusal(block: BlockRecord | None, current: dict[str, Any], iid: str, target_seq: int) -> tuple[str, bool]:
    """Why a scale step must not place (``''`` if it may), and whether that is a failure (a target
    reached meanwhile, by another copy's step, is not)."""
    if block is None or block["status"] not in LIVE:
        return f"block is {block['status'] if block else 'unknown'}", True
    ir = block["ir"]
    if target_seq and iid not in current:
        why = _superseded(block, target_seq, len(scaling.live(current)), up=True)
        if why:
            return why, why.startswith("superseded")
    if iid not in current and len(current) >= ir["maxInstances"]:
        return f"already at maxInstances ({ir['maxInstances']})", True
    return "", False


async def on_scale(w: Worker, m: Inbound[ScaleRequest]) -> None:
    ev = m.data
    block, current = await w.store.block_view(ev.block_id)
    iid = h.instance_id(ev.block_id, ev.request_id)
    why, failed = _scale_refusal(block, current, iid, ev.target_seq)
    if why:
        if failed:
            await _step_failed(w, ev.block_id, block, "scale", ev.request_id, why)
        else:  # reached meanwhile (another copy's step): nothing to do, nothing failed
            log.info("scale.skipped", block=ev.block_id, request=ev.request_id, why=why)
        return
    assert block is not None
    ir, gen = block["ir"], block["gen"]
    trace: list[Decision] = []
    req = al.Request(ir, ev.cluster_id, "scale", (iid,), extra={"block_metrics": await block_metrics(w, ev.block_id, ev.block_metrics)})
    try:
        placements, attempts = await allocate(w, req, current, trace=trace)
    except PlacementFailed as exc:
        await _step_failed(w, ev.block_id, block, "scale", ev.request_id, exc.reason, trace)
        return
    # the bound is checked again where it is atomic: concurrent steps all saw room above
    if await start(w, ir, gen, ev.cluster_id, "scale", placements, attempts, key=ev.request_id, trace=trace,
                   limit=int(ir["maxInstances"])):
        await _step_failed(w, ev.block_id, block, "scale", ev.request_id, f"already at maxInstances ({ir['maxInstances']})", trace)


async def on_scale_down(w: Worker, m: Inbound[ScaleDownRequest]) -> None:
    await scale_down(w, m.data)


async def on_reassignment(w: Worker, m: Inbound[ReassignRequest]) -> None:
    """One reassignment of an instance at a time, on any controller copy: two requests for the
    same instance handled together (a health verdict and an operator's, say) each placed a
    replacement. The claim is a lease in Redis; the second request waits for it (it then finds
    the instance on its way out) and fails with the reason if it never comes free."""
    ev = m.data
    holder = await w.store.claim_replacement(ev.block_id, ev.instance_id, ev.request_id, w.settings.reassign_claim_s)
    if holder != ev.request_id:
        if m.deliveries < w.settings.reassign_attempts:
            raise Defer(_backoff(m.deliveries))
        block = await w.store.get_block(ev.block_id)
        await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id,
                           f"the instance is already being replaced (request {holder or 'unknown'})")
        return
    await reassign(w, m)
    # decided (placed, or failed for good): a Defer or an error above keeps the claim for the
    # redelivery of this same request
    await w.store.release_replacement(ev.block_id, ev.instance_id, ev.request_id)


def _nothing_to_move(block: BlockRecord | None, old: InstanceRecord | None, iid: str) -> str:
    """Why a reassignment has nothing to do ('' when it has)."""
    if block is None or block["status"] not in LIVE or old is None:
        return (f"no such instance: {iid} was already replaced or removed (nothing left to move)" if block and old is None
                else f"block is {block['status'] if block else 'unknown'}")
    if old.get("status") == "removing":  # already replaced (or scaled down): a replacement would be one too many
        return "the instance is already being removed"
    return ""


async def reassign(w: Worker, m: Inbound[ReassignRequest]) -> None:
    ev = m.data
    block, current = await w.store.block_view(ev.block_id)
    current = current if block else {}
    old = current.get(ev.instance_id)
    meta = await w.store.node_meta(old["node"]) if old else None
    node_down = meta is not None and not meta["healthy"]
    why = _nothing_to_move(block, old, ev.instance_id)
    if why:
        await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id, why)
        if block is not None and old is not None and node_down:
            await _evict(w, ev.block_id, block["gen"], ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}")
        return
    assert block is not None and old is not None  # else ``why`` said so above
    ir, gen = block["ir"], block["gen"]
    iid = h.instance_id(ev.block_id, ev.request_id)
    trace: list[Decision] = []
    try:
        placements, attempts = await _replacement(w, ev, ir, iid, current, node_down, trace)
    except PlacementFailed as exc:
        if not node_down and not exc.policy and m.deliveries < w.settings.reassign_attempts:
            # the capacity may be held by instances on their way out (a failed one's remove is
            # in flight): try again shortly rather than leave the block short of an instance (a
            # policy that gave no answer, timed out or the wrong shape, or a choice refused on the
            # snapshot it was given, would only fail again);
            # no step event carries this attempt's policy calls, so they are recorded on their own
            await w.bus.emit_all([Emit(E.block_decision, d) for d in trace])
            raise Defer(_backoff(m.deliveries)) from exc
        await _replacement_failed(w, ev, block, old, node_down, exc.reason, trace)
        return
    await start(w, ir, gen, ev.cluster_id, "reassignment", placements, attempts, key=ev.request_id, replaces=ev.instance_id,
                trace=trace)
    if node_down:
        await _evict(w, ev.block_id, gen, ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}; replaced by {iid}")
        return
    await w.store.set_instance_status(ev.block_id, ev.instance_id, "removing")
    await w.bus.emit(
        E.node_instance_remove,
        InstanceCommand(ev.block_id, gen, ev.cluster_id, ev.instance_id, old["node"], old.get("gpus", []), reason=f"reassigned to {iid}"),
    )


async def _replacement(
    w: Worker, ev: ReassignRequest, ir: BlockIR, iid: str, current: dict[str, Any], node_down: bool, trace: list[Decision],
) -> tuple[list[dict[str, Any]], int]:
    """The replacement's placement, off the node it leaves; when nothing else fits, the node it
    leaves, when its agent is alive after the fault (a one-node cluster replaces a crashed
    instance where it was), rather than none; a suspect node stays left out."""
    extra = {"block_metrics": await block_metrics(w, ev.block_id, ev.block_metrics), "instance_id": ev.instance_id,
             "pod_name": ev.instance_id, "reason": ev.reason}
    req = al.Request(ir, ev.cluster_id, "reassignment", (iid,), avoid=ev.avoid_node, extra=extra)
    try:
        return await allocate(w, req, current, trace=trace)
    except PlacementFailed:
        if not ev.avoid_node or node_down or not await _alive_since(w, ev.avoid_node, ev.at):
            raise
    return await allocate(w, al.Request(ir, ev.cluster_id, "reassignment", (iid,), extra=extra), current, trace=trace)


async def _replacement_failed(
    w: Worker, ev: ReassignRequest, block: BlockRecord, old: InstanceRecord, node_down: bool, reason: str, trace: list[Decision],
) -> None:
    await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id, reason, trace)
    if node_down:  # its node is gone: release it anyway, the capacity is not usable
        await _evict(w, ev.block_id, block["gen"], ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}")
    elif block["status"] == "placing":
        # never became ready and cannot replace what it lost: its story ends here
        await _fail_placing(w, ev.block_id, block["gen"], inst_cluster=old["cluster"],
                            reason=f"replacement of {ev.instance_id} could not be placed: {reason}")
    elif _gone(ev):
        # a ready block's instance that runs nowhere (its agent started again without it, or it
        # exited): released anyway, its agent told to tear down what is left of it; the reconciler
        # then asks for the instance the block is short of, on any node, its own too. Until it
        # has it, the room it frees is the block's (a nomination, as a preemptor's): a lower
        # block the queue walker (poked by this release) or an allocation would place there took
        # it for good, since a short block never preempts (docs/priority.md)
        await Nominations(w.store.r).nominate(ev.block_id, block["gen"], [old["node"]], time.time() + hq.NOMINATION_S,
                                              replaces=ev.instance_id)
        await _evict(w, ev.block_id, block["gen"], ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}")


def _gone(ev: ReassignRequest) -> bool:
    """A replacement of an instance that runs nowhere: the lifecycle's answer to a ``removed`` of
    reason ``lost`` (``handlers.lifecycle.on_removed``, request ``lost_request(iid)``; the fold of the
    stream has dropped it already) or to its agent's ``failed`` (it exited or could not start:
    ``fault_request(iid, "failed")``). Its reservation holds nothing that runs: kept, a crashed
    instance of a full node (a one-node cluster the block fills) was never replaced. An operator's
    request has an id of its own; an ``unhealthy`` instance or the checker's ``replace`` may still run."""
    return ev.request_id in (lc.lost_request(ev.instance_id), lc.fault_request(ev.instance_id, "failed"))


# -- the block lifecycle facts -----------------------------------------------------------------------
async def _view(w: Worker, bid: str) -> lc.View:
    block, insts = await w.store.block_view(bid)
    return lc.View(block, insts if block is not None else {})


async def on_added(w: Worker, m: Inbound[InstanceEvent]) -> None:
    ev = m.data
    # the block and its instances in one exchange; the decision looks at this one only, its commit
    # at all of them (the ready's mark, status and CAS in one more exchange: effects.commit_added)
    block, insts = await w.store.block_and_instances(ev.block_id)
    inst = insts.one(ev.instance_id)
    await commit_added(w, lc.on_added(ev, lc.View(block, {ev.instance_id: inst} if block is not None and inst else {})), insts)
    await moves.after_added(w, ev)  # a move's new instance ready: its move switches (docs/rebalance.md)


async def on_removed(w: Worker, m: Inbound[InstanceEvent]) -> None:
    ev = m.data
    # instances are read even for an unknown block: a removal after the record went must still release
    view = lc.View(*await w.store.block_view(ev.block_id))
    await commit(w, lc.on_removed(ev, view))
    await moves.after_removed(w, ev, view.instances.get(ev.instance_id), view.block)  # a move's instance gone
    queue.poke(w)  # capacity freed: the pending queue's head is tried (docs/priority.md)


async def on_fault(w: Worker, m: Inbound[InstanceEvent]) -> None:
    """``instance.failed`` and ``instance.unhealthy``: through the block's stabilityChecker."""
    ev = m.data
    kind = "failed" if m.event is E.instance_failed else "unhealthy"
    if await moves.on_new_fault(w, ev, kind):  # a move's new instance before its switch: the move fails
        return
    v = await _view(w, ev.block_id)
    data = lc.fault_input(ev, kind, v)
    if data is None:  # not live there (an older generation, replaced, another node's): ignored
        verdict, effects = lc.on_fault(ev, kind, v, w.settings.max_replacements)
        log.info("instance.fault", block=ev.block_id, instance=ev.instance_id, kind=kind, reason=ev.reason,
                 action=verdict.action, why=verdict.why)
        await commit(w, effects)
        return
    what, effects = await fault_verdict(w, ev, kind, v, data, f"{kind}:{m.stream_seq}")
    log.info("instance.fault", block=ev.block_id, instance=ev.instance_id, kind=kind, reason=ev.reason, action=what)
    await commit(w, effects)


async def on_verdict(w: Worker, m: Inbound[InstanceVerdict]) -> None:
    ev = m.data
    if ev.verdict not in ("restart", "replace"):
        return  # routing only: the mapper's
    what, effects = lc.on_verdict(ev, await _view(w, ev.block_id), w.settings.max_replacements)
    log.info("instance.verdict", block=ev.block_id, instance=ev.instance_id, verdict=ev.verdict, reason=ev.reason, action=what)
    await commit(w, effects)


async def on_dangling(w: Worker, m: Inbound[Dangling]) -> None:
    ev = m.data
    # the node is the subject's aios.node.{nid}.instance.dangling, which the server vouches for
    # (agent-<nid> may publish only its own node's subjects); the body's node_id is just a claim
    nid = m.tokens["nid"]
    if ev.node_id != nid:
        log.warning("instance.dangling_ignored", subject_node=nid, body_node=ev.node_id, instance=ev.instance_id,
                    why="node_id in the body is not the node of the subject")
        return
    block = await w.store.get_block(ev.block_id) if ID_RE.match(ev.block_id or "") else None
    inst = (await w.store.instances(ev.block_id)).get(ev.instance_id) if block else None
    verdict = faults.on_dangling(block, inst, nid, ev.gen)
    log.info("instance.dangling", node=nid, instance=ev.instance_id, action=verdict.action, why=verdict.why)
    if verdict.action == "adopt" and block is not None and inst is not None:
        # adopting = asking the node to run it: its agent finds it running and wraps it as-is
        cmd = InstanceCommand(
            ev.block_id, ev.gen, inst["cluster"], ev.instance_id, nid, inst.get("gpus", []),
            block["ir"].get("image", ""), h.env_for(block["ir"], ev.instance_id, inst.get("gpus", [])),
            reason="adopt dangling", launch=block["ir"].get("launch") or {}, resources=wire(block["ir"].get("resources") or {}),
        )
        await w.bus.emit(E.node_instance_create, cmd, qualifier=f"adopt:{ev.handle}")
    else:
        await w.bus.emit(
            E.node_instance_remove,
            InstanceCommand(ev.block_id or "-", ev.gen, "", ev.instance_id, nid, [], reason=f"dangling: {verdict.why}"),
            qualifier=f"dangling:{nid}:{ev.handle}",
        )


async def on_inventory(w: Worker, m: Inbound[NodeInventory]) -> None:
    ev = m.data
    nid = m.tokens["nid"]  # the subject's node (agent-<nid> may publish only its own): the body's is a claim
    if ev.node_id != nid:
        log.warning("node.inventory_ignored", subject_node=nid, body_node=ev.node_id, why="node_id in the body is not the node of the subject")
        return
    effects = lc.on_inventory(ev, await w.store.node_instances(nid))
    log.info("node.inventory", node=nid, boot=ev.boot, runs=len(ev.instances), lost=sum(len(e.events) for e in effects if isinstance(e, Publish)))
    await commit(w, effects)
    queue.poke(w)  # a node (re)started: its capacity may take a waiting block


async def on_registered(w: Worker, m: Inbound[NodeRegistered]) -> None:
    ev = m.data
    node = Node.model_validate(ev.node)
    known = node.cluster in await w.inventory.clusters()
    meta = await w.store.node_meta(node.id)
    if (
        known and meta is not None and meta["cluster"] == node.cluster and meta["agent"] == ev.agent
        and meta["healthy"] == node.healthy and meta["spec"] == node.model_dump(mode="json")
    ):
        queue.poke(w)  # a node or cluster added (`blocks cluster add` wrote it already): capacity for the queue
        return  # already recorded as announced (`blocks cluster add` writes Redis itself; an agent restarted)
    new = await w.store.ensure_cluster(Cluster(id=node.cluster))
    await w.store.put_node(node, agent=ev.agent)
    # a (re-)registration refreshes that node only; a cluster new to us refreshes the cluster
    # list everywhere (reloading a 1,000-node cluster per registration stalled placements)
    await w.hint(node.cluster, None if new or not known else [node.id])
    queue.poke(w)  # a node or cluster added: capacity for the pending queue


async def on_quota(w: Worker, m: Inbound[QuotaSet]) -> None:
    """A quota set, raised or removed: quota freed is a capacity event for the pending queue."""
    queue.poke(w)


async def on_pending(w: Worker, m: Inbound[Pending]) -> None:
    """A block the quota holds (the gateway's ``quota: ...`` wait) may reclaim from borrowers, and
    one that may preempt (a priority above 0, not itself a waiting victim) may evict lower blocks:
    the walker decides it on its next pass, now rather than at the next capacity event or resync."""
    if m.data.reason.startswith(QUOTA_REASON) or (m.data.priority > 0 and not m.data.preempted_by):
        queue.poke(w)


async def on_scale_target(w: Worker, m: Inbound[ScaleTarget]) -> None:
    await scale_target(w, m.data, m.stream_seq)


async def on_delete(w: Worker, m: Inbound[DeleteRequest]) -> None:
    view = await _view(w, m.data.block_id)
    await commit(w, lc.on_delete(m.data.block_id, view))
    if view.block is not None and view.block["status"] == "pending":  # out of the pending queue
        await queue.PendingQueue(w.store.r).remove(m.data.block_id)


async def fault_verdict(
    w: Worker, ev: InstanceEvent, kind: str, v: lc.View, data: dict[str, Any], key: str
) -> tuple[str, list[Any]]:
    """An agent's fault report through the block's stabilityChecker (``lc.on_fault_verdict``): the
    call's record goes out as ``block.decision``; a policy that fails leaves the old rule to the
    framework and is recorded as ``block.health.failed`` (step ``agent_report``) with the reason."""
    assert v.block is not None
    ir = v.block["ir"]
    rule = lc.stability_rule(ir)
    trace: list[Decision] = []
    verdict: dict[str, Any] | None = None
    failure = ""
    try:
        result = await w.invoke({**ir, "policies": {**(ir.get("policies") or {}), "stabilityChecker": rule}},
                                "stabilityChecker", data, trace)
        verdict = lc.fault_verdict(result, data, ev.instance_id)
    except PolicyFailed as exc:
        failure = exc.reason
    except st.BadVerdicts as exc:
        failure = f"stabilityChecker {rule['policyRuleURI']}: {exc}"
        trace = [msgspec.structs.replace(d, error=d.error or failure) for d in trace]
    what, effects = lc.on_fault_verdict(ev, kind, v, w.settings.max_replacements, verdict, failure, key)
    if failure:
        await w.bus.emit(E.block_health_failed, StepFailed(ev.block_id, ev.gen, "agent_report",
                                                           f"{failure[:1500]}; {what}"[:2000], key, decisions=trace))
    else:
        await w.bus.emit_all([Emit(E.block_decision, d, qualifier=key) for d in trace])
    return what, effects


async def _fail_placing(w: Worker, bid: str, gen: int, inst_cluster: str, reason: str) -> None:
    block, insts = await w.store.block_view(bid)
    await commit(w, lc.fail_placing(bid, gen, inst_cluster, reason, lc.View(block, insts if block is not None else {})))


async def _evict(w: Worker, bid: str, gen: int, cid: str, iid: str, inst: InstanceRecord, reason: str) -> None:
    """An instance on a dead node: released now (its node cannot be used anyway), recorded as
    removed, and a remove queued in the node's mailbox so a returning node stops it."""
    await release(w, bid, iid, inst)
    reconciler.poke(w)
    await w.bus.emit_all([
        Emit(E.instance_removed, InstanceEvent(bid, gen, iid, inst["node"], inst.get("gpus", []), reason)),
        Emit(E.node_instance_remove, InstanceCommand(bid, gen, cid, iid, inst["node"], [], reason=reason)),
    ])


async def _alive_since(w: Worker, nid: str, since: float) -> bool:
    """Whether node ``nid``'s agent has sent a heartbeat since ``since``: alive after a fault that
    is to move an instance off it. A node that never sends heartbeats (the simulated fleet) has
    no such evidence either way: alive."""
    try:
        beats = await w.store.health.last_heartbeats([nid])
    except Exception as exc:
        log.warning("controller.heartbeats_unavailable", error=repr(exc))
        return False
    last = beats.get(nid)
    return last is None or last >= since


def _backoff(deliveries: int) -> float:
    """A reassignment's wait before its next try: 0.5, 1, 2, 4, 4... s."""
    return min(0.5 * 2 ** (deliveries - 1), 4.0)




async def _reselect_or_fail(
    w: Worker, ir: BlockIR, ev: AllocationRequest, exc: PlacementFailed, trace: list[Decision] | None = None
) -> None:
    """The chosen cluster could not take the gang (it filled up since its dry_run, or its policy
    raised): record why and send the block back through selection, a bounded number of rounds.
    A resourceAllocator that gave no answer (timed out, wrong shape) or a choice the framework
    refuses fails the block at once (``al.after_failure``: another round would fail the same way)."""
    bid, gen, n, reason = ev.block_id, ev.gen, ev.attempt, exc.reason
    then = al.after_failure(exc, n, w.settings.selection_rounds)
    if then == "fail":  # the policy's error, as a policy's failure at selection fails the block
        await _allocation_failed(w, ev, reason, trace)
        await w.fail_block(bid, gen, reason, Step.FAIL_ALLOCATION, ev.cluster_id)
        return
    if then == "wait":  # fits nowhere after its rounds: waits (docs/priority.md)
        await _allocation_failed(w, ev, reason, trace)
        await queue.wait_or_fail(w, bid, gen, ir, f"{reason} (after {n + 1} selection rounds)", Step.FAIL_ALLOCATION,
                                 {ev.cluster_id: reason}, ev.cluster_id)
        return
    # marked before the CAS (announce): a reselect whose publish failed is published by the
    # reconciler even when the request does not come back to find the block ``_reselected``
    events = _reselect_emits(ir, ev, reason, trace)
    key = await announce.mark(w, bid, gen, Step.RESELECT, events)
    ok, info = await w.store.transition(bid, gen, Step.RESELECT, attempt=str(n + 1))
    back = ok or info == "parsed"
    await w.bus.emit_all(events if back else events[:1])  # the block back to selection only if the step took
    await announce.settle(w, key, back)


def _reselected(block: BlockRecord, ev: AllocationRequest) -> bool:
    """The block is where this request's reselect step left it (``parsed``, the next round) and
    no gateway took that round yet."""
    return block["gen"] == ev.gen and block["status"] == "parsed" and int(block.get("attempt", 0)) == ev.attempt + 1


async def _allocation_failed(w: Worker, ev: AllocationRequest, reason: str, trace: list[Decision] | None) -> None:
    await w.bus.emit_all(_reselect_emits(None, ev, reason, trace))


def _reselect_emits(ir: BlockIR | None, ev: AllocationRequest, reason: str, trace: list[Decision] | None) -> list[Emit]:
    """Why the cluster could not take the gang (the first one stored keeps its reason) and, with
    ``ir``, the block back to selection (its next round)."""
    failed = Emit(E.block_allocation_failed, StepFailed(ev.block_id, ev.gen, "allocation", f"{ev.cluster_id}: {reason}",
                                                        str(ev.attempt), decisions=trace or []))
    return [failed] if ir is None else [failed, Emit(E.block_parsed, Parsed(ev.block_id, ev.gen, wire_ir(ir), ev.attempt + 1))]


async def _reselect_events(w: Worker, ir: BlockIR, ev: AllocationRequest, reason: str) -> None:
    """A reselect step's events again, when its request comes back after the step was taken."""
    await w.bus.emit_all(_reselect_emits(ir, ev, reason, None))




async def _step_failed(
    w: Worker, bid: str, block: BlockRecord | None, step: str, request_id: str, reason: str,
    trace: list[Decision] | None = None,
) -> None:
    gen = block["gen"] if block else 0
    reconciler.poke(w)  # a failed step may leave the block short: the reconciler looks again
    event = {"scale": E.block_scale_failed, "scale.target": E.block_scale_failed, "scale_down": E.block_scale_down_failed}.get(
        step, E.block_reassignment_failed)
    await w.bus.emit(event, StepFailed(bid, gen, step, reason, request_id, decisions=trace or []))
    if step in ("scale", "reassignment") and block is not None:
        await reconciler.note_failed(w, bid, gen, step, reason)  # why a short block is short


# -- scaling to a target, scale-down ---------------------------------------------------------------
def _superseded(block: BlockRecord, target_seq: int, live: int, up: bool) -> str:
    """Why a step asked for by target version ``target_seq`` must not act now ('' if it may): a
    later target replaced it, or the block already has what the current target asks."""
    held = int(block.get("desired_seq") or 0)
    if held != target_seq:
        return f"superseded by a later target (desired {block.get('desired', '?')})"
    desired = int(block.get("desired") or 0)
    if up and live >= desired:
        return f"target {desired} already reached"
    return ""


async def scale_target(w: Worker, ev: ScaleTarget, seq: int) -> None:
    """A desired instance count: clamped, stored on the block (the latest target wins), then
    reached with scale steps (one per missing instance) or one scale_down step."""
    bid = ev.block_id
    block, insts = await w.store.block_view(bid) if ID_RE.match(bid or "") else (None, {})
    if block is None or block["status"] not in LIVE or not block.get("cluster") or (ev.gen and ev.gen != block["gen"]):
        why = "unknown block" if block is None else (
            f"block is {block['status']}" if block["status"] not in LIVE or not block.get("cluster")
            else f"block generation is {block['gen']}, the target was for {ev.gen}")
        await _step_failed(w, bid, block, "scale.target", ev.request_id, f"target {ev.target} not applied: {why}")
        return
    ir, gen = block["ir"], block["gen"]
    target, note = scaling.clamp(int(ev.target), int(ir["minInstances"]), int(ir["maxInstances"]))
    reason = scaling.target_reason(ev.source, ev.reason, note)
    ok, info = await w.store.set_desired(bid, gen, target, seq, LIVE, desired_reason=reason, desired_request=ev.request_id)
    if not ok:
        log.info("scale.target_ignored", block=bid, target=target, why=info)
        if not info.startswith("superseded"):
            await _step_failed(w, bid, block, "scale.target", ev.request_id, f"target {ev.target} not applied: block is {info}")
        return
    plan = scaling.plan_target(ev.request_id, target, insts, lambda rid: h.instance_id(bid, rid))
    log.info("scale.target", block=bid, asked=ev.target, target=target, note=note, source=ev.source,
             up=len(plan.up), down=plan.down)
    cid = block["cluster"]
    out = [Emit(E.cluster_scale, ScaleRequest(bid, cid, rid, gen=gen, target_seq=seq)) for rid in plan.up]
    if plan.down:
        out.append(Emit(E.cluster_scale_down, ScaleDownRequest(
            bid, cid, plan.down_request, target, plan.down, gen=gen, target_seq=seq, reason=reason)))
    await w.bus.emit_all(out)


@dataclass
class _Down:
    """A scale-down step while it removes its count: what it read, and how far it got."""

    ev: ScaleDownRequest
    block: BlockRecord
    insts: dict[str, InstanceRecord]
    floor: int
    grace: float
    metrics: dict[str, InstanceSample]
    block_metrics: dict[str, Any]
    done: int = 0
    races: int = 0


async def scale_down(w: Worker, ev: ScaleDownRequest) -> None:
    """Remove up to ``ev.count`` instances, never below ``max(minInstances, ev.target)``: for each,
    the resourceAllocator (action ``scale_down``) names it (or leaves it to the default: least
    loaded, newest first); it is marked removing atomically with the floor check
    (``Store.drain_instance``), the decision is published (``scale_down.chosen``) and its node
    told to drain and remove it. A policy that fails, or names no live instance, fails the step
    with the reason: nothing more is removed. A redelivery re-sends what it already chose (the
    stream deduplicates) and never goes below the floor."""
    bid = ev.block_id
    block, insts = await w.store.block_view(bid)
    if block is None or block["status"] not in LIVE or (ev.gen and ev.gen != block["gen"]):
        await _step_failed(w, bid, block, "scale_down", ev.request_id, f"block is {block['status'] if block else 'unknown'}")
        return
    s = _Down(ev, block, insts, max(int(block["ir"]["minInstances"]), int(ev.target), 0), float(w.settings.scale_down_grace_s),
              await _instance_metrics(w, bid), await block_metrics(w, bid, ev.block_metrics))
    await _resend_chosen(w, s)
    while s.done < ev.count:
        stopped = await _remove_one(w, s)
        if stopped is None:
            continue
        why, trace, always = stopped
        if why and (always or not s.done):
            await _step_failed(w, bid, block, "scale_down", ev.request_id, why, trace)
        return


async def _instance_metrics(w: Worker, bid: str) -> dict[str, InstanceSample]:
    try:
        return await w.store.metrics.instances(bid)
    except Exception as exc:
        log.warning("controller.instance_metrics_unavailable", block=bid, error=repr(exc))
        return {}


def _remove_command(s: _Down, iid: str, rec: InstanceRecord) -> InstanceCommand:
    return InstanceCommand(s.ev.block_id, s.block["gen"], rec["cluster"], iid, rec["node"], [],
                           reason=f"scale down ({s.ev.request_id})", drain_s=s.grace)


async def _resend_chosen(w: Worker, s: _Down) -> None:
    """What this request already chose (a redelivery): told again, deduplicated by the stream."""
    mine = {iid: rec for iid, rec in s.insts.items() if rec.get("drain") == s.ev.request_id}
    if mine:
        await w.bus.emit_all([Emit(E.node_instance_remove, _remove_command(s, iid, rec)) for iid, rec in mine.items()])
    s.done = len(mine)


async def _remove_one(w: Worker, s: _Down) -> tuple[str, list[Decision], bool] | None:
    """Choose and remove one instance. None: one more removed, or the instances changed under
    the step (look again); else the step stops: why ('' when done), the policy calls, and whether
    it failed even when it already removed some."""
    ev, ir = s.ev, s.block["ir"]
    if ev.target_seq:
        why = _superseded(await w.store.get_block(ev.block_id) or {}, ev.target_seq, 0, up=False)
        if why:
            return why, [], False
    cands = scaling.candidates(s.insts, s.metrics, time.time())
    if len(cands) <= s.floor:
        return f"nothing to remove: {len(cands)} instance(s), floor {s.floor} (minInstances {ir['minInstances']})", [], False
    trace: list[Decision] = []
    try:
        iid, by = await _choose_removal(w, s, cands, trace)
    except (PolicyFailed, scaling.ChoiceRefused) as exc:
        return str(exc), trace, True
    marked = await w.store.drain_instance(ev.block_id, iid, s.floor, ev.request_id, ev.count)
    if marked in ("floor", "done"):
        return "", trace, False  # a concurrent scale-down took the block to the floor first, or this same request did its count
    if marked != "ok":  # gone or going meanwhile (another step chose it): look again
        s.races += 1
        if s.races > 5:
            return f"instances kept changing under the step ({marked})", trace, True
        s.insts = await w.store.instances(ev.block_id)
        return None
    rec = s.insts[iid]
    why = "chosen by the resourceAllocator" if by == "policy" else "default: least loaded, newest first"
    await w.bus.emit_all([
        Emit(E.block_scale_down_chosen, ScaleDownChosen(ev.block_id, s.block["gen"], rec["cluster"], ev.request_id, iid, rec["node"],
                                                      by, f"{why}; {ev.reason}" if ev.reason else why, trace)),
        Emit(E.node_instance_remove, _remove_command(s, iid, rec)),
    ])
    s.done += 1
    s.insts = {**s.insts, iid: {**rec, "status": "removing", "drain": ev.request_id}}
    return None


async def _choose_removal(w: Worker, s: _Down, cands: list[ScaleDownCandidate], trace: list[Decision]) -> tuple[str, str]:
    """The resourceAllocator's ``scale_down`` choice (instance, ``policy``/``default``)."""
    ir, cid = s.block["ir"], s.block["cluster"]
    nodes = await w.inventory.nodes(cid)
    clusters = await w.inventory.clusters()
    data = h.payload(ir, clusters.get(cid, {"id": cid, "labels": {}}), nodes, s.insts, await w.affinity_index(ir),
                     block_metrics=s.block_metrics)
    data["instances"] = cands  # the seed's scale payload plus the instances to choose from
    result = await w.invoke(ir, "resourceAllocator", {"action": "scale_down", "payload": data}, trace)
    return scaling.choice(result, cands)
