"""Queries over core NATS that notice when nobody is listening.

A query (a non-stored catalog event, e.g. ``cluster.dry_run``) is a plain publish to a queue
group: NATS drops it when no member of the group is subscribed, e.g. while the controller
process of ``blocks up --process-per-kind`` is still starting, or while every copy restarts. The
asker would only find out at its deadline.

So each query goes out with a reply subject on the sender's inbox. The receivers never answer it
(the answer is a stored event); but when the server has no subscriber for the subject it sends a
*no responders* status (503) to that reply subject at once, and the query is sent again after a
short backoff, for as long as ``give_up_s`` allows (the asker's own deadline re-ask covers the
rest). A query taken by a receiver that dies is still lost: that is the deadline's job.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client

log = structlog.get_logger("aios.bus")

#: the status NATS sends to a request's reply subject when no one is subscribed to its subject
NO_RESPONDERS = "503"


@dataclass
class _Held:
    subject: str
    body: bytes
    headers: dict[str, str]
    first: float
    tries: int


class QuerySender:
    def __init__(self, nc: Client, give_up_s: float = 10.0, first_backoff_s: float = 0.05, max_backoff_s: float = 1.0,
                 hold_s: float = 2.0):
        self.nc = nc
        self.give_up_s = give_up_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        #: how long a sent query is remembered: a no-responders status comes back within a round trip
        self.hold_s = hold_s
        self._inbox: str | None = None
        self._sub: Any = None
        self._next = 0
        self._held: collections.OrderedDict[str, tuple[float, _Held]] = collections.OrderedDict()
        self._timers: set[asyncio.TimerHandle] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: queries sent again because nobody was listening (for tests and logs)
        self.resent = 0
        self.dropped = 0

    async def _reply_to(self) -> str:
        if self._inbox is None:
            inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{inbox}.*", cb=self._on_status)
            self._inbox = inbox
        return self._inbox

    async def send(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        await self._send(_Held(subject, body, headers, time.monotonic(), 0))

    async def _send(self, q: _Held) -> None:
        inbox = await self._reply_to()
        now = time.monotonic()
        while self._held:  # forget what is old enough that no status can still come for it
            token, (sent, _) = next(iter(self._held.items()))
            if now - sent < self.hold_s:
                break
            del self._held[token]
        self._next += 1
        token = str(self._next)
        self._held[token] = (now, q)
        await self.nc.publish(q.subject, q.body, reply=f"{inbox}.{token}", headers=q.headers)

    async def _on_status(self, msg: Any) -> None:
        if not msg.headers or msg.headers.get("Status") != NO_RESPONDERS:
            return
        entry = self._held.pop(msg.subject.rsplit(".", 1)[-1], None)
        if entry is None:
            return
        q = entry[1]
        if time.monotonic() - q.first >= self.give_up_s:
            self.dropped += 1
            log.warning("query.no_responders", subject=q.subject, tries=q.tries + 1,
                        note="nobody listens: left to the asker's deadline")
            return
        if q.tries == 0:
            log.info("query.no_responders_retry", subject=q.subject)
        q.tries += 1
        self.resent += 1
        delay = min(self.max_backoff_s, self.first_backoff_s * 2 ** (q.tries - 1))
        loop = asyncio.get_running_loop()

        def again() -> None:
            self._timers.discard(handle)
            task = loop.create_task(self._resend(q))
            self._tasks.add(task)  # a task nobody holds may be collected before it runs
            task.add_done_callback(self._tasks.discard)

        handle = loop.call_later(delay, again)
        self._timers.add(handle)

    async def _resend(self, q: _Held) -> None:
        if self.nc.is_closed:
            return
        try:
            await self._send(q)
        except Exception as exc:  # closing or disconnected: the asker's deadline asks again
            log.warning("query.resend_failed", subject=q.subject, error=repr(exc))

    def close(self) -> None:
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        for t in self._tasks:
            t.cancel()
