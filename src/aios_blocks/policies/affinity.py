"""Affinity at scheduling time (seed 002), the pipeline filter -> score -> adapt: Required entries
filter nodes, Preferred entries score, Adaptive entries score like Preferred with a weight the
adapt stage (:func:`adapt`) moves from live metrics (the block's own instances' latency per node).

Entries are the normalised dicts of ``schemas.affinity.AffinityEntry``
(``category, strength, anti, target_type, target``). A node view gets an ``affinity`` annotation::

    {"pass": bool, "score": float, "reasons": [...], "require_gpus": [...], "prefer_gpus": [...],
     "avoid_gpus": [...]}   (+ "adaptive": [{"entry", "base", "weight", "why"}] with Adaptive entries)

so the built-in allocators (and custom policies, which receive the same node views) can filter,
rank and pick GPUs without knowing the rules. Targets that name instances (LeaseId) or blocks
(ServiceId) are resolved through a placement index:
``{"services": {block uuid: [[node, rack], ...]}, "leases": {instance uuid: node}}``, and, for a
block with Adaptive entries, ``"adapt"``: the adapt stage's table (:func:`adapt`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from ..schemas.affinity import AIOS_NAMESPACE, id128
from ..schemas.records import (
    AdaptiveTerm,
    AdaptNode,
    AdaptTable,
    AffinityIndex,
    AffinityTerm,
    InstanceSample,
    NodeView,
)

PREFERRED_WEIGHT = 1.0
#: the adapt stage: an Adaptive entry's weight is PREFERRED_WEIGHT times a multiplier in these bounds
ADAPT_MIN = 0.5
ADAPT_MAX = 2.0
#: the figures it adapts from (instance samples of the metrics collector, docs/metrics.md): the
#: instance's own p50 latency when any instance of the block reports it, else the executors' p50
#: dispatch time (send to last byte)
ADAPT_FIGURES = ("latency_p50_ms", "dispatch_p50_ms")
Index = AffinityIndex


_NAMESPACE = AIOS_NAMESPACE.bytes


@functools.lru_cache(maxsize=200_000)
def uid(value: str) -> str:
    """``str(id128(value))``. An id shorter than 32 characters can never parse as a UUID, so its
    uuid5 is computed here without building ``uuid.UUID`` objects (a quarter of the time; ``blocks
    recover`` calls this twice per placement it folds)."""
    if len(value) >= 32:
        return str(id128(value))
    h = bytearray(hashlib.sha1(_NAMESPACE + value.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def empty_index() -> Index:
    return {"services": {}, "leases": {}}


def add_to_index(index: Index, block_id: str, iid: str, node: str, rack: str) -> Index:
    """A copy of ``index`` with one more placement (tentative placements of a gang, dry_run)."""
    services = dict(index["services"])
    key = uid(block_id)
    services[key] = [*services.get(key, []), [node, rack]]
    return {**index, "services": services, "leases": {**index["leases"], uid(iid): node}}


def has_adaptive(entries: Iterable[AffinityTerm]) -> bool:
    return any(e.get("strength") == "Adaptive" for e in entries)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def adapt(per_instance: Mapping[str, InstanceSample]) -> AdaptTable:
    """The adapt stage (seed 002 §6), pure: from the latest samples of the block's own instances
    (``{iid: {"node", "latency_p50_ms", "dispatch_p50_ms", ...}}``), per node the multiplier of an
    Adaptive entry's weight:

    * the figure: ``latency_p50_ms`` when any instance reports it, else ``dispatch_p50_ms``
      (instances without it are left out);
    * a node's p50: the median of its instances' figures; the block median: the median over all
      of the block's instances with the figure;
    * multiplier = block median / node p50, bounded to [ADAPT_MIN, ADAPT_MAX]: a node whose
      instances answer twice as fast as the block's median weighs 2x, half as fast 0.5x;
    * a node with no figure (no instance of the block there yet), or no figures at all: 1 (the
      base weight).

    Returns ``{"figure", "block_median_ms", "bounds", "nodes": {node: {"p50_ms", "instances",
    "multiplier"}}}`` (``figure`` "" and no nodes when there is nothing to adapt from)."""
    figure = next((f for f in ADAPT_FIGURES if any(_num(s.get(f)) is not None for s in per_instance.values())), "")
    by_node: dict[str, list[float]] = {}
    for s in per_instance.values():
        v = _num(s.get(figure)) if figure else None
        node = s.get("node")
        if v is None or not isinstance(node, str) or not node:
            continue
        by_node.setdefault(node, []).append(v)
    allv = [v for vs in by_node.values() for v in vs]
    nodes: dict[str, AdaptNode] = {}
    out: AdaptTable = {"figure": figure if allv else "", "block_median_ms": None, "bounds": [ADAPT_MIN, ADAPT_MAX],
                       "nodes": nodes}
    if not allv:
        return out
    med = _median(allv)
    out["block_median_ms"] = round(med, 3)
    for node in sorted(by_node):
        p50 = _median(by_node[node])
        m = ADAPT_MAX if p50 <= 0 else med / p50
        nodes[node] = {"p50_ms": round(p50, 3), "instances": len(by_node[node]),
                              "multiplier": round(min(ADAPT_MAX, max(ADAPT_MIN, m)), 3)}
    return out


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 0:  # NaN, negative: no figure
        return None
    return float(v)


def adapted_weight(node_id: str, table: AdaptTable | None) -> tuple[float, float, str]:
    """(multiplier, weight, why) of an Adaptive entry a node satisfies."""
    info = (table or {}).get("nodes", {}).get(node_id)
    if not table or not table.get("figure"):
        return 1.0, PREFERRED_WEIGHT, "no live metrics for the block yet: base weight"
    if info is None:
        return 1.0, PREFERRED_WEIGHT, f"no {table['figure']} of the block's instances on this node: base weight"
    m = float(info["multiplier"])
    bounded = " (bounded)" if m in (ADAPT_MIN, ADAPT_MAX) else ""
    why = (f"{table['figure']} {info['p50_ms']:g} ms here ({info['instances']} instance(s)) vs block median "
           f"{table['block_median_ms']:g} ms: x{m:g}{bounded}")
    return m, round(PREFERRED_WEIGHT * m, 6), why


def referenced(entries: Iterable[AffinityTerm]) -> tuple[list[str], list[str]]:
    """(service uuids, lease uuids) the entries need resolved."""
    svcs = [e["target"] for e in entries if e["target_type"] == "ServiceId"]
    leases = [e["target"] for e in entries if e["target_type"] == "LeaseId"]
    return svcs, leases


def describe(e: AffinityTerm) -> str:
    target = {"RackId": "rack", "TrustDomain": "trust domain", "LinkTier": "GPU link tier"}.get(e["target_type"], e["target_type"])
    return f"{e['strength']} {'away from' if e['anti'] else 'toward'} {target} {e['target']}"


def _match(e: AffinityTerm, node: NodeView, index: Index) -> tuple[bool, list[str]]:
    """Does the node match the entry's target? Also the GPUs (by id) the target names on it."""
    tt, target = e["target_type"], e["target"]
    labels = node.get("labels", {})
    if tt == "NodeId":
        return uid(node["node_id"]) == target, []
    if tt == "ResourceId":
        gpus = [g["id"] for g in node["gpus"] if uid(g["id"]) == target]
        return bool(gpus), gpus
    if tt == "LeaseId":
        return index["leases"].get(target) == node["node_id"], []
    if tt == "ServiceId":
        # a block's failure domain is the rack (the node itself when a node has no rack label)
        rack = labels.get("rack")
        for other_node, other_rack in index["services"].get(target, []):
            if (rack and other_rack == rack) or other_node == node["node_id"]:
                return True, []
        return False, []
    if tt == "RackId":
        return labels.get("rack") == target, []
    if tt == "TrustDomain":
        return labels.get("trust-domain") == target, []
    if tt == "LinkTier":
        return _reaches(node, target, index), []
    return False, []


