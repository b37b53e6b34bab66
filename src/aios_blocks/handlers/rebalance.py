"""The ``rebalancer`` policy's input and what its answer asks for (issue 38, docs/rebalance.md).
Pure: node views (``state.nodes.node_view``), the placed blocks and the pending ones in, the
seed-shaped input of ``builtin:rebalance-min`` out; a policy's answer in, the
``block.move.requested`` events out. ``blocks rebalance``, the rebalancer worker and the queue
walker (a pending block's moves, tried before any preemption) all build it here."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from ..policies import affinity, topology
from ..policies.builtin import rebalance as rb
from ..schemas.catalog import E, Emit
from ..schemas.lifecycle import BlockStatus, InstanceStatus
from ..schemas.moves import MoveRequested
from ..schemas.records import TopologyRecord
from . import preemption as pre
from . import vcluster

DEFAULT_POLICY = "builtin:rebalance-min"
#: who asks, in ``MoveRequested.requested_by``
REQUESTED_BY = "rebalancer"


class Trigger(enum.StrEnum):
    """Why the rebalancer runs."""

    #: a pending block that would fit after a few moves (tried before any preemption)
    PENDING = "pending"
    #: the cluster's fragmentation is above ``AIOS_REBALANCE_FRAG_THRESHOLD``
    FRAGMENTATION = "fragmentation"
    #: ``blocks rebalance``
    MANUAL = "manual"


def round_trigger(pending: bool, ratio: float, threshold: float, idle: bool = False, waited: bool = True,
                  ) -> tuple[Trigger | None, str]:
    """The periodic round's decision for one cluster (the rebalancer worker's, and the online
    replay's model of it, ``trace/online_rebalance.py``): the trigger of its policy call, or None
    and why not. ``pending``: some waiting block may go to the cluster; ``waited``: one of them has
    waited ``AIOS_REBALANCE_FRAG_WAIT_S`` or longer; ``ratio``: the cluster's FGD fragmentation
    ratio; ``idle``: ``AIOS_REBALANCE_FRAG_IDLE``.

    * a block that has waited, and the ratio at or above the threshold: ``FRAGMENTATION`` (the
      policy tries the pending blocks first, then moves that lower the fragmentation);
    * else a pending block: ``PENDING`` (only moves that make room for one);
    * no pending block: no call, unless ``idle`` and the ratio is at or above the threshold
      (moves for fragmentation alone).

    *Decision:* by default nothing moves for fragmentation while nothing waits, nor for a block
    that has only just arrived: a move restarts an instance elsewhere (warm caches, local state)
    for a benefit only a block that does not fit can collect, and a block that just arrived is
    usually placed by the queue as capacity comes; a quiet cluster's placements stay where they
    were put (tests and operators that read them see them unchanged)."""
    above = ratio >= threshold
    if pending:
        return (Trigger.FRAGMENTATION, "") if above and waited else (Trigger.PENDING, "")
    if idle and above:
        return Trigger.FRAGMENTATION, ""
    if above:
        return None, f"fragmentation {ratio:.3f}, no pending block (AIOS_REBALANCE_FRAG_IDLE off)"
    return None, f"fragmentation {ratio:.3f} below the threshold {threshold:g}, no pending block"


def matches(ir: Mapping[str, Any], cluster: Mapping[str, Any]) -> bool:
    """Whether a pending block may go to the cluster at all (its filter rule's labels). Blocks of a
    virtual cluster are left to the queue; a block with affinity rules gets moves where its
    Required entries admit it (``pending_input``, with its affinity index), its Preferred and
    Adaptive entries ranking the nodes where room is made."""
    if ir.get("virtualClusterId"):
        return False
    rule = (ir.get("policies") or {}).get("clusterAllocator") or {}
    match = ((rule.get("settings") or {}).get("filter") or {}).get("matchLabels") or {}
    labels = cluster.get("labels") or {}
    return all(labels.get(k) == v for k, v in match.items())


def placement_filters(ir: Mapping[str, Any], views: Mapping[str, Mapping[str, Any]], index: Mapping[str, Any] | None,
                      ) -> tuple[list[str] | None, dict[str, float] | None]:
    """``targets`` and the block's affinity score per node of them (``affinity.annotate``'s
    ``score``: its Preferred entries, and its Adaptive ones with the adapt stage's weight, as the
    placement ranks a node): None when every target scores the same (no Preferred or Adaptive
    entry, or none that tells the nodes apart)."""
    scoped = vcluster.scope(ir, views)  # type: ignore[arg-type]
    entries = list(ir.get("affinity") or [])
    if not entries:
        return (None if len(scoped) == len(views) else sorted(scoped)), None
    if index is None:
        return [], None
    probe: dict[str, Any] = {nid: dict(v) for nid, v in scoped.items()}  # annotate writes on the views: copies
    affinity.annotate(probe, entries, index)  # type: ignore[arg-type]
    where = sorted(nid for nid, v in probe.items() if v["affinity"]["pass"])
    scores = {nid: float(probe[nid]["affinity"]["score"]) for nid in where}
    return where, (scores if len(set(scores.values())) > 1 else None)


def targets(ir: Mapping[str, Any], views: Mapping[str, Mapping[str, Any]], index: Mapping[str, Any] | None,
            ) -> list[str] | None:
    """The nodes a move of the block's instances may go to: those a placement of it may use, by
    the placement's own filters (its virtual cluster's nodes, ``vcluster.scope``, as
    ``controller.dry_run`` and ``controller.plan`` take them; of those, the ones its Required
    affinity admits, ``affinity.annotate`` on its affinity ``index``, as ``controller._affinity_of``
    checks a choice). None: every node (no virtual cluster, no affinity). A block with affinity
    whose index is not known gets no target (it is not moved: the rebalancer cannot check it)."""
    return placement_filters(ir, views, index)[0]


def tier_of(view: Mapping[str, Any] | None, gpus: Iterable[str]) -> str:
    """The link tier of an instance's GPU set on its node (``policies.topology.set_tier``), '' for
    one GPU or a node that reports no topology of its GPUs."""
    ids = [g["id"] for g in (view or {}).get("gpus") or ()]
    topo: TopologyRecord = (view or {}).get("topology") or TopologyRecord()
    got = [ids.index(g) for g in gpus if g in ids]
    if len(got) < 2 or not topo or int(topo.get("gpus", 0)) != len(ids):
        return ""
    return str(topology.set_tier(topo, got).value)


def topologies(views: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The nodes that report a topology of their GPUs: node -> {"gpus": ids in its order, "topology"}."""
    out = {}
    for nid, v in sorted(views.items()):
        topo = v.get("topology") or {}
        ids = [g["id"] for g in v.get("gpus") or ()]
        if topo and int(topo.get("gpus", 0)) == len(ids):
            out[nid] = {"gpus": ids, "topology": dict(topo)}
    return out


