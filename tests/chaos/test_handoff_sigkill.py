"""The runner's hand-off (``bus/runner.py``, "Hand-off"; ``AIOS_HANDOFF=1``) under SIGKILL: in ``blocks up``'s front
group (parser and gateway in one process) the parser's ``block.parsed`` is handed to the gateway
right after its commit. The process killed there (fault point ``handoff.gateway.given``: stored,
not handed) or after the gateway's hand-off handled it and stored its effects but before the
stream's delivery of it is acked (``handoff.gateway.handled``) loses nothing and does nothing
twice: the restarted group's consumers get the unacked events again, every block is placed once
(one selection, one placement), and the state is the stream's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.recovery.invariants import check

from ..integration.conftest import System
from ..integration.test_pending_queue import events, spec, status_of
from .conftest import grouped_system

pytestmark = pytest.mark.integration

POINTS = ("handoff.gateway.given", "handoff.gateway.handled")


@pytest.fixture(params=POINTS)
async def grouped(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[System, Path]]:
    """The placement path's workers in ``blocks up``'s groups (parser+gateway in one process), the
    first process that reaches the fault point SIGKILLing itself there (once)."""
    # (AIOS_HANDOFF: off by default, docs/trace.md "Live vs Ray")
    async with grouped_system(tmp_path, monkeypatch, request.param, AIOS_HANDOFF="1") as got:
        yield got


async def test_a_front_process_killed_at_a_hand_off_loses_nothing(grouped: tuple[System, Path]) -> None:
    system, once = grouped
    c = system.client
    await c.add_sim_cluster("c1", nodes=4, gpus=8)  # room for every try
    restarts = system.supervisor.restarts
    bids: list[str] = []
    # one block at a time until a hand-off reached the point (the stream's delivery of an event
    # may reach the gateway before its commit's ack reaches the parser: then nothing is handed)
    for i in range(30):
        bid = f"h{i}"
        bids.append(bid)
        await c.submit(spec(bid))
        await status_of(system, bid, "ready", timeout=90)
        if not await asyncio.to_thread(once.exists):
            break
    assert not await asyncio.to_thread(once.exists)  # the fault point was reached: the process kills itself there
    async with asyncio.timeout(30):  # ... and the supervisor (it looks every 0.2 s) started it again
        while system.supervisor.restarts == restarts:
            await asyncio.sleep(0.1)
    for bid in bids:  # each placed once, by one selection round
        assert (await c.store.get_block(bid) or {})["status"] == "ready", bid
        assert len(await events(system, bid, "selection")) == 1, bid
        assert len(await events(system, bid, "placement")) == 1, bid
    rep = await check(c.bus, c.store, settled=False)  # no GPU double-booked; the state is the stream's
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
