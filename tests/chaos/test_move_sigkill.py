"""Safe under faults (issue 38 item 2, docs/rebalance.md "Moves"): a controller SIGKILLed in the
middle of a make-before-break move - after the new instance's reservation and before its start
(fault point ``move.reserved``), or after the move's switch is recorded and before the old
instance is told to drain (``move.switched``) - leaves the move finished by the other controller
copy (the redelivered request or ``added``): one new instance, on the node it was reserved on,
the old one removed only after the new one ran, nothing double-booked, the state the stream's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import moves as mv
from aios_blocks.recovery.invariants import check
from aios_blocks.schemas.moves import MoveRequested
from aios_blocks.state.moves import MoveStore

from ..integration.conftest import System

pytestmark = pytest.mark.integration


@pytest.fixture(params=["move.reserved", "move.switched"])
def fault(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """The controller that first reaches the point SIGKILLs itself (once). Set before ``chaos``
    starts the workers, which inherit it."""
    once = tmp_path / "fault-once"
    once.write_text("")
    monkeypatch.setenv("AIOS_FAULT", f"{request.param}:{once}")
    monkeypatch.setenv("AIOS_MOVE_SWEEP_S", "0.5")
    return request.param, once


async def test_a_controller_killed_mid_move(fault: tuple[str, Path], chaos: System) -> None:
    point, once = fault
    c = chaos.client
    await c.add_sim_cluster("c1", nodes=3, gpus=1)
    _, kind, _ = await chaos.submit_and_wait({"blockId": "mk", "blockComponentURI": "aios://test/model",
                                              "minInstances": 1, "maxInstances": 1})
    assert kind == "ready"
    restarts = chaos.supervisor.restarts
    await c.bus.emit(E.block_move_requested, MoveRequested("mk", "k1", "mk-0", reason="chaos", requested_by="test"))
    ms = MoveStore(c.store.r)
    async with asyncio.timeout(120):
        while (rec := await ms.get("mk", "k1")) is None or rec["phase"] not in ("completed", "failed"):
            await asyncio.sleep(0.2)
    assert not await asyncio.to_thread(once.exists) and chaos.supervisor.restarts > restarts, point  # the kill happened
    assert rec["phase"] == "completed", rec
    new = mv.new_instance_id("mk", "k1")
    insts = await c.store.instances("mk")
    assert list(insts) == [new] and insts[new]["status"] == "running"
    (res,) = await c.store.reservations("c1")
    assert res["node"] == insts[new]["node"] == rec["node"]
    story = [s for s, _, _ in await c.history("mk", idle=0.3)]
    hist = [s.rsplit(".", 1)[1] for s in story if ".move." in s]
    assert hist == ["requested", "started", "switched", "completed"], hist
    # make-before-break through the kill: the old instance went only after the new one ran
    assert story.index(f"aios.block.mk.instance.{new}.added") < story.index("aios.block.mk.instance.mk-0.removed")
    rep = await check(c.bus, c.store, settled=False)  # no GPU double-booked; the state is the stream's
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
