"""The queue walker's retry is stored after the ``block.pending`` of the wait it ends (docs/reliability.md,
"A retry stored before the wait it ended"), on real NATS JetStream and Redis.

A handler's events are held in its batch's outbox until the batch commits (slow under a burst):
the gateway's ``wait_or_fail`` took the block to ``pending`` in Redis and queued it, its
``block.pending`` still in the outbox, and the walker, capacity there, retried the block and
published its ``parsed`` (attempt 1) at once: the stream held the retry before the wait (the
tester's ``burst-b-18``, seq 910 parsed, 912 pending). When the handler's process was killed
before its commit, the reconciler's republish found the block moved on and dropped the pending:
the wait was never said, and Redis kept ``pending_since``/``pending_deadline`` the stream's fold
never has (``blocks check`` reported it for ever). The walker now publishes the wait's marked
announcement (same message ids) before its retry's CAS.

The handler runs as the consumer runner runs it (an outbox, committed later or never); the walker's
pass is called by the test (its periodic pass an hour away): deterministic, no sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.cli.client import Client
from aios_blocks.recovery.fold import fold
from aios_blocks.schemas.events import Parsed, Selection
from aios_blocks.schemas.lifecycle import Step
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker
from aios_blocks.workers.queue import QueueWalker, wait_or_fail

from ..unit.views import make_ir
from .conftest import worker_rig

pytestmark = pytest.mark.integration

BID = "burst-b-18"
FIELDS = ("status", "attempt", "pending_since", "pending_deadline", "reason", "preempting")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller", Settings(queue_resync_s=3600), ["c0"]) as got:
        yield got


async def _wait_in_a_batch(w: Worker) -> Any:
    """Block BID selected (round 0, stored) and the gateway's wait, its handler's batch not committed:
    Redis ``pending`` and queued, its ``block.pending`` in the returned outbox."""
    ir = make_ir(bid=BID, resources={"cpu": 1, "memory": 1, "gpus": 1})
    await w.store.create_block(BID, 1, "d", {"status": "selecting", "ir": ir, "attempt": "0"})
    await w.bus.emit(E.block_parsed, Parsed(BID, 1, ir, 0))
    await w.bus.emit(E.block_selection, Selection(BID, 1, ["c0"]))
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await wait_or_fail(w, BID, 1, ir, "no cluster passed: c0 full", Step.WAIT)
    block = await w.store.get_block(BID)
    assert block is not None and block["status"] == "pending"
    return box


async def _order(client: Client) -> list[str]:
    """The block's pending and retry as the stream stored them, oldest first (a CloudEvent each)."""
    out = []
    for subject, body, _q, _t in await client.stream():
        if subject == E.block_pending.subject(bid=BID):
            out.append("pending")
        elif subject == E.block_parsed.subject(bid=BID) and (msgspec.json.decode(body).get("data") or {}).get("attempt"):
            out.append("retry")
    return out


async def _agree(w: Worker, client: Client) -> tuple[dict[str, str], dict[str, str]]:
    """The block's fields at issue: Redis's, and the stream's fold's."""
    raw = await w.store.r.hgetall(f"aios:block:{BID}")
    redis = {f: raw[f] for f in FIELDS if f in raw}
    folded = fold(await client.stream()).blocks[BID]
    return redis, {f: folded[f] for f in FIELDS if f in folded}


async def test_the_walkers_retry_is_stored_after_the_wait_a_batch_still_holds(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    box = await _wait_in_a_batch(w)
    assert await QueueWalker(w).tick()  # capacity there: the walker retries the block
    assert (await w.store.get_block(BID) or {})["status"] == "parsed"
    assert await _order(client) == ["pending", "retry"]  # was ["retry"]: the pending still in the batch
    assert await w.bus.commit([box.deferred], 10.0) == [""]  # the batch's commit, at last
    assert await _order(client) == ["pending", "retry"]  # the batch's own copy: a duplicate, dropped
    redis, folded = await _agree(w, client)
    assert redis == folded and redis["pending_since"], (redis, folded)


async def test_a_wait_whose_handler_died_before_its_commit_is_said_before_the_retry(rig: tuple[Worker, Client]) -> None:
    """The handler's process killed before its batch's commit (its outbox lost): the retry says the
    wait first; before, the wait was never stored and Redis kept fields the fold has not."""
    w, client = rig
    await _wait_in_a_batch(w)  # its outbox dropped: never committed
    assert await QueueWalker(w).tick()
    redis, folded = await _agree(w, client)
    assert redis == folded and redis["pending_since"], (redis, folded)  # was: the fold without pending_since...
    assert await _order(client) == ["pending", "retry"]  # was ["retry"]
