"""A chosen cluster that could not take the gang sends the block back to selection
(``workers.controller._reselect_or_fail``): the Redis step (``parsed``, attempt n + 1) is taken
inside the handler, its ``block.parsed`` is published after it. Found by the partition suite
(tests/chaos/test_partitions.py seed 51): the stream lost its quorum right after a heal, the
publish failed, the allocation request came again, and the controller, seeing the block no longer
``allocating``, dropped it: the block stayed ``parsed`` for good, its create never answered. A
request that comes again after its reselect step must publish the step's events again (the stream
deduplicates them by id)."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.bus.catalog import E, Emit
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.testing import MemorySystem
from aios_blocks.workers import controller


async def test_an_allocation_redelivered_after_its_reselect_step_publishes_the_parsed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        real_allocate = controller.allocate
        calls = {"allocate": 0, "parsed_failed": 0}

        async def full_once(w: Any, req: Any, *a: Any, **kw: Any) -> Any:
            calls["allocate"] += 1
            if calls["allocate"] == 1:  # the chosen cluster filled up since its dry run
                raise PlacementFailed("no room left")
            return await real_allocate(w, req, *a, **kw)

        real_emit = s.bus._emit

        async def lose_first_reselect(e: Emit) -> Any:
            if e.event is E.block_parsed and getattr(e.payload, "attempt", 0) == 1 and not calls["parsed_failed"]:
                calls["parsed_failed"] += 1  # the stream has no quorum: no ack
                raise TimeoutError("no ack from the stream")
            return await real_emit(e)

        monkeypatch.setattr(controller, "allocate", full_once)
        monkeypatch.setattr(s.bus, "_emit", lose_first_reselect)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()

        assert calls["parsed_failed"] == 1 and calls["allocate"] >= 2, calls
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "ready", block
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0, 1]
        assert [f["request_id"] for f in s.bus.events(E.block_allocation_failed, bid=bid)] == ["0"]
