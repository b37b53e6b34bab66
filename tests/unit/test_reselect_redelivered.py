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
        calls = await _full_once_and_the_reselect_unacked(s, monkeypatch)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()

        assert calls["parsed_failed"] == 1 and calls["allocate"] >= 2, calls
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "ready", block
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0, 1]
        assert [f["request_id"] for f in s.bus.events(E.block_allocation_failed, bid=bid)] == ["0"]


async def test_a_reselect_whose_publish_failed_is_announced_by_the_reconciler_when_its_request_does_not_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same step without the redelivery's help (``_reselected`` never true: e.g. the request
    was dead-lettered, or the block's record moved on in a way the request cannot see): the step's
    events were marked before its CAS (docs/reliability.md, "Announcements"), so the reconciler's
    pass publishes them and the block goes on to be placed."""
    from aios_blocks.workers import reconciler

    async with MemorySystem.open() as s:
        await _full_once_and_the_reselect_unacked(s, monkeypatch)
        monkeypatch.setattr(controller, "_reselected", lambda block, ev: False)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "parsed" and [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0]

        monkeypatch.setattr(reconciler, "ANNOUNCE_AFTER_S", 0.0)
        r = reconciler.Reconciler(s.worker)
        await r.tick()
        assert r.announced == (1, 0)
        await s.run()
        assert (await s.store.get_block(bid) or {}).get("status") == "ready"
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0, 1]


async def _full_once_and_the_reselect_unacked(s: MemorySystem, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A cluster c1 whose first allocation finds no room (it filled up since its dry run), and the
    stream without quorum for the first reselect's ``block.parsed`` (no ack). Returns the counts."""
    await s.add_component()
    await s.add_sim_cluster("c1", nodes=2, gpus=2)
    real_allocate = controller.allocate
    calls = {"allocate": 0, "parsed_failed": 0}

    async def full_once(w: Any, req: Any, *a: Any, **kw: Any) -> Any:
        calls["allocate"] += 1
        if calls["allocate"] == 1:
            raise PlacementFailed("no room left")
        return await real_allocate(w, req, *a, **kw)

    real_emit = s.bus._emit

    async def lose_first_reselect(e: Emit) -> Any:
        if e.event is E.block_parsed and getattr(e.payload, "attempt", 0) == 1 and not calls["parsed_failed"]:
            calls["parsed_failed"] += 1
            raise TimeoutError("no ack from the stream")
        return await real_emit(e)

    monkeypatch.setattr(controller, "allocate", full_once)
    monkeypatch.setattr(s.bus, "_emit", lose_first_reselect)
    return calls
