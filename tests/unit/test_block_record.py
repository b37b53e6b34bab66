"""What a block record looks like to callers (`blocks get --json`)."""

from __future__ import annotations

from aios_blocks.testing import MemorySystem


async def test_a_block_record_gives_its_create_sequence_as_a_number() -> None:
    # `blocks get BID --json` showed "created": "11" beside "gen": 11
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()
        block = await s.store.get_block(bid)
    assert block is not None
    assert isinstance(block["created"], int) and block["created"] == block["gen"]
