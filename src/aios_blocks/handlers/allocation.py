"""Allocation as a pure decision, Nomad's plan/apply split: ``plan_allocation(snapshot, request)``
returns the effects to commit (a ``Reserve``: the placements, and the node views as the
reservation leaves them); ``start_effects`` what recording and announcing them takes (a
``StartInstances``). No I/O here besides the resourceAllocator ``invoke``; the one adapter
(``workers/allocate.py``) reads the snapshot, commits a ``Reserve`` with compare-and-set in Redis
(``Store.reserve_gang``: all or nothing, never double-booked) and, on a conflict, reads again and
plans again (bounded)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..policies import affinity, capacity, topology
from ..policies.affinity import uid
from ..schemas.catalog import E, Emit
from ..schemas.errors import PlacementFailed
from ..schemas.events import Decision, InstanceCommand, Placement, PlacementMade
from ..schemas.lifecycle import Step
from ..schemas.records import AdaptTable, BlockIR, ClusterRecord, InstanceRecord, Needs, NodeView, wire
from . import sidecars
from .controller import Invoke, check_choice, env_for, plan


@dataclass(frozen=True)
class Snapshot:
    """What a plan reads: the cluster's record and node views, the block's instances, its
    affinity index and the nodes suspect now (node -> why)."""

    cluster: ClusterRecord
    #: shared with the inventory cache: read, never written (a plan copies what it takes)
    nodes: dict[str, NodeView]
    instances: dict[str, InstanceRecord] | None = None
    index: affinity.Index | None = None
    suspects: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """Place ``iids`` of the block ``ir`` in cluster ``cluster_id`` (``action``: allocation,
    scale, reassignment), off node ``avoid``; ``extra``: the action's payload extras
    (``block_metrics``, ``instance_id``, ``pod_name``, ``reason``)."""

    ir: BlockIR
    cluster_id: str
    action: str
    iids: tuple[str, ...]
    avoid: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: place on this node only ("" = any): a move to a named node (docs/rebalance.md)
    only: str = ""
    #: and on these GPUs of it (() = the policy's and the topology pass's pick): a move's ``to_gpus``
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reserve:
    """Guarded (compare-and-set): take the placements' capacity on their nodes, all or nothing
    (``Store.reserve_gang``). ``taken``: the touched nodes' views as the reservation leaves them
    (``capacity.take``, the optimistic twin of the script), for the next plan to start from."""

    cluster_id: str
    placements: tuple[dict[str, Any], ...]
    taken: dict[str, NodeView] = field(hash=False)

    @property
    def touched(self) -> list[str]:
        return sorted({p["node"] for p in self.placements})


def excluded(nodes: Mapping[str, Any], suspects: Mapping[str, str], avoid: str) -> dict[str, str]:
    """The cluster's nodes a plan leaves out, node -> why, in node order (the policy input holds it)."""
    out = {nid: why for nid, why in suspects.items() if nid in nodes}
    if avoid and avoid in nodes:
        out[avoid] = "the node the replaced instance is moved off" + (f"; {out[avoid]}" if avoid in out else "")
    return dict(sorted(out.items()))


async def plan_allocation(snap: Snapshot, req: Request, invoke: Invoke) -> list[Reserve]:
    """The reservation that places ``req`` on ``snap`` (one ``Reserve``), or PlacementFailed with
    the reason (naming the nodes left out, and why, when some were)."""
    nodes = snap.nodes
    if req.only:
        if req.only not in nodes:
            raise PlacementFailed(f"node {req.only} is not a node of cluster {req.cluster_id}")
        nodes = {req.only: nodes[req.only]}
    out = excluded(nodes, snap.suspects, req.avoid)
    extra = {**req.extra, **({"excluded_nodes": out} if out else {})}
    try:
        placements = await plan(req.ir, snap.cluster, nodes, req.action, list(req.iids), invoke,
                                snap.instances, snap.index, **extra)
    except PlacementFailed as exc:
        if out:  # say which nodes were not offered, and why (explain shows the step's failure)
            raise PlacementFailed(f"{exc.reason}; left out: " + "; ".join(f"{n} ({why})" for n, why in out.items()),
                                  policy=exc.policy) from exc
        raise
    if req.gpus:
        placements = [pinned(p, req, nodes) for p in placements]
    return [Reserve(req.cluster_id, tuple(placements), taken(snap.nodes, placements, req.ir["resources"]))]


def after_failure(exc: PlacementFailed, attempt: int, rounds: int) -> str:
    """What an allocation whose chosen cluster could not take the gang does next: ``reselect``
    (another selection round: the cluster filled up since its dry_run, its reservations lost a
    race; other copies' placements may have left room elsewhere; a resourceAllocator that raised,
    which is how a seed-shaped one, and the built-ins, say that nothing fits: the framework
    cannot tell that from a bug), ``wait`` (its ``rounds`` spent: the pending queue, or failed
    with ``queue: false``: ``queue.wait_or_fail``), or ``fail`` (its resourceAllocator gave no
    answer: timed out, returned the wrong shape, could not be loaded; or a choice the framework
    refuses, a node or GPUs that cannot hold the instance on the very snapshot the policy was given,
    ``controller.refused``; another round would call it again and fail again, so the block fails at
    once with the policy's error or every problem of its choice, as a policy's failure at
    selection or post_dry_run fails it: docs/priority.md)."""
    if exc.policy:
        return "fail"
    return "wait" if attempt + 1 >= rounds else "reselect"


