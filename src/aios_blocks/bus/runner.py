"""The one consumer runner every worker uses.

It pulls batches from a durable consumer and commits them per fetched batch:

1. the batch's guard (``Guard``: the state epoch) is checked once;
2. every message's handler runs, concurrently; what a handler publishes is held in its
   :class:`~.nats_bus.Outbox` (no awaited publish per event);
3. the batch's stored events are committed together (``Bus.commit``: atomic batches per stream
   when there are enough of them, ``publish_async`` otherwise) and every ack awaited;
4. the guard is checked once more (state replaced meanwhile: the batch is redone);
5. then each input is settled: acked when its handler returned and all it published is stored
   (at-least-once: an ack only after the effects are durable), else per what the failure means.

Failures:

* :class:`Defer` - not an error: redeliver after the given delay (timers, e.g. gather deadlines);
* :class:`Poison` - the message can never succeed: dead-letter it now with the reason;
* anything else (a publish of the handler that failed included) - retry with backoff; after
  ``max_deliver`` deliveries, dead-letter it.

Hand-off: once a batch's stored events are committed (acked by the stream), each one a consumer
of this process takes is given to that consumer's runner at once (:class:`HandOff`), rather than
after the stream delivers it to that runner's pull loop: the next step runs in the same turn of the
event loop (parser -> gateway in ``blocks up``'s parser+gateway process). The stream still delivers
it: that delivery, once the hand-off's batch is settled, is acked unhandled when the hand-off's
handler succeeded and its effects are stored, else handled as any delivery (so a process killed
between the commit and the hand-off's settle loses nothing: the event is stored and unacked).
A hand-off is never retried nor dead-lettered itself: the delivery does that.

Off unless ``AIOS_HANDOFF=1`` (docs/trace.md "Live vs Ray": measured, it saves nothing: the
stream pushes a stored event to the pull request its consumer keeps open as it acks the commit,
so the delivery comes with the ack, first one time in three; and with several copies of a kind the
delivery may go to another copy, which then handles the event too).

A dead letter goes to ``aios.dlq.{consumer}.{subject}`` and carries the original body, headers, the
error and the delivery count. A handler exception never escapes the runner: a worker does not die
of its input. Several batches may be in flight at once (``concurrency`` messages in all), so a
slow handler holds back its own batch's acks, not the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from .. import faults
from ..schemas.events import DeadLetter
from ..settings import current as current_settings
from . import subjects
from .catalog import E
from .nats_bus import Bus, Deferred, outbox

log = structlog.get_logger("aios.runner")

HANDLED = Counter("aios_messages_total", "Messages handled", ["consumer", "outcome"])
LATENCY = Histogram("aios_handler_seconds", "Handler latency", ["consumer"])
HANDOFFS = Counter("aios_handoffs_total", "Stored events handed to a consumer of the same process after their "
                   "commit (given), their stream deliveries acked unhandled (skipped) or handled (redone), and "
                   "those whose delivery was taken before their commit's ack came (pulled_first)",
                   ["consumer", "outcome"])

#: the JetStream runners of this process by stream (``ConsumerRunner.run`` while it runs): who a
#: committed event may be handed to
_LOCAL: dict[str, list[ConsumerRunner]] = {}
#: stream sequences a runner remembers: handed off and not yet delivered, taken from its pull loop
REMEMBERED = 8192
#: how much of a message a dead letter keeps (characters of its body read as UTF-8): ``blocks dlq
#: replay`` takes a longer one from the stream, where the original still is
DLQ_DATA_CHARS = 65536


def handoff_on() -> bool:
    """Whether runners hand committed events to this process's consumers (``AIOS_HANDOFF=1``; off by default)."""
    return current_settings().handoff


class Defer(Exception):
    """Redeliver this message after ``delay`` seconds (not counted as a failure)."""

    def __init__(self, delay: float):
        self.delay = max(0.0, delay)
        super().__init__(f"deferred {self.delay:.3f}s")


class Poison(Exception):
    """This message can never be handled: dead-letter it immediately with this reason."""


@dataclass
class Delivery:
    subject: str
    data: bytes
    headers: dict[str, str]
    deliveries: int
    stream_seq: int


Handler = Callable[[Delivery], Awaitable[None]]


