"""The controller plans a cluster's allocation requests in the order they were delivered
(``workers.allocate.Turn``), on real NATS JetStream and Redis: a preempted block placed again,
whose step reads its reservations in one Redis exchange more than a new block's (its instance ids
are not the ``{bid}-0`` read with the block), is not overtaken by the request delivered after it
in the same batch. Without the turn the new block took the one GPU; the queue walk released the
victim first and the in-process replay places it first (test_trace_online_lockstep failed about
1 run in 2 on this)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.schemas.events import AllocationRequest
from aios_blocks.settings import Settings
from aios_blocks.workers import controller
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig

pytestmark = pytest.mark.integration


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller", Settings(sim_start_delay_s=0), ["c0"]) as got:
        yield got


async def _step(w: Worker, bid: str, seq: int) -> None:
    req = AllocationRequest(bid, 1, "c0", 1)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await controller.on_allocation(w, Inbound(E.cluster_allocation, req, {},
                                                  Delivery(E.cluster_allocation.subject(cid="c0"), b"", {}, 1, seq)))
    assert await w.bus.commit([box.deferred], 10.0) == [""]


async def test_a_victim_placed_again_is_not_overtaken_by_a_later_request(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    # both ask the cluster's one GPU; the victim (its instance ids r1-*) is delivered first
    await w.store.create_block("ao-victim", 1, "d", {"status": "allocating", "ir": make_ir(bid="ao-victim"), "attempt": "1",
                                                     "cluster": "c0", "preempted_by": "ao-high"})
    await w.store.create_block("ao-new", 1, "d", {"status": "allocating", "ir": make_ir(bid="ao-new"), "attempt": "1",
                                                  "cluster": "c0"})
    await w.inventory.nodes("c0")  # loaded: neither step reads the inventory first
    # one batch: the handlers start in delivery order and run together (as ConsumerRunner._batch)
    await asyncio.gather(_step(w, "ao-victim", 20), _step(w, "ao-new", 21))
    placed = {bid: [(i["node"], i["gpus"]) for i in (await w.store.instances(bid)).values()] for bid in ("ao-victim", "ao-new")}
    assert placed == {"ao-victim": [("c0-n0", ["c0-g0"])], "ao-new": []}, placed
