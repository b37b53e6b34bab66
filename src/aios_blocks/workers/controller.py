"""Cluster controller: dry_run, allocation (a gang of minInstances), scale, reassignment, and the
block lifecycle facts (instance added/removed, delete) that make a block ready or deleted."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.router import TRIGGER_SEQ, Inbound, Router
from ..bus.runner import Defer
from ..handlers import controller as h
from ..handlers import faults, scaling, sidecars
from ..handlers import lifecycle as lc
from ..handlers import stability as st
from ..handlers.effects import Publish, ReadyIfRunning
from ..policies import capacity
from ..policies.affinity import uid
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
    Placement,
    PlacementMade,
    ReassignRequest,
    ScaleDownChosen,
    ScaleDownRequest,
    ScaleRequest,
    ScaleTarget,
    StepFailed,
)
from ..schemas.lifecycle import LIVE, Step
from ..schemas.spec import ID_RE, Cluster, Node
from . import reconciler
from .base import Worker
from .effects import commit, release
from .vcluster import ensure_job_cluster

log = structlog.get_logger("aios.controller")



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


def bindings(w: Worker, cluster: str | None = None) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.controller(cluster))

    @router.on(E.cluster_dry_run)
    async def on_dry_run(m: Inbound[DryRunRequest]) -> None:
        ev = m.data
        if ev.at:  # a query has no stream sequence: its decision names the state its round started from
            TRIGGER_SEQ.set(ev.at)
        ir = ev.ir or await w.block_ir(ev.block_id, ev.gen)
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

    @router.on(E.cluster_allocation)
    async def on_allocation(m: Inbound[AllocationRequest]) -> None:
        ev = m.data
        block = await w.store.get_block(ev.block_id)
        if block is None or block["gen"] != ev.gen or block["status"] not in ("allocating", "placing"):
            return
        if int(block.get("attempt", 0)) != ev.attempt:
            return
        ir = block["ir"]
        iids = [h.instance_id(ev.block_id, i) for i in range(ir["minInstances"])]
        if not iids:
            await commit(w, [ReadyIfRunning(ev.block_id, ev.gen, 0, ev.cluster_id, Step.READY_EMPTY)])
            return
        trace: list[Decision] = []
        try:
            placements, attempts = await _commit(w, ir, ev.cluster_id, "allocation", iids, trace=trace)
        except PlacementFailed as exc:
            await _reselect_or_fail(w, ir, ev, exc.reason, trace)
            return
        await _start(w, ir, ev.gen, ev.cluster_id, "allocation", placements, attempts, key="gang", trace=trace,
                     step=(Step.RESERVE, {"cluster": ev.cluster_id}))

    @router.on(E.cluster_scale)
    async def on_scale(m: Inbound[ScaleRequest]) -> None:
        ev = m.data
        block, current = await w.store.block_view(ev.block_id)
        if block is None or block["status"] not in LIVE:
            await _step_failed(w, ev.block_id, block, "scale", ev.request_id, f"block is {block['status'] if block else 'unknown'}")
            return
        ir, gen = block["ir"], block["gen"]
        iid = h.instance_id(ev.block_id, ev.request_id)
        if ev.target_seq and iid not in current:
            why = _superseded(block, ev.target_seq, len(scaling.live(current)), up=True)
            if why.startswith("superseded"):
                await _step_failed(w, ev.block_id, block, "scale", ev.request_id, why)
                return
            if why:  # reached meanwhile (another copy's step): nothing to do, nothing failed
                log.info("scale.skipped", block=ev.block_id, request=ev.request_id, why=why)
                return
        if iid not in current and len(current) >= ir["maxInstances"]:
            await _step_failed(w, ev.block_id, block, "scale", ev.request_id, f"already at maxInstances ({ir['maxInstances']})")
            return
        trace: list[Decision] = []
        try:
            placements, attempts = await _commit(
                w, ir, ev.cluster_id, "scale", [iid], current, trace=trace,
                block_metrics=await block_metrics(w, ev.block_id, ev.block_metrics),
            )
        except PlacementFailed as exc:
            await _step_failed(w, ev.block_id, block, "scale", ev.request_id, exc.reason, trace)
            return
        # the bound is checked again where it is atomic: concurrent steps all saw room above
        if await _start(w, ir, gen, ev.cluster_id, "scale", placements, attempts, key=ev.request_id, trace=trace,
                        limit=int(ir["maxInstances"])):
            await _step_failed(w, ev.block_id, block, "scale", ev.request_id,
                               f"already at maxInstances ({ir['maxInstances']})", trace)

    @router.on(E.cluster_scale_down)
    async def on_scale_down(m: Inbound[ScaleDownRequest]) -> None:
        await scale_down(w, m.data)

    @router.on(E.cluster_reassignment)
    async def on_reassignment(m: Inbound[ReassignRequest]) -> None:
        # one reassignment of an instance at a time, on any controller copy: two requests for the
        # same instance handled together (a health verdict and an operator's, say) each placed a
        # replacement. The claim is a lease in Redis; the second request waits for it (it then
        # finds the instance on its way out) and fails with the reason if it never comes free.
        ev = m.data
        holder = await w.store.claim_replacement(ev.block_id, ev.instance_id, ev.request_id, w.settings.reassign_claim_s)
        if holder != ev.request_id:
            if m.deliveries < w.settings.reassign_attempts:
                raise Defer(_backoff(m.deliveries))
            block = await w.store.get_block(ev.block_id)
            await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id,
                               f"the instance is already being replaced (request {holder or 'unknown'})")
            return
        await reassign(m)
        # decided (placed, or failed for good): a Defer or an error above keeps the claim for the
        # redelivery of this same request
        await w.store.release_replacement(ev.block_id, ev.instance_id, ev.request_id)

    async def reassign(m: Inbound[ReassignRequest]) -> None:
        ev = m.data
        block, current = await w.store.block_view(ev.block_id)
        current = current if block else {}
        old = current.get(ev.instance_id)
        meta = await w.store.node_meta(old["node"]) if old else None
        node_down = meta is not None and not meta["healthy"]
        why = ""
        if block is None or block["status"] not in LIVE or old is None:
            why = (f"no such instance: {ev.instance_id} was already replaced or removed (nothing left to move)" if block and old is None
                   else f"block is {block['status'] if block else 'unknown'}")
        elif old.get("status") == "removing":  # already replaced (or scaled down): a replacement would be one too many
            why = "the instance is already being removed"
        if why:
            await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id, why)
            if block is not None and old is not None and node_down:
                await _evict(w, ev.block_id, block["gen"], ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}")
            return
        assert block is not None and old is not None  # else ``why`` said so above
        ir, gen = block["ir"], block["gen"]
        iid = h.instance_id(ev.block_id, ev.request_id)
        trace: list[Decision] = []
        bm = await block_metrics(w, ev.block_id, ev.block_metrics)
        try:
            try:
                placements, attempts = await _commit(
                    w, ir, ev.cluster_id, "reassignment", [iid], current, trace=trace, avoid=ev.avoid_node,
                    block_metrics=bm, instance_id=ev.instance_id, pod_name=ev.instance_id, reason=ev.reason,
                )
            except PlacementFailed:
                if not ev.avoid_node or node_down or not await _alive_since(w, ev.avoid_node, ev.at):
                    raise
                # nothing else fits: the node it leaves, when its agent is alive after the fault
                # (a one-node cluster replaces a crashed instance where it was), rather than none;
                # a suspect node stays left out (``_plan_and_reserve``)
                placements, attempts = await _commit(
                    w, ir, ev.cluster_id, "reassignment", [iid], current, trace=trace,
                    block_metrics=bm, instance_id=ev.instance_id, pod_name=ev.instance_id, reason=ev.reason,
                )
        except PlacementFailed as exc:
            if not node_down and m.deliveries < w.settings.reassign_attempts:
                # the capacity may be held by instances on their way out (a failed one's remove is
                # in flight): try again shortly rather than leave the block short of an instance;
                # no step event carries this attempt's policy calls, so they are recorded on their own
                await w.bus.emit_all([Emit(E.block_decision, d) for d in trace])
                raise Defer(_backoff(m.deliveries)) from exc
            await _step_failed(w, ev.block_id, block, "reassignment", ev.request_id, exc.reason, trace)
            if node_down:  # its node is gone: release it anyway, the capacity is not usable
                await _evict(w, ev.block_id, gen, ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}")
            elif block["status"] == "placing":
                # never became ready and cannot replace what it lost: its story ends here
                await _fail_placing(w, ev.block_id, gen, inst_cluster=old["cluster"],
                                    reason=f"replacement of {ev.instance_id} could not be placed: {exc.reason}")
            return
        await _start(w, ir, gen, ev.cluster_id, "reassignment", placements, attempts, key=ev.request_id, replaces=ev.instance_id,
                     trace=trace)
        if node_down:
            await _evict(w, ev.block_id, gen, ev.cluster_id, ev.instance_id, old, f"evicted: {ev.reason}; replaced by {iid}")
            return
        await w.store.set_instance_status(ev.block_id, ev.instance_id, "removing")
        await w.bus.emit(
            E.node_instance_remove,
            InstanceCommand(ev.block_id, gen, ev.cluster_id, ev.instance_id, old["node"], old.get("gpus", []), reason=f"reassigned to {iid}"),
        )

    return [router.binding()]


def lifecycle_bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.LIFECYCLE)

    async def view(bid: str) -> lc.View:
        block, insts = await w.store.block_view(bid)
        return lc.View(block, insts if block is not None else {})

    @router.on(E.instance_added)
    async def on_added(m: Inbound[InstanceEvent]) -> None:
        ev = m.data
        block, inst = await w.store.block_and_instance(ev.block_id, ev.instance_id)  # it looks at that one only
        await commit(w, lc.on_added(ev, lc.View(block, {ev.instance_id: inst} if block is not None and inst else {})))

    @router.on(E.instance_removed)
    async def on_removed(m: Inbound[InstanceEvent]) -> None:
        ev = m.data
        # instances are read even for an unknown block: a removal after the record went must still release
        await commit(w, lc.on_removed(ev, lc.View(*await w.store.block_view(ev.block_id))))

    @router.on(E.instance_failed)
    @router.on(E.instance_unhealthy)
    async def on_fault(m: Inbound[InstanceEvent]) -> None:
        ev = m.data
        kind = "failed" if m.event is E.instance_failed else "unhealthy"
        v = await view(ev.block_id)
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

    @router.on(E.instance_verdict)
    async def on_verdict(m: Inbound[InstanceVerdict]) -> None:
        ev = m.data
        if ev.verdict not in ("restart", "replace"):
            return  # routing only: the mapper's
        what, effects = lc.on_verdict(ev, await view(ev.block_id), w.settings.max_replacements)
        log.info("instance.verdict", block=ev.block_id, instance=ev.instance_id, verdict=ev.verdict, reason=ev.reason, action=what)
        await commit(w, effects)

    @router.on(E.node_dangling)
    async def on_dangling(m: Inbound[Dangling]) -> None:
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
                reason="adopt dangling", launch=block["ir"].get("launch") or {}, resources=block["ir"].get("resources") or {},
            )
            await w.bus.emit(E.node_instance_create, cmd, qualifier=f"adopt:{ev.handle}")
        else:
            await w.bus.emit(
                E.node_instance_remove,
                InstanceCommand(ev.block_id or "-", ev.gen, "", ev.instance_id, nid, [], reason=f"dangling: {verdict.why}"),
                qualifier=f"dangling:{nid}:{ev.handle}",
            )

    @router.on(E.node_inventory)
    async def on_inventory(m: Inbound[NodeInventory]) -> None:
        ev = m.data
        nid = m.tokens["nid"]  # the subject's node (agent-<nid> may publish only its own): the body's is a claim
        if ev.node_id != nid:
            log.warning("node.inventory_ignored", subject_node=nid, body_node=ev.node_id, why="node_id in the body is not the node of the subject")
            return
        effects = lc.on_inventory(ev, await w.store.node_instances(nid))
        log.info("node.inventory", node=nid, boot=ev.boot, runs=len(ev.instances), lost=sum(len(e.events) for e in effects if isinstance(e, Publish)))
        await commit(w, effects)

    @router.on(E.node_registered)
    async def on_registered(m: Inbound[NodeRegistered]) -> None:
        ev = m.data
        node = Node.model_validate(ev.node)
        known = node.cluster in await w.inventory.clusters()
        meta = await w.store.node_meta(node.id)
        if (
            known and meta is not None and meta["cluster"] == node.cluster and meta["agent"] == ev.agent
            and meta["healthy"] == node.healthy and meta["spec"] == node.model_dump(mode="json")
        ):
            return  # already recorded as announced (`blocks cluster add` writes Redis itself; an agent restarted)
        new = await w.store.ensure_cluster(Cluster(id=node.cluster))
        await w.store.put_node(node, agent=ev.agent)
        # a (re-)registration refreshes that node only; a cluster new to us refreshes the cluster
        # list everywhere (reloading a 1,000-node cluster per registration stalled placements)
        await w.hint(node.cluster, None if new or not known else [node.id])

    @router.on(E.block_scale_target)
    async def on_scale_target(m: Inbound[ScaleTarget]) -> None:
        await scale_target(w, m.data, m.stream_seq)

    @router.on(E.block_delete)
    async def on_delete(m: Inbound[DeleteRequest]) -> None:
        await commit(w, lc.on_delete(m.data.block_id, await view(m.data.block_id)))

    return [router.binding()]


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


async def _evict(w: Worker, bid: str, gen: int, cid: str, iid: str, inst: dict[str, Any], reason: str) -> None:
    """An instance on a dead node: released now (its node cannot be used anyway), recorded as
    removed, and a remove queued in the node's mailbox so a returning node stops it."""
    await release(w, bid, iid, inst)
    reconciler.poke(w)
    await w.bus.emit_all([
        Emit(E.instance_removed, InstanceEvent(bid, gen, iid, inst["node"], inst.get("gpus", []), reason)),
        Emit(E.node_instance_remove, InstanceCommand(bid, gen, cid, iid, inst["node"], [], reason=reason)),
    ])


