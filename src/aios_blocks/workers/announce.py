"""A status step's announcement made at least once (docs/reliability.md, "Announcements"): its
events are marked pending (``state.announce``) before the step's compare-and-set and unmarked
once the stream acked them; the reconciler's pass publishes again what stays marked
(:func:`republish`), so a step taken in Redis is never left unsaid on the stream when its publish
failed and its redelivery decided otherwise.

    key = await announce.mark(w, bid, gen, step, events)
    ok, info = await w.store.transition(bid, gen, step)
    if moved: await w.bus.emit_all(events)
    await announce.settle(w, key, moved)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ..handlers import reconcile as rc
from ..schemas.catalog import Emit
from ..schemas.lifecycle import TRANSITIONS, Step
from ..state.announce import Announcements
from ..state.announce import entry as state_entry
from ..state.keys import ANNOUNCE

if TYPE_CHECKING:
    from ..bus.nats_bus import Bus
    from .base import Worker

log = structlog.get_logger("aios.announce")


def _store(w: Worker) -> Announcements:
    return Announcements(w.store.r)


async def mark(w: Worker, bid: str, gen: int, step: Step, events: Sequence[Emit]) -> str:
    """Mark ``events`` pending before ``step``'s CAS ("" when there are none)."""
    if not events:
        return ""
    return await _store(w).mark(bid, gen, TRANSITIONS[step].target.value, events, time.time())


def entry(bid: str, gen: int, step: Step, events: Sequence[Emit]) -> tuple[str, str, str]:
    """What :func:`mark` writes, to write it with the step's CAS in one exchange, first
    (``Store.mark_then_transition``, ``Store.set_status_then_ready``): (the hash, the key, the
    text); ``events`` not empty. The key is what :func:`settle` takes."""
    key, text = state_entry(bid, gen, TRANSITIONS[step].target.value, events, time.time())
    return ANNOUNCE, key, text


async def settle(w: Worker, key: str, published: bool) -> None:
    """Unmark: once what the handler published is stored (``published``), else now (the CAS did
    not take: nothing to announce)."""
    if not key:
        return
    ann = _store(w)
    if published:
        await w.bus.after_commit(lambda: ann.done(key))
    else:
        await ann.done(key)


async def say_first(w: Worker, bid: str, gen: int, step: Step) -> None:
    """Publish now (outside a handler: acked on return) and unmark the announcements still marked
    for ``bid``'s ``step`` in ``gen``: a step that follows it (the queue walker's retry of a wait)
    is then stored after it, not before (docs/reliability.md, "A retry stored before the wait it
    ended"). Raises when the stream does not take them (the caller's step waits)."""
    ann = _store(w)
    target = TRANSITIONS[step].target.value
    mine = [p for p in await ann.pending() if p.block_id == bid and p.gen == gen and p.target == target]
    for p in mine:
        await w.bus.emit_all(p.events)  # the same message ids: the handler's own publish, later, is a duplicate
    await ann.done(*(p.key for p in mine))


async def republish(w: Worker, after_s: float) -> tuple[int, int]:
    """Publish again the announcements marked at least ``after_s`` ago whose block holds their
    step's target; drop the others (``handlers.reconcile.announcements``). Returns (published,
    dropped); one whose publish fails stays for the next pass."""
    published, dropped, _failed = await publish_pending(w.store.r, w.bus, after_s)
    return published, dropped


async def publish_pending(r: Any, bus: Bus, after_s: float) -> tuple[int, int, int]:
    """:func:`republish` on a Redis connection and a bus (``blocks recover`` calls it first, with
    ``after_s`` 0: a step Redis took and the stream has not heard would else be rebuilt away, its
    block back to the step before, and nothing would take it again). Returns (published,
    dropped, failed)."""
    ann = Announcements(r)
    pending = await ann.pending()
    if not pending:
        return 0, 0, 0
    again, drop = rc.announcements(pending, await ann.statuses(p.block_id for p in pending), time.time(), after_s)
    await ann.done(*drop)
    by_key = {p.key: p for p in pending}
    # all at once: with the stream out of reach each waits its ack timeout, the pass once
    results = await asyncio.gather(*(bus.emit_all(by_key[k].events) for k in again), return_exceptions=True)
    acked = []
    for key, res in zip(again, results, strict=True):
        p = by_key[key]
        if isinstance(res, BaseException):  # the next pass tries again
            log.warning("announce.republish_failed", block=p.block_id, key=key, error=repr(res))
            continue
        acked.append(key)
        log.warning("announce.republished", block=p.block_id, gen=p.gen, status=p.target, key=key,
                    waited_s=round(time.time() - p.at, 1))
    await ann.done(*acked)
    return len(acked), len(drop), len(again) - len(acked)
