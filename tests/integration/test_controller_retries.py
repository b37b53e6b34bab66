"""A controller step handled twice (JetStream redelivers after a crash or a lost ack) must have the
effect of one, on real NATS JetStream and Redis: the controller's own helpers and the effects
adapter, called twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.bus import subjects
from aios_blocks.cli.client import Client
from aios_blocks.handlers.effects import Replace
from aios_blocks.workers import controller
from aios_blocks.workers.base import Worker
from aios_blocks.workers.effects import commit

from .conftest import worker_rig

BID = "retry-1"


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller") as got:
        yield got


async def _stored(client: Client, subject: str) -> int:
    info = await client.bus.js.stream_info(subjects.STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_a_replacement_requested_twice_is_published_and_counted_once(worker: tuple[Worker, Client]) -> None:
    w, client = worker
    await w.store.r.hset(f"aios:block:{BID}", mapping={"gen": 1, "status": "ready"})
    for _ in range(2):  # the same fault handled twice: same request id
        await commit(w, [Replace(BID, 1, "c1", f"{BID}-0", "exited 1", f"{BID}-0:failed")])
    assert (await w.store.get_block(BID))["replacements"] == "1"
    assert await _stored(client, subjects.cluster_command("c1", "reassignment")) == 1
    # a different fault of the same instance is a new request: counted
    await commit(w, [Replace(BID, 1, "c1", f"{BID}-0", "unhealthy", f"{BID}-0:unhealthy")])
    assert (await w.store.get_block(BID))["replacements"] == "2"


async def test_a_redelivered_placement_keeps_the_status_of_running_instances(worker: tuple[Worker, Client]) -> None:
    w, client = worker
    ir = {"blockId": BID, "image": "", "resources": {"gpus": 1}, "launch": {}}
    placements = [{"iid": f"{BID}-0", "node": "c1-n0", "gpus": ["g0"]}, {"iid": f"{BID}-1", "node": "c1-n1", "gpus": ["g1"]}]
    await controller.start(w, ir, 1, "c1", "allocation", placements, 1, key="gang")
    await w.store.set_instance_status(BID, f"{BID}-0", "running")
    await w.store.set_instance_status(BID, f"{BID}-1", "removing")
    await controller.start(w, ir, 1, "c1", "allocation", placements, 1, key="gang")  # redelivered
    insts = await w.store.instances(BID)
    assert {iid: i["status"] for iid, i in insts.items()} == {f"{BID}-0": "running", f"{BID}-1": "removing"}
    assert await _stored(client, subjects.node_command("c1-n0", "instance.create")) == 1  # deduplicated