class Guard(Protocol):
    """Checked once before and once after a batch (``workers.base.EpochGuard``)."""

    #: how long to wait before a batch the guard refused or invalidated comes back
    pause_s: float

    async def current(self) -> Any:
        """The token the batch runs under; raises :class:`Defer` when no batch may run now."""

    async def still(self, token: Any) -> bool:
        """Whether ``token`` still holds, by a read that starts after the call."""


@dataclass
class RunnerOptions:
    batch: int = 64
    #: messages in flight over every batch of this consumer
    concurrency: int = 128
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = (0.2, 1.0, 2.0, 5.0)
    fetch_timeout_s: float = 1.0
    #: how long a batch waits for the stream to acknowledge what its handlers published
    publish_timeout_s: float = 10.0
    #: hand committed events to this process's consumers (module docstring, "Hand-off")
    handoff: bool = field(default_factory=handoff_on)


@dataclass
class _Outcome:
    """How one message of a batch ended: ``ok`` (ack once its publishes are stored), ``defer``,
    ``poison``/``malformed`` (dead-letter now) or ``error`` (retry, dead-letter at the limit)."""

    kind: str
    delivery: Delivery
    reason: str = ""
    delay: float = 0.0
    pending: list[asyncio.Future[Any]] = field(default_factory=list)
    #: its stored events, held for the batch's ``Bus.commit``
    deferred: list[Deferred] = field(default_factory=list)
    #: its queries (core NATS), sent once its stored events are stored
    after: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)
    #: its effects that wait for its stored events (``Bus.after_commit``)
    then: list[Callable[[], Awaitable[object]]] = field(default_factory=list)


