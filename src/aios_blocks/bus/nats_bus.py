"""The door to NATS: connection, the JetStream streams (``AIOS``, the control events; ``AIOS_OUTPUTS``,
the blocks' task outputs for side-cars), consumers, publishing. Connecting is in ``bus.connection``
and the streams and consumers a ``Bus`` makes in ``bus.topology`` (both re-exported here).

Publishing always sets a deterministic ``Nats-Msg-Id`` so a redelivered step that publishes again
is dropped by JetStream's duplicate window instead of producing a second event; on the wire it is
a keyed digest of the logical id (``event_ids``), so no client can guess, and so suppress, a
system event. Events go out in the CloudEvents NATS binding's structured mode
(``Content-Type: application/cloudevents+json``) with an absolute-URI ``source``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    PubAck,
)
from nats.js.errors import APIError, KeyWrongLastSequenceError, NotFoundError

from ..schemas.events import envelope
from ..settings import Settings
from ..settings import current as current_settings
from . import event_ids, subjects
from .catalog import Body, Emit, Event
from .connection import (  # noqa: F401  (re-exported: callers import them from here)
    INBOX_PREFIX,
    RECONNECT_WAIT_S,
    Unreachable,
    connect,
    inbox_hint,
    may_reply,
    recent_denials,
    security_options,
)
from .pull import Puller
from .queries import QuerySender
from .topology import Topology

log = structlog.get_logger("aios.bus")

#: answers one request: (subject tokens, body, headers) -> (body, headers)
Responder = Callable[[dict[str, str], bytes, dict[str, str]], Awaitable[tuple[bytes, dict[str, str]]]]


@dataclass
class Outbox:
    """The stored events one handler published, their acks not yet awaited. Inside
    :func:`outbox` (the consumer runner opens one around each handler) ``Bus.emit`` and
    ``Bus.emit_all`` publish with ``publish_async`` and return at once; the runner awaits every
    ack of a fetched batch together and only then acks the batch's inputs, so a message is still
    acked only once what it published is stored (DESIGN §13: ~4x the steps of awaiting each
    publish).

    A task started inside (a probe watcher, say) inherits the outbox but outlives it: once the
    block is left the outbox is closed, and publishing from there waits for its ack as usual."""

    pending: list[asyncio.Future[Any]] = field(default_factory=list)
    closed: bool = False
    #: set by the runner when the bus commits a batch's events together (``Bus.commit``): stored
    #: events are kept here, not published, until the whole batch's handlers are done
    defer: bool = False
    deferred: list[Deferred] = field(default_factory=list)
    #: whether an ``Emit.early`` event goes out at once in spite of ``defer`` (a batch of one
    #: delivery: no atomic batch to join) while nothing is held before it (the order stays)
    early: bool = False
    #: queries (core NATS, not stored) the handler sent: the runner sends them once the handler's
    #: stored events are stored, so an answer never lands in the stream before the facts that
    #: asked for it (and a handler that fails sends none: its redelivery asks again)
    after: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)
    #: effects that must wait until the handler's stored events are stored (``Bus.after_commit``)
    then: list[Callable[[], Awaitable[object]]] = field(default_factory=list)


@dataclass(frozen=True)
class Deferred:
    """A stored event an :class:`Outbox` holds for ``Bus.commit``."""

    stream: str
    subject: str
    body: bytes
    headers: dict[str, str]


@dataclass(frozen=True)
class Prepared:
    """An event encoded ahead of its publish (:meth:`Bus.prepare`): ``Bus.emit_all`` sends it as
    it sends ``emit``, without encoding it again. ``stored`` None: not a stored event (a query or
    a core message: encoded when sent)."""

    emit: Emit
    stored: Deferred | None


def _open_outbox() -> Outbox | None:
    box = _OUTBOX.get()
    return None if box is None or box.closed else box


_OUTBOX: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar("aios_outbox", default=None)


class outbox:  # lower case: used as ``with outbox() as box``, like the function it was
    """Collect the publishes of the code inside (this task and the tasks it starts) in an Outbox
    (``defer``: hold the stored ones for ``Bus.commit`` instead of publishing them). A class, not
    a ``contextlib.contextmanager``: one is opened around every handler."""

    __slots__ = ("box", "token")

    def __init__(self, defer: bool = False, early: bool = False) -> None:
        self.box = Outbox(defer=defer, early=early)
        self.token: contextvars.Token[Outbox | None] | None = None

    def __enter__(self) -> Outbox:
        self.token = _OUTBOX.set(self.box)
        return self.box

    def __exit__(self, *exc: object) -> None:
        self.box.closed = True
        if self.token is not None:
            _OUTBOX.reset(self.token)


#: the CloudEvents NATS binding, structured mode: the whole event is the JSON body
CLOUDEVENTS_JSON = "application/cloudevents+json"


def source_uri(name: str) -> str:
    """``aios-blocks/parser`` -> ``aios-blocks://<host>/parser`` (CloudEvents wants a URI-reference;
    an absolute one says which host and worker published)."""
    if "://" in name:
        return name
    return f"aios-blocks://{socket.gethostname()}/{name.removeprefix('aios-blocks').strip('/') or 'unknown'}"


@dataclass
class Serving:
    """A queue-group responder (``Bus.serve``): ``stop`` leaves the group and answers every
    request already taken, so a stopping process loses none."""

    sub: Any
    tasks: set[asyncio.Task[None]]

    async def stop(self, timeout: float) -> None:
        try:
            await self.sub.drain()  # no new request comes here; those received are still handled
        except Exception:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)


#: how long a JetStream API call or a publish waits for its answer
JS_TIMEOUT_S = 10.0


class _JetStream(JetStreamContext):
    """nats-py's JetStream context, with one fix: a ``publish_async`` the stream answers with an
    error (an atomic batch refused for an id it has seen, a full stream) fails its future with
    that error. nats-py's reply callback builds the error with ``APIError.from_error``, which
    raises instead of returning it, so the error went to the connection's error callback and the
    future waited out the whole timeout (10 s) instead (nats-py 2.16)."""

    async def _handle_async_reply(self, msg: Any) -> None:
        try:
            await super()._handle_async_reply(msg)
        except APIError as err:
            future = self._publish_async_futures.get(msg.subject.rsplit(".", 1)[-1])
            if future is not None and not future.done():
                future.set_exception(err)


class Bus(Topology):
    """A NATS connection with its JetStream context and the project's conventions."""

    def __init__(self, nc: Client, source: str = "aios-blocks", event_key: str | None = None, settings: Settings | None = None):
        self.nc = nc
        self.js: JetStreamContext = _JetStream(nc, timeout=JS_TIMEOUT_S)
        self.source = source_uri(source)
        self.settings = settings or current_settings()
        self._event_key = event_key or self.settings.event_key or None
        self._ids: event_ids.EventIds | None = None
        self._key_lookup: asyncio.Future[str] | None = None
        #: streams that take atomic batches (``allow_atomic``, nats-server 2.12+; ``ensure_stream``)
        self.atomic_streams: set[str] = set()
        #: queries (non-stored events) go out through it: sent again while nobody listens
        self.query_sender = QuerySender(nc, give_up_s=max(1.0, self.settings.dry_run_deadline_s))
        #: ``emit_together``'s events of this turn of the loop, and the tasks storing earlier ones
        self._together: list[tuple[Deferred, asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: streams known not to take atomic batches (``_may_batch``)
        self._no_atomic: set[str] = set()

    @classmethod
    async def open(cls, url: str, source: str = "aios-blocks", event_key: str | None = None,
                   settings: Settings | None = None, first_wait_s: float | None = None) -> Bus:
        """``first_wait_s``: see :func:`connect` (a CLI gives up, a worker waits)."""
        s = settings or current_settings()
        return cls(await connect(url, name=source, settings=s, first_wait_s=first_wait_s), source, event_key, s)

    # -- event ids -------------------------------------------------------------------------
    async def ids(self) -> event_ids.EventIds:
        """The wire-id maker: the given key, ``AIOS_EVENT_KEY``, else the shared one in the KV
        bucket (created by the first system process that needs it)."""
        if self._ids is None:
            if self._event_key:
                self._ids = event_ids.EventIds(self._event_key)
                return self._ids
            # one lookup for every caller that comes before it ends (they all go on together)
            if self._key_lookup is None or self._key_lookup.cancelled():
                self._key_lookup = asyncio.ensure_future(self._shared_event_key())
            key = await asyncio.shield(self._key_lookup)
            if self._ids is None:
                self._ids = event_ids.EventIds(key)
        return self._ids

    async def _shared_event_key(self) -> str:
        try:
            kv = await self._key_bucket()
            try:
                await kv.create(event_ids.KV_KEY, event_ids.new_key().encode())
            except KeyWrongLastSequenceError:
                pass  # another process made it first: use theirs
            entry = await kv.get(event_ids.KV_KEY)
            return bytes(entry.value or b"").decode()
        except Exception as exc:  # no right to the bucket (a role without the key): a key of our own
            log.warning("bus.event_key_private", error=str(exc) or type(exc).__name__,
                        note="set AIOS_EVENT_KEY; until then a republish after a restart is not deduplicated")
            return event_ids.new_key()

    async def store_event_key(self, key: str) -> None:
        """Make ``key`` the shared one (the embedded setup: the key in its secrets file)."""
        await (await self._key_bucket()).put(event_ids.KV_KEY, key.encode())

    async def _key_bucket(self) -> Any:
        """The KV bucket of the shared event key, created if absent."""
        try:
            return await self.js.key_value(event_ids.KV_BUCKET)
        except NotFoundError:
            return await self.js.create_key_value(bucket=event_ids.KV_BUCKET, history=1, replicas=self.settings.stream_replicas)

    async def _headers(self, msg_id: str, content_type: str = CLOUDEVENTS_JSON) -> dict[str, str]:
        return {"Nats-Msg-Id": (await self.ids()).wire(msg_id), "Content-Type": content_type}

    async def close(self) -> None:
        self.query_sender.close()
        if not self.nc.is_closed:
            try:
                await self.nc.flush(timeout=5)
            except Exception:  # closing anyway
                pass
            try:
                await self.nc.close()  # acks were flushed above; drain() waits on idle pull subs
            except (RuntimeError, ConnectionError):
                # the server went away first (a SIGKILLed `blocks up` takes it down with the workers):
                # uvloop refuses to write what was pending to the closed transport (RuntimeError),
                # asyncio's streams raise ConnectionResetError('Connection lost') from the close's
                # drain (a `blocks agent` stopped while its `blocks up` was down exited 1 with 'agent
                # failed'). Nothing can be sent any more; the process is stopping anyway
                pass

    # -- publishing ------------------------------------------------------------------------
    def encode(self, subject: str, kind: str, data: Any, msg_id: str) -> bytes:
        return envelope(msg_id, self.source, subjects.event_type(kind), subject, data)

    async def publish(self, subject: str, kind: str, data: Any, msg_id: str) -> Any:
        """Publish one event and wait for the stream's ack (durable before we go on)."""
        payload = self.encode(subject, kind, data, msg_id)
        return await self.js.publish(subject, payload, headers=await self._headers(msg_id))

    async def publish_many(self, items: Iterable[tuple[str, str, Any, str]]) -> None:
        """Publish several events concurrently and wait for all acks."""
        futs = []
        for subject, kind, data, msg_id in items:
            payload = self.encode(subject, kind, data, msg_id)
            futs.append(await self.js.publish_async(subject, payload, headers=await self._headers(msg_id)))
        if futs:
            await asyncio.gather(*futs)

    async def emit(self, event: Event[Any], payload: Any, *, qualifier: str = "", msg_id: str | None = None,
                   headers: dict[str, str] | None = None, sync: bool = False, **tokens: str) -> Any:
        """Publish one catalog event and, when the stream keeps it, wait for its ack (returned).
        The subject, the CloudEvents type and the message id all come from the catalog entry.
        Inside an :func:`outbox` the ack is left to the outbox's owner and ``None`` is returned,
        unless ``sync`` (the caller reads the ack, e.g. whether it was a duplicate)."""
        e = Emit(event, payload, tokens, qualifier, msg_id, tuple((headers or {}).items()))
        box = _open_outbox()
        if sync and box is not None and box.deferred:
            await self._send_deferred(box)  # what the handler published before goes out first, in order
        if sync or box is None:
            return await self._emit_one(e, wait=True)
        fut = await self._emit_one(e, wait=False, box=box)
        if fut is not None:
            box.pending.append(fut)
        return None

    async def emit_all(self, effects: Iterable[Emit | Prepared]) -> list[Any]:
        """Publish several catalog events concurrently and wait for every stored one's ack (inside
        an :func:`outbox`: leave the acks to it and return ``[]``); a :class:`Prepared` one as it was
        encoded then."""
        box = _open_outbox()
        futs = [f for f in [await self._emit_one(e, wait=False, box=box) for e in effects] if f is not None]
        if box is not None:
            box.pending.extend(futs)
            return []
        return list(await asyncio.gather(*futs))

    async def after_commit(self, effect: Callable[[], Awaitable[object]]) -> None:
        """Run ``effect`` once what the current handler publishes is stored (inside an
        :func:`outbox`: the runner runs it after the batch's commit, and not at all when the
        handler fails; outside: now, the publishes before it having been awaited)."""
        box = _open_outbox()
        if box is not None:
            box.then.append(effect)
        else:
            await effect()

    async def prepare(self, effects: Iterable[Emit]) -> list[Prepared]:
        """``effects`` with their stored events' messages made now (body, id, headers: what
        ``emit_all`` would make), for an ``emit_all`` of them later, which sends them as they are.
        Nothing is published: one never passed to ``emit_all`` is never sent. A handler encodes
        its events while it waits for something they do not depend on (the allocation's, while
        its reservation's script is in flight: ``workers.allocate``). The envelope's ``time`` is
        when it was made."""
        out: list[Prepared] = []
        for e in effects:
            ev = e.event
            if ev.body is Body.CORE or not ev.stored:
                out.append(Prepared(e, None))
            else:
                subject = e.subject()
                out.append(Prepared(e, await self._stored(e, subject, e.logical_id())))
        return out

    async def _emit_one(self, e: Emit | Prepared, wait: bool, box: Outbox | None = None) -> Any:
        if isinstance(e, Prepared):
            if e.stored is not None:
                return await self._send_stored(e.emit, e.stored, wait, box)
            e = e.emit
        ev = e.event
        subject = e.subject()
        if ev.body is Body.CORE:
            await self.nc.publish(subject, msgspec.json.encode(e.payload))
            return None
        mid = e.logical_id()
        if not ev.stored:  # a query over core NATS (a CloudEvent, no message id): nothing to wait for
            headers = {"Content-Type": CLOUDEVENTS_JSON, **dict(e.headers)}
            body = envelope(mid, self.source, ev.type, subject, e.payload)
            if box is not None:
                box.after.append((subject, body, headers))  # sent after what the handler stored
            else:
                await self.query_sender.send(subject, body, headers)
            return None
        return await self._send_stored(e, await self._stored(e, subject, mid), wait, box)

    async def _send_stored(self, e: Emit, d: Deferred, wait: bool, box: Outbox | None) -> Any:
        """Publish a stored event's message (``_emit_one``): held in ``box`` for its batch's commit
        when the box defers, else with ``publish_async`` (or awaited, ``wait``)."""
        if wait:
            return await self.js.publish(d.subject, d.body, headers=d.headers)
        if box is not None and box.defer and not (e.early and box.early and not box.deferred):
            box.deferred.append(d)
            return None
        return await self.js.publish_async(d.subject, d.body, headers=d.headers)

    async def _stored(self, e: Emit, subject: str, mid: str) -> Deferred:
        """A stored event's message: its body framed as the catalog says, its id and headers."""
        ev = e.event
        if ev.body is Body.RAW:
            body = e.payload if isinstance(e.payload, bytes) else msgspec.json.encode(e.payload)
            headers = await self._headers(mid, "application/json")
        else:
            body = envelope(mid, self.source, ev.type, subject, e.payload)
            headers = await self._headers(mid)
        if e.headers:
            headers = {**headers, **dict(e.headers)}
        return Deferred(ev.stream, subject, body, headers)

    # -- many callers' events, stored together --------------------------------------------------
    async def emit_together(self, event: Event[Any], payload: Any, *, msg_id: str | None = None, **tokens: str) -> Any:
        """Publish one stored catalog event and wait for its ack, stored together with the others
        emitted this way in the same turn of the event loop: from ``atomic_batch_min`` of them on
        (a client's burst of ``Client.create`` calls gathered at once), they go as atomic batches,
        a few disk syncs for all instead of one each; fewer go one by one (``publish_async``). The
        ack is each event's own (its stream sequence). A producer's batching, as Kafka's linger:
        the events are the same, and so are their ids and order within the turn."""
        e = Emit(event, payload, tokens, "", msg_id, ())
        if not event.stored or event.body is Body.CORE:
            return await self._emit_one(e, wait=True)
        subject = e.subject()
        d = await self._stored(e, subject, e.logical_id())
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._together:
            loop.call_soon(self._send_together)
        self._together.append((d, fut))
        return await fut

    def _send_together(self) -> None:
        held, self._together = self._together, []
        t = asyncio.get_running_loop().create_task(self._store_together(held))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _store_together(self, held: list[tuple[Deferred, asyncio.Future[Any]]]) -> None:
        by_stream: dict[str, list[tuple[Deferred, asyncio.Future[Any]]]] = {}
        for d, fut in held:
            by_stream.setdefault(d.stream, []).append((d, fut))
        timeout = JS_TIMEOUT_S
        parts: list[Awaitable[None]] = []
        for stream, items in by_stream.items():
            if len(items) >= max(2, self.settings.atomic_batch_min) and self._may_batch(stream):
                step = self.settings.atomic_batch_max
                parts += [self._together_atomic(items[i:i + step], timeout) for i in range(0, len(items), step)]
            else:
                parts.append(self._together_each(items, timeout))
        try:
            await asyncio.gather(*parts)
        except BaseException as exc:  # never leave a caller waiting on an event nobody publishes
            for _d, fut in held:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError("closed"))
            raise

    async def _together_atomic(self, items: list[tuple[Deferred, asyncio.Future[Any]]], timeout: float) -> None:
        ack, why = await self._send_atomic([d for d, _ in items], timeout)
        if ack is not None and getattr(ack, "batch_size", None) != len(items):
            # stored, but not said to be in one piece: each event published again is answered,
            # as a duplicate, with the sequence it was stored at
            ack, why = None, "the ack does not count the batch"
        if ack is None:
            if "10174" in why:  # atomic publish is disabled on this stream
                self._no_atomic.add(items[0][0].stream)
            log.info("bus.batch_fallback", events=len(items), why=why)
            await self._together_each(items, timeout)
            return
        last = len(items) - 1
        for i, (_d, fut) in enumerate(items):  # a batch is stored in one piece: sequences in a row
            if not fut.done():
                fut.set_result(PubAck(stream=ack.stream, seq=ack.seq - (last - i), domain=ack.domain, duplicate=False))

    async def _together_each(self, items: list[tuple[Deferred, asyncio.Future[Any]]], timeout: float) -> None:
        async def one(d: Deferred, fut: asyncio.Future[Any]) -> None:
            try:
                ack = await self.js.publish(d.subject, d.body, timeout=timeout, headers=d.headers)
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
                return
            if not fut.done():
                fut.set_result(ack)

        await asyncio.gather(*(one(d, fut) for d, fut in items))

    def _may_batch(self, stream: str) -> bool:
        """Whether ``emit_together`` sends ``stream`` atomic batches: a worker knows from
        ``ensure_stream``; a client (which may not read the stream's config: the upstream role)
        tries on a server that has them (2.12+; an older one would store a batch's messages one by
        one, not in one piece), and a stream that refuses them (10174) is not tried again."""
        if self.settings.atomic_batch_min <= 0 or stream in self._no_atomic:
            return False
        if stream in self.atomic_streams:
            return True
        version = self.nc.connected_server_version
        return (version.major, version.minor) >= (2, 12)

    # -- a fetched batch's events, committed together -----------------------------------------
    async def _send_deferred(self, box: Outbox) -> None:
        """Publish what ``box`` holds now (``publish_async``, acks left to the box's owner): a
        publish that must go out at once (``sync``) never overtakes its handler's earlier events."""
        held, box.deferred = box.deferred, []
        for d in held:
            box.pending.append(await self.js.publish_async(d.subject, d.body, headers=d.headers))

    async def commit(self, groups: list[list[Deferred]], timeout: float, seqs: list[list[int]] | None = None) -> list[str]:
        """Store every group's events; per group, ``""`` when all of them are stored, else why not.
        ``seqs``, when given, is filled per group with each event's stream sequence (0 when not
        known to be a new message of the stream: not stored, or a duplicate the window dropped).

        Per stream, when there are at least ``atomic_batch_min`` events and the stream allows it,
        they go as atomic batches (``Nats-Batch-Id`` / ``-Sequence`` / ``-Commit``: the server
        stores a batch all at once with a few disk syncs instead of one per message, DESIGN §13),
        else with ``publish_async``. A batch the server refuses (an event id it has seen: a
        redelivered step's events, error 10201; a server limit) goes again event by event, where
        the duplicate window drops what was stored before."""
        errors = [""] * len(groups)
        got: list[list[int]] = seqs if seqs is not None else []
        got[:] = [[0] * len(group) for group in groups]
        by_stream: dict[str, list[tuple[int, int, Deferred]]] = {}
        for gi, group in enumerate(groups):
            for di, d in enumerate(group):
                by_stream.setdefault(d.stream, []).append((gi, di, d))
        if not by_stream:
            return errors
        parts: list[Awaitable[list[tuple[int, str]]]] = []
        for stream, items in by_stream.items():
            if stream in self.atomic_streams and len(items) >= self.settings.atomic_batch_min:
                step = self.settings.atomic_batch_max
                parts += [self._atomic(items[i:i + step], timeout, got) for i in range(0, len(items), step)]
            else:
                parts.append(self._each(items, timeout, got))
        # one part (a turn's few events to one stream): awaited here, not in a task of its own (a
        # turn of the loop before its publish goes out, and one after its ack)
        for failures in [await parts[0]] if len(parts) == 1 else await asyncio.gather(*parts):
            for gi, why in failures:
                errors[gi] = errors[gi] or why
        return errors

    async def _atomic(self, items: list[tuple[int, int, Deferred]], timeout: float,
                      got: list[list[int]]) -> list[tuple[int, str]]:
        ack, why = await self._send_atomic([d for _gi, _di, d in items], timeout)
        if ack is not None:
            last = len(items) - 1
            for i, (gi, di, _d) in enumerate(items):  # stored in one piece: sequences in a row
                got[gi][di] = int(ack.seq) - (last - i)
            return []
        log.info("bus.batch_fallback", events=len(items), why=why)
        return await self._each(items, timeout, got)

    async def _send_atomic(self, items: list[Deferred], timeout: float) -> tuple[Any, str]:
        """``items`` as one atomic batch: (the commit's ack, ``""``) when all were stored, else
        (None, why): refused (10201: an id seen before), too big, timed out."""
        batch = uuid.uuid4().hex
        last = len(items)
        try:
            for i, d in enumerate(items, 1):
                headers = {**d.headers, "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
                if i < last:
                    await self.nc.publish(d.subject, d.body, headers=headers)
                else:
                    headers["Nats-Batch-Commit"] = "1"
                    fut = await self.js.publish_async(d.subject, d.body, headers=headers)
            ack = await asyncio.wait_for(fut, timeout)
            if getattr(ack, "batch_size", None) in (None, last):
                return ack, ""
            return None, f"batch stored {ack.batch_size} of {last}"
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    async def _each(self, items: list[tuple[int, int, Deferred]], timeout: float,
                    got: list[list[int]]) -> list[tuple[int, str]]:
        futs = [await self.js.publish_async(d.subject, d.body, headers=d.headers) for _gi, _di, d in items]
        _, late = await asyncio.wait(futs, timeout=timeout)
        failures = []
        for (gi, di, _d), f in zip(items, futs, strict=True):
            if f in late:
                f.cancel()
                failures.append((gi, "publish failed: TimeoutError: no ack from the stream"))
            elif (err := f.exception()) is not None:
                failures.append((gi, f"publish failed: {type(err).__name__}: {err}"))
            elif not getattr(ack := f.result(), "duplicate", False):
                got[gi][di] = int(getattr(ack, "seq", 0) or 0)
        return failures

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str | None = None,
                          content_type: str = "application/json") -> Any:
        """A body that is not a CloudEvent (a bare spec, a dead letter, a stored policy input)."""
        headers = await self._headers(msg_id, content_type) if msg_id else {"Content-Type": content_type}
        return await self.js.publish(subject, payload, headers=headers)

    async def notify(self, subject: str, data: Any) -> None:
        """Core-NATS publish for cache-invalidation hints (lost hints only cost a stale read)."""
        await self.nc.publish(subject, msgspec.json.encode(data))

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]], queue: str = "") -> Any:
        return await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)

    async def puller(self, stream: str, durable: str) -> Puller:
        """Takes durable ``durable``'s messages (``bus.pull``)."""
        return await Puller(self.nc, self.js._prefix, stream, durable).start()

    # -- core request/reply (catalog events with responders) -------------------------------------
    async def serve(self, event: Event[Any], queue: str, handler: Responder, **tokens: str) -> Serving:
        """Answer ``event``'s requests as one of the queue group ``queue``: ``handler(tokens, body,
        headers) -> (body, headers)`` runs as its own task per request (requests are answered
        concurrently); a handler that raises is answered with ``Aios-Status: 500``, never with
        silence. A request without a reply subject is handled and its answer dropped; one whose
        reply subject is not an inbox (``may_reply``) is refused unhandled."""
        tasks: set[asyncio.Task[None]] = set()

        async def answer(msg: Any) -> None:
            if msg.reply and not may_reply(msg.reply):
                log.warning("bus.reply_refused", subject=msg.subject, reply=msg.reply[:120],
                            why="a reply subject must be an inbox (_INBOX.)")
                return
            toks = event.match(msg.subject) or {}
            try:
                body, headers = await handler(toks, msg.data, dict(msg.headers or {}))
            except Exception as exc:
                log.warning("bus.serve_failed", subject=msg.subject, error=repr(exc))
                body, headers = b"", {"Aios-Status": "500", "Aios-Error": f"{type(exc).__name__}: {exc}"[:500]}
            if msg.reply:
                try:
                    await self.nc.publish(msg.reply, body, headers=headers)
                except Exception as exc:
                    log.warning("bus.reply_failed", subject=msg.subject, error=repr(exc))

        async def cb(msg: Any) -> None:
            t = asyncio.get_running_loop().create_task(answer(msg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        sub = await self.nc.subscribe(event.filter(**tokens), queue=queue, cb=cb, pending_msgs_limit=1_000_000,
                                      pending_bytes_limit=512 * 1024 * 1024)
        return Serving(sub, tasks)

    async def request(self, event: Event[Any], body: bytes, headers: dict[str, str] | None = None,
                      timeout: float = 60.0, **tokens: str) -> Any:
        """One core-NATS request of a request/reply catalog event; the reply message."""
        return await self.nc.request(event.subject(**tokens), body, timeout=timeout, headers=headers)
