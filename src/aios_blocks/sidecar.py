"""The side-car SDK (docs/sidecars.md): write a handler for a block's task outputs and ``run`` it.

::

    from aios_blocks import sidecar

    def store(output: sidecar.Output, ctx: sidecar.Context) -> None:
        db.execute("INSERT OR IGNORE INTO outputs VALUES (?, ?)", (output.task_id, output.text))

    sidecar.run(store)

A node agent starts the side-car with its block (``AIOS_NATS_URL``, ``AIOS_BLOCK_ID``, ``AIOS_GEN``,
``AIOS_SIDECAR``: the spec entry as JSON); :func:`run` reads them.

* **Consumer**: one durable pull consumer per side-car name on the block's output subject
  (``sidecar-{bid}-{name}`` on ``AIOS_OUTPUTS``); every copy of the side-car pulls from it, so
  copies share the outputs (queue-group semantics). It is created here, if absent, with the
  spec's ``ackWaitS`` and ``maxDeliver``; the node agent deletes it when the block goes.
* **At-least-once**: an output is acknowledged only after the handler returned. A side-car that
  dies mid-handler gets the output again (after ``ackWaitS``), and so does its next copy.
* **Dedupe by task id**: a task id whose handler already succeeded in this process is acknowledged
  without calling the handler again (a redelivery whose ack was lost). Across restarts the handler
  should be idempotent by task id (the SQLite example's primary key).
* **Retries, then a dead letter**: a handler that raises is retried with backoff (``nak`` with a
  delay); on the ``maxDeliver``-th failed delivery the output goes to
  ``aios.output.{bid}.dlq.{name}.{outcome}`` (catalog ``output.dlq``: ``DeadLetter`` with the
  reason, the body cut to 8 KiB, stored in ``AIOS_OUTPUTS`` with the outputs, which observers
  cannot read) and is terminated.
* An output of another generation of the block id (``gen``) is acknowledged and skipped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog

from .bus import event_ids, subjects
from .bus.catalog import E
from .runtime.ticker import Ticker
from .schemas.events import DeadLetter, SidecarAlert, TaskOutput, decode_envelope

log = structlog.get_logger("aios.sidecar")
T = TypeVar("T")

#: how much of an output a dead letter keeps (dead letters stay small)
DLQ_DATA_BYTES = 8 * 1024
#: task ids remembered for dedupe
SEEN_MAX = 100_000
BACKOFF_S = (0.2, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class Output:
    """One task's output as a handler sees it."""

    block_id: str
    task_id: str
    instance_id: str
    status: int
    body: bytes
    content_type: str
    size: int
    truncated: bool
    time: float
    outcome: str
    gen: int
    #: how many times this output has been delivered to the side-car (1 the first time)
    deliveries: int = 1

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    @classmethod
    def of(cls, ev: TaskOutput, deliveries: int = 1) -> Output:
        body = base64.b64decode(ev.output) if ev.encoding == "base64" else ev.output.encode("utf-8")
        return cls(ev.block_id, ev.task_id, ev.instance_id, ev.status, body, ev.content_type, ev.size, ev.truncated, ev.time,
                   ev.outcome, ev.gen, deliveries)


@dataclass
class Config:
    """Who the side-car is (from the environment its node agent gives it: :meth:`from_env`)."""

    block_id: str
    name: str
    nats_url: str = "nats://127.0.0.1:4222"
    gen: int = 0
    max_deliver: int = 5
    ack_wait_s: float = 30.0
    status: str = "any"
    parameters: dict[str, Any] = field(default_factory=dict)
    nats_ca: str | None = None
    batch: int = 32

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Config:
        env = dict(os.environ if env is None else env)
        missing = [k for k in ("AIOS_BLOCK_ID", "AIOS_SIDECAR") if not env.get(k)]
        if missing:
            raise SystemExit(f"side-car: {', '.join(missing)} not set (a node agent sets them when it starts a side-car)")
        spec = json.loads(env["AIOS_SIDECAR"])
        return cls(
            block_id=env["AIOS_BLOCK_ID"], name=str(spec["name"]), nats_url=env.get("AIOS_NATS_URL") or cls.nats_url,
            gen=int(env.get("AIOS_GEN") or 0), max_deliver=int(spec.get("maxDeliver", 5)),
            ack_wait_s=float(spec.get("ackWaitS", 30.0)), status=str((spec.get("consumes") or {}).get("status", "any")),
            parameters=dict(spec.get("parameters") or {}), nats_ca=env.get("AIOS_NATS_CA") or None,
        )

    @property
    def durable(self) -> str:
        return subjects.sidecar_durable(self.block_id, self.name)


