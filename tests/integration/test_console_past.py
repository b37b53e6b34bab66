"""The console's past moment on a real stream (issue 37, docs/console.md "Any past moment"): a
``Feed`` reads a real NATS JetStream stream ``AIOS`` written by the real workers (blocks placed,
waiting, scaled and deleted) and takes a checkpoint every few events; at seeded sequences, the
past fold it makes from its nearest checkpoint equals the stream read again and folded from
sequence 1, field for field, and so do the views."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from aios_blocks.console import projection as pj
from aios_blocks.console.feed import Feed
from aios_blocks.recovery.fold import Fold
from aios_blocks.recovery.rebuild import read_stream

from .conftest import System

pytestmark = pytest.mark.integration


async def until(feed: Feed, ok: Any, timeout: float = 90) -> None:
    async with asyncio.timeout(timeout):
        while not ok(feed.fold):
            await asyncio.sleep(0.2)


def statuses(f: Fold, bids: list[str]) -> list[str]:
    return [f.blocks.get(bid, {}).get("status", "") for bid in bids]


async def test_past_moments_from_checkpoints_are_the_stream_folded_from_its_start(system: System) -> None:
    c = system.client
    feed = Feed(c.bus, lambda s, e: "", check_every=7, checkpoints=6, chunk=16)
    await feed.start()
    try:
        await c.add_sim_cluster("past", nodes=3, gpus=2)
        spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 2}
        bids = [await c.submit({**spec, "blockId": f"past-{i}"}) for i in range(8)]  # 6 GPUs: 2 wait
        await until(feed, lambda f: sorted(statuses(f, bids)) == ["pending"] * 2 + ["ready"] * 6)
        ready = [b for b in bids if feed.fold.blocks[b]["status"] == "ready"]
        for bid in ready[:3]:
            await c.delete(bid)
        await until(feed, lambda f: statuses(f, ready[:3]) == ["deleted"] * 3
                    and sorted(statuses(f, bids)).count("ready") == 5)  # the waiting two placed
        await c.scale_to(ready[3], 2)
        await until(feed, lambda f: len(f.instances.get(ready[3], {})) == 2 or statuses(f, [ready[3]]) != ["ready"])
        await asyncio.sleep(1)

        msgs: list[tuple[str, bytes, int, float]] = []
        await read_stream(c.bus, lambda s, raw, seq, ts: msgs.append((s, raw, seq, ts)))
        last = min(feed.fold.last_seq, msgs[-1][2])
        assert last > 60 and len(feed.checks.items) > 2  # (thinned: the interval doubled)
        for seq in [*sorted(random.Random(37).sample(range(1, last), 10)), last - 1]:
            feed._past.clear()
            then = await feed.at(seq)
            ref = Fold()
            for m in msgs:
                if m[2] <= seq:
                    ref.apply(*m)
            for fld in dataclasses.fields(Fold):
                assert getattr(then, fld.name) == getattr(ref, fld.name), (seq, fld.name)
            assert pj.overview(then) == pj.overview(ref), seq
            assert pj.gpumap(then) == pj.gpumap(ref), seq
            assert pj.blocks_page(then) == pj.blocks_page(ref), seq
            for bid in bids:
                if bid in ref.blocks:
                    assert pj.block_detail(then, bid, [], str) == pj.block_detail(ref, bid, [], str), (seq, bid)
        assert feed.fold.blocks[ready[0]]["status"] == "deleted"
        then = await feed.at(max(m[2] for m in msgs if m[0] == f"aios.block.{ready[0]}.ready"))
        assert then.blocks[ready[0]]["status"] == "ready" and then.instances[ready[0]]  # a deleted block as it was
    finally:
        await feed.close()
