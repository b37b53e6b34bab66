"""A selection round's steps are stored in causal order (selection < post_dry_run < allocation), on
real NATS JetStream and Redis, when the gather's timer fires while the handler that opened the
round still waits for its batch's commit (a batch's events are committed once all its handlers are
done: a slow batch under load outlasts ``dry_run_deadline_s``).

The bug (console bench, 10,000 creates): a first round with one candidate asked no dry_run and was
decided inside the ``parsed`` handler, so the round was marked decided in Redis before its
selection was stored; the round's timer took that for a decider that had stopped and published the
post_dry_run and the allocation at once, the placement followed, and the selection came after them
all. The fold then left the block ``selecting`` while Redis said ``ready``.

The tests run the handler as the consumer runner does (an :func:`outbox` that holds its events,
``Bus.commit`` after it returns, then its ``after_commit`` effects), with the timer loop's turn
(``fire_due``, on the real clock) in between and the round's deadline already past (a deadline of
0 s): deterministic, no sleeps."""

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
from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.settings import Settings
from aios_blocks.workers import gateway
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig

pytestmark = pytest.mark.integration

BID = "order-1"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    # the one cluster is the only candidate: the round asks no dry_run
    async with worker_rig(tmp_path, "gateway", Settings(dry_run_deadline_s=0, dry_run_patience_s=60), ["c0"]) as got:
        yield got


async def _order(client: Client) -> list[str]:
    """The round's steps as the stream stored them, oldest first."""
    wanted = {E.block_selection.subject(bid=BID): "selection", E.block_post_dry_run.subject(bid=BID): "post_dry_run",
              E.cluster_allocation.subject(cid="c0"): "allocation"}
    return [wanted[s] for s, _b, _q, _t in await client.stream() if s in wanted]


async def _open_round(w: Worker) -> Any:
    """The ``parsed`` handler of round 0, run as the runner runs it; its outbox, not yet committed."""
    ir = make_ir(bid=BID)
    await w.store.create_block(BID, 1, "d", {"status": "parsed", "ir": ir, "attempt": "0"})
    m = Inbound(E.block_parsed, Parsed(BID, 1, ir, 0), {}, Delivery(E.block_parsed.subject(bid=BID), b"", {}, 1, 7))
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await gateway.on_parsed(w, m)
    return box


async def _commit(w: Worker, box: Any) -> None:
    """The batch's commit, then what waited for it (``ConsumerRunner._batch``)."""
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    for f in box.pending:
        await f
    for subject, body, headers in box.after:
        await w.bus.query_sender.send(subject, body, headers)
    for effect in box.then:
        await effect()


async def test_a_round_with_one_candidate_is_decided_only_once_its_selection_is_stored(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    box = await _open_round(w)
    # the batch's other handlers are slow: the timer loop turns, past the round's deadline, before the commit
    await gateway.fire_due(w)
    assert await _order(client) == []  # nothing of the round is stored before its selection
    await _commit(w, box)
    await gateway.fire_due(w)  # whatever the timer still has to do
    assert await _order(client) == ["selection", "post_dry_run", "allocation"]
    block = await w.store.get_block(BID)
    assert block is not None and block["status"] == "allocating" and block["cluster"] == "c0", block
    assert await w.store.gather_claim_due(time.time() + 3600) == ([], None)  # the round is finished


async def test_a_round_asks_no_cluster_again_before_its_selection_is_stored(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await client.add_cluster(Cluster(id="c1"))  # two candidates: the round asks both
    await client.add_node(Node(id="c1-n0", cluster="c1", gpus=[Gpu(id="c1-g0")]))
    asked: list[str] = []

    async def heard(msg: Any) -> None:
        asked.append(msg.subject)

    sub = await client.bus.nc.subscribe(E.cluster_dry_run.filter(), cb=heard)
    box = await _open_round(w)
    await gateway.fire_due(w)  # past the deadline, nobody answered: a timer would ask again
    await client.bus.nc.flush()
    assert asked == []  # an answer to it would be decided, and stored, before the selection
    await _commit(w, box)
    await client.bus.nc.flush()
    assert sorted(asked) == [E.cluster_dry_run.subject(cid=c) for c in ("c0", "c1")]
    assert await _order(client) == ["selection"]
    # stored: the timer is due at the round's deadline (asks again, then decides, as for any round)
    claimed, _ = await w.store.gather_claim_due(time.time())
    assert claimed == [(BID, 1, 0)]
    await sub.unsubscribe()
