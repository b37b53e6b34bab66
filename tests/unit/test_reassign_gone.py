"""A reassignment of an instance that is gone says so in words `blocks explain` can show. Found as
a stranger after a `kill -9` of a node's agent: the health checker's replacement and the heartbeat
eviction's reassignment raced, the block came back, and explain still said `reassignment failed:
no such instance`, which read as a fault of the block."""

from __future__ import annotations

from aios_blocks.bus.catalog import E
from aios_blocks.schemas.events import ReassignRequest
from aios_blocks.testing import MemorySystem


async def test_a_reassignment_of_an_instance_already_gone_names_it_and_why() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()
        before = dict(await s.store.instances(bid))
        await s.bus.emit(E.cluster_reassignment, ReassignRequest(bid, "c1", "re1", f"{bid}-gone", "test"))
        await s.run()
        (failed,) = s.bus.events(E.block_reassignment_failed, bid=bid)
        assert failed["reason"] == f"no such instance: {bid}-gone was already replaced or removed (nothing left to move)"
        assert await s.store.instances(bid) == before  # the block is left as it was
