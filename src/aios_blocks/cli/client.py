"""An async client over the bus and the state store: what the CLI and the tests use.

Upstream systems need none of this: publishing a spec to ``aios.block.{bid}.create`` with any NATS
client is the whole API.

Start-up: every command that talks to the servers imports this module, so it imports at the top
only the bus, the store and the schemas; the workers' steps (handlers, policies, recovery) are
imported by the methods that run them (``plan``, ``decisions``, ``scale_to``, ...), not by
``blocks dlq`` or ``blocks watch`` (tests/unit/test_cli_imports.py holds it to that).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.consumer_names import subscribe_ordered
from ..bus.nats_bus import Bus
from ..bus.subjects import uri_digest
from ..schemas.events import (
    ClusterRegistered,
    ComponentRegistered,
    DeleteRequest,
    InventoryHint,
    NodeRegistered,
    PolicyUpdated,
    ReassignRequest,
    ScaleRequest,
    ScaleTarget,
)
from ..schemas.records import JSON, BlockIR, BlockRecord, DecisionRecord, JSONObject, ReplayedDecision
from ..schemas.roles import is_observer
from ..schemas.spec import Cluster, Component, Gpu, Node, check_id, instance_id
from ..state.store import Store

if TYPE_CHECKING:  # (imported where used: see the module's docstring)
    from ..handlers.plan import Invoke, Plan, PlanCall
    from ..policies.runtime import PolicyRuntime
    from ..projections.base import EventDoc
    from ..schemas.topology import GpuTopology

TERMINAL = {"ready": 0, "failed": 3, "rejected": 4}
#: ``Client.outcome`` of a create the parser gave up on (a dead letter, docs/dead-letters.md): failed, exit 3
DEAD_LETTERED = "dead-lettered"
#: how often ``Client.plan`` re-reads a snapshot that changed while it was read
SNAPSHOT_TRIES = 5


class StateChanged(LookupError):
    """``submit --if-index N``: the state index is no longer N (refused: exit 1)."""

    def __init__(self, expected: int, now: int):
        self.expected, self.now = expected, now
        super().__init__(f"state changed since index {expected} (now {now}): run --dry-run again")


@dataclass(frozen=True)
class Request:
    """A command this client published: what to wait for to know how it ended."""

    bid: str
    action: str  # create | scale | reassignment | delete
    seq: int  # the stream sequence of the command (a create's is the block's generation)
    request_id: str = ""
    instance_id: str = ""  # scale / reassignment: the instance it makes

    def outcome(self, kind: str, data: Mapping[str, object]) -> tuple[bool, str] | None:
        """(succeeded, what happened) when the event ``kind`` ends this request, else None."""
        if self.action == "create":
            if kind in TERMINAL and data.get("gen") == self.seq:
                return kind == "ready", kind
            return None
        if self.action == "delete":
            return (True, "deleted") if kind == "deleted" else None
        if kind == f"{self.action}.failed" and data.get("request_id") == self.request_id:
            return False, str(data.get("reason") or f"{self.action} failed")
        if kind == f"instance.{self.instance_id}.added":
            return True, f"instance {self.instance_id} running on {data.get('node_id')} (GPUs {data.get('gpus')})"
        if kind == f"instance.{self.instance_id}.failed":
            return False, f"instance {self.instance_id} failed: {data.get('reason')}"
        return None


@dataclass(frozen=True)
class ScaleTo:
    """A target this client published (``scale_to``): the count asked, the count the block will
    have (clamped to ``[minInstances, maxInstances]``, ``note`` says how) and where it started."""

    bid: str
    request_id: str
    seq: int
    asked: int
    target: int
    note: str = ""
    before: int = 0


def _block_or_all(bid: str) -> str:
    """A block id, or ``*`` for every block (subscriptions only)."""
    return bid if bid == "*" else check_id(bid, "block id")


#: how long a command waits for its first connection to NATS before it says it cannot reach it
CONNECT_WAIT_S = 5.0


class Client:
    def __init__(self, bus: Bus, store: Store):
        self.bus = bus
        self.store = store

    @classmethod
    async def open(cls, nats_url: str, redis_url: str) -> Client:
        """Raises ``ConnectionError`` (``bus.nats_bus.Unreachable``) when NATS does not answer
        within ``CONNECT_WAIT_S``."""
        bus = await Bus.open(nats_url, source="aios-blocks/cli", first_wait_s=CONNECT_WAIT_S)
        # the admin (or your own server's user) also (re)creates the observers' mirror; an observer may not
        await bus.ensure_topology(observe=not is_observer(urlsplit(nats_url.split(",")[0].strip()).username))
        store = Store.open(redis_url)
        try:
            await store.reachable()
        except ConnectionError:
            await bus.close()
            await store.close()
            raise
        if await store.epoch() is None:  # a fresh system starts its state epoch (recovery.rebuild)
            from ..recovery.rebuild import ensure_epoch

            await ensure_epoch(bus, store)
        return cls(bus, store)

    async def close(self) -> None:
        await self.bus.close()
        await self.store.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tasks -----------------------------------------------------------------------------
    async def task(self, bid: str, body: bytes, headers: dict[str, str] | None = None,
                   timeout: float = 60.0) -> tuple[int, bytes, dict[str, str]]:
        return await send_task(self.bus, bid, body, headers, timeout)

    # -- inventory -------------------------------------------------------------------------
    # Every registration is an event first (the stream is the record ``blocks recover`` rebuilds
    # Redis from), then a direct write to Redis so the caller can use it at once. Message ids are
    # unique per call: a re-registration of the same record is a new fact, not a duplicate.
    async def add_component(self, comp: Component | Mapping[str, object]) -> Component:
        comp = comp if isinstance(comp, Component) else Component.model_validate(comp)
        event = ComponentRegistered(comp.componentURI, comp.model_dump(mode="json"))
        await self.bus.emit(E.component_registered, event, msg_id=f"component:{_op_id()}", digest=uri_digest(comp.componentURI))
        await self.store.put_component(comp)
        return comp

    async def add_cluster(self, cluster: Cluster) -> None:
        await self._publish_cluster(cluster)
        await self.store.put_cluster(cluster)
        await self.bus.emit(E.inventory_hint, InventoryHint(cluster.id))

    async def add_node(self, node: Node, cluster_must_exist: bool = False) -> None:
        """Register (or update) a node; ``cluster_must_exist`` (``blocks node add``): a cluster not
        registered is refused (LookupError naming the known ones), not made by the node."""
        await self._unique([node])
        if cluster_must_exist:
            known = sorted(await self.store.clusters())
            if node.cluster not in known:
                raise LookupError(f"no cluster {node.cluster!r} (known: {', '.join(known) or 'none'}); "
                                  f"create it first with `blocks cluster add {node.cluster}`")
        await self._publish_nodes([node])
        await self.store.put_node(node)
        await self.bus.emit(E.inventory_hint, InventoryHint(node.cluster, [node.id]))

    async def add_sim_cluster(
        self, cid: str, nodes: int = 8, gpus: int = 8, gpu_memory: int = 81920, labels: dict[str, str] | None = None,
        model: str = "sim-h100", node_labels: dict[str, str] | None = None, first: int = 0,
        topology: GpuTopology | None = None,
    ) -> None:
        """A simulated cluster: ``nodes`` nodes with ``gpus`` GPUs each (for demos and tests);
        ``node_labels`` on each (e.g. ``nodeType``), numbered from ``first``; ``topology``: each
        node's GPU topology (docs/topology.md)."""
        cluster = Cluster(id=cid, labels=labels or {})
        made = [
            Node(
                id=f"{cid}-n{n}", cluster=cid, labels={"rack": str(n % 4), **(node_labels or {})}, cpu=64, memory=512 * 1024,
                gpus=[Gpu(id=f"{cid}-n{n}-g{g}", model=model, memory=gpu_memory) for g in range(gpus)], topology=topology,
            )
            for n in range(first, first + nodes)
        ]
        await self._unique(made)
        await self._publish_cluster(cluster)
        await self._publish_nodes(made)
        await self.store.put_cluster(cluster)
        for node in made:
            await self.store.put_node(node)
        await self.bus.emit(E.inventory_hint, InventoryHint(cid))

    async def import_nodes(self, cluster: Cluster, nodes: list[Node]) -> bool:
        """Register ``nodes`` (an imported inventory, ``blocks cluster import``) in ``cluster``,
        registering the cluster first unless it exists; simulated nodes (served by the simulated
        fleet) until an agent claims one. Returns whether the cluster is new."""
        await self._unique(nodes)
        new = cluster.id not in await self.store.clusters()
        if new:
            await self._publish_cluster(cluster)
            await self.store.put_cluster(cluster)
        await self._publish_nodes(nodes)
        for node in nodes:
            await self.store.put_node(node)
        await self.bus.emit(E.inventory_hint, InventoryHint(cluster.id))
        return new

    async def _unique(self, nodes: list[Node]) -> None:
        """Refuse (LookupError, exit 1; nothing registered) nodes whose ids another cluster holds: a
        node id is one node everywhere (its subjects, the node index, the stream's fold), so a second
        registration moved it in the stream while Redis kept both (blocks check: a violation)."""
        held = await self.store.node_clusters([n.id for n in nodes])
        taken = sorted(f"{n.id} (in {held[n.id]})" for n in nodes if held.get(n.id, n.cluster) != n.cluster)
        if taken:
            more = f" and {len(taken) - 10} more" if len(taken) > 10 else ""
            raise LookupError(f"node ids are unique across clusters: {', '.join(taken[:10])}{more} already registered "
                              "in another cluster (blocks node remove NID there first, or give other ids)")

    async def _publish_cluster(self, cluster: Cluster) -> None:
        event = ClusterRegistered(cluster.model_dump(mode="json"))
        await self.bus.emit(E.cluster_registered, event, msg_id=f"cluster:{_op_id()}", cid=cluster.id)

    async def _publish_nodes(self, nodes: list[Node]) -> None:
        op = _op_id()
        await self.bus.emit_all(
            Emit(E.node_registered, NodeRegistered(n.model_dump(mode="json")), {"nid": n.id}, qualifier=op) for n in nodes
        )

    async def policy_put(self, name: str, source: str, language: str) -> int:
        """Store a new version of a registry policy: the ``policy.updated`` event (with the source)
        first, then Redis. The message id ``policy:NAME:vN`` makes JetStream's duplicate window a
        compare-and-set on the version: a concurrent writer of the same version retries with N+1."""
        check_id(name, "policy name")
        for _ in range(10):
            current = await self.store.policy_get(name)
            version = (current["version"] if current else 0) + 1
            event = PolicyUpdated(name, version, source, language)
            ack = await self.bus.emit(E.policy_updated, event)
            if not ack.duplicate:
                await self.store.policy_store(name, version, source, language)
                return version
            await asyncio.sleep(0.05)
        raise RuntimeError(f"policy {name}: could not take a new version (concurrent writers)")

    # -- blocks ----------------------------------------------------------------------------
    async def submit(self, spec: Mapping[str, object]) -> str:
        """Publish a block-create event (``spec``: a block spec, open JSON: the parser checks it);
        returns the block id (generated when absent). A given
        ``blockId`` that is not a valid id is refused here: published, it would land on a subject
        the parser never reads (or on several), so nobody would ever reject it."""
        return (await self.create(spec)).bid

    async def create(self, spec: Mapping[str, object], if_index: int | None = None) -> Request:
        """``submit``, returning the request: its ``seq`` is the generation every event answering
        this create carries (``gen``), so waiting on it ignores other creates of the same id.

        ``if_index``: publish only if the state index (``Store.state_index``) is still this value
        right before publishing, else raise :class:`StateChanged`. A check, not a lock: what
        changes after it (between the check and the publish, or before the workers place the
        block) is not covered; the placement then runs on the state it finds."""
        given = spec.get("blockId")
        bid = check_id(given, "blockId") if given is not None else f"blk-{uuid.uuid4().hex[:12]}"
        spec = {**spec, "blockId": bid}
        if if_index is not None:
            now = await self.store.state_index()
            if now != if_index:
                raise StateChanged(if_index, now)
        ack = await self.bus.emit_together(E.block_create, spec, msg_id=f"create:{bid}:{uuid.uuid4().hex}", bid=bid)
        return Request(bid, "create", ack.seq)

    async def state_index(self) -> int:
        return await self.store.state_index()

    async def plan(self, spec: Mapping[str, object], runtime: PolicyRuntime | None = None) -> Plan:
        """``submit --dry-run``: where the block would be placed now, computed here against the
        current state with the workers' own steps (``handlers.plan``), changing nothing.

        The spec is parsed as the parser worker does (component lookup, pinned registry policy
        versions); the inventory snapshot is read between two equal readings of the state index
        (re-read when something changed meanwhile), and the plan carries that index. Policies
        run with their block's current context, loaded into a throwaway copy: what they write is
        dropped, and no decision record is published."""
        from ..handlers import parse
        from ..handlers.plan import Plan, make_plan
        from ..policies.runtime import PolicyRuntime
        from ..settings import load as load_settings
        from ..state.inventory import Inventory, affinity_index
        from ..state.priority import PriorityStore

        given = spec.get("blockId")
        bid = check_id(given, "blockId") if given is not None else f"blk-{uuid.uuid4().hex[:12]}"
        outcome = parse.read(msgspec.json.encode({**spec, "blockId": bid}), load_settings().max_spec_bytes)
        envelope = parse.envelope_errors(outcome)  # a CloudEvent's wrong attributes: listed with the spec's
        if outcome.doc is not None:
            uri = parse.component_uri(outcome.doc)
            component = await self.store.get_component(uri) if uri else None
            versions, unknown = await parse.registry_check(self.store.policy_get, outcome.doc, component,
                                                           has=self.store.policy_has)
            classes = await PriorityStore(self.store.r).classes()
            outcome = parse.build(outcome.doc, component, bid, versions, priority_classes=classes, unknown=unknown)
        outcome = parse.refused(outcome, envelope)
        if outcome.ir is None:
            return Plan(bid, errors=outcome.errors)
        ir = outcome.ir
        for _ in range(SNAPSHOT_TRIES):
            index = await self.store.state_index()
            inventory = Inventory(self.store)
            clusters = await inventory.clusters()
            nodes = {cid: await inventory.nodes(cid) for cid in clusters}
            aff = await affinity_index(self.store, ir)
            if await self.store.state_index() == index:
                break
        else:
            index = -1  # busy: the snapshot may mix states (said in the notes)
        runtime = runtime or PolicyRuntime(lookup=self.store.policy_get)
        calls: list[PlanCall] = []
        plan = await make_plan(
            ir, clusters, nodes, self._dry_invoker(runtime, ir, "clusterAllocator", calls),
            self._dry_invoker(runtime, ir, "resourceAllocator", calls), aff,
        )
        plan.index, plan.calls = index, calls
        if not plan.places:  # the pending queue's forecast (docs/priority.md)
            from .pending import forecast

            plan.notes += await forecast(self.store, ir, sorted(clusters), load_settings().preempt_min_delta)
        if given is None:
            plan.notes.append(f"the spec has no blockId: planned as {bid}; a submit gets another id, and equal GPUs "
                              "are picked by the block id, so give a blockId to get this plan")
        if index < 0:
            plan.notes.append(f"the state kept changing while it was read ({SNAPSHOT_TRIES} tries): no index to submit with")
        return plan

    def _dry_invoker(
        self, runtime: PolicyRuntime, ir: BlockIR, kind: str, calls: list[PlanCall]
    ) -> Invoke:
        """Like ``Worker.invoker`` but read-only: the rule's context is loaded once into a copy
        that the plan's calls share and that is never saved; nothing is recorded on the stream."""
        from ..schemas.errors import PolicyFailed

        rule, rule_id = ir["policies"][kind], f"{ir['blockId']}.{kind}"
        context: JSONObject | None = None  # the rule's context, loaded once (open JSON: the policy's own)

        async def call(input_data: dict[str, Any]) -> Any:
            nonlocal context
            if context is None:
                context = dict(await self.store.context_load(rule_id))
            record: PlanCall = {"kind": kind, "action": str(input_data.get("action", "?")), "uri": rule.get("policyRuleURI", ""),
                      "version": rule.get("version"), "error": ""}
            calls.append(record)
            try:
                return await runtime.invoke(rule, rule_id, input_data, context)
            except PolicyFailed as exc:
                record["error"] = exc.reason
                raise

        return call

    async def outcome(
        self, req: Request, timeout: float = 60.0, on_event: Callable[[str, EventDoc], None] | None = None
    ) -> tuple[bool, str, EventDoc]:
        """Follow the block's events from the request on (nothing older) until one ends it:
        (succeeded, what happened, that event). ``TimeoutError`` after ``timeout`` seconds. A create
        the parser dead-lettered (``DEAD_LETTERED``) ends it too: no event of the block would."""
        async with asyncio.timeout(timeout):
            if req.action != "create":
                return await self._outcome(req, on_event)
            stop = asyncio.Event()
            follow, letter = (asyncio.ensure_future(self._outcome(req, on_event)),
                              asyncio.ensure_future(self._create_letter(req, stop)))
            try:
                done, _ = await asyncio.wait((follow, letter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                # the letter's watch is stopped between its reads, never cancelled inside one (a
                # consumer cancelled while it is made left the command hanging at its exit)
                stop.set()
                follow.cancel()
                await asyncio.gather(follow, letter, return_exceptions=True)
            found = letter.result() if letter in done else None
            return found if found is not None and follow not in done else follow.result()

    async def _create_letter(self, req: Request, stop: asyncio.Event, every: float = 1.0) -> tuple[bool, str, EventDoc] | None:
        """Until the parser's dead letter of this create (its ``stream_seq``: the create's sequence)
        is stored: (False, ``DEAD_LETTERED`` and the letter's ``STREAM:SEQ``, the letter); None once
        ``stop`` is set. It looks every ``every`` seconds, the first time after one (a create the
        parser takes is answered sooner; its letter comes after 5 deliveries)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if stop.is_set():
                return None
            try:
                letters = await self.scan(f"{subjects.ROOT}.dlq.*.{E.block_create.subject(bid=req.bid)}", 0.3)
            except Exception:  # a read that failed (no right to it, a server away): the wait goes on without it
                continue
            for m in letters:
                env = _decode(m.data)
                if event_data(env).get("stream_seq") == req.seq:
                    return False, f"{DEAD_LETTERED} {subjects.STREAM}:{m.metadata.sequence.stream}", env

    async def _outcome(
        self, req: Request, on_event: Callable[[str, EventDoc], None] | None
    ) -> tuple[bool, str, EventDoc]:
        """The block's events from the request on, until one ends it."""
        async for subject, env in self.follow(req.bid, from_seq=req.seq):
            data = event_data(env)
            if on_event and (req.action != "create" or data.get("gen") in (None, req.seq)):
                on_event(subject, env)
            ended = req.outcome(event_kind(subject), data)
            if ended is not None:
                return ended[0], ended[1], env
        raise TimeoutError(req.bid)  # pragma: no cover - follow() only ends by cancellation

    async def wait(
        self, bid: str, timeout: float = 60.0, on_event: Callable[[str, EventDoc], None] | None = None
    ) -> tuple[str, EventDoc]:
        """Follow the block's events from the start of its stream history until a terminal one."""
        async with asyncio.timeout(timeout):
            async for subject, env in self.follow(bid):
                if on_event:
                    on_event(subject, env)
                if event_kind(subject) in TERMINAL:
                    return event_kind(subject), env
        raise TimeoutError(bid)  # pragma: no cover - follow() only ends by cancellation

    async def follow(self, bid: str = "*", from_start: bool = True,
                     from_seq: int | None = None) -> AsyncIterator[tuple[str, EventDoc]]:
        """Live events of one block (or all), through an ordered push consumer: from the start of
        the stream, from ``from_seq`` on, or only new ones (``from_start=False``)."""
        subject = subjects.block_all(_block_or_all(bid))
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def cb(msg: Any) -> None:
            await queue.put(msg)

        if from_seq is not None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq)
        else:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW)
        sub = await _ordered(self.bus, subject, config, cb)
        try:
            while True:
                msg = await queue.get()
                yield msg.subject, _decode(msg.data)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def scan(self, subject: str, idle: float, stream: str = subjects.STREAM) -> list[Any]:
        """Every stored message on ``subject`` of ``stream``, oldest first (ordered push consumer from
        the start; stops when none is pending, when the consumer's info says it has none to deliver,
        or when nothing came for ``idle`` seconds)."""
        out: list[Any] = []
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def cb(msg: Any) -> None:
            await queue.put(msg)

        async def none_stored() -> None:
            """No message to deliver (none pending, none delivered): ends the scan at once, not
            after ``idle`` (a filter nothing matches: most often the side-cars' dead letters, the
            replays of dead letters; recovery.rebuild reads the same way). Any error (a role
            without CONSUMER.INFO on it) leaves it to ``idle``, as before."""
            with contextlib.suppress(Exception):
                ci = await sub.consumer_info()
                if ci.num_pending == 0 and (ci.delivered is None or not ci.delivered.consumer_seq):
                    await queue.put(None)

        sub = await _ordered(self.bus, subject, ConsumerConfig(deliver_policy=DeliverPolicy.ALL), cb, stream)
        counted = asyncio.ensure_future(none_stored())
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout=idle)
                except TimeoutError:
                    break
                if msg is None:
                    break
                out.append(msg)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            counted.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out

    async def history(self, bid: str = "*", idle: float = 0.5) -> list[tuple[str, EventDoc, int]]:
        """Every stored event of a block (or all blocks), oldest first: (subject, event, seq)."""
        scanned = await self.scan(subjects.block_all(_block_or_all(bid)), idle)
        return [(m.subject, _decode(m.data), m.metadata.sequence.stream) for m in scanned]

    async def timeline(self, bid: str = "*", idle: float = 0.5) -> list[tuple[str, EventDoc, int, str]]:
        """``history`` with the time the stream stored each message (ISO 8601, UTC): what an event
        without a ``time`` of its own (a bare create, as any NATS client may publish it) is shown at.
        The block's dead letters (a worker gave up on one of its messages: ``aios.dlq.{consumer}.``
        + its subject) come in their place in the stream: without them a create dead-lettered, then
        replayed once its cause was fixed, showed only a gap between its ``submitted`` and ``parsed``."""
        scanned = await self.scan(subjects.block_all(_block_or_all(bid)), idle)
        letters = await self.scan(f"{subjects.ROOT}.dlq.*.{subjects.block_all(_block_or_all(bid))}", idle)
        merged = sorted([*scanned, *letters], key=lambda m: m.metadata.sequence.stream)
        return [(m.subject, _decode(m.data), m.metadata.sequence.stream, _stored_at(m)) for m in merged]

    async def dead_letters(self, idle: float = 0.5) -> list[tuple[str, int, str, str, EventDoc]]:
        """Every stored dead letter, oldest first in each stream: (stream, seq, stored at, subject,
        event). The workers' are in ``AIOS`` (``aios.dlq.>``); the side-cars' outputs in
        ``AIOS_OUTPUTS`` (``output.dlq``: users' data, docs/security.md), with any an older version
        left in ``AIOS`` under ``aios.dlq.sidecar-…``."""
        out: list[tuple[str, int, str, str, EventDoc]] = []
        for stream, filter_ in ((subjects.STREAM, subjects.DLQ_ALL), (subjects.STREAM_OUTPUTS, E.output_dead_letter.filter())):
            try:
                scanned = await self.scan(filter_, idle, stream)
            except NotFoundError:  # a stream of an older version without the subject
                scanned = []
            out += [(stream, m.metadata.sequence.stream, _stored_at(m), m.subject, _decode(m.data)) for m in scanned]
        return out

    async def stream(self) -> list[tuple[str, bytes, int, float]]:
        """Every stored message, oldest first: (subject, body, sequence, timestamp)."""
        from ..recovery.rebuild import read_stream

        out: list[tuple[str, bytes, int, float]] = []
        await read_stream(self.bus, lambda s, b, q, t: out.append((s, b, q, t)))
        return out

    async def decisions(self, since: float | None = None, idle: float = 0.5, bid: str = "*") -> list[ReplayedDecision]:
        """Recorded policy decisions of one block or all (oldest first), each with its input rebuilt
        by replay (``recovery.inputs``): ``input`` (None unless rebuilt or recorded) and
        ``input_check``: ``rebuilt`` (its digest is the recorded one), ``recorded`` (an older
        record that held its input), ``mismatch`` or ``unsupported`` (not rebuilt)."""
        from ..recovery import inputs

        only = None if _block_or_all(bid) == "*" else bid
        steps = await inputs.rebuild(await self.stream(), only)
        out: list[ReplayedDecision] = []
        for step in steps:
            if since is not None and step.ts < since:
                continue
            for c in step.calls:
                d: ReplayedDecision = {**DECISION_DEFAULTS, **c.decision}
                d["input"] = c.input if c.status in ("rebuilt", "recorded") else None
                d["input_check"] = c.status
                d["state_seq"] = c.state_seq
                out.append(d)
        return out

    async def scale(self, bid: str) -> str:
        return (await self.scale_request(bid)).request_id

    async def scale_request(self, bid: str) -> Request:
        """One more instance (action ``scale``); the request says which instance it makes."""
        block = await self._live_block(bid)
        rid = uuid.uuid4().hex[:12]
        req = ScaleRequest(bid, block["cluster"], rid, gen=int(block["gen"]))
        ack = await self.bus.emit_together(E.cluster_scale, req)
        return Request(bid, "scale", ack.seq, rid, instance_id(bid, rid))

    async def scale_to(self, bid: str, target: int, reason: str = "", source: str = "cli") -> ScaleTo:
        """Set the block's desired instance count (``block.scale.target``); the controller clamps
        it to ``[minInstances, maxInstances]`` and reaches it with scale-ups and scale-downs."""
        from ..handlers import scaling

        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"target must be a count of instances >= 0, got {target!r}")
        block = await self._live_block(bid)
        ir = block["ir"]
        clamped, note = scaling.clamp(target, int(ir["minInstances"]), int(ir["maxInstances"]))
        before = scaling.running(await self.store.instances(bid))
        rid = uuid.uuid4().hex[:12]
        ack = await self.bus.emit(E.block_scale_target, ScaleTarget(bid, rid, target, reason, source, gen=int(block["gen"])))
        return ScaleTo(bid, rid, ack.seq, target, clamped, note, before)

    async def wait_scaled(
        self, req: ScaleTo, timeout: float = 120.0, on_progress: Callable[[int, int, int], None] | None = None,
        poll_s: float = 0.25,
    ) -> tuple[bool, str]:
        """Wait until the controller holds this target and the block runs exactly ``req.target``
        instances and has no other (none starting, none being removed): (True, summary); (False, why) when a step of this target
        failed (a policy error, a later target superseded it, the block went away).
        ``on_progress(running, starting, removing)`` is called when the counts change.
        ``TimeoutError`` after ``timeout`` seconds."""
        failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def watch_failures() -> None:
            async for subject, env in self.follow(req.bid, from_seq=req.seq):
                data = event_data(env)
                kind = event_kind(subject)
                rid = str(data.get("request_id", ""))
                if kind.endswith(".failed") and (rid == req.request_id or rid.startswith(req.request_id + ":")):
                    failed.set_result(f"{data.get('step', kind)}: {data.get('reason', '')}")
                    return
                if kind in ("deleted", "failed") and not failed.done():
                    failed.set_result(f"block {kind}")
                    return

        watcher = asyncio.create_task(watch_failures())
        last: tuple[int, int, int] | None = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if failed.done():
                        return False, failed.result()
                    block, insts = await self.store.block_view(req.bid)
                    held = int((block or {}).get("desired_seq") or 0)
                    if held > req.seq:
                        return False, f"superseded by a later target ({(block or {}).get('desired')}, {(block or {}).get('desired_reason')})"
                    counts = tuple(sum(1 for r in insts.values() if r.get("status") == s) for s in ("running", "starting", "removing"))
                    if counts != last:
                        last = counts  # type: ignore[assignment]
                        if on_progress:
                            on_progress(*counts)
                    if held == req.seq and counts[0] == req.target and len(insts) == req.target:
                        return True, f"{req.bid} runs {req.target} instance(s)"
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(failed), poll_s)
        finally:
            # a watcher cancelled while it still sets up its stream subscription may not end at
            # once (the target was already met at the first look): never wait on it for long
            watcher.cancel()
            await asyncio.wait({watcher}, timeout=2)

    async def reassign(self, bid: str, iid: str, reason: str = "requested") -> str:
        return (await self.reassign_request(bid, iid, reason)).request_id

    async def reassign_request(self, bid: str, iid: str, reason: str = "requested") -> Request:
        check_id(iid, "instance id")
        block = await self._live_block(bid)
        if iid not in await self.store.instances(bid):
            raise LookupError(f"block {bid!r} has no instance {iid!r}")
        rid = uuid.uuid4().hex[:12]
        req = ReassignRequest(bid, block["cluster"], rid, iid, reason, gen=int(block["gen"]))
        ack = await self.bus.emit(E.cluster_reassignment, req)
        return Request(bid, "reassignment", ack.seq, rid, instance_id(bid, rid))

    async def delete(self, bid: str) -> Request:
        check_id(bid, "block id")
        block = await self.store.get_block(bid)
        if block is None:
            raise LookupError(f"no block {bid!r}")
        if block.get("status") == "deleted":  # (a delete under way may be asked again: it waits for the same end)
            raise LookupError(f"block {bid!r} is already deleted")
        rid = uuid.uuid4().hex[:12]
        ack = await self.bus.emit(E.block_delete, DeleteRequest(bid, rid))
        return Request(bid, "delete", ack.seq, rid)

    async def _live_block(self, bid: str) -> BlockRecord:
        check_id(bid, "block id")
        block = await self.store.get_block(bid)
        if block is None:
            raise LookupError(f"no block {bid!r}")
        if not block.get("cluster") or block["status"] not in ("ready", "placing"):
            raise LookupError(f"block {bid!r} is {block['status']}: it must be placed first")
        return block


