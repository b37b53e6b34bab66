"""The door to Redis: current state of components, clusters, nodes, blocks, instances and gathers.

Every key is built by ``state.keys`` (the key layout is documented there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..schemas.lifecycle import REUSABLE, TRANSITIONS, Step
from ..schemas.spec import Cluster, Component, Node
from ..settings import Settings
from ..settings import current as current_settings
from . import scripts
from .autoscale import AutoscaleStore
from .connection import is_cluster_client, open_redis
from .health import HealthStore
from .keys import (  # noqa: F401  (re-exported: the store's callers import keys from here too)
    AFF_LEASE,
    BLOCKS,
    CLUSTERS,
    EPOCH_KEY,
    GATHER_DUE,
    HEARTBEATS,
    NODE_INDEX,
    POLICIES,
    P,
    aff_svc_key,
    block_key,
    cluster_nodes_key,
    component_key,
    ctx_key,
    due_member,
    gather_key,
    index_cluster,
    index_key,
    inst_key,
    node_inst_key,
    node_key,
    policy_key,
    policy_version_key,
    replace_claim_key,
    res_key,
    res_pattern,
)
from .metrics import MetricsStore

_json = msgspec.json


#: Redis connections per process, and how long a caller waits for one before failing


def _dumps(v: Any) -> str:
    return _json.encode(v).decode()


class Records(Mapping[str, dict[str, Any]]):
    """A block's instance records as a script returned them (id, JSON, id, JSON, ...), decoded
    when first read: most callers want one record, or none of them."""

    def __init__(self, flat: list[Any]):
        self._flat = flat
        self._all: dict[str, dict[str, Any]] | None = None

    def one(self, iid: str) -> dict[str, Any] | None:
        if self._all is not None:
            return self._all.get(iid)
        flat = self._flat
        for i in range(0, len(flat), 2):
            if flat[i] == iid:
                return _json.decode(flat[i + 1])
        return None

    def _decoded(self) -> dict[str, dict[str, Any]]:
        if self._all is None:
            flat = self._flat
            self._all = {flat[i]: _json.decode(flat[i + 1]) for i in range(0, len(flat), 2)}
        return self._all

    def __getitem__(self, iid: str) -> dict[str, Any]:
        return self._decoded()[iid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._flat) // 2


class StoreUnreachable(ConnectionError):
    """Redis did not answer (``Store.reachable``)."""


class Store:
    def __init__(self, r: aioredis.Redis):
        #: always made with ``decode_responses=True``: redis-py's types cannot say so (they give
        #: ``bytes | str`` for every reply), so the store's own signatures carry the real types
        self.r: Any = r
        self._reserve = r.register_script(scripts.RESERVE_GANG)
        self._release = r.register_script(scripts.RELEASE)
        self._transition = r.register_script(scripts.TRANSITION)
        self._create = r.register_script(scripts.CREATE_BLOCK)
        self._gather_add = r.register_script(scripts.GATHER_ADD)
        self._gather_settle = r.register_script(scripts.GATHER_SETTLE)
        self._health_cas = r.register_script(scripts.NODE_HEALTH_CAS)
        self._claim_due = r.register_script(scripts.CLAIM_DUE)
        #: the metrics collector's windows and the workers' /metrics targets (``state.metrics``)
        self.metrics = MetricsStore(r)
        #: the autoscaler's leases and memory of each block (``state.autoscale``)
        self.autoscale = AutoscaleStore(r)
        #: the executors' passive counts and the health checker's lease (``state.health``)
        self.health = HealthStore(r)
        self._set_status = r.register_script(scripts.SET_INSTANCE_STATUS)
        self._set_desired = r.register_script(scripts.SET_DESIRED)
        self._drain = r.register_script(scripts.DRAIN_INSTANCE)
        self._add_instances = r.register_script(scripts.ADD_INSTANCES)
        self._lease = r.register_script(scripts.LEASE)
        self._lease_release = r.register_script(scripts.LEASE_RELEASE)
        self._scripts = (self._reserve, self._release, self._transition, self._create, self._gather_add,
                         self._gather_settle, self._health_cas, self._claim_due, self._set_status, self._set_desired, self._drain,
                         self._add_instances)

    @classmethod
    def open(cls, url: str, max_connections: int | None = None, settings: Settings | None = None) -> Store:
        """One server (``redis://``) or a Redis Cluster (``redis+cluster://``): ``state.connection``."""
        return cls(open_redis(url, settings or current_settings(), max_connections))

    async def close(self) -> None:
        await self.r.aclose()

    async def reachable(self) -> None:
        """Raise :class:`StoreUnreachable` (a ``ConnectionError``) when Redis does not answer a
        PING: a command line tool says so in one line instead of a redis-py traceback."""
        try:
            await self.r.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreUnreachable(f"cannot connect to Redis: {exc}") from exc

    # -- components ------------------------------------------------------------------------
    async def put_component(self, comp: Component) -> None:
        await self.r.set(component_key(comp.componentURI), comp.model_dump_json())

    async def get_component(self, uri: str) -> dict[str, Any] | None:
        raw = await self.r.get(component_key(uri))
        return _json.decode(raw) if raw else None

    async def components(self) -> dict[str, dict[str, Any]]:
        """Every registered component by URI (a SCAN: for listing, not for hot paths)."""
        keys = sorted([k async for k in self.r.scan_iter(match=component_key("*"), count=1000)])
        pipe = self.r.pipeline(transaction=False)  # not MGET: on Redis Cluster the keys are in many slots
        for k in keys:
            pipe.get(k)
        values = await pipe.execute() if keys else []
        return {k.split(":", 2)[2]: _json.decode(v) for k, v in zip(keys, values, strict=True) if v}

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

    async def clusters(self) -> dict[str, dict[str, Any]]:
        raw = await self.r.hgetall(CLUSTERS)
        return {cid: _json.decode(v) for cid, v in raw.items()}

    async def put_node(self, node: Node, agent: str | None = None) -> None:
        """Register or update a node's capacity (usage counters are kept). ``agent``: who serves
        its commands ("" = the simulated fleet; None = leave as it is)."""
        key = node_key(node.cluster, node.id)
        fields: dict[str, Any] = {
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

    async def read_nodes(self, cid: str, nids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Current view of some nodes: capacity, usage and health, shaped for policies."""
        nids = list(nids)
        pipe = self.r.pipeline(transaction=False)
        for nid in nids:
            pipe.hgetall(node_key(cid, nid))
        out: dict[str, dict[str, Any]] = {}
        for nid, h in zip(nids, await pipe.execute(), strict=True):
            if h:
                out[nid] = node_view(h)
        return out

    # -- reservations ----------------------------------------------------------------------
    async def reserve_gang(self, cid: str, placements: list[dict[str, Any]]) -> tuple[bool, str, str]:
        """All-or-nothing reservation of several instances in one cluster (one atomic script)."""
        keys: list[str] = []
        for p in placements:
            keys += [node_key(cid, p["node"]), res_key(cid, p["iid"])]
        keys.append(index_key(cid))
        ok, reason, node = await self._reserve(keys=keys, args=[_dumps(placements)])
        return bool(ok), reason, node

    async def release(self, cid: str, nid: str, iid: str) -> bool:
        return bool(await self._release(keys=[node_key(cid, nid), res_key(cid, iid), index_key(cid)]))

    async def reservation(self, cid: str, iid: str) -> dict[str, Any] | None:
        h = await self.r.hgetall(res_key(cid, iid))
        return h or None

    async def reservations_of(self, cid: str, iids: list[str]) -> list[dict[str, Any] | None]:
        """The reservations of these instances (None where there is none), one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for iid in iids:
            pipe.hgetall(res_key(cid, iid))
        return [h or None for h in await pipe.execute()]

    async def reservations(self, cid: str) -> list[dict[str, Any]]:
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

    # -- blocks ----------------------------------------------------------------------------
    async def create_block(self, bid: str, gen: int, digest: str, fields: dict[str, Any]) -> tuple[bool, str]:
        now = time.time()

        def build(pipe: Any) -> None:  # the record and its place in the block list, one round trip
            _queue_script(pipe, self._create, [block_key(bid)], [str(gen), digest, _dumps(_strs(fields)), ",".join(sorted(REUSABLE))])
            pipe.zadd(BLOCKS, {bid: now}, nx=True)

        (ok, what), added = await self._pipeline(build)
        if ok and what == "created" and not added:  # an id used again: it moves to the top
            await self.r.zadd(BLOCKS, {bid: now})
        return bool(ok), what

    async def transition(
        self, bid: str, gen: int | None, step: Step, *, in_round: int | None = None, **fields: Any
    ) -> tuple[bool, str]:
        """Compare-and-set the block's status by one lifecycle step (``schemas.lifecycle``): only
        from the step's source statuses, only if ``gen`` matches (and, with ``in_round``, only if
        the block is in that selection round, its ``attempt``). Returns (done, new version or the
        status that blocked it)."""
        rule = TRANSITIONS[step]
        fields["updated"] = time.time()
        args = ["" if gen is None else str(gen), rule.allowed(), rule.target.value, _dumps(_strs(fields))]
        if in_round is not None:
            args.append(str(in_round))
        ok, info = await self._transition(keys=[block_key(bid)], args=args)
        return bool(ok), str(info)

    async def set_desired(
        self, bid: str, gen: int | None, target: int, version: int, live: Iterable[str], **fields: Any
    ) -> tuple[bool, str]:
        """Compare-and-set the block's desired instance count (``desired``, ``desired_seq``): only
        for a live block of generation ``gen``, and only from a ``version`` not older than the one
        it holds (the latest target wins; the same one again is accepted). (done, why not)."""
        args = ["" if gen is None else str(gen), ",".join(sorted(live)), str(int(target)), str(int(version)),
                _dumps(_strs({**fields, "updated": time.time()}))]
        ok, info = await self._set_desired(keys=[block_key(bid)], args=args)
        return bool(ok), str(info)

    async def drain_instance(self, bid: str, iid: str, floor: int, request_id: str, count: int = 1_000_000) -> str:
        """Mark one instance ``removing`` for a scale-down unless that takes the block to ``floor``
        or below, or request ``request_id`` has marked ``count`` already (the same request handled
        twice at once: a redelivery in the same batch) - atomic over the block's instances,
        ``scripts.DRAIN_INSTANCE``: ``ok``, ``absent``, ``removing`` (already going), ``floor`` or
        ``done``."""
        return str(await self._drain(keys=[inst_key(bid)], args=[iid, str(int(floor)), request_id, str(int(count))]))

    async def claim_replacement(self, bid: str, iid: str, request_id: str, ttl_s: float) -> str:
        """Take or keep the claim on replacing instance ``iid`` for reassignment ``request_id``:
        one reassignment of an instance at a time, on any controller copy (two at once each placed
        a replacement). A lease, not state: it lapses after ``ttl_s`` when its holder dies with its
        message dead-lettered, and a redelivery of the same request takes it again. Returns the
        holder now (``request_id`` when it is ours)."""
        key = replace_claim_key(bid, iid)
        if await self._lease(keys=[key], args=[request_id, max(1, int(ttl_s * 1000))]):
            return request_id
        return str(await self.r.get(key) or "")  # held by another request (or lapsed just now: "")

    async def release_replacement(self, bid: str, iid: str, request_id: str) -> None:
        """Give the claim back once the reassignment is decided (placed or failed)."""
        await self._lease_release(keys=[replace_claim_key(bid, iid)], args=[request_id])

    async def get_block(self, bid: str) -> dict[str, Any] | None:
        return _block(await self.r.hgetall(block_key(bid)))

    async def block_view(self, bid: str) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """The block record and its instances, in one round trip (two slots: not one snapshot,
        as two reads are not)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(inst_key(bid))
        block, insts = await pipe.execute()
        return _block(block), {iid: _json.decode(v) for iid, v in insts.items()}

    async def list_blocks(self, limit: int = 1000) -> list[str]:
        return await self.r.zrevrange(BLOCKS, 0, limit - 1)

    async def blocks_at_zero(self, match: Callable[[dict[str, Any]], bool], limit: int = 1_000_000) -> list[str]:
        """The ids of the live blocks (placing or ready) with no instance (scaled to zero) whose
        record ``match``es: blocks no instance check sees, yet placed somewhere. A chunk of
        records and instance counts per round trip."""
        out: list[str] = []
        bids = await self.list_blocks(limit)
        for i in range(0, len(bids), 500):
            chunk = bids[i:i + 500]
            pipe = self.r.pipeline(transaction=False)
            for bid in chunk:
                pipe.hgetall(block_key(bid))
                pipe.hlen(inst_key(bid))
            replies = await pipe.execute()
            for bid, h, n in zip(chunk, replies[::2], replies[1::2], strict=True):
                block = _block(h)
                if block is not None and block.get("status") in ("placing", "ready") and not n and match(block):
                    out.append(bid)
        return out

    # -- instances -------------------------------------------------------------------------
    async def put_instances(self, bid: str, instances: dict[str, dict[str, Any]]) -> None:
        """Record new instances. One already recorded keeps its record: a redelivered placement
        must not turn a running (or removing) instance back into a starting one."""
        if instances:
            pipe = self.r.pipeline(transaction=False)
            for iid, v in instances.items():
                pipe.hsetnx(inst_key(bid), iid, _dumps(v))
                pipe.hset(node_inst_key(v["node"]), iid, bid)
            await pipe.execute()

    async def start_instances(
        self, bid: str, instances: dict[str, dict[str, Any]], index: list[tuple[str, str, str, str, str]],
        transition: tuple[int, Step, dict[str, Any]] | None = None, limit: int | None = None,
    ) -> list[str]:
        """What placing instances records, in one round trip and in this order: the block's step
        (``transition``: gen, step, fields; a CAS that may find it moved on), the affinity index
        entries (``index``: svc, lease, iid, node, rack; ``index_add``) and the instance records
        (``put_instances``: one already recorded keeps its record). Not one transaction (several
        Redis Cluster slots); every write is idempotent, so a redelivery redoes what a crash cut.

        ``limit`` (a scale step: the block's ``maxInstances``): the records go first, within that
        bound (``scripts.ADD_INSTANCES``, atomic over the block's instances), and the rest only for
        the instances recorded. Returns the instances refused for the bound (recorded nothing)."""
        refused: list[str] = []
        if limit is not None and instances:
            args: list[Any] = [str(int(limit))]
            for iid, v in instances.items():
                args += [iid, _dumps(v)]
            refused = [str(i) for i in await self._add_instances(keys=[inst_key(bid)], args=args) or []]
            instances = {iid: v for iid, v in instances.items() if iid not in refused}
            index = [e for e in index if e[2] not in refused]
            if not instances and transition is None:
                return refused

        def build(pipe: Any) -> None:
            if transition is not None:
                gen, step, fields = transition
                rule = TRANSITIONS[step]
                args = [str(gen), rule.allowed(), rule.target.value, _dumps(_strs({**fields, "updated": time.time()}))]
                _queue_script(pipe, self._transition, [block_key(bid)], args)
            for svc, lease, iid, node, rack in index:
                pipe.hset(aff_svc_key(svc), iid, _dumps([node, rack]))
                pipe.hset(AFF_LEASE, lease, node)
            for iid, v in instances.items():
                if limit is None:  # (with a limit, recorded above)
                    pipe.hsetnx(inst_key(bid), iid, _dumps(v))
                pipe.hset(node_inst_key(v["node"]), iid, bid)

        await self._pipeline(build)
        return refused

    async def _pipeline(self, build: Callable[[Any], None]) -> list[Any]:
        """Run the commands ``build`` queues as one pipeline (one round trip; not a transaction).
        Scripts are queued by digest with no ``SCRIPT EXISTS`` check first (redis-py's pipelines
        make one, a second round trip); if the server lost them (restarted, flushed), they are
        loaded and the whole pipeline runs again, so every command in one must be idempotent."""
        for attempt in (1, 2):
            if is_cluster_client(self.r):
                # redis-py's cluster pipelines refuse EVALSHA: the same commands, in order, with
                # each script sent alone (routed by its key) and the rest pipelined between them
                rec = _Recorder()
                build(rec)
                try:
                    return await rec.run(self.r)
                except NoScriptError:
                    if attempt == 2:
                        raise
                    for script in self._scripts:
                        await self.r.script_load(script.script)
                    continue
            pipe = self.r.pipeline(transaction=False)
            build(pipe)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                for script in self._scripts:
                    await self.r.script_load(script.script)
        raise AssertionError("unreachable")

    async def set_instance_status(self, bid: str, iid: str, status: str, endpoint: str | None = None) -> dict[str, Any] | None:
        """Set one instance's status (and its ``endpoint`` when given); its record after the change
        (None: not recorded)."""
        return (await self.set_instance_status_all(bid, iid, status, endpoint))[0]

    async def set_instance_status_all(
        self, bid: str, iid: str, status: str, endpoint: str | None = None
    ) -> tuple[dict[str, Any] | None, Mapping[str, dict[str, Any]]]:
        """Set one instance's status and, when given, its ``endpoint`` (one atomic script); (its
        record, every instance of the block right after the write, decoded when first read), or
        (None, {}) when the instance is not recorded."""
        args = [iid, status] + ([_dumps(endpoint)] if endpoint else [])
        flat = await self._set_status(keys=[inst_key(bid)], args=args)
        if not flat:
            return None, {}
        insts = Records(flat)
        return insts.one(iid), insts

    async def block_and_instance(self, bid: str, iid: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The block record and one of its instances, in one round trip (a decision about one
        instance need not decode all of them: a block scaled to 64 has 64)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(block_key(bid))
        pipe.hget(inst_key(bid), iid)
        block, raw = await pipe.execute()
        return _block(block), (None if raw is None else _json.decode(raw))

    async def instances(self, bid: str) -> dict[str, dict[str, Any]]:
        raw = await self.r.hgetall(inst_key(bid))
        return {iid: _json.decode(v) for iid, v in raw.items()}

    async def drop_instance(self, bid: str, iid: str) -> None:
        raw = await self.r.hget(inst_key(bid), iid)
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(inst_key(bid), iid)
        if raw is not None:
            pipe.hdel(node_inst_key(_json.decode(raw)["node"]), iid)
        await pipe.execute()

    # -- nodes served by agents: who runs what, liveness ------------------------------------------
    async def node_instances(self, nid: str) -> dict[str, dict[str, Any]]:
        """Instances recorded on node ``nid``: iid -> {block_id, gen, status, ...record}."""
        index = await self.r.hgetall(node_inst_key(nid))
        if not index:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for iid, bid in index.items():
            pipe.hget(inst_key(bid), iid)
            pipe.hget(block_key(bid), "gen")
        raw = await pipe.execute()
        out: dict[str, dict[str, Any]] = {}
        for n, (iid, bid) in enumerate(index.items()):
            rec, gen = raw[2 * n], raw[2 * n + 1]
            if rec is None:
                continue
            d = _json.decode(rec)
            if d.get("node") != nid:
                continue
            out[iid] = {**d, "block_id": bid, "gen": int(gen or 0)}
        return out

    async def simulated_nodes_with_instances(self) -> list[dict[str, Any]]:
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
        out: list[dict[str, Any]] = []
        for n in range(len(nodes)):
            (spec, agent), count = raw[2 * n], raw[2 * n + 1]
            if spec is not None and not agent and int(count or 0) > 0:
                out.append(_json.decode(spec))
        return out

    async def node_meta(self, nid: str) -> dict[str, Any] | None:
        """{cluster, agent, healthy, gpus} of a registered node (None if unknown)."""
        cid = await self.node_cluster(nid)
        if cid is None:
            return None
        spec, agent, healthy = await self.r.hmget(node_key(cid, nid), ["spec", "agent", "healthy"])
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

    async def block_bump(self, bid: str, field: str) -> int:
        """Count something about a block (e.g. instance replacements); returns the new count."""
        return int(await self.r.hincrby(block_key(bid), field, 1))

    # -- affinity placement index (who runs where, by 128-bit id) ------------------------------
    async def index_add(self, svc: str, lease: str, iid: str, node: str, rack: str) -> None:
        # not a transaction: two lookups in two Redis Cluster slots, each write idempotent
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(aff_svc_key(svc), iid, _dumps([node, rack]))
        pipe.hset(AFF_LEASE, lease, node)
        await pipe.execute()

    async def index_remove(self, svc: str, lease: str, iid: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(aff_svc_key(svc), iid)
        pipe.hdel(AFF_LEASE, lease)
        await pipe.execute()

    async def index_read(self, svcs: list[str], leases: list[str]) -> dict[str, Any]:
        """``{"services": {uuid: [[node, rack], ...]}, "leases": {uuid: node}}`` for these ids."""
        pipe = self.r.pipeline(transaction=False)
        for svc in svcs:
            pipe.hvals(aff_svc_key(svc))
        if leases:
            pipe.hmget(AFF_LEASE, leases)
        out = await pipe.execute()
        # each service's placements sorted: the order of a hash's values is not state
        services = {svc: sorted(_json.decode(v) for v in vals) for svc, vals in zip(svcs, out[: len(svcs)], strict=True)}
        lease_nodes = dict(zip(leases, out[len(svcs)], strict=True)) if leases else {}
        return {"services": services, "leases": {k: v for k, v in lease_nodes.items() if v}}

    # -- gather ----------------------------------------------------------------------------
    async def gather_open(
        self, bid: str, gen: int, attempt: int, expected: list[str], deadline: float, ttl: int = 3600, at: int = 0
    ) -> None:
        """Open a gather and set its deadline timer (``GATHER_DUE``: the gateways' timer loop
        claims it when due; nothing about it is stored in the stream). ``at``: the state version
        the round started from, which a dry_run request asked again carries (``DryRunRequest.at``)."""
        key = gather_key(bid, gen, attempt)
        # not a transaction: the timer key is in another Redis Cluster slot, and every write is NX
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(key, "expected", _dumps(expected))
        pipe.hsetnx(key, "deadline", deadline)
        if at:
            pipe.hsetnx(key, "at", at)
        pipe.expire(key, ttl)
        pipe.zadd(GATHER_DUE, {due_member(bid, gen, attempt): deadline}, nx=True)
        await pipe.execute()

    async def gather_claim_due(self, now: float, lease_s: float = 30.0, limit: int = 64) -> tuple[list[tuple[str, int, int]], float | None]:
        """Gathers whose timer is due, claimed for ``lease_s``; and when the next one is due."""
        out = await self._claim_due(keys=[GATHER_DUE], args=[now, lease_s, limit])
        nxt = float(out[-1]) if out and out[-1] != "" else None
        claimed = []
        for m in out[:-1]:
            bid, gen, attempt = m.split("|")
            claimed.append((bid, int(gen), int(attempt)))
        return claimed, nxt

    async def gather_timer(self, bid: str, gen: int, attempt: int, at: float | None) -> None:
        """Move a gather's timer to ``at`` (``None``: it is done, drop it)."""
        if at is None:
            await self.r.zrem(GATHER_DUE, due_member(bid, gen, attempt))
        else:
            await self.r.zadd(GATHER_DUE, {due_member(bid, gen, attempt): at})

    async def gather_add(
        self, bid: str, gen: int, attempt: int, cid: str, result: dict[str, Any], ttl: int = 3600
    ) -> tuple[int, int]:
        answered, expected, _, _ = await self.gather_add_state(bid, gen, attempt, cid, result, ttl)
        return answered, expected

    async def gather_add_state(
        self, bid: str, gen: int, attempt: int, cid: str, result: dict[str, Any], ttl: int = 3600
    ) -> tuple[int, int, str | None, float]:
        """Record one cluster's answer: (answered, expected, the decision token or None, the
        deadline), all as of right after the write."""
        answered, expected, decided, deadline = await self._gather_add(
            keys=[gather_key(bid, gen, attempt)], args=[cid, _dumps(result), ttl]
        )
        return int(answered), int(expected), decided or None, float(deadline or 0)

    async def gather_read(self, bid: str, gen: int, attempt: int) -> dict[str, Any]:
        return _gather(await self.r.hgetall(gather_key(bid, gen, attempt)))

    async def gather_decide_read(
        self, bid: str, gen: int, attempt: int, token: str
    ) -> tuple[bool, dict[str, Any] | None, dict[str, Any]]:
        """``gather_decide``, then the block and the gather as they are after the claim, in one
        round trip: (this caller decides, the block record, the gather)."""
        key = gather_key(bid, gen, attempt)
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(key, "decided", token)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(key)
        _, block, g = await pipe.execute()
        return g.get("decided") == token, _block(block), _gather(g)

    async def gather_finish(self, bid: str, gen: int, attempt: int) -> None:
        """A round whose decision is stored: its timer and its gather go (the answers it holds are
        in the ``post_dry_run`` now; a late answer finds no open round and decides nothing)."""
        pipe = self.r.pipeline(transaction=False)  # two slots on Redis Cluster: not one transaction
        pipe.zrem(GATHER_DUE, due_member(bid, gen, attempt))
        pipe.delete(gather_key(bid, gen, attempt))
        await pipe.execute()

    async def gather_decide(self, bid: str, gen: int, attempt: int, token: str) -> bool:
        """Claim the one decision of this gather (results complete vs deadline race)."""
        key = gather_key(bid, gen, attempt)
        if await self.r.hsetnx(key, "decided", token):
            return True
        return await self.r.hget(key, "decided") == token

    async def gather_settle(self, bid: str, gen: int, attempt: int, outcome: str) -> str:
        """Record the round's outcome (a cluster id, or ``!reason``) once; return the recorded one.
        A decider that runs again (redelivery) publishes what the first run decided."""
        return str(await self._gather_settle(keys=[gather_key(bid, gen, attempt)], args=[outcome]))

    # -- policy context (seed 000: an external cache shared by all workers) -----------------
    async def context_load(self, rule_id: str) -> dict[str, Any]:
        raw = await self.r.hgetall(ctx_key(rule_id))
        return {k: _json.decode(v) for k, v in raw.items()}

    async def context_save(self, rule_id: str, changed: dict[str, Any], deleted: Iterable[str]) -> None:
        key = ctx_key(rule_id)
        pipe = self.r.pipeline(transaction=True)
        if changed:
            pipe.hset(key, mapping={k: _dumps(v) for k, v in changed.items()})
        deleted = list(deleted)
        if deleted:
            pipe.hdel(key, *deleted)
        if changed or deleted:
            await pipe.execute()

    # -- policy registry -------------------------------------------------------------------
    async def policy_put(self, name: str, source: str, language: str) -> int:
        key = policy_key(name)
        await self.r.sadd(POLICIES, name)  # the list of names is in another Redis Cluster slot
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(key, "version", 1)
        pipe.hset(key, mapping={"source": source, "language": language, "updated": time.time()})
        version, _ = await pipe.execute()
        await self.r.hset(f"{key}:v{version}", mapping={"source": source, "language": language})
        return int(version)

    async def policy_get(self, name: str, version: int | None = None) -> dict[str, Any] | None:
        key = policy_key(name)
        h = await self.r.hgetall(key)
        if not h:
            return None
        if version is not None and int(h["version"]) != version:
            old = await self.r.hgetall(f"{key}:v{version}")
            if not old:
                return None
            h = {**old, "version": version}
        h["version"] = int(h["version"])
        return h

    async def policy_names(self) -> list[str]:
        return sorted(await self.r.smembers(POLICIES))

    # -- recovery support (event-sourced registry, epoch guard) -----------------------------------
    async def policy_store(self, name: str, version: int, source: str, language: str) -> None:
        """Record registry version ``version`` (already published as ``policy.updated``); the
        head moves only forward, so replays and late writers never roll it back."""
        key = policy_key(name)
        await self.r.hset(f"{key}:v{version}", mapping={"source": source, "language": language})
        await self.r.sadd(POLICIES, name)  # another Redis Cluster slot than the head's
        await self._policy_head(keys=[key], args=[name, str(version), source, language, str(time.time())])

    @property
    def _policy_head(self) -> Any:
        return self.r.register_script(scripts.POLICY_HEAD)

    async def epoch(self) -> str | None:
        """The state epoch: set when Redis holds valid state (fresh system, or after ``blocks
        recover``). Absent = Redis lost its state: workers wait instead of acting on emptiness."""
        return await self.r.get(EPOCH_KEY)

    async def set_epoch(self, value: str, only_if_absent: bool = False) -> bool:
        return bool(await self.r.set(EPOCH_KEY, value, nx=only_if_absent))


def _gather(h: dict[str, str]) -> dict[str, Any]:
    return {
        "expected": _json.decode(h["expected"]) if "expected" in h else [],
        "deadline": float(h.get("deadline", 0)),
        "results": {k[2:]: _json.decode(v) for k, v in h.items() if k.startswith("r:")},
        "decided": h.get("decided"),
        "at": int(h.get("at") or 0),
    }


class _Recorder:
    """Stands in for a pipeline on Redis Cluster: records the queued commands, then runs them in
    order, scripts (``evalsha``) one by one and the commands between them as cluster pipelines."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        def queue(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args, kwargs))

        return queue

    async def run(self, r: Any) -> list[Any]:
        out: list[Any] = []
        pending: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        async def flush() -> None:
            if pending:
                pipe = r.pipeline(transaction=False)
                for name, args, kwargs in pending:
                    getattr(pipe, name)(*args, **kwargs)
                out.extend(await pipe.execute())
                pending.clear()

        for call in self.calls:
            if call[0] == "evalsha":
                await flush()
                out.append(await r.evalsha(*call[1], **call[2]))
            else:
                pending.append(call)
        await flush()
        return out


def _queue_script(pipe: Any, script: Any, keys: list[str], args: list[Any]) -> None:
    """Queue a registered script in a pipeline by its digest (see ``Store._pipeline``)."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def _block(h: dict[str, str]) -> dict[str, Any] | None:
    """A block hash as callers see it: ``ir`` decoded, ``gen``, ``version`` and ``created`` (the
    create's stream sequence) as ints (`blocks get --json` showed ``"created": "11"``)."""
    if not h:
        return None
    out: dict[str, Any] = dict(h)
    if "ir" in out:
        out["ir"] = _json.decode(out["ir"])
    for k in ("gen", "version", "desired", "desired_seq", "created"):
        if k in out:
            out[k] = int(out[k])
    return out


def _strs(fields: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else _dumps(v) for k, v in fields.items()}


def node_view(h: dict[str, str]) -> dict[str, Any]:
    """A node hash -> the dict policies see: capacity, usage, free figures and GPUs."""
    spec = _json.decode(h["spec"])
    gpus = []
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
    view = {
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
    if h.get("vc"):  # its virtual cluster (seed 003, ``state.vcluster``); absent: the primary's
        view["virtualCluster"] = h["vc"]
    if h.get("drain") == "1":
        view["draining"] = True
    return view
