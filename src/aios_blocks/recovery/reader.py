"""Read the whole stream fast (``blocks recover``, ``blocks check``): one ephemeral push consumer
(ack none, flow control, heartbeats: what nats-py's ordered consumer creates), whose messages are
cut out of the connection's byte stream by :class:`_Tap` and handed to the caller in order,
without nats-py building a ``Msg``, parsing its headers, queueing it and awaiting a callback per
message (most of the client's time when reading a million messages, docs/benchmarks.md).

Order and completeness are checked as the ordered consumer checks them: each message's consumer
sequence must follow the previous one; on a gap (a message lost, e.g. across a reconnect) the
consumer is recreated from the stream sequence after the last message handed out, so the caller
sees every stored message once, oldest first. The read ends at the first message whose pending
count is 0 (the last one matching the filters when it was delivered).

The tap stands in for the connection's protocol parser (``nc._ps``, nats-py's private parser
object, a stable ``parse(bytes)`` / ``reset()`` pair since nats-py 2.0) while the read lasts; every
protocol unit that is not a message of the read's subscription (PING, INFO, replies to requests,
other subscriptions' messages) is passed whole to nats-py's parser. Where the connection has no
such parser, :func:`usable` says so and the caller reads through nats-py's ordered consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from ..bus.consumer_names import create_named

OnMsg = Callable[[str, bytes, int, float], None]

#: the heartbeat the consumer sends when idle (it carries the flow-control reply when stalled)
HEARTBEAT_S = 2.0


class StreamReadError(Exception):
    """The server refused or ended the read (a status other than heartbeat / flow control)."""


def usable(nc: Any) -> bool:
    """Whether this nats-py connection has the parser the tap stands in for."""
    ps = getattr(nc, "_ps", None)
    return ps is not None and callable(getattr(ps, "parse", None)) and callable(getattr(ps, "reset", None))


class _Tap:
    """The connection's parser while the stream is read: messages of subscription ``sid`` go to
    ``on_msg``; everything else, as whole protocol units, to nats-py's parser (``inner``)."""

    def __init__(self, nc: Any, on_msg: OnMsg):
        self.nc = nc
        self.inner = nc._ps
        self.on_msg = on_msg
        self.buf = b""
        #: a large message being gathered: the parts read since, their size, the size still needed
        self.parts: list[bytes] = []
        self.have = 0
        self.need = 0
        self.sid = b""  # the subscription being read ("" once done or between consumers)
        self.ours: set[bytes] = set()  # every subscription this read made (stragglers are dropped)
        self.next_dseq = 1  # the consumer sequence expected next
        self.last_sseq = 0  # stream sequence of the last message handed out
        self.count = 0
        self.last_activity = time.monotonic()
        self.done = asyncio.Event()
        self.gap = asyncio.Event()
        self.error: BaseException | None = None
        self.detaching = False

    # -- the parser interface nats-py calls ------------------------------------------------------
    def reset(self) -> None:  # on reconnect
        self.buf = b""
        self.parts, self.have, self.need = [], 0, 0
        self.inner.reset()

    async def parse(self, data: bytes = b"") -> None:
        if not self.buf and getattr(self.inner, "buf", None):
            # nats-py's parser was in the middle of a unit when the tap came: it finishes it (a
            # message of the read it takes meanwhile goes nowhere: a gap, so the consumer restarts)
            await self.inner.parse(data)
            return
        if self.need:  # the rest of a large message: gather its parts, join them once
            self.parts.append(bytes(data))
            self.have += len(data)
            if self.have < self.need:
                return
            data = b"".join(self.parts)
            self.parts, self.have, self.need = [], 0, 0
        buf = self.buf + data if self.buf else bytes(data)
        self.buf = b""
        n = len(buf)
        pos = 0
        sid, ours = self.sid, self.ours
        on_msg = self.on_msg
        find = buf.find
        startswith = buf.startswith
        while pos < n:
            eol = find(b"\r\n", pos)
            if eol < 0:
                break
            if startswith(b"HMSG ", pos):
                args = buf[pos + 5 : eol].split(b" ")
                if len(args) == 5:
                    subj, msid, reply, hlen, tlen = args
                else:
                    subj, msid, hlen, tlen = args
                    reply = b""
                h = int(hlen)
            elif startswith(b"MSG ", pos):
                args = buf[pos + 4 : eol].split(b" ")
                if len(args) == 4:
                    subj, msid, reply, tlen = args
                else:
                    subj, msid, tlen = args
                    reply = b""
                h = 0
            else:  # a one-line operation (PING, PONG, +OK, -ERR, INFO)
                await self.inner.parse(buf[pos : eol + 2])
                pos = eol + 2
                continue
            start = eol + 2
            end = start + int(tlen)
            if end + 2 > n:
                if end + 2 - pos > 65536:  # a large one: the next reads are gathered first
                    self.need = end + 2 - n
                break  # the rest of it comes with the next read
            unit_end = end + 2
            if msid != sid:
                if msid not in ours:  # another subscription's: nats-py's
                    await self.inner.parse(buf[pos:unit_end])
                pos = unit_end  # (or a straggler of a consumer this read replaced: dropped)
                continue
            pos = unit_end
            if not reply.startswith(b"$JS.ACK."):
                await self._status(buf[start : start + h], reply)
                sid = self.sid
                continue
            # a stored message: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
            # (or v2: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>])
            t = reply.split(b".")
            if len(t) == 9:
                sseq, dseq, ts, pending = int(t[5]), int(t[6]), int(t[7]), int(t[8])
            else:
                sseq, dseq, ts, pending = int(t[7]), int(t[8]), int(t[9]), int(t[10])
            if dseq != self.next_dseq:
                self._lost()  # a message is missing: this consumer's others are dropped
                sid = self.sid
                continue
            self.next_dseq = dseq + 1
            self.last_sseq = sseq
            try:
                on_msg(subj.decode(), buf[start + h : end], sseq, ts / 1e9)
            except BaseException as exc:  # never into nats-py's read loop: it would stop reading
                self._fail(exc)
                sid = self.sid
                continue
            self.count += 1
            if pending == 0:
                self._finish()
                sid = self.sid
        self.last_activity = time.monotonic()
        if pos < n:
            self.buf = buf[pos:]
        if self.detaching and not self.buf and not self.need and self.nc._ps is self:
            self.nc._ps = self.inner

    async def _status(self, hdr: bytes, reply: bytes) -> None:
        """Heartbeats and flow control of the consumer; any other status ends the read."""
        line = hdr.split(b"\r\n", 1)[0]  # NATS/1.0 100 Idle Heartbeat
        code = line[9:12]
        if code == b"100":
            if reply:  # flow control request: every message before it is handled already
                await self.nc.publish(reply.decode(), b"")
            for h in hdr.split(b"\r\n")[1:]:
                name, _, value = h.partition(b":")
                name, value = name.strip().lower(), value.strip()
                if name == b"nats-consumer-stalled" and value:
                    await self.nc.publish(value.decode(), b"")
                elif name == b"nats-last-consumer" and value.isdigit() and int(value) >= self.next_dseq:
                    self._lost()  # the heartbeat says it sent more than came here
            return
        self._fail(StreamReadError(f"stream read ended by the server: {line.decode(errors='replace')}"))

    # -- outcomes ----------------------------------------------------------------------------------
    def _finish(self) -> None:
        self.sid = b""
        self.done.set()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._finish()

    def _lost(self) -> None:
        self.sid = b""
        self.gap.set()

    def detach(self) -> None:
        """Hand the connection back to nats-py's parser (once no partial unit is buffered here)."""
        self.sid = b""
        self.detaching = True
        if not self.buf and self.nc._ps is self:
            self.nc._ps = self.inner


