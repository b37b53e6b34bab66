"""Task outputs for side-cars: the executor hands each answered task's output to an
:class:`OutputPublisher`, which publishes it to ``aios.output.{bid}.{outcome}`` (the
``AIOS_OUTPUTS`` stream) off the task's path (docs/sidecars.md).

* ``offer`` is synchronous and O(1): it never waits, never raises, and never touches NATS. It is
  called as the task's answer is handed back, so the caller's reply is never held by an output.
* A bounded buffer (``outputs_buffer``) sits between the tasks and NATS. A background loop drains
  it in batches (gathered for ``outputs_linger_ms`` after the first output: fewer, larger batches
  cost the executor about a third of the CPU per output of one publish each), publishing each batch concurrently and waiting for the stream's acks (bounded by
  ``outputs_publish_timeout_s``); a batch that failed (NATS away or slow) is tried again, with
  backoff, until it is stored: the message id is the task id (catalog id rule
  ``output:{block_id}:{task_id}``), so a retried publish is deduplicated by JetStream.
* While NATS is away the buffer fills; once full, new outputs are **dropped and counted**
  (``aios_executor_outputs_total{outcome="dropped"}``): a NATS outage never fails or slows a task,
  and costs at most the outputs beyond the buffer.
* Outputs larger than ``outputs_max_msg_bytes`` are cut to that size and marked ``truncated``
  (``size`` keeps the whole answer's size).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import Counter

from ..bus.catalog import E, Emit
from ..runtime.ticker import Ticker
from ..schemas.events import TaskOutput
from ..settings import Settings

log = structlog.get_logger("aios.executor.outputs")

OUTPUTS = Counter("aios_executor_outputs_total", "Task outputs for side-cars, by what became of them", ["outcome"])

#: a caller's task id (header ``Aios-Task-Id``): it becomes part of a message id
TASK_ID_MAX = 128


def task_id_of(headers: dict[str, str]) -> tuple[str, str]:
    """(task id, problem): the caller's ``Aios-Task-Id`` when it is a valid one, else a fresh id;
    ``problem`` says why a given one was refused ("" when fine)."""
    given = headers.get("Aios-Task-Id") or headers.get("aios-task-id")
    if not given:
        return uuid.uuid4().hex, ""
    if len(given) > TASK_ID_MAX or not all(c.isalnum() or c in "-_.:" for c in given) or not given.isascii():
        return "", (f"Aios-Task-Id must be at most {TASK_ID_MAX} characters of letters, digits, '-', '_', '.', ':'; "
                    f"got {given[:40]!r}")
    return given, ""


def encode_output(body: bytes, limit: int) -> tuple[str, str, bool]:
    """(text, encoding, truncated) of an answer's body cut to ``limit`` bytes: UTF-8 text when it
    is, else base64."""
    cut = body[:limit]
    truncated = len(body) > limit
    try:
        text = cut.decode("utf-8")
        return text, "utf-8", truncated
    except UnicodeDecodeError:
        if truncated:  # a multi-byte character cut at the limit: text up to the last whole one
            for drop in (1, 2, 3):
                with contextlib.suppress(UnicodeDecodeError):
                    return cut[: len(cut) - drop].decode("utf-8"), "utf-8", True
        return base64.b64encode(cut).decode("ascii"), "base64", truncated


@dataclass
class _Pending:
    bid: str
    task_id: str
    iid: str
    status: int
    body: bytes
    size: int
    content_type: str
    at: float
    gen: int


class OutputPublisher:
    """Bounded, non-blocking publishing of task outputs (see the module doc)."""

    def __init__(self, bus: Any, settings: Settings):
        self.bus = bus
        self.limit = settings.outputs_max_msg_bytes
        self.capacity = settings.outputs_buffer
        self.timeout_s = settings.outputs_publish_timeout_s
        self.linger_s = settings.outputs_linger_ms / 1000
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self.published = 0
        self.dropped = 0
        self.retried = 0

    def offer(self, bid: str, task_id: str, iid: str, status: int, body: bytes, content_type: str = "",
              size: int | None = None, gen: int = 0) -> bool:
        """Queue one output; ``False`` (counted) when the buffer is full. Never blocks or raises."""
        if len(self._queue) >= self.capacity:
            self.dropped += 1
            OUTPUTS.labels("dropped").inc()
            return False
        self._queue.append(_Pending(bid, task_id, iid, status, bytes(body[: self.limit + 4]),
                                    len(body) if size is None else size, content_type, time.time(), gen))
        self._wake.set()
        return True

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _event(self, p: _Pending) -> TaskOutput:
        text, enc, truncated = encode_output(p.body, self.limit)
        return TaskOutput(p.bid, p.task_id, p.iid, p.status, text, enc, p.content_type, p.size,
                          truncated or p.size > self.limit, p.at, "ok" if p.status < 400 else "error", p.gen)

    async def run(self, stop: asyncio.Event, batch: int = 256) -> None:
        """Drain the buffer until ``stop`` (what is left then is tried once more, briefly). The loop
        is a ``runtime.ticker.Ticker``: each tick waits for an output or publishes a batch
        (``_step``) and says when the next is due: at once, or after the backoff of a batch NATS
        did not store."""
        self._delay = 0.1
        ticker = Ticker(0.0, "outputs.step_failed", log, next_in=lambda due: 0.1 if due is None else due)
        await ticker.run(lambda: self._step(stop, batch), stop)
        await self._last(batch)

    async def _step(self, stop: asyncio.Event, batch: int) -> float:
        """Wait for an output (then linger for a batch to gather), or publish one batch: the seconds
        until the next step (0; the backoff, 0.1 s doubling to 2 s, after a failed batch)."""
        if not self._queue:
            self._wake.clear()
            waker = asyncio.ensure_future(self._wake.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([waker, stopper], return_when=asyncio.FIRST_COMPLETED)
            waker.cancel()
            stopper.cancel()
            if self.linger_s and not stop.is_set() and len(self._queue) < batch:
                await asyncio.sleep(self.linger_s)  # let a batch gather: a publish per output costs ~3x the CPU
            return 0.0
        items = [self._queue[i] for i in range(min(batch, len(self._queue)))]
        if await self._publish(items):
            self._published(items)
            self._delay = 0.1
            return 0.0
        self.retried += len(items)
        OUTPUTS.labels("retried").inc(len(items))
        delay, self._delay = self._delay, min(self._delay * 2, 2.0)
        return delay

    async def _last(self, batch: int) -> None:
        """Stopping: publish what is left; once NATS refuses a batch, the rest is lost (counted)."""
        while self._queue:
            items = [self._queue[i] for i in range(min(batch, len(self._queue)))]
            if await self._publish(items):
                self._published(items)
                continue
            self.retried += len(items)
            OUTPUTS.labels("retried").inc(len(items))
            self.dropped += len(self._queue)
            OUTPUTS.labels("dropped").inc(len(self._queue))
            self._queue.clear()

    def _published(self, items: list[_Pending]) -> None:
        for _ in items:
            self._queue.popleft()
        self.published += len(items)
        OUTPUTS.labels("published").inc(len(items))

    async def _publish(self, items: list[_Pending]) -> bool:
        try:
            await asyncio.wait_for(self.bus.emit_all([Emit(E.block_output, self._event(p)) for p in items]), self.timeout_s)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NATS away or slow: the batch is tried again (deduplicated)
            log.warning("outputs.publish_failed", outputs=len(items), buffered=len(self._queue), error=repr(exc))
            return False
