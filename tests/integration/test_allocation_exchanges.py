"""The Redis exchanges of the controller's allocation turn after its plan (docs/trace.md "The
reservation and the records in one script"), on real NATS JetStream and Redis: on one Redis server
the gang's reservation and its instance records (the block's step, the affinity index, the records
and their nodes' entries, the nomination's drop) go as one script (``Store.reserve_then_start``),
one exchange, not the reservation's and then the records'; a reservation refused writes none of
them and the step plans again; the outcome is the one of the two exchanges before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.policies import node_digest
from aios_blocks.policies.capacity import node_ref
from aios_blocks.schemas import events
from aios_blocks.schemas.events import AllocationRequest, chunked_root_of, ref_entry
from aios_blocks.settings import Settings
from aios_blocks.state.keys import AFF_LEASE, node_inst_key
from aios_blocks.workers import controller
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig
from .test_create_exchanges import Exchanges, _noted

pytestmark = pytest.mark.integration

BID = "ax-1"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller", Settings(sim_start_delay_s=0), ["c0"]) as got:
        yield got


async def _allocate(w: Worker) -> tuple[Exchanges, list[str]]:
    seen = _noted(w)
    req = AllocationRequest(BID, 1, "c0", 0)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await controller.on_allocation(w, Inbound(E.cluster_allocation, req, {}, Delivery(E.cluster_allocation.subject(cid="c0"), b"", {}, 1, 9)))
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    return seen, [d.subject for d in box.deferred]


def _after_plan(seen: Exchanges) -> list[list[tuple[str, str]]]:
    """The exchanges from the first reservation on (the plan's reads are before it)."""
    first = next(i for i, ex in enumerate(seen) if any(n == "EVALSHA" and k.startswith("aios:{c:c0}:node:") for n, k in ex))
    return seen[first:]


async def test_the_reservation_and_the_records_go_in_one_exchange(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    await w.store.create_block(BID, 1, "d", {"status": "allocating", "ir": make_ir(bid=BID), "attempt": "0", "cluster": "c0"})
    await w.inventory.nodes("c0")  # the view read before (warm, as on the path)
    seen, published = await _allocate(w)
    # one script for the reservation and the records; nothing else of the turn after it
    assert _after_plan(seen) == [[("EVALSHA", "aios:{c:c0}:node:c0-n0")]], seen
    assert published == [E.block_placement.subject(bid=BID), E.node_instance_create.subject(nid="c0-n0")]
    block = await w.store.get_block(BID)
    assert block is not None and block["status"] == "placing" and block["cluster"] == "c0", block
    insts = await w.store.instances(BID)
    assert [(iid, i["node"], i["gpus"], i["status"]) for iid, i in insts.items()] == [(f"{BID}-0", "c0-n0", ["c0-g0"], "starting")]
    taken = await w.store.reservation("c0", f"{BID}-0")
    assert taken is not None and taken["node"] == "c0-n0"
    assert await w.store.r.hgetall(node_inst_key("c0-n0")) == {f"{BID}-0": BID}
    assert list((await w.store.r.hgetall(AFF_LEASE)).values()) == ["c0-n0"]


async def test_a_refused_reservation_writes_no_record(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    await w.store.create_block(BID, 1, "d", {"status": "allocating", "ir": make_ir(bid=BID), "attempt": "0", "cluster": "c0"})
    assert (await w.inventory.nodes("c0"))["c0-n0"]["healthy"]
    # the node turned unhealthy behind the view's back: the plan picks it, the script refuses it
    await w.store.r.hset("aios:{c:c0}:node:c0-n0", "healthy", 0)
    seen, published = await _allocate(w)
    assert [ex for ex in seen if any(n == "EVALSHA" and k.startswith("aios:{c:c0}:node:") for n, k in ex)] == \
        [[("EVALSHA", "aios:{c:c0}:node:c0-n0")]], seen  # one try; the next reads the node again and plans nothing
    assert E.block_placement.subject(bid=BID) not in published and E.node_instance_create.subject(nid="c0-n0") not in published
    # nothing the records' part writes: no record, no node entry, no index entry, no step
    assert await w.store.instances(BID) == {}
    assert await w.store.r.hgetall(node_inst_key("c0-n0")) == {}
    assert await w.store.r.hgetall(AFF_LEASE) == {}
    assert await w.store.reservation("c0", f"{BID}-0") is None
    block = await w.store.get_block(BID)
    # its one step the reselection's (allocating -> parsed), none to placing before it
    assert block is not None and block["status"] == "parsed" and block["version"] == 2, block


async def test_the_events_are_made_while_the_script_is_in_flight(rig: tuple[Worker, Client]) -> None:
    """The decision record's input digest (the JSON and hash of the input's parts other than the
    node map: ``LaterDigests``) and the placement's events (``allocation.announce``, their
    messages: ``allocate._prepare``) are made once the reservation's script is written and before
    its answer is read, not before the script and after its answer: on the path, they overlap
    Redis's round trip. Published as before, the digest the input's (test_decision_inputs)."""
    w, _client = rig
    await w.store.create_block(BID, 1, "d", {"status": "allocating", "ir": make_ir(bid=BID), "attempt": "0", "cluster": "c0"})
    await w.inventory.nodes("c0")
    await w.bus.ids()  # the event key looked up before (as on the path: a worker's first event does)
    order: list[str] = []
    r: Any = w.store.r
    real_exchange, real_stored = r._exchange, w.bus._stored

    async def exchange(commands: list[Any]) -> list[Any]:
        script = any(str(args[0]).upper() == "EVALSHA" for args, _ in commands)
        if script:
            order.append("script sent")
        got = await real_exchange(commands)
        if script:
            order.append("script answered")
        return list(got)

    async def stored(e: Any, subject: str, mid: str) -> Any:
        order.append(f"made {e.event.name}")
        return await real_stored(e, subject, mid)

    def digest(raw: bytes) -> str:
        order.append("digested")
        return real_digest(raw)

    r._exchange = exchange
    w.bus._stored = stored  # type: ignore[method-assign]
    real_digest = events.input_digest
    with patch.object(events, "input_digest", digest):
        _seen, published = await _allocate(w)
    assert order == ["script sent", "digested", "made block.placement", "made node.instance.create", "script answered"], order
    assert published == [E.block_placement.subject(bid=BID), E.node_instance_create.subject(nid="c0-n0")]


async def test_the_next_placement_finds_the_views_memos_caught_up(rig: tuple[Worker, Client]) -> None:
    """Once a placement's events are stored (``Bus.after_commit``), the view's memos every
    placement input reads are caught up with its change (``node_digest.settle``): the next
    placement's decision record re-hashes no chunk of the node map's root (one, the last
    placement's node, without it) and its input is the same."""
    w, _client = rig
    bids = ["ax-1", "ax-2"]
    for bid in bids:
        await w.store.create_block(bid, 1, "d", {"status": "allocating", "ir": make_ir(bid=bid), "attempt": "0", "cluster": "c0"})
    await w.inventory.nodes("c0")
    hashed: list[int] = []
    real = node_digest.chunk_digest

    def chunk(entries: list[bytes]) -> bytes:
        hashed.append(len(entries))
        return real(entries)

    digests = []
    for bid in bids:
        with patch.object(node_digest, "chunk_digest", chunk), outbox(defer=bool(w.bus.atomic_streams)) as box:
            req = AllocationRequest(bid, 1, "c0", 0)
            await controller.on_allocation(w, Inbound(E.cluster_allocation, req, {}, Delivery(E.cluster_allocation.subject(cid="c0"), b"", {}, 1, 9)))
            in_turn = len(hashed)
            assert await w.bus.commit([box.deferred], 10.0) == [""]
            for then in box.then:  # the runner's, once the batch's events are stored
                await then()
        digests.append(in_turn)
        hashed.clear()
    # the first turn may build the root; the second finds it caught up by the first's settle
    assert digests[1] == 0, digests
    view = await w.inventory.nodes("c0")
    assert node_digest.nodes_root(view) == chunked_root_of([ref_entry(nid, node_ref(v)) for nid, v in view.items()])
