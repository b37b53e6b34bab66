"""Capacity arithmetic on node views (the dicts built by ``state.store.node_view``).

Used by the built-in allocators to choose, and by the controller to apply tentative placements to
its working snapshot between the allocation calls of one gang. The atomic reservation script in
``state/scripts.py`` applies the same rules at commit time; this is the optimistic half.
"""

from __future__ import annotations

from typing import Any

Needs = dict[str, Any]  # {"gpus", "gpuMemory", "cpu", "memory"}


def gpu_usable(gpu: dict[str, Any], needs: Needs, share: bool) -> bool:
    if gpu["exclusive"]:
        return False
    if share:
        return gpu["memory_free"] >= max(needs.get("gpuMemory", 0), 0) and gpu["memory"] >= needs.get("gpuMemory", 0)
    return gpu["instances"] == 0 and gpu["memory"] >= needs.get("gpuMemory", 0)


def node_fits(node: dict[str, Any], needs: Needs, share: bool) -> list[dict[str, Any]] | None:
    """The node's usable GPUs if one instance fits on it, else None."""
    if not node.get("healthy", True):
        return None
    if node["cpu_free"] + 1e-9 < needs.get("cpu", 0) or node["memory_free"] < needs.get("memory", 0):
        return None
    usable = [g for g in node["gpus"] if gpu_usable(g, needs, share)]
    if len(usable) < needs.get("gpus", 0):
        return None
    return usable


def why_not(node: dict[str, Any], needs: Needs, share: bool) -> str:
    """Human reason a node cannot take one instance (for explain/failed events)."""
    if not node.get("healthy", True):
        return "unhealthy"
    if node["cpu_free"] + 1e-9 < needs.get("cpu", 0):
        return f"cpu {node['cpu_free']:g} free < {needs.get('cpu', 0):g}"
    if node["memory_free"] < needs.get("memory", 0):
        return f"memory {node['memory_free']} MiB free < {needs.get('memory', 0)}"
    usable = [g for g in node["gpus"] if gpu_usable(g, needs, share)]
    return f"{len(usable)} usable GPUs < {needs.get('gpus', 0)}"


def take(node: dict[str, Any], gpu_ids: list[str], needs: Needs, share: bool) -> None:
    """Apply one placement to a node view in place (the optimistic twin of RESERVE_GANG)."""
    node["cpu_free"] = round(node["cpu_free"] - needs.get("cpu", 0), 6)
    node["memory_free"] -= needs.get("memory", 0)
    wanted = set(gpu_ids)
    for g in node["gpus"]:
        if g["id"] in wanted:
            used = g["memory"] if not share else needs.get("gpuMemory", 0)
            g["memory_used"] += used
            g["memory_free"] -= used
            g["instances"] += 1
            g["exclusive"] = g["exclusive"] or not share


def free_gpus(node: dict[str, Any]) -> int:
    return sum(1 for g in node["gpus"] if g["instances"] == 0 and not g["exclusive"])


def copy_nodes(nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy deep enough for ``take`` (node dicts and GPU dicts)."""
    return {nid: {**n, "gpus": [dict(g) for g in n["gpus"]]} for nid, n in nodes.items()}
