"""The store's compare-and-set script, on a real Redis, follows the lifecycle table exactly: every
(status, step) pair moves the block iff the table says so, and never across generations."""

from __future__ import annotations

import itertools
from pathlib import Path

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.lifecycle import REUSABLE, TRANSITIONS, BlockStatus, Step
from aios_blocks.state.store import Store


async def test_the_cas_script_takes_its_rules_from_the_table(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    st = Store.open(servers.redis_url)
    try:
        for n, (status, step) in enumerate(itertools.product(list(BlockStatus), list(Step))):
            bid = f"b{n}"
            assert (await st.create_block(bid, 5, "d", {"status": status.value}))[0]
            ok, info = await st.transition(bid, 5, step, reason="r")
            rule = TRANSITIONS[step]
            block = await st.get_block(bid)
            assert block is not None
            if status in rule.sources:
                assert ok and block["status"] == rule.target and block["version"] == 2 and block["reason"] == "r", (status, step)
            else:
                assert not ok and info == status.value and block["status"] == status and block["version"] == 1, (status, step)
            stale, why = await st.transition(bid, 4, step)
            assert not stale and why == "stale-gen:5"
        # a block id is reused (a new generation) only from the table's reusable statuses
        for status in BlockStatus:
            bid = f"reuse-{status.value}"
            await st.create_block(bid, 1, "d", {"status": status.value})
            ok, what = await st.create_block(bid, 2, "d2", {"status": "parsed"})
            assert ok == (status in REUSABLE), (status, what)
    finally:
        await st.close()
        servers.stop()
