"""Announcements pending (docs/reliability.md, "Announcements"): the events of a status step that
the stream has not acked yet, kept in Redis from before the step's compare-and-set until the
publish is acked.

A step is taken in Redis (CAS) and then announced on the stream; when the publish fails the
handler is retried, but its redelivery may find another state (the instance that made the block
ready was lost and replaced meanwhile) and decide otherwise, so the announcement would never be
made: Redis says ``ready``, the stream (and the client waiting for its create's answer) never
hears it, and ``blocks recover`` writes ``placing``. So the step's events are written here
first, removed once acked, and the reconciler's pass publishes again (same message ids, so the
stream deduplicates) those still here a while later whose block holds the step's target.

Under ``aios:health:`` (``recovery.image.LIVE``): not state, not in the digest, not rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..schemas.catalog import BY_NAME, Emit
from .keys import ANNOUNCE, block_key


class _Event(msgspec.Struct):
    e: str
    p: Any
    q: str = ""
    t: dict[str, str] = {}
    id: str | None = None


class _Entry(msgspec.Struct):
    bid: str
    gen: int
    target: str
    at: float
    events: list[_Event]


_decode = msgspec.json.Decoder(_Entry)


@dataclass(frozen=True)
class Pending:
    """One step's announcement not yet acked: its block, the status the step moves it to, when it
    was marked, and its events."""

    key: str
    block_id: str
    gen: int
    target: str
    at: float
    events: tuple[Emit, ...]


def key_of(events: Iterable[Emit]) -> str:
    """An announcement's key: its events' message ids (the same events, the same key)."""
    return ",".join(e.logical_id() for e in events)


def _wire(e: Emit) -> _Event:
    # through JSON, not ``to_builtins``: a payload may hold ``msgspec.Raw`` (a decision's policy
    # input and output), which only the encoder takes
    return _Event(e.event.name, msgspec.json.decode(msgspec.json.encode(e.payload)), e.qualifier, dict(e.tokens), e.msg_id)


def _emit(e: _Event) -> Emit:
    event = BY_NAME[e.e]
    payload = e.p if event.payload is None else msgspec.convert(e.p, type=event.payload)
    return Emit(event, payload, e.t, e.q, e.id)


def entry(bid: str, gen: int, target: str, events: Iterable[Emit], at: float) -> tuple[str, str]:
    """An announcement as :meth:`Announcements.mark` keeps it: (its key, its text), the field and
    value of the ``ANNOUNCE`` hash (written by ``mark``, or with the step's CAS in one exchange)."""
    evs = list(events)
    return key_of(evs), msgspec.json.encode(_Entry(bid, gen, target, round(at, 3), [_wire(e) for e in evs])).decode()


class Announcements:
    def __init__(self, r: Any):
        self.r = r

    async def mark(self, bid: str, gen: int, target: str, events: Iterable[Emit], at: float) -> str:
        """Keep ``events`` (a step of ``bid`` to ``target``) until :meth:`done`; returns the key."""
        key, text = entry(bid, gen, target, events, at)
        await self.r.hset(ANNOUNCE, key, text)
        return key

    async def done(self, *keys: str) -> None:
        if keys:
            await self.r.hdel(ANNOUNCE, *keys)

    async def pending(self) -> list[Pending]:
        """Every announcement not acked yet (an unreadable entry is dropped)."""
        out: list[Pending] = []
        bad: list[str] = []
        for key, raw in (await self.r.hgetall(ANNOUNCE)).items():
            try:
                d = _decode.decode(raw)
                events = tuple(_emit(e) for e in d.events)
            except (msgspec.MsgspecError, KeyError):
                bad.append(key)
                continue
            out.append(Pending(key, d.bid, d.gen, d.target, d.at, events))
        await self.done(*bad)
        return sorted(out, key=lambda p: p.at)

    async def statuses(self, bids: Iterable[str]) -> dict[str, tuple[str, int]]:
        """bid -> (status, gen) now; a block with no record is left out."""
        ids = sorted(set(bids))
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for bid in ids:
            pipe.hmget(block_key(bid), ["status", "gen"])
        return {bid: (str(status), int(gen or 0)) for bid, (status, gen) in zip(ids, await pipe.execute(), strict=True)
                if status is not None}
