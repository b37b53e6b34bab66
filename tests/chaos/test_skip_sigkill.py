"""A one-candidate round decided in its ``parsed`` handler (``workers.gateway._decide_now``: the
round's gather, decision and the block's CHOOSE step in Redis, then its selection, post_dry_run and
allocation in the handler's one commit) under SIGKILL: the front process (parser and gateway, in
``blocks up``'s groups) killed at fault point ``gateway.skip.chosen`` (the block ``allocating`` in
Redis, nothing of the round stored) loses nothing and does nothing twice. The restarted gateway
gets the unacked ``parsed`` again (after the consumer's ack wait, 30 s), finds the round chosen and
stores the recorded round, the selection first: the block is placed once (one selection, one
post_dry_run, one allocation, one placement, in that stream order) and the state is the stream's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.recovery.invariants import check

from ..integration.conftest import System
from ..integration.test_pending_queue import events, spec, status_of
from .conftest import grouped_system

pytestmark = pytest.mark.integration


@pytest.fixture
async def grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[System, Path]]:
    # the round's timer (its net: the deadline plus the patience) out of the test's time: the
    # delivery that comes back finishes the round (the timer's way: tests/integration/test_skip_commit.py)
    async with grouped_system(tmp_path, monkeypatch, "gateway.skip.chosen", AIOS_DRY_RUN_PATIENCE_S="600") as got:
        yield got


async def test_a_gateway_killed_between_choosing_and_storing_a_round_loses_nothing(grouped: tuple[System, Path]) -> None:
    system, once = grouped
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=4)  # one cluster: every first round asks no dry_run
    restarts = system.supervisor.restarts
    bids = ["k0", "k1"]
    await c.submit(spec(bids[0]))  # its round reaches the point: the front process dies there
    async with asyncio.timeout(30):  # ... and the supervisor (it looks every 0.2 s) starts it again
        while system.supervisor.restarts == restarts:
            await asyncio.sleep(0.1)
    assert not await asyncio.to_thread(once.exists)
    block = await c.store.get_block(bids[0])
    assert block is not None and block["status"] in ("allocating", "placing", "ready"), block
    await c.submit(spec(bids[1]))  # a block after the restart goes the usual way
    for bid in bids:
        await status_of(system, bid, "ready", timeout=90)
    kinds = ("selection", "post_dry_run", "allocation", "placement")
    stream = [(s, json.loads(b)) for s, b, _q, _t in await c.stream() if s.rsplit(".", 1)[1] in kinds]
    for bid in bids:  # each placed once, by one round stored in order
        assert len(await events(system, bid, "selection")) == 1, bid
        assert len(await events(system, bid, "post_dry_run")) == 1, bid
        assert len(await events(system, bid, "placement")) == 1, bid
        steps = [s.rsplit(".", 1)[1] for s, e in stream if (e.get("data") or {}).get("block_id") == bid]
        assert steps == ["selection", "post_dry_run", "allocation", "placement"], (bid, steps)
    rep = await check(c.bus, c.store, settled=False)  # no GPU double-booked; the state is the stream's
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