async def _ordered(bus: Bus, subject: str, config: ConsumerConfig, cb: Any, stream: str = subjects.STREAM) -> Any:
    """An ordered consumer on ``stream`` (``AIOS``; the side-cars' dead letters: ``AIOS_OUTPUTS``)
    with a name of its own: an observer may create only consumers named after its user, taken
    race-free (``bus.consumer_names``, docs/security.md)."""
    return (await subscribe_ordered(bus.nc, bus.js, subject, stream, "cli", config, cb=cb))[1]


def _op_id() -> str:
    return uuid.uuid4().hex[:16]


def event_data(env: EventDoc) -> JSONObject:
    """An envelope's ``data`` where it is an object, else ``{}`` (a forged or foreign event)."""
    data = env.get("data")
    return data if isinstance(data, dict) else {}


def event_kind(subject: str) -> str:
    """``aios.block.B.dry_run.result`` -> ``dry_run.result``: from the catalog (``projections.lines``)."""
    from ..projections.lines import kind_of

    return kind_of(subject)


def _stored_at(msg: Any) -> str:
    """When the stream stored ``msg`` (ISO 8601, UTC, milliseconds, ``Z``)."""
    return str(msg.metadata.timestamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"))


def _decode(raw: bytes) -> EventDoc:
    try:
        doc: JSON = msgspec.json.decode(raw)
        return cast("EventDoc", doc) if isinstance(doc, dict) else {"data": doc}  # (an envelope's fields, or a foreign object)
    except msgspec.DecodeError:
        return {"data": raw.decode("utf-8", errors="replace")}


#: a decision record's fields left out of the JSON when empty (``Decision`` omits defaults)
DECISION_DEFAULTS: DecisionRecord = {"output": None, "error": "", "duration_us": 0, "logs": [], "at": 0, "given": {},
                                     "output_digest": ""}


def decisions_of(subject: str, data: Any) -> list[DecisionRecord]:
    """The policy decisions an event records: a step event's folded ``decisions``, or a
    ``decision`` event itself (a step redone later, or a stream written by an older version),
    with the fields left out when empty filled in."""
    if not isinstance(data, dict):
        return []
    if subject.endswith(".decision"):
        return [_filled(data)]
    out = []
    if isinstance(data.get("answers"), list):  # a post_dry_run: its dry_run answers' decisions first
        for a in data["answers"]:
            out += decisions_of(subject, a) if isinstance(a, dict) else []
    found = data.get("decisions")
    return out + ([_filled(d) for d in found if isinstance(d, dict)] if isinstance(found, list) else [])


def _filled(stored: Mapping[str, object]) -> DecisionRecord:
    """A stored decision (``schemas.events.Decision`` as JSON) with its empty fields filled in."""
    return cast(DecisionRecord, {**DECISION_DEFAULTS, **stored})


#: how long a task waits for an executor to subscribe (one that is starting: a task sent right after
#: `blocks up` was started) before it is answered 503 "no executor is running"
NO_EXECUTOR_WAIT_S = 10.0


async def send_task(bus: Bus, bid: str, body: bytes, headers: dict[str, str] | None = None,
                    timeout: float = 60.0, no_executor_wait_s: float = NO_EXECUTOR_WAIT_S,
                    on_no_executor: Callable[[], None] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """One task to a block through an executor (NATS request/reply): (status, body, headers).
    Needs NATS only (the ``upstream`` role can send it). Raises TimeoutError when no answer comes.
    While no executor listens (NATS answers "no responders" at once) it is asked again, for up to
    ``no_executor_wait_s`` (at most ``timeout``); ``on_no_executor`` is called at each such answer."""
    import nats.errors

    loop = asyncio.get_running_loop()
    start = loop.time()
    give_up, pause = start + min(timeout, no_executor_wait_s), 0.05
    while True:
        try:
            msg = await bus.request(E.block_task, body, headers or {}, max(timeout - (loop.time() - start), 0.001), bid=bid)
            break
        except nats.errors.NoRespondersError:
            if on_no_executor is not None:
                on_no_executor()
            if loop.time() + pause > give_up:
                waited = f" for {loop.time() - start:.0f} s" if loop.time() - start >= 1 else ""
                return 503, b"", {"Aios-Error": f"no executor is running (no responder on the block's task subject{waited})"}
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no answer from block {bid} within {timeout:g} s")
    h = dict(msg.headers or {})
    try:
        status = int(h.get("Aios-Status", "200"))
    except ValueError:
        status = 502
    return status, bytes(msg.data), h
