"""The reconciler (docs/reliability.md, "Reconciler"), run by every controller process next to its
health monitor: level-triggered, so that a block below its ``minInstances`` always comes back
while there is capacity, whatever edge-triggered step failed on the way (a reassignment that
failed for good, an eviction while a virtual cluster was being refilled).

Every ``AIOS_RECONCILE_RESYNC_S`` (5 s), and soon after this process's controller saw a step fail
or evicted an instance (``poke``), the copy that holds the reconciler's lease (one controller copy
at a time; another takes over when it lapses) reads every ``ready`` block's sizes and instance
statuses (``state.reconcile``), and ``handlers.reconcile.decide`` says which blocks are short and
asks for their missing instances: a ``block.scale.target`` (source ``reconciler``, the reason in
words) that the controller reaches with scale steps, each one's failure stored with why no node
could take it. Asks for one block are spaced by an exponential backoff (``AIOS_RECONCILE_BACKOFF_S``
doubled, at most ``AIOS_RECONCILE_MAX_BACKOFF_S``), kept in Redis with the lease, so `blocks
explain` shows one ask and one failure per wait, not one per pass.

A block still short at a pass after the first ask (it placed nothing) is marked *short* on its
record and announced once (``block.degraded``); once whole again its mark goes and
``block.restored`` says so (docs/reliability.md, "Short blocks"); ``aios_reconciler_short_blocks``
counts them. A block marked short is one the queue walker walks with the waiting blocks (its
missing instances may preempt lower blocks, docs/priority.md "A short block preempts"): the mark
pokes it.

The same pass publishes again the status steps' announcements the stream has not acked after
``ANNOUNCE_AFTER_S`` (``workers.announce``): a block made ready in Redis whose ``block.ready``
publish failed is announced even when the handler's redelivery decided otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time

import structlog
from prometheus_client import Gauge

from ..bus.catalog import E, Emit
from ..handlers import reconcile as rc
from ..runtime.ticker import Ticker
from ..schemas import condition as cond
from ..schemas.events import ScaleTarget
from ..state.reconcile import ReconcileStore
from . import announce, queue
from .base import Worker

log = structlog.get_logger("aios.reconciler")

#: a poke waits this long for more before the pass (a burst of failures is one pass)
DEBOUNCE_S = 0.3
#: a step's announcement still not acked this long after it was marked is published again (its
#: handler's own publish, retried, has had its chance; a repeat is deduplicated anyway)
ANNOUNCE_AFTER_S = 5.0
#: ready blocks marked short (docs/reliability.md "Short blocks"): the lease holder's figure after
#: each pass, 0 on the other copies (so ``max`` or ``sum`` over the controllers is the count)
SHORT_BLOCKS = Gauge("aios_reconciler_short_blocks", "Ready blocks below their minInstances whose "
                     "replacement the reconciler could not place (marked short)")
#: id(worker) -> its reconciler (``poke``)
_running: dict[int, Reconciler] = {}


def poke(w: Worker) -> None:
    """Ask this process's reconciler (if it runs one) for a pass soon."""
    r = _running.get(id(w))
    if r is not None:
        r.wake.set()


async def note_failed(w: Worker, bid: str, gen: int, step: str, reason: str) -> None:
    """The controller's note of a failed scale / reassignment step: the reason a short block's mark
    gives. Advisory: a note not written (Redis away) leaves the mark with the reconciler's words."""
    try:
        await ReconcileStore(w.store.r).note_failed(bid, gen, step, reason, time.time())
    except Exception as exc:  # (the step's failure event is out already)
        log.info("reconcile.note_failed", block=bid, error=str(exc))