def movable(placed: Iterable[Mapping[str, Any]], nodes: Iterable[str], moving: Mapping[str, int] | None = None,
            views: Mapping[str, Mapping[str, Any]] | None = None, indexes: Mapping[str, Any] | None = None,
            ) -> list[dict[str, Any]]:
    """The ready blocks' running instances on these nodes, as ``candidates`` of the preemption
    input plus each block's disruption budget (``maxMoving``, default 1), its moves under way
    (``moving``) and its GPU models; with ``views``, the nodes it may move to (``targets``: its
    placement's filters; ``indexes``: block -> its affinity index) and each instance's link tier."""
    rows = []
    by_id: dict[str, Mapping[str, Any]] = {}
    for row in placed:
        if row.get("status") != BlockStatus.READY:
            continue
        insts = {iid: i for iid, i in (row.get("instances") or {}).items() if i.get("status", "running") == InstanceStatus.RUNNING}
        if insts:
            rows.append({**row, "instances": insts})
            by_id[str(row["block_id"])] = row
    out = []
    for c in pre.candidates(rows, nodes):
        ir = by_id[c["block_id"]].get("ir") or {}
        row = {**c, "maxMoving": max(1, int(ir.get("maxMoving") or 1)), "moving": int((moving or {}).get(c["block_id"], 0)),
               "gpuModels": list((ir.get("resources") or {}).get("gpuModels") or [])}
        if views is not None:
            where, prefer = placement_filters(ir, views, (indexes or {}).get(c["block_id"]))
            if where is not None:
                row["targets"] = where
            if prefer is not None:
                row["prefer"] = prefer
            row["instances"] = {iid: ({**i, "tier": t} if (t := tier_of(views.get(i["node_id"]), i["gpus"])) else i)
                                for iid, i in c["instances"].items()}
        out.append(row)
    return out


def pending_input(ir: Mapping[str, Any], views: Mapping[str, Mapping[str, Any]], index: Mapping[str, Any] | None = None,
                  ) -> dict[str, Any]:
    """A pending block as the policy reads it, with ``targets`` when its placement may use only
    some nodes (its virtual cluster, of those the ones its Required affinity admits on its
    affinity ``index``; with affinity and no index, none) and ``prefer`` (its Preferred/Adaptive
    score per target, when they differ: room is made on the best it can be)."""
    out = pre.block_input(str(ir["blockId"]), ir)
    where, prefer = placement_filters(ir, views, index)
    if where is not None:
        out["targets"] = where
    if prefer is not None:
        out["prefer"] = prefer
    return out


