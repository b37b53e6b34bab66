"""A first selection round with one candidate (no dry_run asked, ``workers.gateway.skip_reason``) is
decided in its ``parsed`` handler (``gateway._decide_now``, docs/trace.md "Live vs Ray", the
gateway's one commit): its selection, post_dry_run and allocation go out in the handler's outbox,
one commit, in that stream order, and what waits for that commit stores nothing more. On real NATS
JetStream and Redis, the handler run as the consumer runner runs it (``test_round_order``'s way).

A process that stops after the round is chosen in Redis and before that commit (the block
``allocating``, nothing stored) is finished by the ``parsed`` delivery that comes back (its SELECT
finds the round chosen) or, if none comes, by the round's timer: each stores the round's recorded
selection first, then its post_dry_run and allocation, once (the chaos test with a real SIGKILL:
``tests/chaos/test_skip_sigkill.py``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.schemas.events import Parsed
from aios_blocks.settings import Settings
from aios_blocks.workers import gateway
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig

pytestmark = pytest.mark.integration

BID = "skip-1"
STEPS = ["selection", "post_dry_run", "allocation"]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    # the one cluster is the only candidate: the round asks no dry_run
    async with worker_rig(tmp_path, "gateway", Settings(), ["c0"]) as got:
        yield got


def _step(subject: str) -> str:
    wanted = {E.block_selection.subject(bid=BID): "selection", E.block_post_dry_run.subject(bid=BID): "post_dry_run",
              E.cluster_allocation.subject(cid="c0"): "allocation"}
    return wanted.get(subject, subject)


async def _stored(client: Client) -> list[str]:
    """The round's steps as the stream stored them, oldest first."""
    return [s for s in (_step(s) for s, _b, _q, _t in await client.stream()) if s in STEPS]


def _noted(w: Worker, phase: list[str]) -> list[tuple[str, str]]:
    """Each JetStream publish of ``w`` and each Redis exchange, with the phase it happened in."""
    seen: list[tuple[str, str]] = []
    js: Any = w.bus.js
    real_pub, real_async = js.publish, js.publish_async
    r: Any = w.store.r
    real_ex = r._exchange

    async def publish(subject: str, *a: Any, **k: Any) -> Any:
        seen.append((phase[0], _step(subject)))
        return await real_pub(subject, *a, **k)

    async def publish_async(subject: str, *a: Any, **k: Any) -> Any:
        seen.append((phase[0], _step(subject)))
        return await real_async(subject, *a, **k)

    async def exchange(commands: list[Any]) -> list[Any]:
        seen.append((phase[0], "redis"))
        return await real_ex(commands)

    js.publish, js.publish_async, r._exchange = publish, publish_async, exchange
    return seen


def _parsed() -> Inbound[Parsed]:
    ir = make_ir(bid=BID)
    return Inbound(E.block_parsed, Parsed(BID, 1, ir, 0), {}, Delivery(E.block_parsed.subject(bid=BID), b"", {}, 1, 7))


async def _handle(w: Worker, phase: list[str], commit: bool = True) -> None:
    """The ``parsed`` handler as the runner runs it: the handler, its batch's commit, then what
    waited for the commit (``ConsumerRunner._batch``); ``commit=False``: its process stops there."""
    phase[0] = "handler"
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await gateway.on_parsed(w, _parsed())
    if not commit:
        return
    phase[0] = "commit"
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    for f in box.pending:
        await f
    phase[0] = "then"
    for effect in box.then:
        await effect()
    phase[0] = "after"


async def _block(w: Worker) -> dict[str, Any]:
    block = await w.store.get_block(BID)
    assert block is not None
    return dict(block)


async def _new_block(w: Worker) -> None:
    await w.store.create_block(BID, 1, "d", {"status": "parsed", "ir": make_ir(bid=BID), "attempt": "0"})


async def test_a_one_candidate_round_is_stored_in_one_commit_in_stream_order(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _new_block(w)
    await w.bus.ids()  # the shared event key, made once per deployment (a KV put): not the round's
    await gateway._snapshot(w)  # the inventory view loaded (a worker's first look), as it is for every later block
    phase = ["handler"]
    seen = _noted(w, phase)
    await _handle(w, phase)
    # the three events in the handler's commit, in order; nothing published after it
    assert [s for p, s in seen if p == "commit"] == STEPS
    assert [s for p, s in seen if p in ("handler", "then") and s != "redis"] == []
    # Redis: the step's CAS with the quotas and the inventory, then the round opened and decided
    # (one exchange each), and after the commit the round's timer and gather dropped (one)
    assert [p for p, s in seen if s == "redis"] == ["handler", "handler", "then"]
    assert await _stored(client) == STEPS
    block = await _block(w)
    assert block["status"] == "allocating" and block["cluster"] == "c0", block
    assert await w.store.gather_claim_due(time.time() + 3600) == ([], None)  # the round is finished
    # the decision is the one a dry run's round records: explain reads it from the post_dry_run
    posts = [b for s, b, _q, _t in await client.stream() if _step(s) == "post_dry_run"]
    assert b"dry run skipped: c0 is the only candidate" in posts[0]


async def test_a_round_chosen_but_not_stored_is_stored_by_the_parsed_delivered_again(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _new_block(w)
    phase = ["handler"]
    await _handle(w, phase, commit=False)  # chosen in Redis, the process stops before its commit
    assert (await _block(w))["status"] == "allocating"
    assert await _stored(client) == []
    await _handle(w, phase)  # the delivery comes back: the SELECT finds the round chosen
    assert await _stored(client) == STEPS
    assert await w.store.gather_claim_due(time.time() + 3600) == ([], None)
    await _handle(w, phase)  # once more (the first delivery's commit was stored): nothing twice
    assert await _stored(client) == STEPS
    block = await _block(w)
    assert block["status"] == "allocating" and block["cluster"] == "c0", block


async def test_a_round_chosen_but_not_stored_is_stored_by_its_timer(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _new_block(w)
    phase = ["handler"]
    await _handle(w, phase, commit=False)
    fired, _ = await gateway.fire_due(w)  # not due before its net (the deadline and the patience)
    assert fired == 0 and await _stored(client) == []
    fired, _ = await gateway.fire_due(w, now=time.time() + 3600)  # no delivery came back: the timer's net
    assert fired == 1
    assert await _stored(client) == STEPS
    assert await w.store.gather_claim_due(time.time() + 7200) == ([], None)
    await _handle(w, phase)  # the delivery comes back after all: nothing twice
    assert await _stored(client) == STEPS


async def test_a_commit_slower_than_the_timer_s_net_stores_nothing_twice(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _new_block(w)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:  # the handler done, its batch not committed yet
        await gateway.on_parsed(w, _parsed())
    fired, _ = await gateway.fire_due(w, now=time.time() + 3600)  # past the net: the timer takes the round
    assert fired == 1 and await _stored(client) == STEPS  # the recorded selection first
    assert await w.bus.commit([box.deferred], 10.0) == [""]  # the batch's commit at last: duplicates dropped
    for effect in box.then:
        await effect()
    assert await _stored(client) == STEPS
    block = await _block(w)
    assert block["status"] == "allocating" and block["cluster"] == "c0", block
    assert await w.store.gather_claim_due(time.time() + 7200) == ([], None)
