"""Cluster controller steps: resourceAllocator dry_run / allocation / scale / reassignment.

Pure: given the IR, the cluster, a snapshot of its nodes and an ``invoke`` callable for the block's
resourceAllocator, these return scores and placement plans. The worker commits plans atomically
(``state.Store.reserve_gang``) and retries on conflict with a refreshed snapshot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..policies import affinity, capacity, topology
from ..policies.sampling import threshold_of
from ..schemas.errors import PlacementFailed, PolicyFailed
from ..schemas.records import (
    AdaptiveTerm,
    AdaptTable,
    BlockIR,
    ClusterRecord,
    InstanceRecord,
    Needs,
    NodeAffinity,
    NodeView,
    Placement,
    SampleInfo,
)
from ..schemas.sharing import GPU_MEMORY_LIMIT_ENV, GPU_SHARE_ENV
from ..schemas.spec import instance_id as instance_id  # (re-exported: it lives with the ids, for the CLI)
from . import vcluster
from .gateway import cluster_metrics, sample_for, share_of

Invoke = Callable[[dict[str, Any]], Awaitable[Any]]


def payload(
    ir: BlockIR,
    cluster: ClusterRecord,
    nodes: dict[str, NodeView],
    instances: Mapping[str, InstanceRecord] | None = None,
    index: affinity.Index | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The seed's payload: ``block``, ``cluster``, ``cluster_metrics``, ``healthy_nodes`` (+ the
    action's extras: ``block_metrics``, ``instance_id``, ``pod_name``, ``reason``). Node details are in
    ``cluster_metrics["nodes"]`` so a policy can choose GPUs; when the block has affinity, each
    node view carries its pass/fail and score (``affinity.annotate``) and
    ``cluster_metrics["affinity_index"]`` the placements its targets resolve to.

    A cluster with more nodes than ``settings.sampleNodes`` (default 100) is sampled
    (``policies.sampling``): ``cluster_metrics["nodes"]`` and ``healthy_nodes`` then hold only the
    sampled nodes (enough feasible ones, or a few infeasible ones when none fits), the totals
    still cover every node, and ``cluster_metrics["sample"]`` says so
    (``total_nodes, visited, feasible, limit, seed`` and ``unsatisfiable`` when Required affinity
    rejects every node)."""
    return _payload(ir, cluster, nodes, instances, index, int(ir.get("maxInstances") or 1), **extra)


#: instance record fields a policy input leaves out (not a function of the stream's facts)
VOLATILE = frozenset({"since"})
#: an instance record's key order -> its fields in the input's order (records share a few shapes)
_FIELD_ORDER: dict[tuple[str, ...], tuple[str, ...]] = {}


def canonical_record(record: InstanceRecord) -> dict[str, Any]:
    """An instance record as a policy input holds it: its fields by name, ``VOLATILE`` left out."""
    rec: Mapping[str, Any] = record  # read by the names it holds
    keys = tuple(rec)
    order = _FIELD_ORDER.get(keys)
    if order is None:
        if len(_FIELD_ORDER) > 1024:  # a bound, not a cache policy: shapes are few
            _FIELD_ORDER.clear()
        order = _FIELD_ORDER[keys] = tuple(sorted(k for k in keys if k not in VOLATILE))
    return {k: rec[k] for k in order}


