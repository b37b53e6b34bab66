"""An in-memory system for fast wiring tests (FastStream's ``TestNatsBroker`` idea): the real
workers' routers and handlers, the real ``Store`` and its Lua scripts (on ``fakeredis``), and an
in-memory bus that keeps the stream, deduplicates by message id like JetStream's window and
delivers each stored event to every consumer whose filters take it. A block goes from create to
ready in milliseconds, with no server.

Integration tests stay on real servers for what only they can show (acks, redelivery after a
crash, dead letters, SIGKILL, ordering under load); this is for the wiring: which handler takes
which event, what it publishes, what state it leaves.

    async with MemorySystem.open() as sys:
        await sys.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await sys.submit({"blockComponentURI": "aios://x", "minInstances": 1})
        await sys.run()
        assert (await sys.store.get_block(bid))["status"] == "ready"
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .bus import subjects
from .bus.catalog import Body, E, Emit, Event
from .bus.runner import Defer, Delivery, Poison
from .bus.subjects import ConsumerSpec, matches
from .policies.runtime import PolicyRuntime
from .schemas.events import envelope
from .schemas.spec import Cluster, Component, Gpu, Node
from .settings import Settings
from .state.inventory import Inventory
from .state.store import EPOCH_KEY, Store
from .workers import gateway

Handler = Callable[[Delivery], Awaitable[None]]


@dataclass
class Ack:
    """What ``js.publish`` answers: the stream sequence, and whether it was a duplicate."""

    seq: int
    duplicate: bool = False
    stream: str = subjects.STREAM


@dataclass
class Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    event: Event[Any] | None


@dataclass
class MemoryBus:
    """The ``Bus`` surface the workers use, in memory."""

    source: str = "aios-blocks://memory/test"
    stream: list[Stored] = field(default_factory=list)
    core: list[tuple[str, bytes]] = field(default_factory=list)
    _ids: dict[str, int] = field(default_factory=dict)
    _subs: list[tuple[str, Callable[[Any], Awaitable[None]]]] = field(default_factory=list)
    #: stream sequences not yet delivered to the consumers
    pending: deque[int] = field(default_factory=deque)
    #: queries (events not stored, ``ConsumerSpec.core_filters``) not yet taken by a consumer
    queries: deque[tuple[str, bytes]] = field(default_factory=deque)
    #: (stream, durable) of every consumer deleted (side-cars' when their block goes)
    deleted_consumers: list[tuple[str, str]] = field(default_factory=list)

    async def delete_consumer(self, stream: str, durable: str) -> bool:
        self.deleted_consumers.append((stream, durable))
        return True

    async def emit(self, event: Event[Any], payload: Any, *, qualifier: str = "", msg_id: str | None = None,
                   headers: dict[str, str] | None = None, sync: bool = False, **tokens: str) -> Any:
        return await self._emit(Emit(event, payload, tokens, qualifier, msg_id, tuple((headers or {}).items())))

    async def emit_all(self, effects: Iterable[Emit]) -> list[Any]:
        return [a for a in [await self._emit(e) for e in effects] if a is not None]

    async def emit_together(self, event: Event[Any], payload: Any, *, msg_id: str | None = None, **tokens: str) -> Any:
        return await self._emit(Emit(event, payload, tokens, "", msg_id, ()))

    async def after_commit(self, effect: Callable[[], Awaitable[object]]) -> None:
        await effect()  # what was emitted before it is stored already

    async def _emit(self, e: Emit) -> Ack | None:
        subject = e.subject()
        if e.event.body is Body.CORE or not e.event.stored:
            if e.event.body is Body.CORE:
                body = msgspec.json.encode(e.payload)
            else:  # a query: a CloudEvent over core NATS, taken by a consumer's queue group
                body = envelope(e.logical_id(), self.source, e.event.type, subject, e.payload)
                self.queries.append((subject, body))
            self.core.append((subject, body))
            await self._core(subject, body)
            return None
        mid = e.logical_id()
        if mid in self._ids:
            return Ack(self._ids[mid], duplicate=True)
        if e.event.body is Body.RAW:
            data = e.payload if isinstance(e.payload, bytes) else msgspec.json.encode(e.payload)
        else:
            data = envelope(mid, self.source, e.event.type, subject, e.payload)
        seq = len(self.stream) + 1
        self._ids[mid] = seq
        self.stream.append(Stored(seq, subject, data, {"Nats-Msg-Id": mid, **dict(e.headers)}, e.event))
        self.pending.append(seq)
        return Ack(seq)

    async def _core(self, subject: str, body: bytes) -> None:
        for pattern, cb in self._subs:
            if matches(pattern, subject):
                await cb(_CoreMsg(subject, body))

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        self._subs.append((subject, cb))
        return None

    async def close(self) -> None:
        return None

    def events(self, event: Event[Any], **tokens: str) -> list[Any]:
        """The stored payloads of one catalog event (decoded), oldest first."""
        out = []
        for s in self.stream:
            if s.event is event and all(event.match(s.subject) and event.match(s.subject).get(k) == v for k, v in tokens.items()):  # type: ignore[union-attr]
                out.append(msgspec.json.decode(s.data)["data"] if event.body is Body.CLOUDEVENT else s.data)
        return out


@dataclass
class _CoreMsg:
    subject: str
    data: bytes
    reply: str = ""


@dataclass
class MemorySystem:
    """The parser, gateway, controller, lifecycle and simulated fleet consumers on one in-memory
    bus and one fakeredis-backed store."""

    bus: MemoryBus
    store: Store
    worker: Any
    bindings: list[tuple[ConsumerSpec, Handler]]
    deliveries: dict[tuple[str, int], int] = field(default_factory=dict)
    #: (due, consumer, seq) of deferred deliveries
    delayed: list[tuple[float, str, int]] = field(default_factory=list)
    dead: list[tuple[str, int, str]] = field(default_factory=list)
    #: every query taken (a delivery of one names it by ``-(its index + 1)``)
    query_log: list[tuple[str, bytes]] = field(default_factory=list)

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings | None = None) -> AsyncIterator[MemorySystem]:
        import fakeredis

        from .agent import fleet
        from .workers import controller, gateway, parser, vcluster
        from .workers.base import Worker

        s = settings or Settings(sim_start_delay_s=0.0, dry_run_deadline_s=5.0)
        if "sim_serve" not in s.model_fields_set:  # wiring tests: simulated instances open no sockets
            s = s.model_copy(update={"sim_serve": False})
        store = Store(fakeredis.aioredis.FakeRedis(decode_responses=True))
        await store.r.set(EPOCH_KEY, "memory")
        bus = MemoryBus()
        w = Worker(bus, store, Inventory(store), PolicyRuntime(lookup=store.policy_get, timeout_s=s.policy_timeout_s),  # type: ignore[arg-type]
                   "memory", s)
        await w._watch_hints()
        bindings = [*parser.bindings(w), *gateway.bindings(w), *controller.bindings(w), *controller.lifecycle_bindings(w),
                    *vcluster.bindings(w), *fleet.bindings(w)]
        system = cls(bus, store, w, bindings)
        try:
            yield system
        finally:
            await store.close()

    # -- setup, as the CLI does it ---------------------------------------------------------------
    async def add_component(self, uri: str = "aios://test/model", **fields: Any) -> None:
        """A component with one GPU per instance and the built-in policies (``fields`` override)."""
        base: dict[str, Any] = {
            "componentURI": uri, "image": "aios/test:1", "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
            "policies": [
                {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
                {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"},
            ],
        }
        await self.store.put_component(Component.model_validate({**base, **fields}))

    async def add_sim_cluster(self, cid: str, nodes: int = 2, gpus: int = 2, labels: dict[str, str] | None = None,
                              node_labels: dict[str, str] | None = None) -> None:
        await self.store.put_cluster(Cluster(id=cid, labels=labels or {}))
        for n in range(nodes):
            await self.store.put_node(Node(
                id=f"{cid}-n{n}", cluster=cid, labels={"rack": str(n % 4), **(node_labels or {})}, cpu=64, memory=512 * 1024,
                gpus=[Gpu(id=f"{cid}-n{n}-g{g}", model="sim-h100", memory=81920) for g in range(gpus)],
            ))
        await self.bus.emit(E.inventory_hint, _hint(cid))

    async def submit(self, spec: dict[str, Any]) -> str:
        bid = str(spec.setdefault("blockId", f"b{len(self.bus.stream) + 1}"))
        await self.bus.emit(E.block_create, spec, msg_id=f"create:{bid}:{len(self.bus.stream)}", bid=bid)
        return bid

    async def delete(self, bid: str) -> None:
        from .schemas.events import DeleteRequest

        await self.bus.emit(E.block_delete, DeleteRequest(bid, f"del-{len(self.bus.stream)}"))

    # -- delivery ----------------------------------------------------------------------------------
    async def run(self, max_messages: int = 10_000, wait_deferred: float = 0.0) -> int:
        """Deliver every pending stored event to every consumer that takes it, until nothing is
        left (deferred deliveries due within ``wait_deferred`` seconds are waited for). Returns
        how many deliveries were made."""
        made = 0
        while made < max_messages:
            if self.bus.queries:  # one consumer of the queue group takes each query
                subject, body = self.bus.queries.popleft()
                spec, handler = next(((s, h) for s, h in self.bindings
                                      if any(matches(f, subject) for f in s.core_filters)), (None, None))
                if spec is not None and handler is not None:
                    self.query_log.append((subject, body))
                    await self._deliver(spec.durable, handler, Stored(-len(self.query_log), subject, body, {}, None))
                    made += 1
                continue
            if self.bus.pending:
                seq = self.bus.pending.popleft()
                msg = self.bus.stream[seq - 1]
                for spec, handler in self.bindings:
                    if any(matches(f, msg.subject) for f in spec.filters):
                        await self._deliver(spec.durable, handler, msg)
                        made += 1
                continue
            fired, nxt = await gateway.fire_due(self.worker)  # the gateway's deadline timers
            made += fired
            if fired:
                continue
            due = [d for d in self.delayed if d[0] <= time.monotonic() + wait_deferred]
            if nxt is not None and nxt <= time.time() + wait_deferred:
                await asyncio.sleep(max(0.0, nxt - time.time()))
                continue
            if not due:
                return made
            self.delayed.remove(min(due))
            when, durable, seq = min(due)
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            handler = next(h for s, h in self.bindings if s.durable == durable)
            await self._deliver(durable, handler, self._message(seq))
            made += 1
        raise RuntimeError(f"still busy after {max_messages} deliveries")

    async def deliver_together(self, msgs: list[Stored]) -> None:
        """Deliver these stored events to their consumer all at once, as one fetched batch's
        handlers run (``run`` delivers one at a time): for races between concurrent steps."""
        ((spec, handler),) = [(s, h) for s, h in self.bindings if any(matches(f, msgs[0].subject) for f in s.filters)]
        for m in msgs:
            self.bus.pending.remove(m.seq)  # taken here, not by ``run`` (a deferred one comes back to it)
        await asyncio.gather(*(self._deliver(spec.durable, handler, m) for m in msgs))

    def _message(self, seq: int) -> Stored:
        """A stored event by its sequence, or a query taken before by its (negative) place in
        ``query_log``."""
        if seq > 0:
            return self.bus.stream[seq - 1]
        subject, body = self.query_log[-seq - 1]
        return Stored(seq, subject, body, {}, None)

    async def _deliver(self, durable: str, handler: Handler, msg: Stored) -> None:
        key = (durable, msg.seq)
        self.deliveries[key] = n = self.deliveries.get(key, 0) + 1
        try:
            await handler(Delivery(msg.subject, msg.data, dict(msg.headers), n, max(msg.seq, 0)))
        except Defer as d:
            self.delayed.append((time.monotonic() + d.delay, durable, msg.seq))
        except (Poison, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.dead.append((durable, msg.seq, str(exc)))
        except Exception as exc:  # the real runner retries with backoff, then dead-letters
            if n >= 5:
                self.dead.append((durable, msg.seq, f"{type(exc).__name__}: {exc}"))
            else:
                self.delayed.append((time.monotonic(), durable, msg.seq))


def _hint(cid: str) -> Any:
    from .schemas.events import InventoryHint

    return InventoryHint(cid)
