"""``blocks node drain|undrain|remove`` and ``blocks cluster remove`` (the node and cluster
lifecycle virtual clusters need): Redis changed atomically (``state.inventory_admin``), then the
stored event (``blocks recover`` rebuilds from it) and the inventory hint.

Drain: nothing new is placed on the node (it reads as not healthy: a virtual cluster holding it
replaces it), and each of its instances is moved through a ``reassignment`` with the reason
``evacuation`` (seed 004's word for LXD scriptlets). Remove: only a drained, idle node outside
any virtual cluster. Cluster remove: refused while an instance runs in it or it holds a virtual
cluster.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from .common import _request, _seconds_over, console, err

if TYPE_CHECKING:  # the rest is imported when a command runs: `blocks` starts with typer and rich only
    from ..schemas.vcluster import NodeDrain
    from .client import Client


async def _node(c: Client, nid: str) -> str:
    from ..schemas.spec import check_id

    check_id(nid, "node id")
    meta = await c.store.node_meta(nid)
    if meta is None:
        raise LookupError(f"no node {nid!r}")
    return str(meta["cluster"])


async def drain(c: Client, nid: str, undo: bool = False) -> NodeDrain:
    """Drain (or undrain) a node; returns the event published, with the instances it moves."""
    from ..bus.catalog import E, Emit
    from ..schemas.events import InventoryHint, ReassignRequest
    from ..schemas.vcluster import NodeDrain
    from ..state.inventory_admin import InventoryAdmin

    cid = await _node(c, nid)
    if not await InventoryAdmin(c.store).drain(cid, nid, not undo):
        raise LookupError(f"no node {nid!r}")
    rid = uuid.uuid4().hex[:12]
    moving = {} if undo else {
        iid: inst for iid, inst in (await c.store.node_instances(nid)).items() if inst.get("status") != "removing"
    }
    event = NodeDrain(nid, cid, rid, not undo, sorted(moving))
    out = [Emit(E.node_drain, event), Emit(E.inventory_hint, InventoryHint(cid, [nid]))]
    for iid, inst in sorted(moving.items()):
        req = ReassignRequest(inst["block_id"], inst.get("cluster") or cid, f"evacuate-{iid}-{rid}", iid, "evacuation",
                              gen=int(inst["gen"]))
        out.append(Emit(E.cluster_reassignment, req))
    await c.bus.emit_all(out)
    return event


async def wait_empty(c: Client, nid: str, timeout: float) -> int:
    """Instances left on the node after waiting up to ``timeout`` seconds for them to move."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        left = len(await c.store.node_instances(nid))
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.2)


async def remove_node(c: Client, nid: str) -> str:
    from ..bus.catalog import E, Emit
    from ..schemas.events import InventoryHint
    from ..schemas.vcluster import NodeRemoved
    from ..state.inventory_admin import InventoryAdmin

    cid = await _node(c, nid)
    why = await InventoryAdmin(c.store).remove_node(cid, nid)
    if why:
        raise LookupError(f"node {nid} not removed: {why}")
    await c.bus.emit_all([Emit(E.node_removed, NodeRemoved(nid, cid, uuid.uuid4().hex[:12])),
                          Emit(E.inventory_hint, InventoryHint(cid, [nid]))])
    return cid


async def remove_cluster(c: Client, cid: str) -> list[str]:
    from ..bus.catalog import E, Emit
    from ..schemas.events import InventoryHint
    from ..schemas.spec import check_id
    from ..schemas.vcluster import ClusterRemoved
    from ..state.inventory_admin import InventoryAdmin

    check_id(cid, "cluster id")
    # a block placed here lives here with or without instances (those with instances the removal
    # script refuses by their nodes): one scaled to zero would be left "ready" on a cluster that
    # no longer exists, holding its tasks until they time out
    placed = await c.store.blocks_at_zero(lambda b: b.get("cluster") == cid)
    if placed:
        raise LookupError(f"cluster {cid} not removed: blocks scaled to zero are placed on it (delete them first): "
                          + ", ".join(placed[:10]) + (" ..." if len(placed) > 10 else ""))
    nodes, why = await InventoryAdmin(c.store).remove_cluster(cid)
    if why:
        raise LookupError(f"cluster {cid} not removed: {why}")
    await c.bus.emit_all([Emit(E.cluster_removed, ClusterRemoved(cid, uuid.uuid4().hex[:12], sorted(nodes))),
                          Emit(E.inventory_hint, InventoryHint(cid))])
    return nodes


def register(node_app: typer.Typer, cluster_app: typer.Typer, DataDir: Any) -> None:
    """Add the commands to the CLI's ``node`` and ``cluster`` groups."""

    @node_app.command("drain")
    def drain_cmd(
        node_id: str,
        wait: float = typer.Option(0.0, "--wait", help="Wait up to this many seconds for its instances to move (exit 5 if not).",
                                   callback=_seconds_over(0.0, inclusive=True)),
        data_dir: Path = DataDir,
    ) -> None:
        """Place nothing new on a node and move its instances away (reassignment, reason evacuation).

        Example: `blocks node drain c1-n3 --wait 60`, then `blocks node remove c1-n3`
        """

        async def go(c: Client) -> int:
            ev = await drain(c, node_id)
            console.print(f"node [bold]{node_id}[/] draining; moving {len(ev.evacuating)} instance(s)")
            if wait > 0:
                left = await wait_empty(c, node_id, wait)
                if left:
                    err.print(f"[red]{left} instance(s) still on {node_id} after {wait:g}s[/]")
                    return 5
                console.print(f"node {node_id} is empty")
            return 0

        code = int(_request(go, data_dir))
        if code:
            raise typer.Exit(code)

    @node_app.command("undrain")
    def undrain_cmd(node_id: str, data_dir: Path = DataDir) -> None:
        """Let placements use a drained node again. Example: `blocks node undrain c1-n3`"""
        _request(lambda c: drain(c, node_id, undo=True), data_dir)
        console.print(f"node [bold]{node_id}[/] takes placements again")

    @node_app.command("remove")
    def remove_cmd(node_id: str, data_dir: Path = DataDir) -> None:
        """Remove a drained node with nothing left on it (exit 1 otherwise, with why).

        Example: `blocks node remove c1-n3`
        """
        cid = _request(lambda c: remove_node(c, node_id), data_dir)
        console.print(f"node [bold]{node_id}[/] removed from {escape(cid)}")

    @cluster_app.command("remove")
    def cluster_remove_cmd(cluster_id: str, data_dir: Path = DataDir) -> None:
        """Remove a cluster and its nodes: refused while an instance runs in it, it holds a virtual
        cluster or a block scaled to zero is placed on it. Example: `blocks cluster remove c1`"""
        nodes = _request(lambda c: remove_cluster(c, cluster_id), data_dir)
        console.print(f"cluster [bold]{cluster_id}[/] removed with {len(nodes)} node(s)")