async def _commit(
    w: Worker, ir: dict[str, Any], cid: str, action: str, iids: list[str],
    instances: dict[str, Any] | None = None, trace: list[Decision] | None = None, avoid: str = "", **extra: Any,
) -> tuple[list[dict[str, Any]], int]:
    """Plan from the snapshot, reserve atomically; on conflict refresh and retry (bounded).
    A redelivered step finds its reservations already made and reuses them. The policy calls'
    records go into ``trace``. Suspect nodes (``state.health``) and ``avoid`` (the node a
    replaced instance is moved off) are left out of the candidates (``excluded``)."""
    existing = await w.store.reservations_of(cid, iids)
    held = [r for r in existing if r]
    if len(held) == len(iids):
        return [
            {"iid": iid, "node": r["node"], "gpus": list(_gpus(r["gpus"]))} for iid, r in zip(iids, held, strict=True)
        ], 0
    await ensure_job_cluster(w, ir, cid)  # seed 003: a job-cluster block's own nodes, carved first
    clusters = await w.inventory.clusters()
    cluster = clusters.get(cid, {"id": cid, "labels": {}})
    return await _plan_and_reserve(w, ir, cid, cluster, action, iids, instances, trace, avoid=avoid, **extra)


_locks: dict[str, asyncio.Lock] = {}
#: id(worker) -> (when read, the suspect nodes then, node -> why): read at most once a second
_suspect_cache: dict[int, tuple[float, dict[str, str]]] = {}
SUSPECT_CACHE_S = 1.0


