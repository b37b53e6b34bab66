"""The one periodic loop every worker's timer runs (the autoscaler's tick, the health checker's, the
metrics collector's, the virtual cluster sweep, the reconciler's pass, the node health rounds,
the gateway's gather timers, the /metrics target's registration).

A tick that raises is logged and the loop goes on (Redis or NATS away for a moment: the next tick
tries again); ``stop`` ends the wait at once. Ticks keep a fixed rate (the next is due ``interval_s``
after the previous was due, never in the past: a slow tick is not followed by a burst), unless
``next_in`` says when to look again from the tick's result. ``guard`` (``workers.base.EpochGuard``)
is asked before each tick: no valid state (Redis flushed, ``blocks recover`` under way), no tick.
``wake`` (an ``asyncio.Event``) brings the next tick forward, ``debounce_s`` after it is set.

Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Guard(Protocol):
    async def current(self) -> Any: ...


class Log(Protocol):
    def warning(self, event: str, **kw: Any) -> Any: ...


@dataclass
class Ticker:
    """``await Ticker(...).run(tick, stop)``; ``failed``: the log event of a tick that raised."""

    interval_s: float
    failed: str
    log: Log | logging.Logger | None = None
    #: seconds until the next tick, from the tick's result (``None`` when it raised); default: the fixed rate
    next_in: Callable[[Any], float] | None = None
    guard: Guard | None = None
    #: wait before the first tick (the reconciler's pass, the node health rounds), else tick at once
    wait_first: bool = False
    wake: asyncio.Event | None = None
    debounce_s: float = 0.0
    #: ticks done (raised or not), for tests and logs
    ticks: int = 0

    async def run(self, tick: Callable[[], Awaitable[Any]], stop: asyncio.Event) -> None:
        due = time.monotonic()
        if self.wait_first:
            due += self.interval_s
            await self._pause(stop, due)
        while not stop.is_set():
            result = None
            try:
                if self.guard is not None:
                    await self.guard.current()
                result = await tick()
            except Exception as exc:  # never die of one tick: the next tries again
                self._warn(exc)
            self.ticks += 1
            if self.next_in is not None:
                due = time.monotonic() + self.next_in(result)
            else:
                due = max(due + self.interval_s, time.monotonic())
            await self._pause(stop, due)

    async def _pause(self, stop: asyncio.Event, due: float) -> None:
        """Until ``due``, ``stop`` or (``debounce_s`` after) ``wake``."""
        waits = [asyncio.ensure_future(stop.wait())]
        if self.wake is not None:
            waits.append(asyncio.ensure_future(self.wake.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, due - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        if self.wake is not None and self.wake.is_set() and not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.debounce_s)
            self.wake.clear()

    def _warn(self, exc: Exception) -> None:
        if isinstance(self.log, logging.Logger):
            self.log.warning("%s: %r", self.failed, exc)
        elif self.log is not None:
            self.log.warning(self.failed, error=repr(exc))
