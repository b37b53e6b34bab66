"""Side-car decisions (docs/sidecars.md): pure functions from the block's IR and record to the
node commands that start and stop its side-cars.

* **Start**: with the block's gang (the ``allocation`` step), every side-car of the IR is sent to
  one node of the block's cluster: the node of its first instance (same cluster, a node the block
  already runs on). The node is recorded on the block (``sidecar_node``) with the step.
* **Stop**: when the block is deleted or fails while placing, every side-car is stopped on the
  recorded node (else on every node that runs one of its instances: an agent that runs no such
  side-car ignores the command), and the agent deletes its durable consumer.

Side-cars reserve nothing (no GPU, CPU or memory): they ride along with the block's instances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..schemas.catalog import E, Emit
from ..schemas.events import SidecarCommand
from ..schemas.records import BlockIR, BlockRecord, InstanceRecord

#: the block record field that says where its side-cars run
NODE_FIELD = "sidecar_node"


def sidecar_node(placements: Sequence[Mapping[str, object]]) -> str:
    """Where a block's side-cars go: the node of its first placed instance ("" when none)."""
    return str(placements[0]["node"]) if placements else ""


def starts(ir: BlockIR, gen: int, cid: str, node: str) -> list[Emit]:
    """``node.sidecar.start`` for every side-car of the block (none without side-cars or node)."""
    if not node:
        return []
    bid = ir["blockId"]
    return [Emit(E.node_sidecar_start, SidecarCommand(bid, gen, cid, node, sc["name"], sc.copy()))
            for sc in ir.get("sidecars") or []]


def stops(block: BlockRecord | None, instances: Mapping[str, InstanceRecord], reason: str) -> list[Emit]:
    """``node.sidecar.stop`` for every side-car of the block, on its recorded node (else on every
    node of its instances)."""
    if block is None:
        return []
    ir = block.get("ir") or {}
    scs = ir.get("sidecars") or []
    if not scs:
        return []
    bid, gen = str(ir.get("blockId") or block.get("id") or ""), int(block.get("gen", 0))
    recorded = str(block.get(NODE_FIELD) or "")
    nodes = [recorded] if recorded else sorted({str(i["node"]) for i in instances.values() if i.get("node")})
    cid = str(block.get("cluster") or "")
    return [Emit(E.node_sidecar_stop, SidecarCommand(bid, gen, cid, nid, sc["name"], sc.copy(), reason), qualifier=nid)
            for nid in nodes for sc in scs]