async def suspect_nodes(w: Worker) -> dict[str, str]:
    """The nodes suspect now (node -> why; docs/health.md "Suspect nodes"), cached a second per
    process; Redis away costs the exclusion, never the placement."""
    now = time.monotonic()
    hit = _suspect_cache.get(id(w))
    if hit is not None and now - hit[0] < SUSPECT_CACHE_S:
        return hit[1]
    try:
        marks = {nid: f"suspect: {d.get('reason', '')}" for nid, d in (await w.store.health.suspects()).items()}
    except Exception as exc:
        log.warning("controller.suspects_unavailable", error=repr(exc))
        marks = hit[1] if hit is not None else {}
    _suspect_cache[id(w)] = (now, marks)
    return marks


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


def excluded(nodes: Any, suspects: dict[str, str], avoid: str) -> dict[str, str]:
    """The cluster's nodes a plan leaves out, node -> why, in node order (the policy input holds it)."""
    out = {nid: why for nid, why in suspects.items() if nid in nodes}
    if avoid and avoid in nodes:
        out[avoid] = "the node the replaced instance is moved off" + (f"; {out[avoid]}" if avoid in out else "")
    return dict(sorted(out.items()))


def _backoff(deliveries: int) -> float:
    """A reassignment's wait before its next try: 0.5, 1, 2, 4, 4... s."""
    return min(0.5 * 2 ** (deliveries - 1), 4.0)


