"""Read the stored messages of one subject filter, oldest first, from a stream sequence on: one
``STREAM.MSG.GET`` with ``next_by_subj`` per message (the request a role with ``STREAM.MSG.GET``
rights may send; no consumer is made). For the tenant desk's history pages (``workers.tenants``):
a block's events are a small part of the stream, and the server jumps to the next one of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.js.errors import NotFoundError


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
