"""Safe under faults (issue 36 item 5, docs/priority.md "Safe under faults"): a controller
SIGKILLed between choosing a preemption's victims and evicting them (the fault point
``queue.preempt.after_events``: the mark and the ``block.preempted``/``block.preempting`` events
are stored, nothing is evicted) leaves no GPU double-booked and no victim both running and
pending; the preemption is carried out once, by the same plan (another copy or the restarted
one), and the preemptor is placed exactly once. Two controller copies run throughout: the stream
holds one ``block.preempting`` for the preemptor."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aios_blocks.recovery.invariants import check

from ..integration.conftest import System
from ..integration.test_pending_queue import events, spec, status_of
from ..integration.test_priority_cli import _ok

pytestmark = pytest.mark.integration


@pytest.fixture
def fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The controller that first reaches the fault point SIGKILLs itself (once: it removes the
    file). Set before ``chaos`` starts the workers, which inherit it."""
    once = tmp_path / "fault-once"
    once.write_text("")
    monkeypatch.setenv("AIOS_FAULT", f"queue.preempt.after_events:{once}")
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "0.5")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")
    return once


async def test_a_controller_killed_mid_preemption(fault: Path, chaos: System) -> None:
    c = chaos.client
    await _ok(chaos, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    for bid in ("lo1", "lo2"):
        _, kind, _ = await chaos.submit_and_wait(spec(bid))
        assert kind == "ready", bid
    restarts = chaos.supervisor.restarts
    await c.submit(spec("hi", priorityClass="high"))
    await status_of(chaos, "hi", "ready", timeout=90)
    assert not await asyncio.to_thread(fault.exists) and chaos.supervisor.restarts > restarts  # the kill happened
    (preempting,) = await events(chaos, "hi", "preempting")  # one preemption, by one plan
    (victim,) = preempting["victims"]
    other = ({"lo1", "lo2"} - {victim}).pop()
    (preempted,) = await events(chaos, victim, "preempted")
    assert preempted["preemptor"] == "hi"
    placements = await events(chaos, "hi", "placement")
    assert len(placements) == 1, placements  # placed exactly once
    v = await status_of(chaos, victim, "pending")
    assert v["preempted_by"] == "hi" and not await c.store.instances(victim)  # not running and pending
    assert (await c.store.get_block(other) or {})["status"] == "ready"
    rep = await check(c.bus, c.store, settled=False)  # no GPU double-booked; the state is the stream's
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)
