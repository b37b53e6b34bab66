"""Taking a durable pull consumer's messages: one ``no_wait`` request at a time, each followed to
its end (in place of nats-py's ``PullSubscription.fetch``).

Why: ``fetch`` falls back to a lingering pull request (no ``no_wait``) when its first request
saw only a status, a stale one included, and then waits for the whole batch or the request's
expiry. A consumer shared by several worker copies, or one at the tail of a burst, so sat on a
partial batch for up to the fetch timeout (1 s) before handling it: ~1 s stalls in one burst in
three with two controller and two gateway copies (docs/benchmarks.md, "Stop 28").

Here every request is ``{"batch": n, "expires": timeout, "no_wait": true}``. nats-server waits up
to ``expires`` for a first message, then sends what it has followed by ``404 No Messages``
(``408 Request Timeout`` when nothing came; no status when the batch was filled), so a take
returns as soon as anything is there. One request is open at a time and its end is known (its
status, its batch filled, or its expiry passed), so a status never ends another request, and
messages still arriving for it are taken by the next take.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

#: how long past a request's expiry its end (status) may take to arrive before it is given up
GRACE_S = 0.5
#: a request's end: nothing (more) to send now, or its expiry
ENDS = frozenset({"404", "408"})
#: idle heartbeat and flow control: not messages, not an end
IGNORED = frozenset({"100"})
#: the pause after a request that ended with "no messages" before any came
NO_MESSAGES_PAUSE_S = 0.05


class PullError(Exception):
    """The server refused a pull request (``409``: consumer deleted, push based, too many waiting
    requests; ``400``...)."""


class Puller:
    """The messages of durable ``durable`` on ``stream``, taken ``n`` at a time (``take``)."""

    def __init__(self, nc: Any, api_prefix: str, stream: str, durable: str):
        self._nc = nc
        self._subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._inbox = ""
        self._sub: Any = None
        #: the open request: when it expires (None: none open) and how many it may still deliver
        self._open_until: float | None = None
        self._left = 0

    async def start(self) -> Puller:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg, pending_msgs_limit=1_000_000,
                                             pending_bytes_limit=512 * 1024 * 1024)
        return self

    async def stop(self) -> int:
        """Leave the inbox and give back (nak) the messages delivered and not taken, so another
        copy gets them now rather than after the consumer's ack wait. Drained, not just
        unsubscribed: what the server sent before it saw us leave still reaches the queue.
        Returns how many were given back."""
        if self._sub is not None:
            try:
                await self._sub.drain()
            except Exception:  # closed connection: nothing to leave
                pass
        given = 0
        while not self._queue.empty():
            msg = self._queue.get_nowait()
            if _status(msg):
                continue
            try:
                await msg.nak()
                given += 1
            except Exception:  # no connection: it comes back after the ack wait instead
                pass
        return given

    async def _on_msg(self, msg: Any) -> None:
        self._queue.put_nowait(msg)

    async def take(self, n: int, timeout: float) -> list[Any]:
        """Up to ``n`` messages: those already here, else the first the server sends within
        ``timeout`` seconds and any that came with it; ``[]`` when none came."""
        msgs: list[Any] = []
        self._drain(msgs, n)
        if msgs:
            return msgs
        if self._open_until is None:
            await self._request(n, timeout)
        while self._open_until is not None:
            left = self._open_until - time.monotonic()
            if left <= 0:  # its end never came (a reconnect, a lost status): the next take asks again
                self._open_until = None
                break
            try:
                async with asyncio.timeout(left):
                    msg = await self._queue.get()
            except TimeoutError:
                self._open_until = None
                break
            ended = self._settle(msg, msgs)
            if msgs:
                self._drain(msgs, n)
                break
            if ended == "404":
                # "no messages" before any came: a server that does not wait when asked no_wait
                # (older than the 2.9+ this was checked on) would have the runner ask again at once
                # and forever; ask again after a pause instead
                await asyncio.sleep(NO_MESSAGES_PAUSE_S)
        return msgs

    async def _request(self, n: int, timeout: float) -> None:
        body = json.dumps({"batch": n, "expires": int(timeout * 1e9), "no_wait": True}).encode()
        self._open_until, self._left = time.monotonic() + timeout + GRACE_S, n
        await self._nc.publish(self._subject, body, reply=self._inbox)

    def _drain(self, msgs: list[Any], n: int) -> None:
        while len(msgs) < n and not self._queue.empty():
            self._settle(self._queue.get_nowait(), msgs)

    def _settle(self, msg: Any, msgs: list[Any]) -> str:
        """A message joins ``msgs``; a status ends the open request (or is ignored). Returns the
        status that ended the request, else ``""``."""
        status = _status(msg)
        if not status:
            msgs.append(msg)
            self._left -= 1
            if self._left <= 0:  # its batch filled: the server sends no status for that
                self._open_until = None
            return ""
        if status in IGNORED:
            return ""
        self._open_until = None
        if status not in ENDS and not msgs:
            raise PullError(f"{status} {msg.headers.get('Description', '')}".strip())
        return str(status)


def _status(msg: Any) -> str | None:
    """A status message's code (``404``...), None for a message of the stream."""
    return msg.headers.get("Status") if msg.headers else None