def _payload(
    ir: BlockIR, cluster: ClusterRecord, nodes: dict[str, NodeView],
    instances: Mapping[str, InstanceRecord] | None, index: affinity.Index | None, want: int, **extra: Any,
) -> dict[str, Any]:
    """``payload`` with a sample sized for ``want`` instances (dry_run: maxInstances; each
    allocation call places one)."""
    block = dict(ir)
    # by id, each record's fields by name: the input is a function of the state, not of the order
    # Redis returns a hash in or a script re-encoded a record with (``recovery.inputs`` rebuilds it)
    # ``since`` (when the controller placed it, by its clock) is left out: the stream cannot give it
    # back exactly, and the scale_down call's ``instances`` carry each one's age
    block["instances"] = {iid: canonical_record(rec) for iid, rec in sorted((instances or {}).items())}
    entries = ir.get("affinity") or []
    seen, info = considered(ir, nodes, index, want)
    metrics = cluster_metrics(nodes, seen)
    if info is not None:
        metrics["sample"] = info
    if entries:
        metrics["affinity_index"] = index or affinity.empty_index()
    return {
        "block": block,
        "cluster": cluster,
        "cluster_metrics": metrics,
        "healthy_nodes": capacity.healthy_ids(seen),
        **extra,
    }


def considered(
    ir: BlockIR, nodes: dict[str, NodeView], index: affinity.Index | None, want: int,
) -> tuple[dict[str, NodeView], SampleInfo | None]:
    """The node views a placement's policy sees, and the sample's figures when the cluster was
    sampled (``policies.sampling``). A cluster the block's ``sampleNodes`` covers (0: every node)
    and a block without affinity entries: ``nodes`` themselves, as ``sampling.sample`` gives them
    then, without its count of the feasible nodes, which the input does not carry (an index of
    every node's fit for each shape not seen before, built for nothing: 19 % of the plan's time
    with the trace's shapes, docs/trace.md "Live vs Ray")."""
    if not ir.get("affinity"):
        threshold = threshold_of(ir)
        if threshold <= 0 or len(nodes) <= threshold:
            return nodes, None
    smp = sample_for(ir, nodes, index, max(1, want))
    return smp.nodes, smp.info() if smp.sampled else None


@dataclass
class DryRunOutcome:
    score: float
    node_info: Placement
    error: str = ""
    #: node -> why Required affinity rejected it / affinity score of the others (explain)
    rejected_nodes: dict[str, str] = field(default_factory=dict)
    node_scores: dict[str, float] = field(default_factory=dict)
    #: instances that fit in the cluster, when the policy says (``selection_score_data.placeable``); -1: not said
    placeable: int = -1
    #: minInstances - placeable when positive (this cluster cannot take the gang), else 0
    shortfall: int = 0
    #: the adapt stage's table (Adaptive affinity entries; ``affinity.adapt``), else {}
    adapt: AdaptTable = field(default_factory=lambda: AdaptTable())


EXPLAIN_LIMIT = 64  # nodes listed per cluster in a dry_run result (the counts cover all of them)


def affinity_explain(nodes: dict[str, NodeView]) -> tuple[dict[str, str], dict[str, float]]:
    rejected: dict[str, str] = {}
    scores: dict[str, float] = {}
    for nid in sorted(nodes):
        aff = nodes[nid].get("affinity")
        if aff is None:
            continue
        if not aff["pass"]:
            if len(rejected) < EXPLAIN_LIMIT:
                rejected[nid] = "; ".join(aff["reasons"])
        elif aff["score"] and len(scores) < EXPLAIN_LIMIT:
            scores[nid] = aff["score"]
    return rejected, scores


async def dry_run(
    ir: BlockIR, cluster: ClusterRecord, nodes: dict[str, NodeView], invoke: Invoke,
    index: affinity.Index | None = None,
) -> DryRunOutcome:
    nodes = vcluster.scope(ir, nodes)  # its virtual cluster's nodes only (seed 003)
    data = _payload(ir, cluster, nodes, None, index, int(ir.get("maxInstances") or 1))
    # only a block with affinity entries has its node views annotated (``_payload``)
    rejected, scores = affinity_explain(data["cluster_metrics"]["nodes"]) if ir.get("affinity") else ({}, {})
    adapt: AdaptTable = (index.get("adapt") or {}).copy() if index else {}
    try:
        result = await invoke({"action": "dry_run", "payload": data})
    except PolicyFailed as exc:
        return DryRunOutcome(0.0, {}, str(exc), rejected, scores, adapt=adapt)
    ssd = result["selection_score_data"]
    placeable = ssd.get("placeable")
    placeable = placeable if isinstance(placeable, int) else -1
    shortfall = max(0, int(ir.get("minInstances") or 0) - placeable) if placeable >= 0 else 0
    score = float(ssd["score"])
    if shortfall or placeable == 0 or score <= 0:  # the cluster cannot (fully) take it: say why, per node
        capacity_reasons(data["cluster_metrics"]["nodes"], ir["resources"], share_of(ir), rejected)
    return DryRunOutcome(score, ssd.get("node_info") or Placement(), "", rejected, scores, placeable, shortfall, adapt)