def _covers(node: NodeView) -> bool:
    """The node reports a topology of its GPUs (one of another GPU count is none)."""
    topo = node.get("topology") or {}
    return bool(topo) and int(topo.get("gpus", 0)) == len(node["gpus"])


def _tier_note(e: AffinityTerm, node: NodeView, index: Index) -> str:
    """What a node rejected by a LinkTier entry can give instead (explain's reason)."""
    if e["target_type"] != "LinkTier":
        return ""
    from . import topology  # only for LinkTier entries (docs/topology.md)

    topo = node.get("topology") or {}
    if not _covers(node):
        return " (the node reports no GPU topology)"
    free = [i for i, g in enumerate(node["gpus"]) if not g["instances"] and not g["exclusive"]]
    k = max(int(index.get("gpus") or 2), 2)
    best = topology.best_tier(topo, free, k)
    return f" (best tier of {k} free GPUs here: {best.value if best else f'fewer than {k} free'})"


def _reaches(node: NodeView, tier: str, index: Index) -> bool:
    """Can the node give an instance of ``index["gpus"]`` GPUs (2 when not said) a set of its
    free GPUs linked at ``tier`` or better? A node that reports no topology cannot say it can."""
    from ..schemas.topology import TIER_RANK, LinkTier
    from . import topology

    topo = node.get("topology")
    if not topo or not _covers(node):
        return False
    free = [i for i, g in enumerate(node["gpus"]) if not g["instances"] and not g["exclusive"]]
    best = topology.best_tier(topo, free, max(int(index.get("gpus") or 2), 2))
    return best is not None and TIER_RANK[best] <= TIER_RANK[LinkTier(tier)]


