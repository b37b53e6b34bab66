"""Affinity at scheduling time (seed 002): Required entries filter nodes, Preferred entries score.

Entries are the normalised dicts of ``schemas.affinity.AffinityEntry``
(``category, strength, anti, target_type, target``). A node view gets an ``affinity`` annotation::

    {"pass": bool, "score": float, "reasons": [...], "require_gpus": [...], "prefer_gpus": [...],
     "avoid_gpus": [...]}

so the built-in allocators (and custom policies, which receive the same node views) can filter,
rank and pick GPUs without knowing the rules. Targets that name instances (LeaseId) or blocks
(ServiceId) are resolved through a placement index:
``{"services": {block uuid: [[node, rack], ...]}, "leases": {instance uuid: node}}``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ..schemas.affinity import id128

PREFERRED_WEIGHT = 1.0
Index = dict[str, Any]


@functools.lru_cache(maxsize=200_000)
def uid(value: str) -> str:
    return str(id128(value))


def empty_index() -> Index:
    return {"services": {}, "leases": {}}


def add_to_index(index: Index, block_id: str, iid: str, node: str, rack: str) -> Index:
    """A copy of ``index`` with one more placement (tentative placements of a gang, dry_run)."""
    services = dict(index["services"])
    key = uid(block_id)
    services[key] = [*services.get(key, []), [node, rack]]
    return {"services": services, "leases": {**index["leases"], uid(iid): node}}


def referenced(entries: Iterable[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(service uuids, lease uuids) the entries need resolved."""
    svcs = [e["target"] for e in entries if e["target_type"] == "ServiceId"]
    leases = [e["target"] for e in entries if e["target_type"] == "LeaseId"]
    return svcs, leases


def describe(e: dict[str, Any]) -> str:
    target = {"RackId": "rack", "TrustDomain": "trust domain"}.get(e["target_type"], e["target_type"])
    return f"{e['strength']} {'away from' if e['anti'] else 'toward'} {target} {e['target']}"


def _match(e: dict[str, Any], node: dict[str, Any], index: Index) -> tuple[bool, list[str]]:
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
    return False, []


def annotate(nodes: dict[str, dict[str, Any]], entries: list[dict[str, Any]], index: Index) -> None:
    """Write the ``affinity`` annotation on every node view (in place)."""
    for node in nodes.values():
        ok, score, reasons = True, 0.0, []
        require, prefer, avoid = [], [], []
        for i, e in enumerate(entries):
            match, gpus = _match(e, node, index)
            satisfied = match != e["anti"]
            if e["strength"] == "Required":
                if not satisfied:
                    ok = False
                    reasons.append(f"rejected by entry {i}: {describe(e)}")
                elif gpus and not e["anti"]:
                    require += gpus
            elif satisfied:
                score += PREFERRED_WEIGHT
            if gpus:
                (avoid if e["anti"] else prefer).extend(gpus)
        node["affinity"] = {
            "pass": ok, "score": score, "reasons": reasons,
            "require_gpus": require, "prefer_gpus": prefer, "avoid_gpus": avoid,
        }


def eliminated(nodes: dict[str, dict[str, Any]], entries: list[dict[str, Any]], index: Index) -> dict[int, int]:
    """Required entry index -> how many of these nodes it rejects."""
    counts = {i: 0 for i, e in enumerate(entries) if e["strength"] == "Required"}
    for node in nodes.values():
        for i in counts:
            match, _ = _match(entries[i], node, index)
            if match == entries[i]["anti"]:
                counts[i] += 1
    return counts


def unsatisfiable(nodes: dict[str, dict[str, Any]], entries: list[dict[str, Any]], index: Index) -> str:
    """The ``RequiredAffinityUnsatisfiable`` reason: each Required entry and what it eliminated."""
    counts = eliminated(nodes, entries, index)
    parts = [f"entry {i} ({describe(entries[i])}) eliminated {n} of {len(nodes)} nodes" for i, n in counts.items()]
    return "RequiredAffinityUnsatisfiable: " + "; ".join(parts)