def capacity_reasons(
    nodes: dict[str, NodeView], needs: capacity.Needs, share: bool, into: dict[str, str]
) -> dict[str, str]:
    """Why each node that cannot take one instance cannot (``capacity: ...``), for explain; nodes
    already rejected (by affinity) keep that reason. At most ``EXPLAIN_LIMIT`` in all."""
    for nid in sorted(nodes):
        if len(into) >= EXPLAIN_LIMIT:
            break
        if nid not in into and capacity.node_fits(nodes[nid], needs, share) is None:
            into[nid] = "capacity: " + capacity.why_not(nodes[nid], needs, share)
    return into


def check_choice(node_id: str, gpus: list[str], nodes: dict[str, NodeView], needs: Needs, share: bool) -> str:
    """Why a policy's choice cannot work on the snapshot, every problem of it ('' if it can)."""
    return "; ".join(choice_problems(node_id, gpus, nodes, needs, share))


def choice_problems(node_id: str, gpus: list[str], nodes: dict[str, NodeView], needs: Needs, share: bool) -> list[str]:
    """Each problem of a policy's choice (node ``node_id``, GPUs ``gpus``) on the snapshot ``nodes``."""
    node, want = nodes.get(node_id), int(needs.get("gpus", 0))
    out = [] if node is not None else [f"node {node_id!r} is not in this cluster"]
    if len(gpus) != want:
        out.append(f"{len(gpus)} GPUs chosen, block needs {want}")
    if node is not None:
        usable = capacity.node_fits(node, needs, share)
        if usable is None:
            out.append(f"node {node_id} cannot host the instance: {capacity.why_not(node, needs, share)}")
        on_node, usable_ids = {g["id"] for g in node["gpus"]}, {g["id"] for g in usable or []}
        unknown = [g for g in dict.fromkeys(gpus) if g not in on_node]
        if unknown:
            out.append(f"GPU(s) {unknown} are not GPUs of {node_id}")
        busy = [g for g in dict.fromkeys(gpus) if g in on_node and g not in usable_ids]
        if busy and usable is not None:  # (not one GPU usable: said above)
            out.append(f"GPU(s) {busy} on {node_id} are not free for this instance")
    if len(set(gpus)) != len(gpus):
        out.append("the same GPU was chosen twice")
    return out


