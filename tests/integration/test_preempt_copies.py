"""Two controller copies never preempt for the same block twice (issue 36 item 5, docs/priority.md
"Safe under faults"): two queue walkers in this process (each its own worker: its own NATS and
Redis connections, as two controller processes) ask the preemption policy for the same waiting
block at once, besides the system's own controller; the plan is claimed once per block, so the
stream holds one ``block.preempting`` for it, and the preemptor is placed once."""

from __future__ import annotations

import asyncio

import pytest

from aios_blocks.recovery.invariants import check
from aios_blocks.workers.base import Worker
from aios_blocks.workers.queue import QueueWalker

from .conftest import System
from .test_pending_queue import events, spec, status_of
from .test_priority_cli import _ok

pytestmark = pytest.mark.integration


@pytest.fixture
def no_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The system's walker passes only on capacity events: the waiting preemptor is left to the two copies."""
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


async def test_two_copies_preempt_once_for_one_block(no_resync: None, system: System) -> None:
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    for bid in ("lo1", "lo2"):
        _, kind, _ = await system.submit_and_wait(spec(bid))
        assert kind == "ready", bid
    await c.submit(spec("hi", priorityClass="high"))
    hi = await status_of(system, "hi", "pending")
    urls = (system.supervisor.nats_url, system.supervisor.redis_url)
    copies = [await Worker.open(*urls, "controller") for _ in range(2)]
    try:
        walkers = [QueueWalker(w) for w in copies]
        clusters = await copies[0].inventory.clusters()
        views = await copies[0].inventory.views(list(clusters))
        done = await asyncio.gather(*(q.preempt(hi, clusters, views) for q in walkers))
        assert done == [True, True], done  # each found victims; one plan was carried out
    finally:
        for w in copies:
            await w.close()
    await status_of(system, "hi", "ready")
    (preempting,) = await events(system, "hi", "preempting")
    (victim,) = preempting["victims"]
    assert len(await events(system, victim, "preempted")) == 1
    assert len(await events(system, "hi", "placement")) == 1
    await status_of(system, victim, "pending")
    rep = await check(c.bus, c.store, settled=False)
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
