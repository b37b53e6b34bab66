"""The seed-004 (LXD) shapes an ``instance_placement`` scriptlet sees, built from node views
(``schemas.lxd``): the placement request, a candidate member, the helpers' member state and
resources, the instance's resources; and the GPUs a placement takes on the chosen node."""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from ..schemas.events import PlacementReason
from ..schemas.lxd import (
    ClusterMember,
    GpuCard,
    InstanceResources,
    MemberResources,
    MemberState,
    PlacementRequest,
)
from ..schemas.records import GpuView, Needs, NodeAffinity, NodeView, PlacementPayload, PolicyBlock

MiB = 1024 * 1024



def pick_gpus(usable: list[GpuView], count: int, aff: NodeAffinity | None = None) -> list[str]:
    """Required GPUs first, then preferred, avoided last; then lowest free memory (bin-pack), id."""
    aff = aff or {}
    require, prefer = set(aff.get("require_gpus", [])), set(aff.get("prefer_gpus", []))
    avoid = set(aff.get("avoid_gpus", []))

    def key(g: GpuView) -> tuple[Any, ...]:
        gid = g["id"]
        return (gid not in require, gid not in prefer, gid in avoid, g["memory_free"], gid)

    return [g["id"] for g in sorted(usable, key=key)[:count]] if count > 0 else []


_T = TypeVar("_T")


def _given(table: dict[str, _T] | None, kind: str, member_name: Any) -> _T:
    """What ``run_lxd``'s caller gave a helper for a member (``LxdGiven``)."""
    table = table or {}
    if member_name not in table:
        raise ValueError(f"no {kind} given for cluster member {member_name!r}")
    return table[member_name]


def _str_map(d: Any) -> dict[str, str]:
    if not isinstance(d, dict):
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v, default=str) for k, v in d.items()}


def placement_request(block: PolicyBlock, payload: PlacementPayload, action: str) -> PlacementRequest:
    """LXD's InstancePlacement (api.InstancesPost + reason + project) for one instance."""
    needs = block.get("resources") or {}
    config = {**_str_map(block.get("initSettings")), **_str_map(block.get("parameters"))}
    config["limits.cpu"] = f"{needs.get('cpu', 0):g}"
    config["limits.memory"] = f"{int(needs.get('memory', 0))}MiB"
    devices: dict[str, dict[str, str]] = {}
    if int(needs.get("gpus", 0)) > 0:
        devices["gpu"] = {"type": "gpu", "count": str(int(needs["gpus"])), "memory": f"{int(needs.get('gpuMemory', 0))}MiB"}
    name = payload.get("pod_name") or payload.get("instance_id") or block.get("blockId") or ""
    return {
        "name": str(name),
        "project": "default",
        "reason": str(PlacementReason.of_reassignment(str(payload.get("reason", "")))
                      if action == "reassignment" else PlacementReason.NEW),
        "type": "container",
        "architecture": "x86_64",
        "profiles": ["default"],
        "ephemeral": False,
        "description": str(block.get("blockComponentURI", "")),
        "config": config,
        "devices": devices,
        "source": {"type": "image", "alias": str(block.get("image", ""))},
        "instance_type": "",
    }


def cluster_member(node: NodeView) -> ClusterMember:
    """LXD's api.ClusterMember for a node view (``config`` = the node's labels)."""
    labels = node.get("labels") or {}
    address = str(labels.get("address", node["node_id"]))
    return {
        "server_name": node["node_id"],
        "url": f"https://{address}:8443",
        "address": address,
        "database": False,
        "status": "Online" if node.get("healthy", True) else "Offline",
        "message": "Fully operational" if node.get("healthy", True) else "Unhealthy",
        "architecture": str(labels.get("arch", labels.get("architecture", "x86_64"))),
        "failure_domain": str(labels.get("rack") or "default"),
        "description": str(labels.get("description", "")),
        "config": _str_map(labels),
        "groups": ["default"],
        "roles": [],
    }


def member_state(node: NodeView) -> MemberState:
    """LXD's api.ClusterMemberState: load averages = CPUs in use; RAM in bytes."""
    load = round(max(float(node["cpu"]) - float(node["cpu_free"]), 0.0), 2)
    return {
        "sysinfo": {
            "uptime": 0,
            "load_averages": [load, load, load],
            "total_ram": int(node["memory"]) * MiB,
            "free_ram": max(int(node["memory_free"]), 0) * MiB,
            "shared_ram": 0,
            "buffered_ram": 0,
            "total_swap": 0,
            "free_swap": 0,
            "processes": 0,
            "logical_cpus": math.floor(float(node["cpu"])),
        },
        "storage_pools": {},
    }


def member_resources(node: NodeView) -> MemberResources:
    """LXD's api.Resources (cpu, memory, gpu; empty storage/network). GPU memory in bytes."""
    cards: list[GpuCard] = []
    for g in node.get("gpus", []):
        model = str(g.get("model", ""))
        vendor = model.split()[0] if " " in model else ""
        cards.append(
            {
                "driver": "nvidia" if vendor.lower() == "nvidia" else "",
                "driver_version": "",
                "product": model,
                "product_name": model,
                "product_id": "",
                "vendor": vendor,
                "vendor_id": "",
                "pci_address": g["id"],
                "numa_node": 0,
                "memory": {"total": int(g["memory"]) * MiB, "used": int(g["memory_used"]) * MiB,
                           "free": int(g["memory_free"]) * MiB},
                "instances": int(g["instances"]),
                "exclusive": bool(g["exclusive"]),
            }
        )
    mem, free = int(node["memory"]) * MiB, max(int(node["memory_free"]), 0) * MiB
    return {
        "cpu": {"architecture": "x86_64", "total": math.floor(float(node["cpu"])), "sockets": []},
        "memory": {"total": mem, "used": mem - free, "free": free, "hugepages_total": 0, "hugepages_used": 0},
        "gpu": {"cards": cards, "total": len(cards)},
        "storage": {"disks": [], "total": 0},
        "network": {"cards": [], "total": 0},
    }


def instance_resources(needs: Needs) -> InstanceResources:
    """LXD's api.InstanceResources from the block's resources (+ gpus, gpu_memory in bytes)."""
    return {
        "cpu_cores": math.ceil(float(needs.get("cpu", 0))),
        "memory_size": int(needs.get("memory", 0)) * MiB,
        "root_disk_size": 0,
        "gpus": int(needs.get("gpus", 0)),
        "gpu_memory": int(needs.get("gpuMemory", 0)) * MiB,
    }