def annotate(nodes: dict[str, NodeView], entries: list[AffinityTerm], index: Index) -> None:
    """Write the ``affinity`` annotation on every node view (in place)."""
    for node in nodes.values():
        ok, score, reasons = True, 0.0, []
        require: list[Any] = []
        prefer: list[Any] = []
        avoid: list[Any] = []
        adaptive: list[AdaptiveTerm] = []
        for i, e in enumerate(entries):
            match, gpus = _match(e, node, index)
            satisfied = match != e["anti"]
            if e["strength"] == "Required":
                if not satisfied:
                    ok = False
                    reasons.append(f"rejected by entry {i}: {describe(e)}" + _tier_note(e, node, index))
                elif gpus and not e["anti"]:
                    require += gpus
            elif e["strength"] == "Adaptive":
                if satisfied:
                    m, w, why = adapted_weight(node["node_id"], index.get("adapt"))
                    score += w
                else:
                    m, w, why = 0.0, 0.0, "the node does not satisfy the entry"
                adaptive.append({"entry": i, "base": PREFERRED_WEIGHT, "multiplier": m, "weight": w, "why": why})
            elif satisfied:
                score += PREFERRED_WEIGHT
            if gpus:
                (avoid if e["anti"] else prefer).extend(gpus)
        node["affinity"] = {
            "pass": ok, "score": score, "reasons": reasons,
            "require_gpus": require, "prefer_gpus": prefer, "avoid_gpus": avoid,
        }
        if adaptive:
            node["affinity"]["adaptive"] = adaptive


def eliminated(nodes: dict[str, NodeView], entries: list[AffinityTerm], index: Index) -> dict[int, int]:
    """Required entry index -> how many of these nodes it rejects."""
    counts = {i: 0 for i, e in enumerate(entries) if e["strength"] == "Required"}
    for node in nodes.values():
        for i in counts:
            match, _ = _match(entries[i], node, index)
            if match == entries[i]["anti"]:
                counts[i] += 1
    return counts


def unsatisfiable(nodes: dict[str, NodeView], entries: list[AffinityTerm], index: Index) -> str:
    """The ``RequiredAffinityUnsatisfiable`` reason: each Required entry and what it eliminated."""
    counts = eliminated(nodes, entries, index)
    parts = [f"entry {i} ({describe(entries[i])}) eliminated {n} of {len(nodes)} nodes" for i, n in counts.items()]
    return "RequiredAffinityUnsatisfiable: " + "; ".join(parts)


