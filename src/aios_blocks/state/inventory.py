"""An in-memory inventory snapshot per worker, refreshed by change hints.

Building a policy's input must not read every node per message. The snapshot loads a cluster's
nodes once, then re-reads only the nodes named by ``aios.cluster.{cid}.inventory`` hints (sent
after every reservation, release and node change) or marked stale by this process's own writes.
A lost hint costs a stale view, never a double-booking: the atomic reservation script re-checks
everything at commit time and a conflict refreshes the nodes involved.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypedDict

import structlog

from ..policies import affinity
from ..policies.capacity import Nodes
from ..schemas.records import BlockIR, ClusterRecord, NodeView
from .store import Store

log = structlog.get_logger("aios.inventory")


async def affinity_index(store: Store, ir: BlockIR) -> affinity.Index:
    """Where the instances/blocks named by the block's affinity targets run now, and for a block
    with Adaptive entries the adapt stage's table (``affinity.adapt``) from the latest samples of
    its own instances (the metrics collector's; none, or the store away: the base weight)."""
    entries = ir.get("affinity") or []
    svcs, leases = affinity.referenced(entries)
    index = await store.index_read(svcs, leases) if svcs or leases else affinity.empty_index()
    if affinity.has_adaptive(entries):
        try:
            samples = await store.metrics.instances(str(ir.get("blockId", "")))
        except Exception as exc:
            log.warning("affinity.adapt_metrics_unavailable", block=ir.get("blockId"), error=repr(exc))
            samples = {}
        index = {**index, "adapt": affinity.adapt(samples)}
    if any(e.get("target_type") == "LinkTier" for e in entries):  # the GPU count a link tier is for
        index = {**index, "gpus": int((ir.get("resources") or {}).get("gpus") or 0)}
    return index


class HintDoc(TypedDict, total=False):
    """An inventory hint as decoded (``schemas.events.InventoryHint`` as JSON)."""

    cluster: str
    #: empty or absent: the whole cluster
    nodes: list[str] | None
    #: the worker process that sent it
    origin: str


class Inventory:
    def __init__(self, store: Store, prefetch: bool = False):
        self.store = store
        #: reload a cluster as soon as a hint says all of it changed (workers that place)
        self.prefetch = prefetch
        self._reloads: set[asyncio.Task[None]] = set()
        self._clusters: dict[str, ClusterRecord] | None = None
        self._nodes: dict[str, dict[str, NodeView]] = {}
        self._dirty: dict[str, set[str] | None] = {}  # None = reload the whole cluster
        #: one refresh of a cluster's view at a time (clusters refresh independently)
        self._locks: dict[str, asyncio.Lock] = {}

    def invalidate(self, cid: str, nodes: list[str] | None = None) -> None:
        """Mark nodes (or the whole cluster, and the cluster list, when ``nodes`` is None) stale."""
        if nodes is None:
            self._dirty[cid] = None
            self._clusters = None
            return
        cur = self._dirty.get(cid, set())
        if cur is not None:
            cur.update(nodes)
            self._dirty[cid] = cur

    def apply(self, cid: str, views: dict[str, NodeView], based_on: dict[str, NodeView]) -> None:
        """Put views this process computed from its own committed change (a reservation it made)
        in place of a re-read: ``views[nid]`` is ``based_on[nid]`` (the view it planned on) with
        the change applied. A node whose view is no longer that one (re-read meanwhile) or is
        marked stale (another process's change was hinted) is left alone, so it is re-read and
        the view always converges on Redis (a node re-read meanwhile may have been read before
        the change: it is marked stale)."""
        loaded = self._nodes.get(cid)
        dirty = self._dirty.get(cid, set())
        if loaded is None or dirty is None:
            return
        for nid, view in views.items():
            if nid not in dirty and loaded.get(nid) is based_on.get(nid, view):
                loaded[nid] = view
            else:
                self.invalidate(cid, [nid])

    def on_hint(self, hint: HintDoc) -> None:
        cid = hint.get("cluster")
        if isinstance(cid, str):
            nodes = hint.get("nodes")
            self.invalidate(cid, list(nodes) if nodes else None)
            if not nodes and self.prefetch:
                # a whole cluster changed (added, re-registered): reload it now, in the
                # background, rather than in the first placement that needs it
                task = asyncio.get_running_loop().create_task(self._reload(cid))
                self._reloads.add(task)
                task.add_done_callback(self._reloads.discard)

    async def _reload(self, cid: str) -> None:
        with contextlib.suppress(Exception):  # a failed prefetch only means a lazy load later
            if cid in await self.clusters():
                await self.nodes(cid)

    async def clusters(self) -> dict[str, ClusterRecord]:
        if self._clusters is None:
            self._clusters = await self.store.clusters()
        return self._clusters

    def loaded(self, cid: str) -> dict[str, NodeView] | None:
        """The cluster's view as it is now if nothing of it is stale (:meth:`nodes` without a read:
        None where that would read Redis)."""
        return self._fresh(cid)

    def _fresh(self, cid: str) -> dict[str, NodeView] | None:
        """The cluster's view if it is loaded, nothing of it is stale and no refresh of it is in
        flight: what taking its lock would give at once, without the lock."""
        view = self._nodes.get(cid)
        if view is None or cid in self._dirty:
            return None
        lock = self._locks.get(cid)
        return view if lock is None or not lock.locked() else None

    async def views(self, cids: list[str]) -> dict[str, dict[str, NodeView]]:
        """:meth:`nodes` of several clusters; the stale ones refreshed together (their reads
        share round trips) rather than one after another."""
        fresh = {cid: self._fresh(cid) for cid in cids}
        stale = [cid for cid, v in fresh.items() if v is None]
        if len(stale) == 1:  # no task for one
            got = {stale[0]: await self.nodes(stale[0])}
        else:
            got = dict(zip(stale, await asyncio.gather(*(self.nodes(c) for c in stale)), strict=True))
        return {cid: got[cid] if v is None else v for cid, v in fresh.items()}

    async def nodes(self, cid: str) -> dict[str, NodeView]:
        """The cluster's node views (shared: copy before changing them)."""
        view = self._fresh(cid)
        if view is not None:
            return view
        lock = self._locks.get(cid)
        if lock is None:
            lock = self._locks[cid] = asyncio.Lock()
        async with lock:
            if cid not in self._nodes or self._dirty.get(cid, set()) is None:
                self._dirty.pop(cid, None)
                ids = await self.store.node_ids(cid)
                # views that log what changes: the capacity memos catch up in O(changes)
                self._nodes[cid] = Nodes(await self.store.read_nodes(cid, ids))
            else:
                stale = self._dirty.pop(cid, set())
                if stale:
                    fresh = await self.store.read_nodes(cid, stale)
                    view = self._nodes[cid]
                    for nid in stale:
                        if nid in fresh:
                            view[nid] = fresh[nid]
                        else:
                            view.pop(nid, None)
            return self._nodes[cid]

    async def warm(self, only: str | None = None) -> int:
        """Load every cluster's nodes now (``only``: one cluster), as kube-scheduler syncs its
        informer caches before it schedules: otherwise the first placement that touches each
        cluster pays for reading all of its nodes (~0.3 s per 1,000). Returns the nodes loaded."""
        loaded = 0
        for cid in list(await self.clusters()):
            if only is None or cid == only:
                loaded += len(await self.nodes(cid))
        return loaded
