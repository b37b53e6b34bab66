"""The Redis exchanges of a create's placement and start (docs/trace.md "The controller's and the
simulated fleet's turns"), on real NATS JetStream and Redis: the controller's allocation reads the
redelivery check's reservation with the block, and the simulated fleet reads a node's registration
with the node index, each in the step's one first exchange (``state.autopipeline``), with the same
outcome: placed on the same node, a redelivered request reusing its reservation, the instance
started and ``added`` published, a command that names another cluster still served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.agent.fleet import Fleet
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.schemas.events import AllocationRequest, InstanceCommand
from aios_blocks.settings import Settings
from aios_blocks.workers import controller
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig
from .test_create_exchanges import Exchanges, _noted

pytestmark = pytest.mark.integration

BID = "px-1"


def _holding(seen: Exchanges, name: str, key: str) -> list[int]:
    """The exchanges (their index) that hold ``name`` on a key starting with ``key``."""
    return [i for i, ex in enumerate(seen) if any(n == name and k.startswith(key) for n, k in ex)]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller", Settings(sim_start_delay_s=0), ["c0"]) as got:
        yield got


async def _allocate(w: Worker) -> Exchanges:
    seen = _noted(w)
    req = AllocationRequest(BID, 1, "c0", 0)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await controller.on_allocation(w, Inbound(E.cluster_allocation, req, {}, Delivery(E.cluster_allocation.subject(cid="c0"), b"", {}, 1, 9)))
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    return seen


async def test_the_allocation_reads_the_first_instance_s_reservation_with_the_block(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    await w.store.create_block(BID, 1, "d", {"status": "allocating", "ir": make_ir(bid=BID), "attempt": "0", "cluster": "c0"})
    res = f"aios:{{c:c0}}:res:{BID}-0"
    seen = await _allocate(w)
    # the redelivery check's read shares the block's exchange; no exchange of its own after it
    assert _holding(seen, "HGETALL", res) == _holding(seen, "HGETALL", f"aios:block:{BID}") == [0], seen
    block = await w.store.get_block(BID)
    assert block is not None and block["status"] == "placing", block
    insts = await w.store.instances(BID)
    assert [(iid, i["node"], i["gpus"]) for iid, i in insts.items()] == [(f"{BID}-0", "c0-n0", ["c0-g0"])]
    taken = await w.store.reservation("c0", f"{BID}-0")
    assert taken is not None and taken["node"] == "c0-n0"

    # the request again (a redelivery: the block still placing, the reservation held): the read
    # ahead finds it and the step reuses it, planning nothing and reserving nothing more
    seen = await _allocate(w)
    assert _holding(seen, "HGETALL", res) == [0], seen
    assert not [ex for ex in seen if any(n == "EVALSHA" and k.startswith("aios:{c:c0}:node:") for n, k in ex)], seen
    assert await w.store.reservation("c0", f"{BID}-0") == taken
    assert [(i["node"], i["gpus"]) for i in (await w.store.instances(BID)).values()] == [("c0-n0", ["c0-g0"])]


def _create(nid: str, cluster: str, iid: str) -> Inbound[InstanceCommand]:
    cmd = InstanceCommand(BID, 1, cluster, iid, nid, ["c0-g0"])
    return Inbound(E.node_instance_create, cmd, {"nid": nid}, Delivery(E.node_instance_create.subject(nid=nid), b"", {}, 1, 11))


async def _command(fleet: Fleet, w: Worker, m: Inbound[InstanceCommand]) -> list[str]:
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await fleet.on_command(m)
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    return [d.subject for d in box.deferred]


async def test_the_fleet_reads_a_node_s_registration_with_the_node_index(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    fleet = Fleet(w)
    seen = _noted(w)
    published = await _command(fleet, w, _create("c0-n0", "c0", f"{BID}-0"))
    # the node index and the command's cluster's record of the node: one exchange, the only one
    assert seen == [[("HGET", "aios:nodeindex"), ("HMGET", "aios:{c:c0}:node:c0-n0")]], seen
    assert published == [E.instance_added.subject(bid=BID, iid=f"{BID}-0")]
    assert fleet.runtime._items[f"sim-{BID}-0"].running
    assert fleet.agents["c0-n0"].cfg.node.gpus[0].id == "c0-g0"  # the node's own registration

    # a command that names another cluster than the index: the index decides, as it did
    fleet2 = Fleet(w)
    seen.clear()
    published = await _command(fleet2, w, _create("c0-n0", "elsewhere", f"{BID}-1"))
    assert published == [E.instance_added.subject(bid=BID, iid=f"{BID}-1")]
    assert fleet2.agents["c0-n0"].cfg.node.gpus[0].id == "c0-g0"
    assert seen[-1] == [("HMGET", "aios:{c:c0}:node:c0-n0")], seen
