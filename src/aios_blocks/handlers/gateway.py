"""Gateway steps: filter rule -> clusterAllocator(selection); gather -> clusterAllocator(post_dry_run).

Pure: inputs are the IR, an inventory snapshot and an ``invoke`` callable that runs the block's
clusterAllocator; outputs are decisions the worker publishes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..policies import affinity, capacity, contract, sampling
from ..schemas.errors import PolicyFailed
from ..schemas.records import BlockIR, ClusterRecord, NodeView
from . import vcluster

#: invoke(input_data) -> the clusterAllocator's result (raises PolicyFailed)
Invoke = Callable[[dict[str, Any]], Awaitable[Any]]


def share_of(ir: BlockIR) -> bool:
    rule = (ir.get("policies") or {}).get("resourceAllocator", {})
    return bool((rule.get("settings") or {}).get("gpuSharing", False))


def cluster_metrics(nodes: dict[str, NodeView], shown: dict[str, NodeView] | None = None) -> dict[str, Any]:
    """Totals over all of a cluster's nodes, plus node views under ``nodes``: all of them, or
    ``shown`` (a sample, see ``policies.sampling``) when the cluster is large."""
    t = capacity.totals(nodes)
    return {
        "node_count": len(nodes),
        "healthy_node_count": t["healthy_node_count"],
        "gpus": t["gpus"],
        "gpus_free": t["gpus_free"],
        "gpu_memory_free": t["gpu_memory_free"],
        "cpu_free": t["cpu_free"],
        "memory_free": t["memory_free"],
        "nodes": nodes if shown is None else shown,
    }


def cluster_entry(cluster: ClusterRecord, nodes: dict[str, NodeView]) -> dict[str, Any]:
    metrics = cluster_metrics(nodes)
    summary = {k: v for k, v in metrics.items() if k != "nodes"}
    return {"cluster_id": cluster["id"], "id": cluster["id"], "labels": cluster.get("labels", {}), "metrics": summary}


def scoped_entry(
    ir: BlockIR, cluster: ClusterRecord, nodes: dict[str, NodeView], index: affinity.Index | None = None
) -> dict[str, Any]:
    """``cluster_entry`` over the nodes the block may use there (its virtual cluster's, seed 003),
    with the block's Preferred-affinity score there when it has entries: post_dry_run breaks a
    tie on it as the selection ranked on it (without it, more free GPUs won over the preference)."""
    cnodes = vcluster.scope(ir, nodes)
    entry = cluster_entry(cluster, cnodes)
    if ir.get("affinity"):
        entry["metrics"]["affinity_score"] = affinity_score(sample_for(ir, cnodes, index))
    return entry


def affinity_score(smp: sampling.Sample) -> float:
    """A cluster's Preferred-affinity score: the best a node of its sample that passes could get."""
    return max((n["affinity"]["score"] for n in smp.nodes.values() if n["affinity"]["pass"]), default=0.0)


def sample_for(
    ir: BlockIR, nodes: dict[str, NodeView], index: affinity.Index | None = None, want: int = 1
) -> sampling.Sample:
    """The nodes the block's placement considers in one cluster (seeded by the block id)."""
    return sampling.sample(
        nodes, ir["resources"], share_of(ir), str(ir.get("blockId", "")), sampling.threshold_of(ir), want,
        ir.get("affinity") or [], index,
    )


def filter_rule(
    ir: BlockIR,
    clusters: dict[str, ClusterRecord],
    nodes: dict[str, dict[str, NodeView]],
    index: affinity.Index | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The clusterAllocator's filter rule (``settings.filter``): label selector and capacity.

    ``{"matchLabels": {...}, "capacity": true}``: a cluster passes when its labels match and (unless
    ``capacity`` is false) at least one healthy node can host one instance and passes the block's
    Required affinity. A large cluster is judged on a seeded node sample (``policies.sampling``),
    which scans to the end before calling a cluster infeasible.
    Returns (entries that passed, cluster id -> why each other one did not).
    """
    rule = ir["policies"]["clusterAllocator"]
    flt = (rule.get("settings") or {}).get("filter") or {}
    match = flt.get("matchLabels") or {}
    check_capacity = flt.get("capacity", True)
    passed, filtered = [], {}
    for cid in sorted(clusters):
        cluster = clusters[cid]
        labels = cluster.get("labels", {})
        wrong = {k: v for k, v in match.items() if labels.get(k) != v}
        if wrong:
            filtered[cid] = "labels do not match " + ", ".join(f"{k}={v}" for k, v in wrong.items())
            continue
        # only the nodes of the block's virtual cluster (seed 003), or the primary's unassigned ones
        cnodes = vcluster.scope(ir, nodes.get(cid, {}))
        if not cnodes and ir.get("virtualClusterId"):
            filtered[cid] = f"no node of virtual cluster {ir['virtualClusterId']} here"
            continue
        entries = ir.get("affinity") or []
        if not entries:  # capacity alone: some node fits (capacity.any_fits: no index built for it)
            if check_capacity and not capacity.any_fits(cnodes, ir["resources"], share_of(ir)):
                filtered[cid] = f"no healthy node with capacity for one instance ({len(cnodes)} nodes)"
                continue
            passed.append(cluster_entry(cluster, cnodes))
            continue
        smp = sample_for(ir, cnodes, index)
        if entries and smp.unsatisfiable:
            filtered[cid] = smp.unsatisfiable
            continue
        if check_capacity and not smp.feasible:
            filtered[cid] = f"no healthy node with capacity for one instance ({len(cnodes)} nodes)"
            continue
        entry = cluster_entry(cluster, cnodes)
        if entries:  # Preferred affinity at cluster level: the best score a node here could get
            entry["metrics"]["affinity_score"] = affinity_score(smp)
        passed.append(entry)
    return passed, filtered


@dataclass
class SelectionDecision:
    candidates: list[str]
    filtered: dict[str, str]
    entries: dict[str, dict[str, Any]]
    failure: str = ""
    #: the failure is "fits nowhere now" (the pending queue's: the block may wait), not a policy's
    waitable: bool = False


async def select(
    ir: BlockIR,
    clusters: dict[str, ClusterRecord],
    nodes: dict[str, dict[str, NodeView]],
    invoke: Invoke,
    index: affinity.Index | None = None,
) -> SelectionDecision:
    passed, filtered = filter_rule(ir, clusters, nodes, index)
    entries = {e["cluster_id"]: e for e in passed}
    if not passed:
        why = "; ".join(f"{c}: {r}" for c, r in filtered.items()) or "no clusters registered"
        return SelectionDecision([], filtered, entries, f"no cluster passed the filter rule ({why})", waitable=True)
    try:
        result = await invoke({"action": "selection", "filter_result": passed})
    except PolicyFailed as exc:
        return SelectionDecision([], filtered, entries, str(exc))
    chosen = [contract.cluster_id_of(c) for c in result["clusters"]]
    unknown = [c for c in chosen if c not in entries]
    if unknown:
        # a cluster the filter rule took out, or none at all: say which, and why
        why = "; ".join(f"{c}: {filtered.get(c, 'unknown cluster')}" for c in dict.fromkeys(unknown))
        return SelectionDecision([], filtered, entries,
                                 f"clusterAllocator selected cluster(s) that are not candidates ({why}); candidates: {list(entries)}")
    chosen = list(dict.fromkeys(chosen))
    for cid in entries:
        if cid not in chosen:
            filtered[cid] = "dropped by the clusterAllocator's selection"
    if not chosen:
        return SelectionDecision([], filtered, entries, "clusterAllocator selected no cluster")
    return SelectionDecision(chosen, filtered, entries)


def gang_shortfall(expected: list[str], results: dict[str, dict[str, Any]], min_instances: int) -> str:
    """Why no cluster can hold ``min_instances`` (from the dry_run counts), or "" when one may."""
    candidates = {c: r for c, r in results.items() if _positive(r)}
    if not candidates or any(int(r.get("placeable", -1)) < 0 for r in candidates.values()):
        return ""  # nothing usable (decided elsewhere) or a policy that did not count: let allocation try
    if max(int(r["placeable"]) for r in candidates.values()) >= min_instances:
        return ""
    fits = ", ".join(f"{c} fits {int(r['placeable'])}" for c, r in sorted(candidates.items()))
    none = [c for c in expected if c in results and c not in candidates]
    silent = [c for c in expected if c not in results]  # after the gather's patience: unreachable
    rest = (f"; {', '.join(none)}: none" if none else "") + (f"; {', '.join(silent)}: no answer in time" if silent else "")
    return f"no cluster can hold minInstances ({min_instances}) at once: {fits}{rest}"


def _positive(result: dict[str, Any]) -> bool:
    return not result.get("error") and float(result.get("score", 0.0) or 0.0) > 0.0


def usable(result: dict[str, Any]) -> bool:
    """A dry_run answer that can carry a decision: a positive score, no error, and room for the
    gang (no ``shortfall``). A cluster short of minInstances does not end a round at its deadline:
    a slower cluster may still answer with room (else the round fails when every cluster answered
    or the patience ran out, with the counts)."""
    return _positive(result) and not result.get("shortfall")


def gather_wait(
    expected: list[str], results: dict[str, dict[str, Any]], now: float, deadline: float, patience_s: float
) -> float:
    """Seconds the gather should still wait (0 = decide now).

    Before the deadline: wait for it (or for every answer, decided elsewhere). At the deadline the
    gateway decides with what it has *if that can decide anything*: some cluster answered with a
    positive score and room for the gang (``usable``), or every cluster answered. A round where nobody usable answered yet means the
    controllers are busy or unreachable, not that the block cannot be placed, so the gather waits
    up to ``patience_s`` more (a backlog under a burst must not fail blocks) and then decides,
    naming the clusters that never answered."""
    if now < deadline:
        return deadline - now
    if any(usable(r) for r in results.values()) or all(c in results for c in expected):
        return 0.0
    return max(0.0, deadline + patience_s - now)


@dataclass
class FinalDecision:
    cluster_id: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    failure: str = ""
    waitable: bool = False


async def choose(
    expected: list[str],
    results: dict[str, dict[str, Any]],
    entries: dict[str, dict[str, Any]],
    invoke: Invoke,
    min_instances: int = 1,
) -> FinalDecision:
    """post_dry_run: every expected cluster with its score_data (missing ones count as score 0).

    When every cluster that could be chosen (a positive score) said how many instances fit
    (``placeable``) and none fits ``min_instances``, the block fails here with that reason: the
    gang could only fail at allocation, round after round."""
    clusters, scores, errors = [], {}, {}
    missing = [c for c in expected if c not in results]
    if shortfall := gang_shortfall(expected, results, min_instances):
        return FinalDecision(scores={c: float(results.get(c, {}).get("score", 0.0)) for c in expected}, missing=missing,
                             errors={c: r["error"] for c, r in results.items() if r.get("error")}, failure=shortfall,
                             waitable=True)
    for cid in expected:
        res = results.get(cid, {"score": 0.0, "node_info": {}})
        if res.get("error"):
            errors[cid] = res["error"]
        scores[cid] = float(res.get("score", 0.0))
        entry = dict(entries.get(cid) or {"cluster_id": cid, "id": cid, "labels": {}, "metrics": {}})
        entry["score_data"] = {"score": scores[cid], "node_info": res.get("node_info", {})}
        if cid in missing:
            entry["missing"] = True
        clusters.append(entry)
    decision = FinalDecision(scores=scores, missing=missing, errors=errors)
    try:
        result = await invoke({"action": "post_dry_run", "clusters": clusters})
    except PolicyFailed as exc:
        decision.failure = str(exc)
        return decision
    cid = contract.cluster_id_of(result)
    if cid not in scores:
        decision.failure = f"clusterAllocator chose {cid!r}, which was not a candidate"
    elif scores[cid] <= 0.0:
        detail = "; ".join(
            f"{c}: {errors.get(c) or ('no answer in time' if c in missing else 'score 0')}" for c in expected
        )
        decision.failure = f"no candidate cluster can place an instance ({detail})"
        # every cluster answered "no room" (score 0, no error): the block may wait for capacity;
        # a policy error or a silent cluster fails it as before
        decision.waitable = not errors and not missing
    else:
        decision.cluster_id = cid
    return decision