async def read(js: Any, nc: Any, stream: str, on_msg: OnMsg, filters: list[str], idle_s: float = 10.0,
               from_seq: int = 0) -> int:
    """Feed every stored message of ``stream`` matching ``filters`` (from ``from_seq``, else the
    first) to ``on_msg``, oldest first; returns how many. ``usable(nc)`` must hold."""
    tap = _Tap(nc, on_msg)
    nc._ps = tap
    sub: Any = None
    consumer = ""
    resets = 0

    async def start(from_seq: int) -> None:
        nonlocal sub, consumer
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=_ignore)
        await nc.flush()
        tap.next_dseq = 1
        tap.sid = str(sub._id).encode()
        tap.ours.add(tap.sid)
        tap.gap.clear()
        # named: an observer may create only consumers named after its user (docs/security.md),
        # so `blocks check` works as one
        cfg = ConsumerConfig(
            deliver_subject=inbox, ack_policy=AckPolicy.NONE, max_deliver=1, flow_control=True,
            idle_heartbeat=HEARTBEAT_S, mem_storage=True, num_replicas=1, inactive_threshold=60.0,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if from_seq else DeliverPolicy.ALL,
            opt_start_seq=from_seq or None,
        )
        if len(filters) == 1:
            cfg.filter_subject = filters[0]
        else:
            cfg.filter_subjects = filters
        consumer, info = await create_named(nc, js, stream, "read",
                                            lambda j, name: j.add_consumer(stream, config=cfg.evolve(name=name)))
        if info.num_pending == 0 and tap.next_dseq == 1:
            tap._finish()  # nothing (more) matches: no message will come to end the read

    async def stop() -> None:
        nonlocal sub, consumer
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            sub = None
        if consumer:
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, consumer)
            consumer = ""

    try:
        await start(from_seq)
        while not tap.done.is_set():
            waiter = asyncio.ensure_future(tap.done.wait())
            lost = asyncio.ensure_future(tap.gap.wait())
            try:
                await asyncio.wait({waiter, lost}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                lost.cancel()
            if tap.done.is_set():
                break
            if tap.gap.is_set() or time.monotonic() - tap.last_activity > idle_s:
                resets += 1
                if resets > 3:
                    raise TimeoutError(f"stream read stalled or lost messages after {tap.count} messages")
                await stop()
                await start(tap.last_sseq + 1)
        if tap.error is not None:
            raise tap.error
        return tap.count
    finally:
        tap.detach()
        await stop()


async def _ignore(msg: Any) -> None:
    """The subscription's callback: never called (the tap takes its messages)."""
