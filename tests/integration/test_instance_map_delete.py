"""A deleted block's instance map stays deleted (real NATS, Redis and the workers of `blocks up`).

Found by a stranger's pass: after `blocks delete`, the mapper took the instances' ``removed`` and
the block's ``deleted`` together; a removal handled after the map was deleted made it anew (no
instance, its ids in ``gone``), so the deleted block stayed in the bucket for ever: the metrics
collector sampled it every second and its ``/blocks`` listed it. Two of three blocks deleted one
after another were left so on `blocks up`; the mapper's handler now makes no map for a block that
is ``deleting`` or ``deleted`` (``handlers.mapper._base``; the pure rule:
tests/unit/test_executor_engine.py::test_a_fact_of_a_deleted_block_after_its_map_was_deleted_makes_no_map_again).
"""

from __future__ import annotations

import asyncio

from aios_blocks.bus.instance_map import InstanceMaps

from .conftest import System
from .test_pending_queue import spec, status_of

BLOCKS = [f"gone-{i}" for i in range(6)]


async def test_deleted_blocks_leave_no_instance_map(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=3, gpus=8)
    for bid in BLOCKS:
        _, kind, _ = await system.submit_and_wait(spec(bid, 2))
        assert kind == "ready", bid
    maps = InstanceMaps(c.bus)
    for bid in BLOCKS:
        assert (await maps.get(bid))[0] is not None, bid
    for bid in BLOCKS:
        await c.delete(bid)
        await status_of(system, bid, "deleted")
    await asyncio.sleep(2)  # every fact of the deletes handled by the mapper (they are ms apart)
    left = {bid: (await maps.get(bid))[0] for bid in BLOCKS}
    assert {b: m for b, m in left.items() if m is not None} == {}