@dataclass
class ConsumerRunner:
    bus: Bus
    spec: subjects.ConsumerSpec
    handler: Handler
    options: RunnerOptions = field(default_factory=RunnerOptions)
    guard: Guard | None = None
    #: its messages are a JetStream consumer's (hand-offs and deliveries matched by stream sequence)
    stored = True

    def __post_init__(self) -> None:
        # this consumer's labelled metrics, looked up once (a label lookup per message adds up)
        durable = self.spec.durable
        self._handled = {k: HANDLED.labels(durable, k) for k in ("ok", "deferred", "retry", "dead_letter")}
        self._latency = LATENCY.labels(durable)
        self._inflight: set[asyncio.Task[None]] = set()
        self._taken = 0  # messages in the batches in flight
        #: stream seq -> the outcome of its hand-off (True: handled, effects stored), until delivered
        self._handed: OrderedDict[int, asyncio.Future[bool]] = OrderedDict()
        #: stream seqs its pull loop took (recent ones): never handed off after that
        self._pulled: OrderedDict[int, None] = OrderedDict()
        self._running = False
        self._stop: asyncio.Event | None = None

    async def run(self, stop: asyncio.Event) -> None:
        puller = await self.bus.puller(self.spec.stream, self.spec.durable)
        log.info("consumer.start", consumer=self.spec.durable, filters=self.spec.filters)
        local = _LOCAL.setdefault(self.spec.stream, [])
        local.append(self)
        self._running = True
        try:
            await self._pull(stop, puller)
        finally:
            self._running = False
            local.remove(self)

    async def _pull(self, stop: asyncio.Event, puller: Any) -> None:
        self._stop = stop

        async def fetch(n: int) -> list[Any] | None:
            try:
                return await puller.take(n, self.options.fetch_timeout_s)
            except Exception as exc:  # refused (consumer gone...), connection trouble: nats-py reconnects, we wait
                if not stop.is_set():
                    log.warning("consumer.fetch_error", consumer=self.spec.durable, error=repr(exc))
                    await asyncio.sleep(0.5)
                return None

        await self._batches(stop, fetch)
        await self._stopped()
        await puller.stop()  # what it took and never handled goes back to the consumer now

    # -- batches in flight (shared with CoreRunner) ------------------------------------------------
    async def _batches(self, stop: asyncio.Event, take: Callable[[int], Awaitable[list[Any] | None]]) -> None:
        """Until ``stop``: ``take(n)`` up to n messages (``None`` or ``[]``: idle) and handle them
        as a batch of its own task; at most ``concurrency`` messages in the batches in flight. A
        take still waiting when ``stop`` is set is cancelled (what reaches a puller after that, its
        ``stop`` gives back): a stop does not wait out an idle fetch's timeout."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                free = self.options.concurrency - self._taken
                if free <= 0:
                    await asyncio.wait({*self._inflight, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                taking = asyncio.ensure_future(take(min(self.options.batch, free)))
                await asyncio.wait((taking, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not taking.done():
                    taking.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await taking
                    break
                if msgs := taking.result():
                    self._start(msgs)
        finally:
            stopped.cancel()

    def _start(self, msgs: list[Any]) -> None:
        self._taken += len(msgs)
        task = asyncio.create_task(self.batch(msgs))
        self._inflight.add(task)
        task.add_done_callback(lambda t, m=msgs: self._done(t, m))  # type: ignore[misc]

    def _done(self, task: asyncio.Task[None], msgs: list[Any]) -> None:
        self._inflight.discard(task)
        self._taken -= len(msgs)
        for msg in msgs:  # a hand-off whose batch ended unsettled (cancelled): its delivery handles it
            if isinstance(msg, HandOff):
                msg.settled(False)

    async def _stopped(self) -> None:
        """Wait for the batches in flight, flush what they published."""
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=10)
        with contextlib.suppress(Exception):
            await self.bus.nc.flush(timeout=5)
        log.info("consumer.stop", consumer=self.spec.durable)

    async def batch(self, msgs: list[Msg]) -> None:
        """Handle one fetched batch and settle every message of it (never raises)."""
        try:
            await self._batch(msgs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of the runner itself: the messages come back later
            log.error("runner.batch_failed", consumer=self.spec.durable, error=repr(exc))
            for msg in msgs:
                await self._settle(msg.nak(delay=1.0))

    async def _batch(self, msgs: list[Any]) -> None:
        if self.stored:
            msgs = await self._not_handed(msgs)
            if not msgs:
                return
        deliveries = [self._delivery(m) for m in msgs]
        token: Any = None
        if self.guard is not None:
            try:
                token = await self.guard.current()
            except Defer as d:
                for msg in msgs:
                    await self._settle(msg.nak(delay=d.delay))
                    self._handled["deferred"].inc()
                return
        if len(deliveries) == 1:  # no task for a batch of one (the unloaded path)
            outcomes = [await self._handle(deliveries[0], early=not self.options.handoff)]
        else:
            outcomes = list(await asyncio.gather(*(self._handle(d) for d in deliveries)))
        await self._commit_stored(outcomes)
        await self._await_publishes(outcomes)
        for o in outcomes:  # queries go out once what their handler stored is stored
            if o.kind == "ok" and o.after:
                for subject, body, headers in o.after:
                    await self.bus.query_sender.send(subject, body, headers)
        await self._run_then(outcomes)
        if self.guard is not None and any(o.kind == "ok" for o in outcomes):
            await self._recheck_guard(outcomes, token)
        for msg, o in zip(msgs, outcomes, strict=True):
            await self._finish(msg, o)

    async def _commit_stored(self, outcomes: list[_Outcome]) -> None:
        """The batch's stored events together (atomic batches where they pay); an event that could
        not be stored fails its own message only, which comes back and publishes again. What was
        stored is handed to this process's consumers that take it (``_hand_off``)."""
        oks = [o for o in outcomes if o.kind == "ok" and o.deferred]
        if not oks:
            return
        seqs: list[list[int]] = []
        errors = await self.bus.commit([o.deferred for o in oks], self.options.publish_timeout_s, seqs)
        for o, why in zip(oks, errors, strict=True):
            if why:
                o.kind, o.reason = "error", why
        if self.options.handoff:
            self._hand_off([(d, seq) for o, got in zip(oks, seqs, strict=True) if o.kind == "ok"
                            for d, seq in zip(o.deferred, got, strict=True) if seq])

    # -- the hand-off (module docstring) -----------------------------------------------------------
    @staticmethod
    def _hand_off(stored: list[tuple[Deferred, int]]) -> None:
        """Give each stored event to every running consumer of this process that takes it."""
        given: dict[int, tuple[ConsumerRunner, list[HandOff]]] = {}
        for d, seq in stored:
            for r in _LOCAL.get(d.stream, ()):
                if r.takes(d.subject, seq):
                    h = r.expect(seq, d)
                    given.setdefault(id(r), (r, []))[1].append(h)
        for r, hands in given.values():
            faults.hit(f"handoff.{r.spec.durable}.given")  # the chaos tests' SIGKILL: stored, not handed
            r._start(hands)

    def takes(self, subject: str, seq: int) -> bool:
        """Whether a stored event is handed here: this consumer takes its subject, its pull loop
        has not taken it already, it is not handed already, and there is room in flight."""
        if not self._running or (self._stop is not None and self._stop.is_set()):
            return False
        if not any(subjects.matches(f, subject) for f in self.spec.filters) or seq in self._handed:
            return False
        if seq in self._pulled:  # the stream's delivery came first: it is being handled
            self._handed_metric("pulled_first").inc()
            return False
        return self._taken < self.options.concurrency

    def expect(self, seq: int, d: Deferred) -> HandOff:
        """Note the hand-off of ``seq`` (its delivery waits for it) and make its message."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._handed[seq] = fut
        while len(self._handed) > REMEMBERED:  # delivered elsewhere (another copy took it): forget it
            self._handed.popitem(last=False)
        self._handed_metric("given").inc()
        return HandOff(d.subject, d.body, dict(d.headers), seq, fut)

    def _handed_metric(self, outcome: str) -> Any:
        return HANDOFFS.labels(self.spec.durable, outcome)

    async def _not_handed(self, msgs: list[Any]) -> list[Any]:
        """The messages of a fetched batch still to handle: a delivery of an event handed off here
        waits for the hand-off's outcome, and is acked unhandled if it succeeded."""
        rest: list[Any] = []
        for msg in msgs:
            if isinstance(msg, HandOff):
                rest.append(msg)
                continue
            seq = msg.metadata.sequence.stream
            self._pulled[seq] = None
            if len(self._pulled) > REMEMBERED:
                self._pulled.popitem(last=False)
            fut = self._handed.pop(seq, None)
            if fut is None:
                rest.append(msg)
            elif await asyncio.shield(fut):  # handled, its effects stored: this delivery is done
                await self._settle(msg.ack())
                self._handed_metric("skipped").inc()
            else:
                self._handed_metric("redone").inc()
                rest.append(msg)
        return rest

    async def _await_publishes(self, outcomes: list[_Outcome]) -> None:
        """Every publish of the batch at once; a publish that failed (or never got its ack) fails
        its own message only, which comes back and publishes again (deduplicated)."""
        pending = [f for o in outcomes if o.kind == "ok" for f in o.pending]
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=self.options.publish_timeout_s)
        for f in late:
            f.cancel()
        for o in outcomes:
            if o.kind != "ok":
                continue
            for f in o.pending:
                err = f.exception() if f.done() and not f.cancelled() else TimeoutError("no ack from the stream")
                if err is not None:
                    o.kind, o.reason = "error", f"publish failed: {type(err).__name__}: {err}"
                    break

    async def _run_then(self, outcomes: list[_Outcome]) -> None:
        """The effects that waited for the batch's events (one failing does not fail the message)."""
        thens = [t for o in outcomes if o.kind == "ok" for t in o.then]
        if not thens:
            return
        for res in await asyncio.gather(*(t() for t in thens), return_exceptions=True):
            if isinstance(res, BaseException):
                log.warning("runner.after_commit_failed", consumer=self.spec.durable, error=repr(res))

    async def _recheck_guard(self, outcomes: list[_Outcome], token: Any) -> None:
        """State replaced while the batch worked (the guard's token changed): do it again."""
        assert self.guard is not None
        try:
            valid = await self.guard.still(token)
        except Exception as exc:  # cannot tell: do the batch again rather than ack it blind
            log.warning("runner.guard_failed", consumer=self.spec.durable, error=repr(exc))
            valid = False
        if not valid:
            for o in outcomes:
                if o.kind == "ok":
                    o.kind, o.delay = "defer", self.guard.pause_s

    async def _handle(self, d: Delivery, early: bool = False) -> _Outcome:
        """Run the handler in an outbox; ``early``: its ``Emit.early`` events may go out at once
        (a batch of one: no atomic batch to join; not with hand-offs, which hand what the commit
        stores)."""
        started = time.perf_counter()
        with outbox(defer=bool(self.bus.atomic_streams), early=early) as box:
            try:
                await self.handler(d)
                return _Outcome("ok", d, pending=box.pending, deferred=box.deferred, after=box.after, then=box.then)
            except Defer as exc:
                out = _Outcome("defer", d, delay=exc.delay)
            except Poison as exc:
                out = _Outcome("poison", d, f"poison: {exc}")
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # malformed: no retry can fix it
                out = _Outcome("poison", d, f"malformed event: {exc}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                out = _Outcome("error", d, f"{type(exc).__name__}: {exc}")
            finally:
                self._latency.observe(time.perf_counter() - started)
        for f in box.pending:  # what it published before failing is not waited for (it comes back)
            f.add_done_callback(_retrieve)
        return out

    async def _finish(self, msg: Any, o: _Outcome) -> None:
        d = o.delivery
        if isinstance(msg, HandOff):  # its delivery acks, retries or dead-letters it
            if o.kind == "ok":
                faults.hit(f"handoff.{self.spec.durable}.handled")  # the chaos tests' SIGKILL: done, not acked
                self._handled["ok"].inc()
            msg.settled(o.kind == "ok")
            return
        if o.kind == "ok":
            await self._settle(msg.ack())
            self._handled["ok"].inc()
        elif o.kind == "defer":
            await self._settle(msg.nak(delay=o.delay))
            self._handled["deferred"].inc()
        elif o.kind == "poison":
            await self._dead_letter(msg, d, o.reason)
        elif d.deliveries >= self.options.max_deliver:
            await self._dead_letter(msg, d, o.reason)
        else:
            delay = self.options.backoff_s[min(d.deliveries - 1, len(self.options.backoff_s) - 1)]
            log.warning("handler.retry", consumer=self.spec.durable, subject=d.subject, deliveries=d.deliveries, error=o.reason)
            await self._settle(msg.nak(delay=delay))
            self._handled["retry"].inc()

    async def _dead_letter(self, msg: Msg, d: Delivery, reason: str) -> None:
        letter = DeadLetter(
            subject=d.subject,
            consumer=self.spec.durable,
            error=reason[:4000],
            deliveries=d.deliveries,
            stream_seq=d.stream_seq,
            data=d.data.decode("utf-8", errors="replace")[:DLQ_DATA_CHARS],
            headers=d.headers,
        )
        subject = E.dead_letter.subject(consumer=self.spec.durable, subject=d.subject)
        try:
            await self.bus.emit(E.dead_letter, letter, consumer=self.spec.durable, subject=d.subject, sync=True)
        except Exception as exc:  # could not record it: let it come back rather than lose it
            log.error("dlq.publish_failed", subject=subject, error=repr(exc))
            await self._settle(msg.nak(delay=5))
            return
        log.error("dead_letter", consumer=self.spec.durable, subject=d.subject, error=reason, deliveries=d.deliveries)
        await self._settle(msg.term())
        self._handled["dead_letter"].inc()

    @staticmethod
    async def _settle(coro: Awaitable[None]) -> None:
        # Acks can fail while reconnecting; the message then simply comes back (at-least-once).
        with contextlib.suppress(Exception):
            await coro

    @staticmethod
    def _delivery(msg: Any) -> Delivery:
        if isinstance(msg, HandOff):
            return Delivery(subject=msg.subject, data=msg.data, headers=msg.headers, deliveries=1, stream_seq=msg.seq)
        meta = msg.metadata
        return Delivery(
            subject=msg.subject, data=msg.data, headers=dict(msg.headers or {}), deliveries=meta.num_delivered,
            stream_seq=meta.sequence.stream,
        )


@dataclass
class HandOff:
    """A stored event handed to a runner of this process after its commit (its first delivery,
    ``stream_seq`` its stream sequence). Settling it only tells the stream's delivery of the same
    event what happened (``settled``): ``ack`` (handled), ``nak``/``term`` (not: the delivery
    handles it)."""

    subject: str
    data: bytes
    headers: dict[str, str]
    seq: int
    outcome: asyncio.Future[bool]

    def settled(self, ok: bool) -> None:
        if not self.outcome.done():
            self.outcome.set_result(ok)

    async def ack(self) -> None:
        self.settled(True)

    async def nak(self, delay: float = 0.0) -> None:
        self.settled(False)

    async def term(self) -> None:
        self.settled(False)


@dataclass
class CoreMsg:
    """A core-NATS message taken by a :class:`CoreRunner`, with the settle calls of a JetStream
    message: ``ack`` and ``term`` are no-ops (nothing to tell the server), ``nak`` puts it back in
    the runner's queue after the delay, one delivery more."""

    subject: str
    data: bytes
    headers: dict[str, str]
    deliveries: int
    requeue: Callable[[CoreMsg, float], None]

    async def ack(self) -> None:
        return None

    async def term(self) -> None:
        return None

    async def nak(self, delay: float = 0.0) -> None:
        self.requeue(CoreMsg(self.subject, self.data, self.headers, self.deliveries + 1, self.requeue), delay)


@dataclass
class CoreRunner(ConsumerRunner):
    """A consumer's events that are not stored (queries over core NATS: ``Event.stored`` false),
    run in the same batches as the stored ones: a queue-group subscription (the group is the
    consumer's ``durable``, so one copy of the worker takes each message) feeds a queue, and the
    messages there are taken as batches of up to ``batch`` (what has arrived, no waiting), guarded,
    handled and committed exactly as :class:`ConsumerRunner` does. Nothing is acked; a handler
    that fails is retried here with the same backoff and dead-lettered at ``max_deliver``.

    A query is not stored, so one held by a process that dies is lost: its sender asks again (the
    gateway's gather timer asks a cluster that has not answered by the deadline). A stopping
    runner leaves the group first and handles what it had already taken."""

    stored = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._queue: asyncio.Queue[CoreMsg] = asyncio.Queue()
        self._timers: set[asyncio.TimerHandle] = set()

    def _requeue(self, msg: CoreMsg, delay: float) -> None:
        loop = asyncio.get_running_loop()
        if delay <= 0:
            self._queue.put_nowait(msg)
            return

        def put() -> None:
            self._timers.discard(handle)
            self._queue.put_nowait(msg)

        handle = loop.call_later(delay, put)
        self._timers.add(handle)

    @staticmethod
    def _delivery(msg: Any) -> Delivery:
        return Delivery(subject=msg.subject, data=msg.data, headers=msg.headers, deliveries=msg.deliveries, stream_seq=0)

    async def run(self, stop: asyncio.Event) -> None:
        async def take(msg: Msg) -> None:
            if msg.reply.startswith("$JS."):
                # a query's reply subject is its sender's inbox (for NATS's no-responders status):
                # one whose reply is a JetStream ack subject was replayed onto the subject from the
                # stream by a push consumer someone made (docs/security.md), not sent by its
                # publisher role
                log.warning("query.replayed_dropped", consumer=self.spec.durable, subject=msg.subject, reply=msg.reply[:64])
                return
            self._queue.put_nowait(CoreMsg(msg.subject, msg.data, dict(msg.headers or {}), 1, self._requeue))

        subs = [await self.bus.nc.subscribe(f, queue=self.spec.durable, cb=take, pending_msgs_limit=1_000_000,
                                            pending_bytes_limit=512 * 1024 * 1024) for f in self.spec.core_filters]
        log.info("consumer.start", consumer=self.spec.durable, core=self.spec.core_filters)

        async def queued(n: int) -> list[Any] | None:
            try:
                async with asyncio.timeout(self.options.fetch_timeout_s):
                    first = await self._queue.get()
            except TimeoutError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # a cancel that met the timeout: stop, not idle
                    raise asyncio.CancelledError from None
                return None
            msgs = [first]
            while len(msgs) < n and not self._queue.empty():
                msgs.append(self._queue.get_nowait())
            return msgs

        await self._batches(stop, queued)
        for sub in subs:  # leave the group: nothing new comes here; what was taken is handled
            with contextlib.suppress(Exception):
                await sub.drain()
        for handle in self._timers:
            handle.cancel()
        left: list[Any] = []
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        for i in range(0, len(left), self.options.batch):
            self._start(left[i:i + self.options.batch])
        await self._stopped()


def _retrieve(f: asyncio.Future[Any]) -> None:
    """Read a publish's outcome nobody waits for (no "exception was never retrieved" noise)."""
    if not f.cancelled():
        f.exception()
