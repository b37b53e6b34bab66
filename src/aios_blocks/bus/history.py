"""Read the stored messages of one subject filter, oldest first, from a stream sequence on: one
``STREAM.MSG.GET`` with ``next_by_subj`` per message (the request a role with ``STREAM.MSG.GET``
rights may send; no consumer is made). For the tenant desk's history pages (``workers.tenants``):
a block's events are a small part of the stream, and the server jumps to the next one of them.

The tenant's side (docs/security.md "Tenants"): ``ask_history`` (a page), ``ask_all_history``
(every page), and ``follow`` (``blocks watch -c``: its block's history from a sequence, then its
live relayed events, each event once: the relay is core NATS and may deliver one twice).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.js.errors import NotFoundError

from . import subjects
from .catalog import EVENTS, STREAM, Event

#: the stored events of a block, which the gateway's relay passes on to its tenant
RELAYED: tuple[Event[Any], ...] = tuple(e for e in EVENTS if e.stored and e.stream == STREAM
                                        and e.pattern.startswith(f"{subjects.ROOT}.block.{{bid}}."))


def relayed(subject: str) -> Event[Any] | None:
    """The catalog event of a stored block event (``None``: a request, a query, anything else)."""
    for e in RELAYED:
        if e.match(subject) is not None:
            return e
    return None


@dataclass(frozen=True)
class Stored:
    seq: int
    subject: str
    data: bytes


async def stored_from(js: Any, stream: str, subject: str, start: int) -> AsyncIterator[Stored]:
    """Every message of ``stream`` on ``subject`` (wildcards allowed) at sequence ``start`` or
    later, in order; it ends at the last one stored when it is reached."""
    seq = max(1, int(start))
    while True:
        try:
            m = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        yield Stored(int(m.seq), str(m.subject), bytes(m.data or b""))
        seq = int(m.seq) + 1


# -- a tenant's side: asking the desk for its block's history ----------------------------------------
def history_request_subject(bid: str) -> str:
    """What a tenant's client asks in its own account (its account maps it to
    ``aios.tenant.<t>.block.B.history``, catalog ``tenant.block.history``)."""
    return f"aios.block.{bid}.history"


async def ask_history(nc: Any, bid: str, start: int = 1, limit: int = 100, timeout: float = 30.0) -> dict[str, Any]:
    """One page of block ``bid``'s history, asked with a tenant's connection: ``{"block_id",
    "events", "next", "more"}``. A block that is not the tenant's (or none): :class:`LookupError`
    with the desk's words; any other refusal: :class:`RuntimeError`."""
    import msgspec

    body = msgspec.json.encode({"from": start, "limit": limit})
    reply = await nc.request(history_request_subject(bid), body, timeout=timeout)
    headers = reply.headers or {}
    status = int(headers.get("Aios-Status", "200"))
    if status == 404:
        raise LookupError(headers.get("Aios-Error") or f"no block {bid}")
    if status != 200:
        raise RuntimeError(f"history of {bid} refused ({status}): {headers.get('Aios-Error', '')}")
    page: dict[str, Any] = msgspec.json.decode(reply.data)
    return page


async def ask_all_history(nc: Any, bid: str, start: int = 1, limit: int = 100) -> dict[str, Any]:
    """Every page from ``start`` on, as one page (``more`` false)."""
    events: list[Any] = []
    while True:
        page = await ask_history(nc, bid, start, limit)
        events += page["events"]
        if not page["more"]:
            return {**page, "events": events}
        start = page["next"]


# -- a tenant's watch: history from a sequence, then live, each event once ---------------------------
class Once:
    """Which events were shown: an event is its subject and CloudEvent ``id`` (the system's ids are
    deterministic per step, ``{bid}:{gen}:{step}:{key}``: a step redelivered and published again
    carries the same id, which JetStream stores once but the core-NATS relay passes on twice). The
    last ``size`` keys are kept. An event without an id is always new."""

    def __init__(self, size: int = 10_000) -> None:
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._size = size

    def first(self, subject: str, event: Any) -> bool:
        """True the first time this event is seen (and remembers it)."""
        eid = event.get("id") if isinstance(event, dict) else None
        if not isinstance(eid, str) or not eid:
            return True
        key = (subject, eid)
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True


def _decoded(data: bytes) -> dict[str, Any]:
    import msgspec

    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {"data": data.decode("utf-8", errors="replace")}
    return doc if isinstance(doc, dict) else {"data": doc}


async def follow(nc: Any, bid: str = "*", since: int | None = None,
                 limit: int = 100) -> AsyncIterator[tuple[int | None, str, dict[str, Any]]]:
    """A tenant's watch, with its own connection: ``(seq, subject, event)`` of block ``bid``'s
    events (``*``: every block of the tenant, live only), each once (:class:`Once`). With ``since``,
    first the block's stored events from that stream sequence (the desk's history pages: a block
    that is not the tenant's is :class:`LookupError`, as ``ask_history``), then the live ones
    (``seq`` ``None``: the relay does not know it). The live subscription is made before the
    history is read, so nothing falls between them; what both hold is shown once. A message with a
    reply (a request the tenant's own users send on ``aios.block.B.…``) or on a subject that is no
    stored block event is not an event of the block: left out."""
    if since is not None and bid == "*":
        raise ValueError("--since needs a block id: a tenant's history is asked block by block")
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await queue.put(msg)

    sub = await nc.subscribe(subjects.block_all(bid), cb=cb)
    try:
        await nc.flush()
        once = Once()
        if since is not None:
            start = since
            while True:
                page = await ask_history(nc, bid, start, limit)
                for e in page["events"]:
                    if once.first(e["subject"], e["event"]):
                        yield e["seq"], e["subject"], e["event"]
                if not page["more"]:
                    break
                start = page["next"]
        while True:
            msg = await queue.get()
            if msg.reply or relayed(msg.subject) is None:
                continue
            event = _decoded(msg.data)
            if once.first(msg.subject, event):
                yield None, msg.subject, event
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
