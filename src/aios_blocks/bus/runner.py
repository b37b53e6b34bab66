"""The one consumer runner every worker uses.

It pulls batches from a durable consumer, runs the handler for each message concurrently (bounded),
acks only after the handler returned (its effects are durable by then), and decides what a failure
means:

* :class:`Defer` - not an error: redeliver after the given delay (timers, e.g. gather deadlines);
* :class:`Poison` - the message can never succeed: dead-letter it now with the reason;
* anything else - retry with backoff; after ``max_deliver`` deliveries, dead-letter it.

A dead letter goes to ``aios.dlq.{consumer}.{subject}`` and carries the original body, headers, the
error and the delivery count. A handler exception never escapes the runner: a worker does not die
of its input.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError
from prometheus_client import Counter, Histogram

from ..schemas.events import DeadLetter
from . import subjects
from .catalog import E
from .nats_bus import Bus

log = structlog.get_logger("aios.runner")

HANDLED = Counter("aios_messages_total", "Messages handled", ["consumer", "outcome"])
LATENCY = Histogram("aios_handler_seconds", "Handler latency", ["consumer"])


def _done(inflight: set[asyncio.Task[None]], slots: asyncio.Semaphore, task: asyncio.Task[None]) -> None:
    inflight.discard(task)
    slots.release()


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


@dataclass
class RunnerOptions:
    batch: int = 64
    concurrency: int = 64
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = (0.2, 1.0, 2.0, 5.0)
    fetch_timeout_s: float = 1.0


@dataclass
class ConsumerRunner:
    bus: Bus
    spec: subjects.ConsumerSpec
    handler: Handler
    options: RunnerOptions = field(default_factory=RunnerOptions)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.js.pull_subscribe_bind(durable=self.spec.durable, stream=subjects.STREAM)
        slots = asyncio.Semaphore(self.options.concurrency)
        inflight: set[asyncio.Task[None]] = set()
        log.info("consumer.start", consumer=self.spec.durable, filters=self.spec.filters)
        while not stop.is_set():
            free = self.options.concurrency - len(inflight)
            if free <= 0:
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await sub.fetch(min(self.options.batch, free), timeout=self.options.fetch_timeout_s)
            except (TimeoutError, NatsTimeout, FetchTimeoutError):
                continue  # idle path
            except Exception as exc:  # connection trouble: nats-py reconnects, we wait
                if stop.is_set():
                    break
                log.warning("consumer.fetch_error", consumer=self.spec.durable, error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await slots.acquire()
                task = asyncio.create_task(self._one(msg))
                inflight.add(task)
                task.add_done_callback(lambda t: _done(inflight, slots, t))
        if inflight:
            await asyncio.wait(inflight, timeout=10)
        with contextlib.suppress(Exception):
            await self.bus.nc.flush(timeout=5)
        log.info("consumer.stop", consumer=self.spec.durable)

    async def _one(self, msg: Msg) -> None:
        meta = msg.metadata
        delivery = Delivery(
            subject=msg.subject,
            data=msg.data,
            headers=dict(msg.headers or {}),
            deliveries=meta.num_delivered,
            stream_seq=meta.sequence.stream,
        )
        started = time.perf_counter()
        try:
            await self.handler(delivery)
        except Defer as d:
            await self._settle(msg.nak(delay=d.delay))
            HANDLED.labels(self.spec.durable, "deferred").inc()
            return
        except Poison as exc:
            await self._dead_letter(msg, delivery, f"poison: {exc}")
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # malformed: no retry can fix it
            await self._dead_letter(msg, delivery, f"malformed event: {exc}")
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if delivery.deliveries >= self.options.max_deliver:
                await self._dead_letter(msg, delivery, reason)
            else:
                delay = self.options.backoff_s[min(delivery.deliveries - 1, len(self.options.backoff_s) - 1)]
                log.warning(
                    "handler.retry",
                    consumer=self.spec.durable,
                    subject=delivery.subject,
                    deliveries=delivery.deliveries,
                    error=reason,
                )
                await self._settle(msg.nak(delay=delay))
                HANDLED.labels(self.spec.durable, "retry").inc()
            return
        finally:
            LATENCY.labels(self.spec.durable).observe(time.perf_counter() - started)
        await self._settle(msg.ack())
        HANDLED.labels(self.spec.durable, "ok").inc()

    async def _dead_letter(self, msg: Msg, d: Delivery, reason: str) -> None:
        letter = DeadLetter(
            subject=d.subject,
            consumer=self.spec.durable,
            error=reason[:4000],
            deliveries=d.deliveries,
            stream_seq=d.stream_seq,
            data=d.data.decode("utf-8", errors="replace")[:65536],
            headers=d.headers,
        )
        subject = E.dead_letter.subject(consumer=self.spec.durable, subject=d.subject)
        try:
            await self.bus.emit(E.dead_letter, letter, consumer=self.spec.durable, subject=d.subject)
        except Exception as exc:  # could not record it: let it come back rather than lose it
            log.error("dlq.publish_failed", subject=subject, error=repr(exc))
            await self._settle(msg.nak(delay=5))
            return
        log.error("dead_letter", consumer=self.spec.durable, subject=d.subject, error=reason, deliveries=d.deliveries)
        await self._settle(msg.term())
        HANDLED.labels(self.spec.durable, "dead_letter").inc()

    @staticmethod
    async def _settle(coro: Awaitable[None]) -> None:
        # Acks can fail while reconnecting; the message then simply comes back (at-least-once).
        with contextlib.suppress(Exception):
            await coro