def pinned(p: dict[str, Any], req: Request, nodes: Mapping[str, NodeView]) -> dict[str, Any]:
    """The placement on the GPUs the request names (a move's ``to_gpus``), checked as a policy's
    choice is (``controller.check_choice``); PlacementFailed when they cannot be taken there."""
    gpus = list(req.gpus)
    if p["node"] != req.only:
        raise PlacementFailed(f"GPUs {gpus} named without their node (to_node {req.only!r})")
    why = check_choice(p["node"], gpus, dict(nodes), req.ir["resources"], bool(p.get("share")))
    if why:
        raise PlacementFailed(f"the GPUs asked for: {why}")
    out = {**p, "gpus": gpus}
    view = nodes[p["node"]]
    if p.get("topology") and view.get("topology"):  # the tier these GPUs achieve (the best the node had stays)
        ids = [g["id"] for g in view["gpus"]]
        out["topology"] = {**p["topology"], "tier": topology.set_tier(view["topology"], [ids.index(g) for g in gpus]).value}
    return out


def taken(nodes: Mapping[str, NodeView], placements: Sequence[dict[str, Any]], needs: Needs) -> dict[str, NodeView]:
    """The views of the nodes a reservation changes, as the reservation script changes them
    (``capacity.take``): copies, the snapshot is shared."""
    out: dict[str, NodeView] = {}
    for p in placements:
        nid = p["node"]
        if nid not in out:
            out[nid] = capacity.copy_node(nodes[nid])
        capacity.take(out[nid], p["gpus"], needs, bool(p.get("share")))
    return out


def reused(iids: Sequence[str], existing: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]] | None:
    """A redelivered step's placements when every instance already holds its reservation (else
    None: plan anew)."""
    held = [r for r in existing if r]
    if len(held) != len(iids):
        return None
    return [{"iid": iid, "node": r["node"], "gpus": _gpus(r["gpus"])} for iid, r in zip(iids, held, strict=True)]


def _gpus(raw: str) -> list[str]:
    got = msgspec.json.decode(raw)
    return list(got) if isinstance(got, dict) else []


# -- starting what was reserved ---------------------------------------------------------------------
@dataclass(frozen=True)
class StartInstances:
    """Guarded: record the placed instances (and the block's ``step``) in one round trip
    (``Store.start_instances``); with ``limit`` (a scale step's maxInstances) an instance past it is
    refused, its reservation released and nothing published for it. Then publish
    ``announce(self, kept)``."""

    ir: BlockIR = field(hash=False)
    gen: int
    cluster_id: str
    action: str
    placements: tuple[dict[str, Any], ...]
    records: dict[str, InstanceRecord] = field(hash=False)
    index: tuple[tuple[str, str, str, str, str], ...]
    step: tuple[int, Step, dict[str, Any]] | None = field(default=None, hash=False)
    limit: int | None = None
    attempts: int = 0
    key: str = ""
    replaces: str = ""
    trace: tuple[Decision, ...] = ()
    sidecar_node: str = ""

    @property
    def block_id(self) -> str:
        return str(self.ir["blockId"])


def start_effects(
    ir: BlockIR, gen: int, cid: str, action: str, placements: Sequence[dict[str, Any]], nodes: Mapping[str, NodeView],
    now: float, *, attempts: int, key: str, replaces: str = "", trace: Sequence[Decision] = (),
    step: tuple[Step, dict[str, Any]] | None = None, limit: int | None = None,
) -> StartInstances:
    """What starting reserved ``placements`` takes: the instance records, their affinity index
    entries (``nodes``: for each node's rack) and the block's ``step``; the gang's step places the
    block's side-cars too (``handlers/sidecars.py``), recorded with the step."""
    bid = ir["blockId"]
    sc_node = sidecars.sidecar_node(list(placements)) if action == "allocation" and ir.get("sidecars") else ""
    fields = {**step[1], sidecars.NODE_FIELD: sc_node} if step is not None and sc_node else (step[1] if step else {})
    records: dict[str, InstanceRecord] = {
        p["iid"]: {"node": p["node"], "gpus": p["gpus"], "cluster": cid, "status": "starting", "action": action,
                   "since": round(now, 3)}
        for p in placements
    }
    index = tuple(
        (uid(bid), uid(p["iid"]), p["iid"], p["node"], nodes.get(p["node"], {}).get("labels", {}).get("rack", ""))
        for p in placements
    )
    return StartInstances(ir, gen, cid, action, tuple(placements), records, index,
                          None if step is None else (gen, step[0], fields), limit, attempts, key, replaces, tuple(trace), sc_node)


def announce(s: StartInstances, kept: Sequence[dict[str, Any]]) -> list[Emit]:
    """The events of the instances recorded (``kept``): the placement, each node's create command
    and the side-cars' starts."""
    ir, bid = s.ir, s.block_id
    placed = [Placement(p["iid"], p["node"], p["gpus"], p.get("adaptive") or [], p.get("topology") or {}) for p in kept]
    made = PlacementMade(
        bid, s.gen, s.cluster_id, s.action, placed,
        s.attempts, s.replaces, s.key, list(s.trace), next((p["adapt"] for p in kept if p.get("adapt")), AdaptTable()),
    )
    out = [Emit(E.block_placement, made)]
    out += [
        Emit(E.node_instance_create, InstanceCommand(
            bid, s.gen, s.cluster_id, p["iid"], p["node"], p["gpus"], ir.get("image", ""), env_for(ir, p["iid"], p["gpus"]),
            launch=ir.get("launch") or {}, resources=wire(ir.get("resources") or {}),
        ))
        for p in kept
    ]
    return out + sidecars.starts(ir, s.gen, s.cluster_id, s.sidecar_node)