def _cluster_lock(cid: str) -> asyncio.Lock:
    """Plans of one cluster are made one at a time inside a process, each on the view the one
    before left, so concurrent messages do not all plan from the same snapshot and collide; other
    processes are the atomic script's job."""
    return _locks.setdefault(cid, asyncio.Lock())


async def _plan_and_reserve(
    w: Worker, ir: dict[str, Any], cid: str, cluster: dict[str, Any], action: str, iids: list[str],
    instances: dict[str, Any] | None, trace: list[Decision] | None, avoid: str = "", **extra: Any,
) -> tuple[list[dict[str, Any]], int]:
    reason = ""
    retries = w.settings.commit_retries
    suspects = await suspect_nodes(w)
    for attempt in range(1, retries + 1):
        async with _cluster_lock(cid):
            nodes = await w.inventory.nodes(cid)
            index = await w.affinity_index(ir)
            out = excluded(nodes, suspects, avoid) if suspects or avoid else {}
            if out:
                extra["excluded_nodes"] = out
            else:
                extra.pop("excluded_nodes", None)
            try:
                placements = await h.plan(
                    ir, cluster, nodes, action, iids, w.invoker(ir, "resourceAllocator", trace), instances, index, **extra
                )
            except PlacementFailed as exc:
                if out:  # say which nodes were not offered, and why (explain shows the step's failure)
                    raise PlacementFailed(f"{exc.reason}; left out: " + "; ".join(f"{n} ({why})" for n, why in out.items())) from exc
                raise
            touched = sorted({p["node"] for p in placements})
            planned_on = {nid: nodes[nid] for nid in touched}
            # our view takes the reservation now, as the script will (``capacity.take``), and the
            # script is sent before the lock goes: the next plan of this cluster starts on this
            # one's result without waiting for its round trip (one plan per Redis round trip per
            # cluster was the bound of a scale burst); a reservation that fails re-reads its nodes
            w.inventory.apply(cid, _taken(planned_on, placements, ir["resources"]), planned_on)
            reserving = asyncio.ensure_future(w.store.reserve_gang(cid, placements))
            await asyncio.sleep(0)  # the script queued (autopipeline) before the next plan's
        try:
            ok, reason, node = await reserving
        except BaseException:  # not known to be taken (Redis failed us): re-read rather than trust the view
            w.inventory.invalidate(cid, touched)
            raise
        if ok:
            if reason != "ok":  # reserved before (a redelivery), not by this plan: re-read what it took
                w.inventory.invalidate(cid, touched)
            await w.hint(cid, touched, applied=reason == "ok")
            return placements, attempt
        w.inventory.invalidate(cid, touched + ([node] if node else []))
        await asyncio.sleep(random.uniform(0, 0.01 * attempt))  # de-synchronise competing controllers
    raise PlacementFailed(f"reservation conflict after {retries} attempts: {reason}")


