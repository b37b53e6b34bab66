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