async def plan(
    ir: BlockIR,
    cluster: ClusterRecord,
    nodes: dict[str, NodeView],
    action: str,
    iids: list[str],
    invoke: Invoke,
    instances: Mapping[str, InstanceRecord] | None = None,
    index: affinity.Index | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Call the resourceAllocator once per instance, applying each choice to a working copy of the
    snapshot so the next call sees it. Returns reservation records for ``Store.reserve_gang``
    (with Adaptive affinity entries, each also carries ``adaptive``: the entries' base and adapted
    weights on its node and why, and ``adapt``: the adapt stage's table, for the decision record).
    Raises PlacementFailed with the reason.

    ``excluded_nodes`` (an extra, node -> why): nodes left out of the candidates (a suspect node;
    the node a replaced instance is moved off), given to the policy as ``excluded_nodes`` so it
    knows why they are missing; recorded with the decision (``Decision.given``) so replay
    rebuilds the same input."""
    excluded = extra.get("excluded_nodes") or {}
    if not excluded:
        extra.pop("excluded_nodes", None)
    where, nodes = _candidate_nodes(ir, nodes, excluded)
    # copy-on-write: only the nodes taken below are copied; one instance takes nothing after its
    # choice, so it plans on the snapshot itself (no O(nodes) copy)
    needs, share = ir["resources"], share_of(ir)
    work = capacity.fork(nodes, needs, share) if len(iids) > 1 else nodes
    out: list[dict[str, Any]] = []
    index = index or affinity.empty_index()
    for k, iid in enumerate(iids):
        try:
            data = _payload(ir, cluster, work, instances, index, 1, **extra)
            result = await invoke({"action": action, "payload": data})
        except PolicyFailed as exc:
            raise PlacementFailed(f"{exc} (instance {len(out) + 1} of {len(iids)})", policy=exc.no_answer) from exc
        node_id, gpus = result["node_id"], list(result.get("gpus", []))
        problems = choice_problems(node_id, gpus, work, needs, share)
        if problems:  # (with Required affinity's verdict too; alone, ``_affinity_of`` says it)
            refused(action, node_id, problems,
                    _affinity_verdict(ir, node_id, work, index) if node_id in work and ir.get("affinity") else None)
        # which GPUs of the chosen node: the best connected set that keeps the node's best sets
        # free (policies/topology.py, docs/topology.md), when the node reports its topology
        gpus, link = _by_topology(work[node_id], gpus, needs, share, ir.get("affinity") or [])
        adaptive, index = _affinity_of(ir, iid, node_id, work, index, action)
        if k < len(iids) - 1:  # the next instance's call sees this one's take
            work[node_id] = capacity.copy_node(work[node_id])
            capacity.take(work[node_id], gpus, needs, share)
        out.append(_reservation(ir, iid, node_id, gpus, needs, share, where, link, adaptive, index))
    return out


def _candidate_nodes(ir: BlockIR, nodes: dict[str, NodeView],
                     excluded: dict[str, Any]) -> tuple[str, dict[str, NodeView]]:
    """Its virtual cluster's nodes only (seed 003; the reservation re-checks each node is still
    there), less the excluded ones: (its place, the nodes)."""
    where = vcluster.place_of(ir, nodes)
    nodes = vcluster.part(nodes, where)
    if excluded:
        nodes = {nid: v for nid, v in nodes.items() if nid not in excluded}
    return where, nodes


def refused(action: str, node_id: str, problems: list[str], verdict: NodeAffinity | None) -> NoReturn:
    """PlacementFailed listing every problem of a refused choice: ``problems`` (its node and GPUs
    on the snapshot: ``choice_problems``) and Required affinity's rejection of its node in
    ``verdict`` (the node's, None: no affinity). ``policy``: checked on the very snapshot the
    policy was given, so asked again with the same input the same policy chooses the same and is
    refused the same: the step fails once, not re-selected (``allocation.after_failure``,
    docs/architecture.md "Re-selection")."""
    if verdict is not None and not verdict.get("pass", True):
        rejects = "; ".join(verdict.get("reasons", []))
        if not problems:
            raise PlacementFailed(f"resourceAllocator {action} chose {node_id}, which Required affinity rejects: {rejects}",
                                  policy=True)
        problems = [*problems, f"Required affinity rejects {node_id}: {rejects}"]
    raise PlacementFailed(f"resourceAllocator {action} chose an impossible placement: " + "; ".join(problems), policy=True)


def _affinity_verdict(ir: BlockIR, node_id: str, work: dict[str, NodeView], index: affinity.Index) -> NodeAffinity:
    """Required and Adaptive affinity on the chosen node (``pass``, ``reasons``, ``adaptive``)."""
    probe = {node_id: work[node_id].copy()}  # annotate a copy: views are shared
    affinity.annotate(probe, ir["affinity"], index)
    return probe[node_id]["affinity"]


def _affinity_of(ir: BlockIR, iid: str, node_id: str, work: dict[str, NodeView],
                 index: affinity.Index, action: str) -> tuple[list[AdaptiveTerm], affinity.Index]:
    """The chosen node checked against Required affinity (PlacementFailed if it rejects it): its
    Adaptive entries, and the index with this instance added. No affinity: nothing, the same index."""
    if not ir.get("affinity"):
        return [], index
    verdict = _affinity_verdict(ir, node_id, work, index)
    if not verdict.get("pass", True):
        refused(action, node_id, [], verdict)
    adaptive = verdict.get("adaptive") or []
    index = affinity.add_to_index(index, ir["blockId"], iid, node_id, work[node_id]["labels"].get("rack", ""))
    return adaptive, index


def _reservation(ir: BlockIR, iid: str, node_id: str, gpus: list[str], needs: capacity.Needs, share: bool,
                 where: str, link: dict[str, str], adaptive: list[AdaptiveTerm], index: affinity.Index) -> dict[str, Any]:
    """One reservation record for ``Store.reserve_gang``."""
    rec: dict[str, Any] = {
        "iid": iid,
        "block": ir["blockId"],
        "node": node_id,
        "gpus": gpus,
        "cpu": needs.get("cpu", 0),
        "mem": needs.get("memory", 0),
        "gpu_mem": needs.get("gpuMemory", 0),
        "exclusive": not share,
        "share": share,
        "vc": where,
    }
    if share and capacity.share_units(needs):  # its thousandths of each GPU's compute (RESERVE_GANG checks the sum)
        rec["gpu_share"] = capacity.share_units(needs)
    if link:
        rec["topology"] = link
    if adaptive:
        rec["adaptive"] = adaptive
        rec["adapt"] = index.get("adapt") or {}
    return rec


def _by_topology(
    node: NodeView, gpus: list[str], needs: capacity.Needs, share: bool, entries: list[Any]
) -> tuple[list[str], dict[str, str]]:
    """``topology.refine`` on a node view (nothing to do on a node without a topology)."""
    if not node.get("topology") or not gpus:
        return gpus, {}
    usable = capacity.node_fits(node, needs, share) or []
    return topology.refine(node, gpus, [g["id"] for g in usable], share, entries)


def ready(min_instances: int, running: int) -> bool:
    return running >= min_instances


def env_for(ir: BlockIR, iid: str, gpus: list[str]) -> dict[str, Any]:
    """What an instance is started with (a runtime turns this into env vars / files). An instance
    that shares its GPUs also gets ``AIOS_GPU_MEMORY_LIMIT_MIB``: the GPU memory it was reserved,
    per GPU, which the node agent turns into the caps its runtime can apply (docs/gpus.md); with a
    ``gpuShare``, ``AIOS_GPU_SHARE`` (the fraction) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the
    percent of each GPU's SMs an MPS client may use, rounded up; docs/trace.md)."""
    env: dict[str, Any] = {
        "AIOS_BLOCK_ID": ir["blockId"],
        "AIOS_INSTANCE_ID": iid,
        "AIOS_GPUS": ",".join(gpus),
        "blockInitData": ir.get("blockInitData", {}),
        "initSettings": ir.get("initSettings", {}),
        "parameters": ir.get("parameters", {}),
        "inputProtocol": ir.get("inputProtocol", {}),
    }
    if gpus and share_of(ir):
        env[GPU_MEMORY_LIMIT_ENV] = str(int(ir["resources"].get("gpuMemory", 0)))
        units = capacity.share_units(ir["resources"])
        if units:  # its share of each GPU's compute: CUDA MPS caps a client's SMs by a percentage
            env[GPU_SHARE_ENV] = f"{units / capacity.SHARE_UNITS:.3f}"
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, -(-units // 10)))  # never rounded down
    return env
