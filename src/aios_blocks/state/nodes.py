"""Clusters, nodes, their reservations and state indexes, and the agents' heartbeats: the
capacity half of the Redis door (a mixin of ``state.store.Store``, the one door callers hold)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ..schemas.records import ClusterRecord, GpuView, JSONObject, NodeMeta, NodeView
from ..schemas.spec import Cluster, Node
from .keys import (
    CLUSTERS,
    HEARTBEATS,
    NODE_INDEX,
    cluster_nodes_key,
    index_cluster,
    index_key,
    node_inst_key,
    node_key,
    quota_res_key,
    quota_usage_key,
    res_key,
    res_pattern,
)
from .records import _dumps

_json = msgspec.json


def reserve_keys(cid: str, placements: Sequence[Mapping[str, object]]) -> list[str]:
    """``scripts.RESERVE_GANG``'s keys: each placement's node and reservation, then the cluster's
    state index, quota usage and quota reservations."""
    keys: list[str] = []
    for p in placements:
        keys += [node_key(cid, str(p["node"])), res_key(cid, str(p["iid"]))]
    return [*keys, index_key(cid), quota_usage_key(cid), quota_res_key(cid)]


class NodeRecords:
    """``Store``'s methods over clusters and nodes (they use its client and scripts)."""

    r: Any
    _reserve: Any
    _release: Any
    _health_cas: Any

    # -- clusters and nodes ----------------------------------------------------------------
    async def put_cluster(self, cluster: Cluster) -> None:
        # not a transaction (two Redis Cluster slots): the change, then the bump of its index
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(CLUSTERS, cluster.id, cluster.model_dump_json())
        pipe.incr(index_key(cluster.id))  # its labels decide the filter rule
        await pipe.execute()

    async def ensure_cluster(self, cluster: Cluster) -> bool:
        """Register the cluster unless it exists (a node agent may name a new cluster)."""
        new = bool(await self.r.hsetnx(CLUSTERS, cluster.id, cluster.model_dump_json()))
        if new:
            await self.r.incr(index_key(cluster.id))
        return new

    async def clusters(self) -> dict[str, ClusterRecord]:
        raw = await self.r.hgetall(CLUSTERS)
        return {cid: _json.decode(v) for cid, v in raw.items()}

    async def put_node(self, node: Node, agent: str | None = None) -> None:
        """Register or update a node's capacity (usage counters are kept). ``agent``: who serves
        its commands ("" = the simulated fleet; None = leave as it is)."""
        key = node_key(node.cluster, node.id)
        fields: dict[str, str | int | float] = {
            "spec": node.model_dump_json(),
            "cpu": node.cpu,
            "memory": node.memory,
            "healthy": 1 if node.healthy else 0,
        }
        if agent is not None:
            fields["agent"] = agent
        for g in node.gpus:
            fields[f"g:{g.id}:total"] = g.memory
        # the node -> cluster index first (another Redis Cluster slot), then one transaction over
        # the cluster's own slot: the node, its cluster's node set, the bump of the state index
        await self.r.hset(NODE_INDEX, node.id, node.cluster)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.sadd(cluster_nodes_key(node.cluster), node.id)
        pipe.incr(index_key(node.cluster))
        await pipe.execute()

    async def set_node_health(self, cid: str, nid: str, healthy: bool) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(node_key(cid, nid), "healthy", 1 if healthy else 0)
        pipe.incr(index_key(cid))
        await pipe.execute()

    async def node_ids(self, cid: str) -> list[str]:
        return sorted(await self.r.smembers(cluster_nodes_key(cid)))

    async def node_cluster(self, nid: str) -> str | None:
        return await self.r.hget(NODE_INDEX, nid)

    async def node_clusters(self, nids: list[str]) -> dict[str, str]:
        """The cluster of each of ``nids`` that is registered (one read)."""
        found = await self.r.hmget(NODE_INDEX, nids) if nids else []
        return {nid: cid for nid, cid in zip(nids, found, strict=True) if cid is not None}

    async def read_nodes(self, cid: str, nids: Iterable[str]) -> dict[str, NodeView]:
        """Current view of some nodes: capacity, usage and health, shaped for policies."""
        nids = list(nids)
        pipe = self.r.pipeline(transaction=False)
        for nid in nids:
            pipe.hgetall(node_key(cid, nid))
        out: dict[str, NodeView] = {}
        for nid, h in zip(nids, await pipe.execute(), strict=True):
            if h:
                out[nid] = node_view(h)
        return out

    # -- reservations ----------------------------------------------------------------------
    async def reserve_gang(self, cid: str, placements: Sequence[Mapping[str, object]]) -> tuple[bool, str, str]:
        """All-or-nothing reservation of several instances in one cluster (one atomic script):
        ``placements`` are ``handlers.controller.plan``'s records (iid, node, gpus, amounts), JSON
        for ``RESERVE_GANG``."""
        ok, reason, node = await self._reserve(keys=reserve_keys(cid, placements), args=[_dumps(placements)])
        return bool(ok), reason, node

    async def release(self, cid: str, nid: str, iid: str) -> bool:
        keys = [node_key(cid, nid), res_key(cid, iid), index_key(cid), quota_usage_key(cid), quota_res_key(cid)]
        return bool(await self._release(keys=keys, args=[iid]))

    async def reservation(self, cid: str, iid: str) -> dict[str, str] | None:
        h = await self.r.hgetall(res_key(cid, iid))
        return h or None

    async def reservations_of(self, cid: str, iids: list[str]) -> list[dict[str, str] | None]:
        """The reservations of these instances (None where there is none), one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for iid in iids:
            pipe.hgetall(res_key(cid, iid))
        return [h or None for h in await pipe.execute()]

    async def reservations(self, cid: str) -> list[dict[str, str]]:
        out = []
        async for key in self.r.scan_iter(match=res_pattern(cid), count=500):
            h = await self.r.hgetall(key)
            if h:
                h["iid"] = key.rsplit(":", 1)[1]
                out.append(h)
        return out

    # -- state index (``blocks submit --dry-run`` / ``--if-index``) -------------------------------
    async def state_indexes(self, cids: Iterable[str] | None = None) -> dict[str, int]:
        """Each cluster's state index (default: every registered cluster; 0 = never bumped).

        One counter per cluster (``index_key``), bumped in the same atomic step as the change:
        a reservation taken (``RESERVE_GANG``) or released (``RELEASE``), a node registered or
        updated (``put_node``), a node's health flipped, a cluster registered or relabelled.
        Per cluster, not global: a global counter would put every capacity script in one slot.
        Where the bump is not in the change's own script or transaction, it comes after the change:
        a reader whose two readings around a snapshot agree may hold a newer state than the index
        says (a false "changed" later), never an older one."""
        cids = sorted(await self.r.hkeys(CLUSTERS)) if cids is None else list(cids)
        if not cids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for cid in cids:
            pipe.get(index_key(cid))
        return {cid: int(v or 0) for cid, v in zip(cids, await pipe.execute(), strict=True)}

    async def state_index(self) -> int:
        """The state index: the sum of every cluster's index. Each change bumps exactly one
        cluster's counter by one and counters never go down (``restart_indexes``), so the sum
        rises with every change anywhere and two equal readings mean nothing placement depends
        on changed in between. (A maximum would miss a change in any cluster but the top one.)"""
        return sum((await self.state_indexes()).values())

    async def scan_indexes(self) -> dict[str, int]:
        """Every cluster index key present, registered cluster or not (``blocks recover``)."""
        out = {}
        async for key in self.r.scan_iter(match=index_key("*"), count=1000):
            raw = await self.r.get(key)
            if raw is not None:
                out[index_cluster(key)] = int(raw)
        return out

    async def restart_indexes(self, cids: Iterable[str], before: dict[str, int], floor: int) -> None:
        """After ``blocks recover`` rewrote the state: every cluster's index restarts above both its
        value before (``before``, read from Redis first) and ``floor`` (the stream's last sequence,
        for a Redis that lost its counters), so an index read before the recover is not matched
        again by chance."""
        pipe = self.r.pipeline(transaction=False)
        for cid in cids:
            pipe.set(index_key(cid), max(before.get(cid, 0), floor) + 1)
        await pipe.execute()

    async def simulated_nodes_with_instances(self) -> list[JSONObject]:
        """The specs of the nodes the simulated fleet serves (``agent`` "") that have instances
        recorded: those a restarted fleet reports (``node.inventory``), since it runs none of them."""
        nodes = [(cid, nid) for cid in await self.clusters() for nid in await self.node_ids(cid)]
        if not nodes:
            return []
        pipe = self.r.pipeline(transaction=False)
        for cid, nid in nodes:
            pipe.hmget(node_key(cid, nid), ["spec", "agent"])
            pipe.hlen(node_inst_key(nid))
        raw = await pipe.execute()
        out: list[JSONObject] = []
        for n in range(len(nodes)):
            (spec, agent), count = raw[2 * n], raw[2 * n + 1]
            if spec is not None and not agent and int(count or 0) > 0:
                out.append(_json.decode(spec))
        return out

    async def node_meta(self, nid: str, cluster: str = "") -> NodeMeta | None:
        """{cluster, agent, healthy, gpus} of a registered node (None if unknown).

        ``cluster``: the cluster the caller has the node in (a command's ``cluster_id``): the node
        index and that cluster's record of the node are read together (one exchange through the
        autopipeline, not two one after the other); the index decides, as without it: where it
        names another cluster (or none), that one is read, as before."""
        fields = ["spec", "agent", "healthy"]
        if cluster:
            pipe = self.r.pipeline(transaction=False)  # one exchange, no task per read (a gather's)
            pipe.hget(NODE_INDEX, nid)
            pipe.hmget(node_key(cluster, nid), fields)
            cid, got = await pipe.execute()
            if cid is None:
                return None
            if cid != cluster:
                got = await self.r.hmget(node_key(cid, nid), fields)
        else:
            cid = await self.node_cluster(nid)
            if cid is None:
                return None
            got = await self.r.hmget(node_key(cid, nid), fields)
        spec, agent, healthy = got
        if spec is None:
            return None
        return {"cluster": cid, "agent": agent or "", "healthy": healthy == "1", "spec": _json.decode(spec)}

    async def set_node_agent(self, cid: str, nid: str, agent: str) -> None:
        await self.r.hset(node_key(cid, nid), "agent", agent)

    async def set_node_health_cas(self, cid: str, nid: str, healthy: bool) -> bool:
        """Flip the node's health; True only for the caller that changed it (one reporter)."""
        return bool(await self._health_cas(keys=[node_key(cid, nid), index_key(cid)], args=["1" if healthy else "0"]))

    async def nodes_healthy(self, nodes: list[tuple[str, str]]) -> list[bool | None]:
        """Health flag of each (cluster, node); None for a node that is not registered."""
        pipe = self.r.pipeline(transaction=False)
        for cid, nid in nodes:
            pipe.hget(node_key(cid, nid), "healthy")
        return [None if v is None else v == "1" for v in await pipe.execute()]

    async def heartbeats_record(self, seen: dict[str, float]) -> None:
        if seen:
            await self.r.zadd(HEARTBEATS, seen)

    async def heartbeats_overdue(self, cutoff: float) -> list[str]:
        """Nodes whose last heartbeat is older than ``cutoff`` (only nodes that ever sent one)."""
        return list(await self.r.zrangebyscore(HEARTBEATS, "-inf", cutoff))

    async def heartbeats_forget(self, nid: str) -> None:
        await self.r.zrem(HEARTBEATS, nid)