class Seen:
    """The task ids whose handler succeeded, the last ``limit`` of them (insertion order)."""

    def __init__(self, limit: int = SEEN_MAX):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._ids

    def add(self, task_id: str) -> None:
        self._ids[task_id] = None
        self._ids.move_to_end(task_id)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class Verdict:
    """What to do with one delivery: ``ack``, ``retry`` (after ``delay``) or ``dead_letter``."""

    action: str
    reason: str = ""
    delay: float = 0.0


def after_failure(deliveries: int, max_deliver: int, reason: str) -> Verdict:
    """A handler failed on its ``deliveries``-th delivery: retry with backoff, or dead-letter."""
    if deliveries >= max_deliver:
        return Verdict("dead_letter", f"{reason} (after {deliveries} deliveries)")
    return Verdict("retry", reason, BACKOFF_S[min(deliveries - 1, len(BACKOFF_S) - 1)])


class Context:
    """What a handler may use besides the output: its parameters, who it is, alerts."""

    def __init__(self, cfg: Config, nc: Any = None):
        self.cfg = cfg
        self.parameters = cfg.parameters
        self.block_id = cfg.block_id
        self.name = cfg.name
        self._nc = nc
        self._loop: asyncio.AbstractEventLoop | None = None
        self.alerts: list[SidecarAlert] = []

    def alert(self, message: str, task_id: str = "") -> None:
        """Publish an alert on ``aios.block.{bid}.sidecar.{name}.alert`` (core NATS; fire and
        forget) and log it. Callable from a sync handler (run in a thread) or an async one."""
        ev = SidecarAlert(self.block_id, self.name, task_id, message[:4000], time.time())
        self.alerts.append(ev)
        del self.alerts[:-100]
        log.warning("sidecar.alert", block=self.block_id, sidecar=self.name, task_id=task_id, message=message)
        if self._nc is None or self._loop is None:
            return
        subject = E.sidecar_alert.subject(bid=self.block_id, name=self.name)
        body = msgspec.json.encode(ev)

        def send() -> None:
            t = asyncio.ensure_future(self._nc.publish(subject, body))
            t.add_done_callback(lambda f: f.cancelled() or f.exception())

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            send()
        else:
            self._loop.call_soon_threadsafe(send)


Handler = Callable[[Output, Context], "Awaitable[None] | None"]


class Processor:
    """The decisions of one side-car copy, apart from NATS (unit-testable): given a delivery's
    body and count, run the handler (or not) and say what to do with the delivery."""

    def __init__(self, cfg: Config, handler: Handler, ctx: Context | None = None):
        self.cfg = cfg
        self.handler = handler
        self.ctx = ctx or Context(cfg)
        self.seen = Seen()
        self.handled = 0
        self.duplicates = 0
        self.skipped = 0
        self.failures = 0
        self._async = inspect.iscoroutinefunction(handler)

    async def process(self, data: bytes, deliveries: int) -> Verdict:
        try:
            ev = msgspec.convert(decode_envelope(data).data, TaskOutput)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return Verdict("dead_letter", f"malformed output event: {exc}")
        if self.cfg.gen and ev.gen and ev.gen != self.cfg.gen:
            self.skipped += 1
            return Verdict("ack", f"output of generation {ev.gen}, not {self.cfg.gen}")
        if ev.task_id in self.seen:
            self.duplicates += 1
            return Verdict("ack", "duplicate task id")
        out = Output.of(ev, deliveries)
        try:
            if self._async:
                await self.handler(out, self.ctx)  # type: ignore[misc]
            else:
                res = await asyncio.to_thread(self.handler, out, self.ctx)
                if inspect.isawaitable(res):
                    await res
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            return after_failure(deliveries, self.cfg.max_deliver, f"{type(exc).__name__}: {exc}")
        self.seen.add(ev.task_id)
        self.handled += 1
        return Verdict("ack")