def _taken(nodes: dict[str, dict[str, Any]], placements: list[dict[str, Any]], needs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The views of the nodes a reservation just changed, as the reservation script changed them
    (``capacity.take``, the optimistic twin of ``RESERVE_GANG``): copies, the snapshot is shared."""
    out: dict[str, dict[str, Any]] = {}
    for p in placements:
        nid = p["node"]
        if nid not in out:
            out[nid] = capacity.copy_node(nodes[nid])
        capacity.take(out[nid], p["gpus"], needs, bool(p.get("share")))
    return out


async def _reselect_or_fail(
    w: Worker, ir: dict[str, Any], ev: AllocationRequest, reason: str, trace: list[Decision] | None = None
) -> None:
    """The chosen cluster could not take the gang (it filled up since its dry_run, or its policy
    failed): record why and send the block back through selection, a bounded number of rounds."""
    bid, gen, n = ev.block_id, ev.gen, ev.attempt
    failed = StepFailed(bid, gen, "allocation", f"{ev.cluster_id}: {reason}", str(n), decisions=trace or [])
    await w.bus.emit(E.block_allocation_failed, failed)
    if n + 1 >= w.settings.selection_rounds:
        await w.fail_block(bid, gen, f"{reason} (after {n + 1} selection rounds)", Step.FAIL_ALLOCATION, ev.cluster_id)
        return
    ok, info = await w.store.transition(bid, gen, Step.RESELECT, attempt=str(n + 1))
    if ok or info == "parsed":
        await w.bus.emit(E.block_parsed, Parsed(bid, gen, ir, n + 1))


def _gpus(raw: str) -> list[str]:
    taken = msgspec.json.decode(raw)
    return list(taken) if isinstance(taken, dict) else []


async def _start(
    w: Worker, ir: dict[str, Any], gen: int, cid: str, action: str, placements: list[dict[str, Any]],
    attempts: int, key: str, replaces: str = "", trace: list[Decision] | None = None,
    step: tuple[Step, dict[str, Any]] | None = None, limit: int | None = None,
) -> list[str]:
    """Record the placed instances (and the block's ``step``, if given), in one round trip, then
    publish the placement and the nodes' create commands. ``limit``: the most instances the block
    may hold (a scale step); an instance past it is not recorded, its reservation is released
    and nothing is published for it. Returns those refused instances."""
    bid = ir["blockId"]
    nodes = await w.inventory.nodes(cid)
    # the gang's step places the block's side-cars too (handlers/sidecars.py): recorded with the step
    sc_node = sidecars.sidecar_node(placements) if action == "allocation" and ir.get("sidecars") else ""
    if sc_node and step is not None:
        step = (step[0], {**step[1], sidecars.NODE_FIELD: sc_node})
    index = [
        (uid(bid), uid(p["iid"]), p["iid"], p["node"], nodes.get(p["node"], {}).get("labels", {}).get("rack", ""))
        for p in placements
    ]
    refused = await w.store.start_instances(
        bid,
        {
            p["iid"]: {"node": p["node"], "gpus": p["gpus"], "cluster": cid, "status": "starting", "action": action,
                       "since": round(time.time(), 3)}
            for p in placements
        },
        index,
        None if step is None else (gen, step[0], step[1]),
        limit=limit,
    )
    if refused:
        gone = [p for p in placements if p["iid"] in refused]
        for p in gone:
            await w.store.release(cid, p["node"], p["iid"])
        await w.hint(cid, sorted({p["node"] for p in gone}))
        placements = [p for p in placements if p["iid"] not in refused]
        if not placements:
            return refused
    made = PlacementMade(
        bid, gen, cid, action, [Placement(p["iid"], p["node"], p["gpus"], p.get("adaptive") or []) for p in placements],
        attempts, replaces, key, trace or [], next((p["adapt"] for p in placements if p.get("adapt")), {}),
    )
    out = [Emit(E.block_placement, made)]
    for p in placements:
        cmd = InstanceCommand(
            bid, gen, cid, p["iid"], p["node"], p["gpus"], ir.get("image", ""), h.env_for(ir, p["iid"], p["gpus"]),
            launch=ir.get("launch") or {}, resources=ir.get("resources") or {},
        )
        out.append(Emit(E.node_instance_create, cmd))
    out += sidecars.starts(ir, gen, cid, sc_node)
    await w.bus.emit_all(out)
    return refused


async def _step_failed(
    w: Worker, bid: str, block: dict[str, Any] | None, step: str, request_id: str, reason: str,
    trace: list[Decision] | None = None,
) -> None:
    gen = block["gen"] if block else 0
    reconciler.poke(w)  # a failed step may leave the block short: the reconciler looks again
    event = {"scale": E.block_scale_failed, "scale.target": E.block_scale_failed, "scale_down": E.block_scale_down_failed}.get(
        step, E.block_reassignment_failed)
    await w.bus.emit(event, StepFailed(bid, gen, step, reason, request_id, decisions=trace or []))


# -- scaling to a target, scale-down ---------------------------------------------------------------
def _superseded(block: dict[str, Any], target_seq: int, live: int, up: bool) -> str:
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
    ir, gen = block["ir"], block["gen"]
    floor = max(int(ir["minInstances"]), int(ev.target), 0)
    grace = float(w.settings.scale_down_grace_s)
    # what this request already chose (a redelivery): told again, deduplicated by the stream
    mine = {iid: rec for iid, rec in insts.items() if rec.get("drain") == ev.request_id}
    if mine:
        await w.bus.emit_all([
            Emit(E.node_instance_remove, InstanceCommand(bid, gen, rec["cluster"], iid, rec["node"], [],
                                                         reason=f"scale down ({ev.request_id})", drain_s=grace))
            for iid, rec in mine.items()
        ])
    done = len(mine)
    metrics: dict[str, dict[str, Any]] = {}
    try:
        metrics = await w.store.metrics.instances(bid)
    except Exception as exc:
        log.warning("controller.instance_metrics_unavailable", block=bid, error=repr(exc))
    bm = await block_metrics(w, bid, ev.block_metrics)
    races = 0
    while done < ev.count:
        if ev.target_seq:
            fresh = await w.store.get_block(bid)
            why = _superseded(fresh or {}, ev.target_seq, 0, up=False)
            if why:
                if not done:
                    await _step_failed(w, bid, block, "scale_down", ev.request_id, why)
                return
        cands = scaling.candidates(insts, metrics, time.time())
        if len(cands) <= floor:
            if not done:
                await _step_failed(w, bid, block, "scale_down", ev.request_id,
                                   f"nothing to remove: {len(cands)} instance(s), floor {floor} (minInstances {ir['minInstances']})")
            return
        trace: list[Decision] = []
        nodes = await w.inventory.nodes(block["cluster"])
        clusters = await w.inventory.clusters()
        data = h.payload(ir, clusters.get(block["cluster"], {"id": block["cluster"], "labels": {}}), nodes, insts,
                         await w.affinity_index(ir), block_metrics=bm)
        data["instances"] = cands  # the seed's scale payload plus the instances to choose from
        try:
            result = await w.invoke(ir, "resourceAllocator", {"action": "scale_down", "payload": data}, trace)
            iid, by = scaling.choice(result, cands)
        except (PolicyFailed, scaling.ChoiceRefused) as exc:
            await _step_failed(w, bid, block, "scale_down", ev.request_id, str(exc), trace)
            return
        rec = insts[iid]
        marked = await w.store.drain_instance(bid, iid, floor, ev.request_id, ev.count)
        if marked in ("floor", "done"):
            return  # a concurrent scale-down took the block to the floor first, or this same request did its count
        if marked != "ok":  # gone or going meanwhile (another step chose it): look again
            races += 1
            if races > 5:
                await _step_failed(w, bid, block, "scale_down", ev.request_id, f"instances kept changing under the step ({marked})", trace)
                return
            insts = await w.store.instances(bid)
            continue
        why = "chosen by the resourceAllocator" if by == "policy" else "default: least loaded, newest first"
        cmd = InstanceCommand(bid, gen, rec["cluster"], iid, rec["node"], [], reason=f"scale down ({ev.request_id})", drain_s=grace)
        await w.bus.emit_all([
            Emit(E.block_scale_down_chosen, ScaleDownChosen(bid, gen, rec["cluster"], ev.request_id, iid, rec["node"], by,
                                                          f"{why}; {ev.reason}" if ev.reason else why, trace)),
            Emit(E.node_instance_remove, cmd),
        ])
        done += 1
        insts = {**insts, iid: {**rec, "status": "removing", "drain": ev.request_id}}
