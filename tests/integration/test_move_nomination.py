"""The room moves make for a waiting block is held for it (docs/rebalance.md "The room moves
make"), as a preemption's room is for its preemptor: between a move's old instance going and the
walker's pass that places the block, a lower block's allocation (a direct submit does not go
through the queue) must not take it.

Real servers, the system's workers; the queue is walked by a walker copy of this test (it holds
the walker's lease), so the walker passes only when the test asks; the rebalancer worker's rounds
are out of the way (one every 300 s)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aios_blocks.handlers import allocation as al
from aios_blocks.recovery.invariants import check
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.settings import current
from aios_blocks.state.queue import LEASE_KEY, PRIMARY, Nominations
from aios_blocks.workers.allocate import allocate
from aios_blocks.workers.base import Worker
from aios_blocks.workers.queue import QueueWalker

from .conftest import System
from .test_priority_cli import blocks
from .test_rebalance import _fragmented, _status, spec

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _walked_by_the_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")
    monkeypatch.setenv("AIOS_REBALANCE_INTERVAL_S", "300")
    yield


async def _moved(system: System, bid: str, node: str) -> None:
    """``bid``'s one instance runs on another node than ``node`` and nothing of it is left there."""
    async with asyncio.timeout(60):
        while True:
            insts = list((await system.client.store.instances(bid)).values())
            if len(insts) == 1 and insts[0]["node"] != node and insts[0]["status"] == "running":
                return
            await asyncio.sleep(0.1)


async def test_a_lower_block_does_not_take_the_room_moves_made_for_a_waiting_block(system: System) -> None:
    c = system.client
    r = await asyncio.to_thread(blocks, system, "priority-class", "add", "high", "1000")
    assert r.returncode == 0, r.stdout + r.stderr
    where = await _fragmented(system)  # s1 and s2 (1 GPU each) on two nodes of 4 GPUs
    # settings as the environment says now (the process-wide cached ones may be an earlier test's,
    # e.g. a lockstep replay's AIOS_REBALANCE_MAX_MOVES=0: then the walker preempts, no moves)
    w = await Worker.open(system.supervisor.nats_url, system.supervisor.redis_url, "controller", settings=current())
    try:
        t = QueueWalker(w)
        await c.store.r.set(LEASE_KEY, t.holder, px=600_000)  # the system's walker passes no more
        await c.submit(spec("p", 4, priorityClass="high"))
        await _status(system, "p", "pending")
        assert await t.tick()  # p fits nowhere (3 free a node): one move makes room, no preemption
        noms = await Nominations(c.store.r).all()
        assert "p" in noms and noms["p"].get("moves") is True, noms
        (source,) = noms["p"]["nodes"]
        moved = next(bid for bid, node in where.items() if node == source)
        await _moved(system, moved, source)  # make-before-break done: the source node is empty
        assert (await c.store.get_block("p") or {})["status"] == "pending"  # no walker pass since
        # a lower block asking for the same room (a direct submit's allocation): without the
        # nomination it is placed on the emptied node (the only one with 4 free GPUs)
        ir = dict((await c.store.get_block("p") or {})["ir"])
        ir["blockId"], ir["priority"] = "probe", 0
        with pytest.raises(PlacementFailed):
            await allocate(w, al.Request(ir, "c1", "allocation", ("probe-0",)))
        walked = await t.walk(PRIMARY)  # the next pass: p takes its room (its own nomination aside)
        assert [x[0] for x in walked.retry] == ["p"], walked.retry
    finally:
        await c.store.r.delete(LEASE_KEY)
        await w.close()
    await _status(system, "p", "ready", timeout=90)
    assert [i["node"] for i in (await c.store.instances("p")).values()] == [source]
    history = await c.history()
    assert not [s for s, _, _ in history if s.endswith(".preempted") or s.endswith(".preempting")]
    async with asyncio.timeout(30):  # placed: the room is its instances', the nomination goes
        while "p" in await Nominations(c.store.r).all():
            await asyncio.sleep(0.1)
    rep = await check(c.bus, c.store, settled=False)
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