def rebalance_input(cid: str, views: Mapping[str, Mapping[str, Any]], placed: Iterable[Mapping[str, Any]],
                    pending: Iterable[Mapping[str, Any]], max_moves: int, trigger: Trigger,
                    moving: Mapping[str, int] | None = None, workload: list[dict[str, Any]] | None = None,
                    measure: bool = True, indexes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole input of one ``rebalance`` call on cluster ``cid``. ``pending``: the waiting
    blocks' records (``{"ir", ...}``), in queue order; ``moving``: block -> its moves under way;
    ``measure``: with the cluster's fragmentation (informative: the policy measures it itself);
    ``indexes``: block -> its affinity index (``state.inventory.affinity_index``; a block with
    affinity that has none here is not moved, and a pending one gets no room)."""
    cluster = pre.cluster_input(cid, views)
    data: dict[str, Any] = {
        "action": "rebalance", "maxMoves": int(max_moves), "trigger": str(trigger), "cluster": cluster,
        "pending": [pending_input(b["ir"], views, (indexes or {}).get(str(b["ir"]["blockId"]))) for b in pending],
        "movable": movable(placed, cluster["nodes"], moving, views, indexes),
    }
    topo = topologies({nid: views[nid] for nid in cluster["nodes"]})
    if topo:
        data["topology"] = topo
    if workload:
        data["workload"] = workload
    if measure:
        data["fragmentation"] = fragmentation(data)
    return data


def fragmentation(data: Mapping[str, Any]) -> dict[str, Any]:
    """The cluster's FGD fragmentation (``policies.builtin.frag``) on the input's workload (or the
    shapes of its pending blocks and movable instances): ``total`` in thousandths of a GPU,
    ``ratio`` = total / the cluster's GPU compute, ``nodes`` per node."""
    nodes = rb._nodes(data.get("cluster") or {})
    insts, _ = rb.movable(data, None)
    wl = rb.workload_of(data.get("workload"), [rb.need_of(p) for p in data.get("pending") or ()], insts)
    c = rb.Cluster(nodes, wl)
    per = {nid: round(c.frag(nid), 3) for nid in nodes}
    capacity = sum(len(n.gpus) for n in nodes.values()) * rb.UNITS
    total = sum(per.values())
    return {"total": round(total, 3), "ratio": round(total / capacity, 4) if capacity else 0.0, "nodes": per}


def moving(placed: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Block -> its instances starting or removing (a move under way has one of each): what of
    its disruption budget is taken."""
    out = {}
    for row in placed:
        n = sum(1 for i in (row.get("instances") or {}).values() if i.get("status", "running") != InstanceStatus.RUNNING)
        if n:
            out[str(row["block_id"])] = n
    return out


def gens(placed: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Block -> its generation (the blocks a move may still be asked for)."""
    return {str(r["block_id"]): int(r.get("gen") or 0) for r in placed}


def move_id(cid: str, output: Mapping[str, Any], k: int, at: float) -> str:
    """A move's id: the round (cluster, time) and the plan's digest, then its place in the plan."""
    digest = hashlib.sha1(repr((cid, round(at, 3), [(m.get("instance_id"), m.get("to")) for m in output.get("moves") or []]))
                          .encode()).hexdigest()[:10]
    return f"rb-{digest}-{k}"


def requests(cid: str, output: Mapping[str, Any], gens: Mapping[str, int], trigger: Trigger, at: float) -> list[Emit]:
    """One ``block.move.requested`` per move of the policy's answer (its target node, its reason
    prefixed by the trigger), for the blocks still known (``gens``: block -> generation)."""
    out = []
    for k, m in enumerate(output.get("moves") or ()):
        bid = str(m.get("block_id") or "")
        if bid not in gens:
            continue
        reason = f"{trigger}: {m.get('reason') or 'rebalance'}"
        out.append(Emit(E.block_move_requested, MoveRequested(
            block_id=bid, move_id=move_id(cid, output, k, at), instance_id=str(m["instance_id"]), to_node=str(m["to"]),
            reason=reason[:500], requested_by=REQUESTED_BY, gen=int(gens[bid]), at=round(at, 3),
            to_gpus=[str(g) for g in m.get("to_gpus") or ()])))
    return out
