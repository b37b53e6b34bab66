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

from ..bus.catalog import E, Emit
from ..handlers import reconcile as rc
from ..runtime.ticker import Ticker
from ..schemas.events import ScaleTarget
from ..state.reconcile import ReconcileStore
from . import announce
from .base import Worker

log = structlog.get_logger("aios.reconciler")

#: a poke waits this long for more before the pass (a burst of failures is one pass)
DEBOUNCE_S = 0.3
#: a step's announcement still not acked this long after it was marked is published again (its
#: handler's own publish, retried, has had its chance; a repeat is deduplicated anyway)
ANNOUNCE_AFTER_S = 5.0
#: id(worker) -> its reconciler (``poke``)
_running: dict[int, Reconciler] = {}


def poke(w: Worker) -> None:
    """Ask this process's reconciler (if it runs one) for a pass soon."""
    r = _running.get(id(w))
    if r is not None:
        r.wake.set()


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
            return None
        blocks = [rc.BlockSize(b.block_id, b.gen, "ready", b.cluster, b.min_instances, b.max_instances, b.desired, b.instances)
                  for b in await self.rs.ready_blocks()]
        memory: dict[str, rc.Memory] = {}
        for bid, d in (await self.rs.memory()).items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                memory[bid] = rc.Memory(since=float(d["since"]), attempts=int(d.get("attempts", 0)),
                                        next_at=float(d.get("next_at", 0.0)), request_id=str(d.get("request_id", "")))
        out = rc.decide(blocks, memory, time.time(), self.backoff)
        if out.asks:
            # asked before remembered: a pass that dies in between asks again with the same id
            # (the memory did not move on), which the stream deduplicates
            await self.w.bus.emit_all([
                Emit(E.block_scale_target, ScaleTarget(a.block_id, a.request_id, a.target, a.reason, source=rc.SOURCE, gen=a.gen))
                for a in out.asks
            ])
            for a in out.asks:
                log.warning("reconcile.ask", block=a.block_id, target=a.target, request=a.request_id, reason=a.reason)
        changed = {bid: dataclasses.asdict(m) for bid, m in out.memory.items() if memory.get(bid) != m}
        await self.rs.save(changed, out.dropped)
        for bid in out.dropped:
            if bid in memory and any(b.block_id == bid for b in blocks):
                log.info("reconcile.converged", block=bid, attempts=memory[bid].attempts)
        self.announced = await announce.republish(self.w, ANNOUNCE_AFTER_S)
        self.last = out
        self.passes += 1
        return out

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
