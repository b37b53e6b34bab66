"""Shared builders for the unit tests: node views in the exact shape ``state.store.node_view``
produces (built *through* ``node_view`` from a Redis-style hash), components and IRs built through
``block_create_IR``, and ``invoke`` callables backed by a real ``PolicyRuntime``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.state.store import node_view

GIB = 1024
#: the examples users copy (shipped in the wheel; ./examples points here)
EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "aios_blocks" / "examples"


def gpu(gid: str, memory: int = 80 * GIB, used: int = 0, instances: int = 0, exclusive: bool = False) -> dict[str, Any]:
    """One GPU of a node: total memory, memory in use, instance count, exclusive flag."""
    return {"id": gid, "memory": memory, "used": used, "instances": instances, "exclusive": exclusive}


def node(
    nid: str,
    cluster: str = "c1",
    gpus: list[dict[str, Any]] | None = None,
    *,
    cpu: float = 64.0,
    cpu_used: float = 0.0,
    memory: int = 512 * GIB,
    mem_used: int = 0,
    healthy: bool = True,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A node view, made by ``state.store.node_view`` from the hash the store keeps in Redis."""
    gpus = gpus if gpus is not None else []
    spec = {
        "id": nid,
        "cluster": cluster,
        "labels": labels or {},
        "cpu": cpu,
        "memory": memory,
        "gpus": [{"id": g["id"], "model": "sim-gpu", "memory": g["memory"]} for g in gpus],
        "healthy": healthy,
    }
    h: dict[str, str] = {
        "spec": msgspec.json.encode(spec).decode(),
        "cpu": str(cpu),
        "memory": str(memory),
        "healthy": "1" if healthy else "0",
        "cpu_used": str(cpu_used),
        "mem_used": str(mem_used),
    }
    for g in gpus:
        h[f"g:{g['id']}:total"] = str(g["memory"])
        h[f"g:{g['id']}:mem"] = str(g["used"])
        h[f"g:{g['id']}:n"] = str(g["instances"])
        h[f"g:{g['id']}:x"] = "1" if g["exclusive"] else "0"
    return node_view(h)


def free_gpus(n: int, prefix: str = "g", memory: int = 80 * GIB) -> list[dict[str, Any]]:
    return [gpu(f"{prefix}{i}", memory) for i in range(n)]


def busy_gpu(gid: str, memory: int = 80 * GIB) -> dict[str, Any]:
    """A GPU held exclusively by one instance (what RESERVE_GANG leaves behind)."""
    return gpu(gid, memory, used=memory, instances=1, exclusive=True)


def nodes_of(*views: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["node_id"]: v for v in views}


def component(
    *,
    resources: dict[str, Any] | None = None,
    cluster_rule: dict[str, Any] | None = None,
    resource_rule: dict[str, Any] | None = None,
    uri: str = "aios://test/model",
) -> dict[str, Any]:
    return {
        "componentURI": uri,
        "image": "aios/test:1",
        "resources": resources if resources is not None else {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024},
        "policies": [
            cluster_rule or {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
            resource_rule or {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"},
        ],
    }


def make_ir(
    *,
    bid: str = "b1",
    min_instances: int = 1,
    max_instances: int = 1,
    resources: dict[str, Any] | None = None,
    allocator: str = "builtin:binpack",
    allocator_settings: dict[str, Any] | None = None,
    selector: str = "builtin:cluster-rank",
    selector_settings: dict[str, Any] | None = None,
    selector_parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A real IR: a component + block spec through ``block_create_IR``."""
    comp = component(
        resources=resources,
        cluster_rule={
            "name": "clusterAllocator",
            "policyRuleURI": selector,
            "settings": selector_settings or {},
            "parameters": selector_parameters or {},
        },
        resource_rule={"name": "resourceAllocator", "policyRuleURI": allocator, "settings": allocator_settings or {}},
    )
    doc = {"blockComponentURI": comp["componentURI"], "minInstances": min_instances, "maxInstances": max_instances}
    return block_create_IR(doc, comp, bid)


def invoker(
    ir: dict[str, Any], kind: str, runtime: PolicyRuntime | None = None, context: dict[str, Any] | None = None
) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    """What a worker passes to the handlers: the IR's ``kind`` rule run by a real PolicyRuntime."""
    rt = runtime or PolicyRuntime()
    rule = ir["policies"][kind]

    async def call(input_data: dict[str, Any]) -> Any:
        return await rt.invoke(rule, f"{ir['blockId']}.{kind}", input_data, {} if context is None else context)

    return call
