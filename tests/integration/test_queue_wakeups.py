"""Walker wake-ups across controller copies (issue 36, docs/priority.md "Event-driven
re-placement"): a capacity event handled by a controller copy that does not hold the queue
walker's lease wakes the leader's walker at once (``state.queue.Wakeups``, Redis pub/sub), instead
of leaving the waiting block to the leader's periodic pass.

The leader here is a walker in this process (its own worker: its own NATS and Redis connections,
as a second controller process) that handles no event; the system's controller handles the
deletion that frees the GPU, and its own walker cannot walk (the lease is the other's). The
periodic pass is 300 s: only the wake-up can place the waiting block within the test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aios_blocks.settings import Settings
from aios_blocks.settings import current as settings_now
from aios_blocks.state.queue import LEASE_KEY, PendingQueue
from aios_blocks.workers.base import Worker
from aios_blocks.workers.queue import QueueWalker

from .conftest import System, worker_rig
from .test_pending_queue import spec, status_of

pytestmark = pytest.mark.integration


@pytest.fixture
def no_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")  # the system's controller inherits it
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


async def test_a_capacity_event_seen_by_a_non_leader_wakes_the_leaders_walker(no_resync: None, system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("holder"))
    assert kind == "ready"
    await c.submit(spec("waiter"))
    await status_of(system, "waiter", "pending")
    leader = await Worker.open(system.supervisor.nats_url, system.supervisor.redis_url, "controller",
                               settings=settings_now())  # the env as set above (load() is cached per process)
    walker = QueueWalker(leader)
    assert walker.s.queue_resync_s == 300
    stop = asyncio.Event()
    # the lease moves to this copy (the system's walker may have taken it on an earlier event)
    await c.store.r.delete(LEASE_KEY)
    assert await PendingQueue(c.store.r).lead(walker.holder, 900)
    task = asyncio.create_task(walker.run(stop))
    try:
        async with asyncio.timeout(10):  # the walker listens before the capacity event
            while not await c.store.r.pubsub_numsub("aios:meta:queue:wake") or \
                    dict(await c.store.r.pubsub_numsub("aios:meta:queue:wake")).get("aios:meta:queue:wake", 0) < 2:
                await asyncio.sleep(0.05)
        passes = walker.passes
        await c.delete("holder")  # handled by the system's controller: instance removed, its walker poked
        await status_of(system, "waiter", "ready", timeout=60)
        assert walker.passes > passes  # placed by the leader's pass the notice woke
        assert await c.store.r.get(LEASE_KEY) == walker.holder
    finally:
        stop.set()
        walker.wake.set()
        await asyncio.wait_for(task, 10)
        await leader.close()


async def test_a_stop_ends_the_walker_at_once_not_at_its_next_periodic_pass(tmp_path: Path) -> None:
    """A controller's stop ended its queue walker only at the walker's next periodic pass
    (``AIOS_QUEUE_RESYNC_S``, 2 s by default: every controller process stopped up to 2 s late).
    Here that pass is an hour away: a walker that waited for it is still running at the guard."""
    async with worker_rig(tmp_path, "controller", Settings(queue_resync_s=3600)) as (w, c):
        walker = QueueWalker(w)
        stop = asyncio.Event()
        task = asyncio.create_task(walker.run(stop))
        async with asyncio.timeout(10):  # listening: its loop is in the wait for its next pass
            while dict(await c.store.r.pubsub_numsub("aios:meta:queue:wake")).get("aios:meta:queue:wake", 0) < 1:
                await asyncio.sleep(0.05)
        assert not task.done()
        stop.set()
        async with asyncio.timeout(60):
            await task
