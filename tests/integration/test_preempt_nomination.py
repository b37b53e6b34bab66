"""The room a preemption freed goes to its preemptor (docs/priority.md "Preemption from the
queue", the nomination): between the preemptor's retry and its placement, a walker pass (the
next victim's removal, any capacity event) found the preemptor out of the queue and its room
free, and sent the victims back through selection to take it (the live race of the lockstep
replay: the preemptor then waited again and preempted a second time).

Real servers, the system's workers; the queue is walked by a walker copy of this test (it holds
the walker's lease), so each pass is one the test asks for; the gateway is SIGSTOPped so the
preemptor's retry stays on its way through selection while the next pass runs, and while a
lower block's allocation is tried."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from aios_blocks.handlers import allocation as al
from aios_blocks.recovery.invariants import check
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.state.queue import LEASE_KEY, PRIMARY, Nominations
from aios_blocks.workers.allocate import allocate
from aios_blocks.workers.base import Worker
from aios_blocks.workers.queue import QueueWalker

from .conftest import System
from .test_pending_queue import events, spec, status_of
from .test_priority_cli import _ok

pytestmark = pytest.mark.integration


@pytest.fixture
def walked_by_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")
    monkeypatch.setenv("AIOS_REBALANCE_MAX_MOVES", "0")


async def drained(system: System, bid: str) -> None:
    async with asyncio.timeout(30):
        while await system.client.store.instances(bid):
            await asyncio.sleep(0.1)


async def test_the_victims_do_not_take_back_the_room_freed_for_the_preemptor(walked_by_the_test: None, system: System) -> None:
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    for bid in ("lo1", "lo2"):
        _, kind, _ = await system.submit_and_wait(spec(bid))
        assert kind == "ready", bid
    w = await Worker.open(system.supervisor.nats_url, system.supervisor.redis_url, "controller")
    gateway = system.supervisor.pids("gateway")
    stopped = False
    try:
        t = QueueWalker(w)
        await c.store.r.set(LEASE_KEY, t.holder, px=600_000)  # the system's walker passes no more
        await c.submit(spec("hi", 2, priorityClass="high"))
        await status_of(system, "hi", "pending")
        for pid in gateway:  # the preemptor's retry will wait in the stream: on its way, not placed
            os.kill(pid, signal.SIGSTOP)
        stopped = True
        assert await t.tick()  # hi preempts lo1 and lo2 (one node of 2 GPUs)
        (preempting,) = await events(system, "hi", "preempting")
        assert sorted(preempting["victims"]) == ["lo1", "lo2"]
        for bid in ("lo1", "lo2"):
            await drained(system, bid)
            await status_of(system, bid, "pending")
        first = await t.walk(PRIMARY)  # the room is free: hi goes back through selection
        assert [r[0] for r in first.retry] == ["hi"]
        assert (await c.store.get_block("hi") or {})["status"] == "parsed"
        assert "hi" in await Nominations(c.store.r).all()
        # the next pass while hi is on its way: without the nomination lo1 and lo2 fit in hi's
        # room and were retried (then raced hi through selection)
        second = await t.walk(PRIMARY)
        assert second.retry == [], second.retry
        for bid in ("lo1", "lo2"):
            assert (await c.store.get_block(bid) or {})["status"] == "pending", bid
        # nor does the placement of a lower block (a submit does not go through the queue): its
        # allocation on c1 finds no room (without the hold: a GPU of hi's reserved for it)
        lo = (await c.store.get_block("lo1") or {})["ir"]
        with pytest.raises(PlacementFailed):
            await allocate(w, al.Request(lo, "c1", "allocation", ("lo1-probe",)))
    finally:
        if stopped:
            for pid in gateway:
                os.kill(pid, signal.SIGCONT)
        await c.store.r.delete(LEASE_KEY)
        await w.close()
    await status_of(system, "hi", "ready")
    assert len(await events(system, "hi", "preempting")) == 1
    assert len(await events(system, "hi", "placement")) == 1
    assert "hi" not in await Nominations(c.store.r).all()  # placed: the room is its instances'
    for bid in ("lo1", "lo2"):
        await status_of(system, bid, "pending")
    rep = await check(c.bus, c.store, settled=False)
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