def node_view(h: dict[str, str]) -> NodeView:
    """A node hash -> the dict policies see: capacity, usage, free figures and GPUs."""
    spec = _json.decode(h["spec"])
    gpus: list[GpuView] = []
    for g in spec.get("gpus", []):
        gid = g["id"]
        total = int(h.get(f"g:{gid}:total", g.get("memory", 0)))
        used = int(h.get(f"g:{gid}:mem", 0))
        gpus.append(
            {
                "id": gid,
                "model": g.get("model", ""),
                "memory": total,
                "memory_used": used,
                "memory_free": total - used,
                "instances": int(h.get(f"g:{gid}:n", 0)),
                "exclusive": h.get(f"g:{gid}:x", "0") == "1",
                # thousandths of its compute not taken by sharing instances' gpuShare
                "share_free": 1000 - int(h.get(f"g:{gid}:share", 0)),
            }
        )
    cpu, mem = float(h.get("cpu", 0)), int(h.get("memory", 0))
    cpu_used, mem_used = float(h.get("cpu_used", 0)), int(h.get("mem_used", 0))
    view: NodeView = {
        "node_id": spec["id"],
        "cluster": spec["cluster"],
        "labels": spec.get("labels", {}),
        # a draining node (``blocks node drain``) takes nothing new: it reads as not healthy
        "healthy": h.get("healthy") == "1" and h.get("drain") != "1",
        "cpu": cpu,
        "cpu_free": round(cpu - cpu_used, 6),
        "memory": mem,
        "memory_free": mem - mem_used,
        "gpus": gpus,
    }
    if spec.get("topology"):  # its GPU topology (docs/topology.md); absent: unknown
        view["topology"] = spec["topology"]
    if h.get("vc"):  # its virtual cluster (seed 003, ``state.vcluster``); absent: the primary's
        view["virtualCluster"] = h["vc"]
    if h.get("drain") == "1":
        view["draining"] = True
    return view