async def serve(handler: Handler, cfg: Config, stop: asyncio.Event | None = None, bus: Any = None) -> Processor:
    """Consume the block's outputs with ``handler`` until ``stop`` (see the module doc). ``bus``: an
    open :class:`~aios_blocks.bus.nats_bus.Bus` (tests); else one is opened on ``cfg.nats_url``."""

    from .bus.nats_bus import Bus, connect

    stop = stop or asyncio.Event()
    own = bus is None
    spec = subjects.sidecar(cfg.block_id, cfg.name, cfg.status)
    if bus is None:
        # nats-py retries a first connect that fails (a refused login too) forever: a SIGTERM
        # meanwhile must still stop the side-car now, not after its agent's stopGraceS and a SIGKILL
        nc = await _unless_stopped(stop, connect(cfg.nats_url, name=f"aios-blocks/sidecar/{cfg.durable}", ca=cfg.nats_ca))
        if nc is None:
            log.info("sidecar.stop", consumer=spec.durable, handled=0, connected=False)
            return Processor(cfg, handler)
        # a key of its own: a side-car never holds the system's (its dead letters dedupe among themselves)
        bus = Bus(nc, f"aios-blocks/sidecar/{cfg.durable}", event_key=event_ids.new_key())
    ctx = Context(cfg, bus.nc)
    ctx._loop = asyncio.get_running_loop()
    proc = Processor(cfg, handler, ctx)
    try:
        while True:
            try:  # a JetStream call waits up to its timeout while NATS is away: not past a stop
                puller = await _unless_stopped(stop, _subscribe(bus, spec, cfg))
            except Exception as exc:  # the stream not there yet, NATS away: wait
                if stop.is_set():
                    return proc
                log.warning("sidecar.waiting", consumer=spec.durable, error=repr(exc))
                await _sleep(stop, 1.0)
                continue
            if puller is None:
                return proc
            break
        log.info("sidecar.start", consumer=spec.durable, filters=spec.filters)
        await _fetching(bus, proc, puller, spec.durable, cfg.batch, stop)
        await puller.stop()  # what it took and never handled goes back to the consumer now
    finally:
        if own:
            await bus.close()
    log.info("sidecar.stop", consumer=spec.durable, handled=proc.handled, duplicates=proc.duplicates)
    return proc


async def _fetching(bus: Any, proc: Processor, puller: Any, durable: str, batch: int, stop: asyncio.Event) -> None:
    """Fetch and settle until ``stop``: a ``runtime.ticker.Ticker`` whose tick is one fetch (up to
    1 s) and the settling of what came; a fetch that raised (NATS away, nats-py reconnecting) is
    logged and the next one comes 0.5 s later."""

    async def tick() -> bool:
        try:
            msgs = await puller.take(batch, 1.0)
        except Exception:
            if stop.is_set():  # stopping: not an error
                return True
            raise
        for msg in msgs:
            await _settle(bus, proc, msg, durable)
        return True

    ticker = Ticker(0.0, "sidecar.fetch_error", log.bind(consumer=durable), next_in=lambda ok: 0.0 if ok else 0.5)
    await ticker.run(tick, stop)


async def _settle(bus: Any, proc: Processor, msg: Any, durable: str) -> None:
    meta = msg.metadata
    v = await proc.process(msg.data, meta.num_delivered)
    try:
        if v.action == "ack":
            await msg.ack_sync(timeout=5)
        elif v.action == "retry":
            log.warning("sidecar.retry", consumer=durable, deliveries=meta.num_delivered, error=v.reason)
            await msg.nak(delay=v.delay)
        else:
            letter = DeadLetter(
                subject=msg.subject, consumer=durable, error=v.reason[:4000], deliveries=meta.num_delivered,
                stream_seq=meta.sequence.stream, data=msg.data[:DLQ_DATA_BYTES].decode("utf-8", errors="replace"),
                headers={k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"},
            )
            # in AIOS_OUTPUTS with the outputs (users' data), not in AIOS where observers read
            outcome = (E.block_output.match(msg.subject) or {}).get("outcome") or msg.subject.rsplit(".", 1)[-1]
            tokens = {"bid": proc.cfg.block_id, "name": proc.cfg.name, "outcome": outcome}
            await bus.emit(E.output_dead_letter, letter, sync=True, **tokens)
            log.error("sidecar.dead_letter", consumer=durable, subject=msg.subject, letter=E.output_dead_letter.subject(**tokens),
                      error=v.reason)
            await msg.term()
    except Exception as exc:  # could not settle (NATS away): the server sends it again after ackWaitS
        log.warning("sidecar.settle_failed", consumer=durable, action=v.action, error=repr(exc))


async def _subscribe(bus: Any, spec: Any, cfg: Config) -> Any:
    await bus.ensure_sidecar_consumer(spec, cfg.max_deliver, cfg.ack_wait_s)
    return await bus.puller(spec.stream, spec.durable)


async def _unless_stopped(stop: asyncio.Event, aw: Awaitable[T]) -> T | None:
    """``aw``'s result (or its exception), or ``None`` once ``stop`` is set first (``aw`` is cancelled)."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return None
    return task.result()


async def _sleep(stop: asyncio.Event, s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), s)


def run(handler: Handler, cfg: Config | None = None) -> None:
    """Serve ``handler`` until SIGTERM/SIGINT (the node agent stops side-cars with SIGTERM)."""
    cfg = cfg or Config.from_env()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(handler, cfg, stop)

    asyncio.run(main())


__all__ = ["Config", "Context", "Output", "Processor", "Seen", "Verdict", "after_failure", "run", "serve"]
