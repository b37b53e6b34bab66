"""The door to Redis: current state of components, clusters, nodes, blocks, instances and gathers.

Every key is built by ``state.keys`` (the key layout is documented there). ``Store`` is one class
put together by concern: blocks and instances here, clusters and nodes in ``state.nodes``,
gathers, contexts and the affinity index in ``state.gathers``, the policy registry and the epoch
in ``state.registry``; the record shapes in ``state.records``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..schemas.lifecycle import REUSABLE, TRANSITIONS, Step
from ..schemas.records import (
    JSON,
    BlockRecord,
    InstanceRecord,
    JobClusterRecord,
    JSONObject,
    LaunchRecord,
    Needs,
    PolicyRule,
)
from ..schemas.spec import Component
from ..settings import Settings
from ..settings import current as current_settings
from . import scripts
from .autoscale import AutoscaleStore
from .connection import is_cluster_client, open_redis, ping
from .gathers import GatherRecords
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
    PRIORITY_CLASSES,
    SUSPECT,
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
from .nodes import NodeRecords, node_view, reserve_keys  # noqa: F401  (node_view re-exported: callers import it from here)
from .queue import NOMINATED
from .records import _block, _dumps, _strs
from .registry import PolicyRecords

_json = msgspec.json


class Records(Mapping[str, InstanceRecord]):
    """A block's instance records as a script returned them (id, JSON, id, JSON, ...), decoded
    when first read: most callers want one record, or none of them."""

    def __init__(self, flat: list[Any]):
        self._flat = flat
        self._all: dict[str, InstanceRecord] | None = None

    def one(self, iid: str) -> InstanceRecord | None:
        if self._all is not None:
            return self._all.get(iid)
        flat = self._flat
        for i in range(0, len(flat), 2):
            if flat[i] == iid:
                return _json.decode(flat[i + 1])
        return None

    def _decoded(self) -> dict[str, InstanceRecord]:
        if self._all is None:
            flat = self._flat
            self._all = {flat[i]: _json.decode(flat[i + 1]) for i in range(0, len(flat), 2)}
        return self._all

    def __getitem__(self, iid: str) -> InstanceRecord:
        return self._decoded()[iid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._flat) // 2


class ComponentRecord(TypedDict, total=False):
    """A registered component as stored (``schemas.spec.Component`` as JSON; ``Store.components``)."""

    componentURI: str
    image: str
    componentInitData: JSONObject
    componentInitSettings: JSONObject
    componentParameters: JSONObject
    componentMetadata: JSONObject
    componentInputProtocol: JSONObject
    componentOutputProtocol: JSONObject
    tags: list[str]
    resources: Needs
    policies: list[PolicyRule]
    launch: LaunchRecord
    affinity: list[JSON] | None
    virtualClusterId: str | None
    jobCluster: JobClusterRecord | None
    sidecars: list[JSONObject]
    outputs: bool


class StoreUnreachable(ConnectionError):
    """Redis did not answer (``Store.reachable``)."""


class Store(NodeRecords, GatherRecords, PolicyRecords):
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
        self._set_status_ready = r.register_script(scripts.SET_STATUS_THEN_READY)
        self._set_desired = r.register_script(scripts.SET_DESIRED)
        self._drain = r.register_script(scripts.DRAIN_INSTANCE)
        self._add_instances = r.register_script(scripts.ADD_INSTANCES)
        self._reserve_start = r.register_script(scripts.RESERVE_THEN_START)
        self._lease = r.register_script(scripts.LEASE)
        self._lease_release = r.register_script(scripts.LEASE_RELEASE)
        self._scripts = (self._reserve, self._release, self._transition, self._create, self._gather_add,
                         self._gather_settle, self._health_cas, self._claim_due, self._set_status, self._set_desired, self._drain,
                         self._add_instances, self._set_status_ready, self._reserve_start)

    @classmethod
    def open(cls, url: str, max_connections: int | None = None, settings: Settings | None = None) -> Store:
        """One server (``redis://``) or a Redis Cluster (``redis+cluster://``): ``state.connection``."""
        return cls(open_redis(url, settings or current_settings(), max_connections))

    @property
    def one_server(self) -> bool:
        """Whether the state is on one Redis server (not a Redis Cluster: ``is_cluster_client``),
        where a script may take keys of any slot (``set_status_then_ready``'s two)."""
        return not is_cluster_client(self.r)

    async def close(self) -> None:
        await self.r.aclose()

    async def reachable(self) -> None:
        """Raise :class:`StoreUnreachable` (a ``ConnectionError``) when Redis does not answer a
        PING: a command line tool says so in one line instead of a redis-py traceback. A Redis
        Cluster in a primary's failover is waited for (``connection.ping``: bounded)."""
        try:
            await ping(self.r)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreUnreachable(f"cannot connect to Redis: {exc}") from exc

    # -- components ------------------------------------------------------------------------
    async def put_component(self, comp: Component) -> None:
        await self.r.set(component_key(comp.componentURI), comp.model_dump_json())

    async def get_component(self, uri: str) -> JSONObject | None:
        raw = await self.r.get(component_key(uri))
        return _json.decode(raw) if raw else None

    async def components(self) -> dict[str, ComponentRecord]:
        """Every registered component by URI (a SCAN: for listing, not for hot paths)."""
        keys = sorted([k async for k in self.r.scan_iter(match=component_key("*"), count=1000)])
        pipe = self.r.pipeline(transaction=False)  # not MGET: on Redis Cluster the keys are in many slots
        for k in keys:
            pipe.get(k)
        values = await pipe.execute() if keys else []
        return {k.split(":", 2)[2]: _json.decode(v) for k, v in zip(keys, values, strict=True) if v}

    # -- blocks ----------------------------------------------------------------------------
    async def create_block(self, bid: str, gen: int, digest: str, fields: Mapping[str, object]) -> tuple[bool, str]:
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
        ok, info = await self._transition(keys=[block_key(bid)], args=transition_args(gen, step, in_round, fields))
        return bool(ok), str(info)

    async def mark_then_transition(self, mark: Mark, bid: str, gen: int | None, step: Step) -> tuple[bool, str]:
        """``mark`` (a hash field: the step's announcement) written, then :meth:`transition` by
        ``step``, in that order: one exchange on one server (a pipeline, so no task or gathered
        call per write), the mark first on a Redis Cluster (``_pipeline``: a script goes alone)."""
        args = transition_args(gen, step, None, {})
        _, (ok, info) = await self._pipeline(lambda pipe: _then_script(pipe, mark, self._transition, [block_key(bid)], args))
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

    async def get_block(self, bid: str) -> BlockRecord | None:
        return _block(await self.r.hgetall(block_key(bid)))

    async def allocation_reads(self, bid: str, cid: str, first: str, suspects: bool
                               ) -> tuple[BlockRecord | None, dict[str, str] | None, Any, Any]:
        """An allocation step's first reads as one pipeline (one exchange, no task per read): the
        block's record, instance ``first``'s reservation in cluster ``cid`` (None: none), the
        nominations' hash as read and, with ``suspects``, the suspect marks' hash (None without;
        its read's exception if that read alone failed: the caller goes on without them). A
        failed read of the first three raises."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(res_key(cid, first))
        pipe.hgetall(NOMINATED)
        if suspects:
            pipe.hgetall(SUSPECT)
        got = list(await pipe.execute(raise_on_error=False))
        for x in got[:3]:
            if isinstance(x, Exception):
                raise x
        return _block(got[0]), got[1] or None, got[2], got[3] if suspects else None

    async def parse_reads(self, uri: str | None, policies: Sequence[str], pins: Sequence[tuple[str, int]] = ()
                          ) -> tuple[Any, Any, list[Any], list[bool]]:
        """A create's reads before its parse as one pipeline (one exchange, no task per read): the
        component's stored record (None without ``uri``), the priority classes' hash, each
        registry policy's hash, as read, and whether each pinned (name, version) is stored
        (``policy_has``)."""
        pipe = self.r.pipeline(transaction=False)
        if uri:
            pipe.get(component_key(uri))
        pipe.hgetall(PRIORITY_CLASSES)
        for name in policies:
            pipe.hgetall(policy_key(name))
        for name, version in pins:
            pipe.exists(policy_version_key(name, version))
        got = list(await pipe.execute())
        raw = got.pop(0) if uri else None
        n = 1 + len(policies)
        return raw, got[0], got[1:n], [bool(x) for x in got[n:]]

    async def block_gen_and_ir(self, bid: str) -> tuple[Any, Any]:
        """A block record's ``gen`` and ``ir`` fields as stored (None where absent), not the whole
        record: what the tenant relay needs of a block it relays an event of (its owner)."""
        gen, ir = await self.r.hmget(block_key(bid), ["gen", "ir"])
        return gen, ir

    async def block_view(self, bid: str) -> tuple[BlockRecord | None, dict[str, InstanceRecord]]:
        """The block record and its instances, in one round trip (two slots: not one snapshot,
        as two reads are not)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(inst_key(bid))
        block, insts = await pipe.execute()
        return _block(block), {iid: _json.decode(v) for iid, v in insts.items()}

    async def list_blocks(self, limit: int = 1000) -> list[str]:
        return await self.r.zrevrange(BLOCKS, 0, limit - 1)

    async def blocks_at_zero(self, match: Callable[[BlockRecord], bool], limit: int = 1_000_000) -> list[str]:
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
    async def put_instances(self, bid: str, instances: Mapping[str, InstanceRecord]) -> None:
        """Record new instances. One already recorded keeps its record: a redelivered placement
        must not turn a running (or removing) instance back into a starting one."""
        if instances:
            pipe = self.r.pipeline(transaction=False)
            for iid, v in instances.items():
                pipe.hsetnx(inst_key(bid), iid, _dumps(v))
                pipe.hset(node_inst_key(v["node"]), iid, bid)
            await pipe.execute()

    async def start_instances(
        self, bid: str, instances: Mapping[str, InstanceRecord], index: list[tuple[str, str, str, str, str]],
        transition: tuple[int, Step, Mapping[str, object]] | None = None, limit: int | None = None,
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

    async def reserve_then_start(
        self, cid: str, placements: Sequence[Mapping[str, object]], bid: str, instances: Mapping[str, InstanceRecord],
        index: list[tuple[str, str, str, str, str]], transition: tuple[int, Step, Mapping[str, object]] | None,
        drop_nomination: bool,
    ) -> tuple[bool, str, str, bool]:
        """:meth:`reserve_gang` and, only if it reserved, :meth:`start_instances` (no limit) and,
        with ``drop_nomination``, the block's nomination dropped (``Nominations.drop``), as one
        script (``scripts.RESERVE_THEN_START``: one server only, its keys are in many Redis Cluster
        slots). (the reservation's ok, reason and node, whether a nomination was dropped); a refused
        reservation wrote nothing."""
        keys = [*reserve_keys(cid, placements), block_key(bid), inst_key(bid), AFF_LEASE, NOMINATED]
        args: list[Any] = [_dumps(placements), bid, "1" if drop_nomination else ""]
        if transition is not None:
            gen, step, fields = transition
            rule = TRANSITIONS[step]  # as start_instances sends it
            args += [str(gen), rule.allowed(), rule.target.value, _dumps(_strs({**fields, "updated": time.time()}))]
        else:
            args += ["", "", "", ""]
        args.append(str(len(instances)))
        for iid, v in instances.items():
            args += [iid, _dumps(v)]
            keys.append(node_inst_key(v["node"]))
        for svc, lease, iid, node, rack in index:
            args += [lease, iid, node, _dumps([node, rack])]
            keys.append(aff_svc_key(svc))
        got = await self._reserve_start(keys=keys, args=args)
        return bool(got[0]), str(got[1]), str(got[2]), bool(got[3]) if len(got) > 3 else False

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

    async def set_instance_status(self, bid: str, iid: str, status: str, endpoint: str | None = None) -> InstanceRecord | None:
        """Set one instance's status (and its ``endpoint`` when given); its record after the change
        (None: not recorded)."""
        return (await self.set_instance_status_all(bid, iid, status, endpoint))[0]

    async def set_instance_status_all(
        self, bid: str, iid: str, status: str, endpoint: str | None = None
    ) -> tuple[InstanceRecord | None, Mapping[str, InstanceRecord]]:
        """Set one instance's status and, when given, its ``endpoint`` (one atomic script); (its
        record, every instance of the block right after the write, decoded when first read), or
        (None, {}) when the instance is not recorded."""
        args = [iid, status] + ([_dumps(endpoint)] if endpoint else [])
        flat = await self._set_status(keys=[inst_key(bid)], args=args)
        if not flat:
            return None, {}
        insts = Records(flat)
        return insts.one(iid), insts

    async def set_status_then_ready(
        self, bid: str, iid: str, status: str, endpoint: str | None, min_instances: int, expected: list[str], gen: int,
        step: Step, mark: Mark | None = None,
    ) -> tuple[InstanceRecord | None, Mapping[str, InstanceRecord], tuple[bool, str] | None]:
        """:meth:`set_instance_status_all` and, when then at least ``min_instances`` run and the
        block's instances are exactly ``expected``, :meth:`transition` by ``step``, as one script
        (``scripts.SET_STATUS_THEN_READY``: one server only, its two keys are two Redis Cluster
        slots; ``one_server``). ``mark``: a hash field written first, in the same exchange (the
        step's announcement). (the instance's record, every record after the write, the
        transition's (done, version or blocking status) or None when it was not tried); (None, {},
        None) when the instance is not recorded."""
        args = [iid, status, _dumps(endpoint) if endpoint else "", str(int(min_instances)), ",".join(sorted(expected)),
                *transition_args(gen, step, None, {})]
        keys = [inst_key(bid), block_key(bid)]
        if mark is None:
            got = await self._set_status_ready(keys=keys, args=args)
        else:
            got = (await self._pipeline(lambda pipe: _then_script(pipe, mark, self._set_status_ready, keys, args)))[1]
        if not got:
            return None, {}, None
        insts = Records(got[0])
        return insts.one(iid), insts, ((bool(got[1]), str(got[2])) if len(got) > 1 else None)

    async def block_and_instances(self, bid: str) -> tuple[BlockRecord | None, Records]:
        """The block record and its instance records (decoded when first read), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(inst_key(bid))
        block, flat = await pipe.execute()
        return _block(block), Records([x for kv in flat.items() for x in kv])

    async def instances(self, bid: str) -> dict[str, InstanceRecord]:
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
    async def node_instances(self, nid: str) -> dict[str, InstanceRecord]:
        """Instances recorded on node ``nid``: iid -> {block_id, gen, status, ...record}."""
        index = await self.r.hgetall(node_inst_key(nid))
        if not index:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for iid, bid in index.items():
            pipe.hget(inst_key(bid), iid)
            pipe.hget(block_key(bid), "gen")
        raw = await pipe.execute()
        out: dict[str, InstanceRecord] = {}
        for n, (iid, bid) in enumerate(index.items()):
            rec, gen = raw[2 * n], raw[2 * n + 1]
            if rec is None:
                continue
            d: InstanceRecord = _json.decode(rec)
            if d.get("node") != nid:
                continue
            out[iid] = {**d, "block_id": bid, "gen": int(gen or 0)}
        return out

    async def block_bump(self, bid: str, field: str) -> int:
        """Count something about a block (e.g. instance replacements); returns the new count."""
        return int(await self.r.hincrby(block_key(bid), field, 1))

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


def transition_args(gen: int | None, step: Step, in_round: int | None, fields: dict[str, Any]) -> list[str]:
    """``scripts.TRANSITION``'s arguments for one lifecycle step (``Store.transition``)."""
    rule = TRANSITIONS[step]
    fields["updated"] = time.time()
    args = ["" if gen is None else str(gen), rule.allowed(), rule.target.value, _dumps(_strs(fields))]
    if in_round is not None:
        args.append(str(in_round))
    return args


#: a hash field written before a step, in its exchange: (key, field, value) (``workers.announce.entry``)
Mark = tuple[str, str, str]


def _then_script(pipe: Any, mark: Mark, script: Any, keys: list[str], args: list[Any]) -> None:
    """``mark``'s HSET, then ``script``: queued in that order (``Store._pipeline``)."""
    pipe.hset(mark[0], mark[1], mark[2])
    _queue_script(pipe, script, keys, args)


def _queue_script(pipe: Any, script: Any, keys: list[str], args: list[Any]) -> None:
    """Queue a registered script in a pipeline by its digest (see ``Store._pipeline``)."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)
