"""The simulated fleet's turn on ``node.instance.create`` on real NATS and Redis (docs/trace.md
"Where a create's time goes"): a first command to a node makes no task but the auto-pipeline's one
exchange (the node index and the node's record read as one pipeline, in the handler's task; no
task per runner waiting for its end), with the same outcome: the instance runs and serves, and
``added`` with its endpoint is what the turn publishes."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from aios_blocks.agent.fleet import Fleet
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.schemas.events import InstanceCommand
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker

from .conftest import worker_rig
from .loop_tasks import tasks_made
from .test_create_exchanges import _noted

pytestmark = pytest.mark.integration

BID = "ft-1"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "agent-sim", Settings(sim_start_delay_s=0), ["c0"]) as got:
        yield got


async def test_a_first_command_to_a_node_makes_no_task_but_its_one_exchange(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    fleet = Fleet(w)
    assert fleet.runtime.server is not None
    await fleet.runtime.server._ensure()  # the server's one-time setup apart
    await w.bus.ids()  # and the bus's event key (looked up once per process)
    seen = _noted(w)
    cmd = InstanceCommand(BID, 1, "c0", f"{BID}-0", "c0-n0", ["c0-g0"], env={"AIOS_INSTANCE_ID": f"{BID}-0"})
    m = Inbound(E.node_instance_create, cmd, {"nid": "c0-n0"}, Delivery(E.node_instance_create.subject(nid="c0-n0"), b"", {}, 1, 11))
    with tasks_made() as made:
        with outbox(defer=bool(w.bus.atomic_streams)) as box:
            await fleet.on_command(m)
    assert made == ["AutoPipelineRedis._flush"], made
    assert seen == [[("HGET", "aios:nodeindex"), ("HMGET", "aios:{c:c0}:node:c0-n0")]], seen
    assert [d.subject for d in box.deferred] == [E.instance_added.subject(bid=BID, iid=f"{BID}-0")]
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    endpoint = msgspec.json.decode(box.deferred[0].body)["data"]["endpoint"]
    assert (await asyncio.to_thread(urllib.request.urlopen, f"{endpoint}/health", timeout=5)).status == 200
    await fleet.runtime.close()


async def test_the_commit_of_a_turn_s_events_to_one_stream_makes_no_task(rig: tuple[Worker, Client]) -> None:
    """``Bus.commit`` of one stream's events (every turn's of the create path when unloaded) awaits
    their publish itself, not in a task (``asyncio.gather`` of one part): the publish goes out a
    turn of the loop sooner, and the commit ends a turn sooner after the ack."""
    w, client = rig
    ev = InstanceCommand(BID, 1, "c0", f"{BID}-9", "c0-n0", [])
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await w.bus.emit(E.node_instance_remove, ev, qualifier="warm")
    assert await w.bus.commit([box.deferred], 10.0) == [""]  # the first publish subscribes to its acks (a task)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await w.bus.emit(E.node_instance_remove, ev)
    with tasks_made() as made:
        seqs: list[list[int]] = []
        assert await w.bus.commit([box.deferred], 10.0, seqs) == [""]
    assert made == [], made
    assert seqs[0][0] > 0  # stored, at its sequence
    assert E.node_instance_remove.subject(nid="c0-n0") in [s for s, _b, _q, _t in await client.stream()]