class Reconciler:
    def __init__(self, w: Worker):
        self.w, self.s = w, w.settings
        self.holder = f"reconciler-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.rs = ReconcileStore(w.store.r)
        self.backoff = rc.Backoff(self.s.reconcile_backoff_s, self.s.reconcile_max_backoff_s)
        self.wake = asyncio.Event()
        #: the last pass's outcome (None: not the leader), for tests and logs
        self.last: rc.Outcome | None = None
        self.passes = 0
        #: the last pass's (announcements published again, dropped)
        self.announced = (0, 0)

    async def tick(self) -> rc.Outcome | None:
        """One pass, if this copy holds the lease: read, decide, ask, remember."""
        if not await self.rs.lead(self.holder, max(3 * self.s.reconcile_resync_s, 10.0)):
            self.last = None
            SHORT_BLOCKS.set(0)
            return None
        blocks = [rc.BlockSize(b.block_id, b.gen, b.status, b.cluster, b.min_instances, b.max_instances, b.desired,
                               b.instances, cond.decode(b.short))
                  for b in await self.rs.ready_blocks()]
        memory: dict[str, rc.Memory] = {}
        for bid, d in (await self.rs.memory()).items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                memory[bid] = rc.Memory(since=float(d["since"]), attempts=int(d.get("attempts", 0)),
                                        next_at=float(d.get("next_at", 0.0)), request_id=str(d.get("request_id", "")),
                                        degraded=bool(d.get("degraded", False)))
        failed = await self.rs.failed_steps()
        notes = {bid: rc.Note(f.gen, f.step, f.reason, f.at) for bid, f in failed.items()}
        now = time.time()
        out = rc.decide(blocks, memory, now, self.backoff, notes, self.s.reconcile_resync_s)
        SHORT_BLOCKS.set(sum(1 for m in out.memory.values() if m.degraded))
        await self._publish(out)
        changed = {bid: dataclasses.asdict(m) for bid, m in out.memory.items() if memory.get(bid) != m}
        await self.rs.save(changed, out.dropped)
        if out.degraded:  # their missing instances may preempt (docs/priority.md): the walker looks now
            queue.poke(self.w)
        # the marks after their events (at least once): a pass cut in between publishes them again
        # with the same ids, and the memory or the mark says the spell was announced
        await self.rs.mark({bid: (m.gen, cond.encode(m)) for bid, m in out.marks.items()}, out.unmark)
        await self.rs.drop_failed(bid for bid, f in failed.items()
                                  if bid not in out.memory and now - f.at > 2 * self.s.reconcile_resync_s)
        for bid in out.dropped:
            if bid in memory and any(b.block_id == bid for b in blocks):
                log.info("reconcile.converged", block=bid, attempts=memory[bid].attempts)
        self.announced = await announce.republish(self.w, ANNOUNCE_AFTER_S)
        self.last = out
        self.passes += 1
        return out

    async def _publish(self, out: rc.Outcome) -> None:
        """The pass's asks and short transitions, asked before remembered: a pass that dies in
        between asks again with the same id (the memory did not move on), which the stream
        deduplicates."""
        emits = [Emit(E.block_scale_target, ScaleTarget(a.block_id, a.request_id, a.target, a.reason, source=rc.SOURCE, gen=a.gen))
                 for a in out.asks]
        emits += [Emit(E.block_degraded, d) for d in out.degraded] + [Emit(E.block_restored, r) for r in out.restored]
        if emits:
            await self.w.bus.emit_all(emits)
        for a in out.asks:
            log.warning("reconcile.ask", block=a.block_id, target=a.target, request=a.request_id, reason=a.reason)
        for d in out.degraded:
            log.warning("reconcile.short", block=d.block_id, live=d.live, min=d.min_instances, reason=d.reason)
        for r in out.restored:
            log.info("reconcile.restored", block=r.block_id, live=r.live, min=r.min_instances, reason=r.reason)

    def _next_wait(self) -> float:
        """Until the next resync, or the next block whose backoff ends, if sooner."""
        wait = self.s.reconcile_resync_s
        if self.last is not None and self.last.memory:
            due = min(m.next_at for m in self.last.memory.values()) - time.time()
            wait = min(wait, max(due, DEBOUNCE_S))
        return wait

    async def run(self, stop: asyncio.Event) -> None:
        _running[id(self.w)] = self
        log.info("reconciler.running", resync_s=self.s.reconcile_resync_s, holder=self.holder)
        # a pass at each resync (sooner when a block's backoff ends), or soon after a poke
        ticker = Ticker(self._next_wait(), "reconcile.pass_failed", log, next_in=lambda _: self._next_wait(),
                        wait_first=True, wake=self.wake, debounce_s=DEBOUNCE_S)
        try:
            await ticker.run(self.tick, stop)
        finally:
            _running.pop(id(self.w), None)


async def run(w: Worker, stop: asyncio.Event) -> None:
    await Reconciler(w).run(stop)
