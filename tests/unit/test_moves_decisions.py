"""The pure decisions of make-before-break moves (``handlers/moves.py``), on in-memory snapshots:
what a request is refused for, when the switch happens (never below minInstances), what a failed
move removes (the new instance only), and what the sweep does with a move whose time is up."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.handlers import moves as mv
from aios_blocks.handlers.effects import Publish, SetInstance
from aios_blocks.schemas.catalog import E
from aios_blocks.schemas.lifecycle import InstanceStatus
from aios_blocks.schemas.moves import MovePhase, MoveRequested

NOW = 1_000.0
BLOCK: dict[str, Any] = {"gen": 7, "status": "ready", "cluster": "c1", "ir": {"minInstances": 2, "maxInstances": 2}}


def _insts(**status: str) -> dict[str, dict[str, Any]]:
    return {iid: {"node": f"n-{iid}", "gpus": ["g"], "cluster": "c1", "status": st} for iid, st in status.items()}


def _rec(phase: MovePhase, **kw: Any) -> dict[str, Any]:
    old = _insts(**{"b-0": "running"})["b-0"]
    rec = mv.record(MoveRequested("b", "m1", "b-0", reason="defrag"), BLOCK, old, NOW - 10)
    return {**rec, "phase": phase.value, "node": "n9", **kw}


def _events(plan: mv.Plan) -> list[tuple[str, Any]]:
    return [(e.event.name, e.payload) for p in plan.effects if isinstance(p, Publish) for e in p.events]


def test_new_instance_ids_are_recognised_and_never_a_gang_or_scale_id() -> None:
    new = mv.new_instance_id("b", "m1")
    assert new.startswith("b-mv") and mv.is_move_instance("b", new)
    assert not mv.is_move_instance("b", "b-0") and not mv.is_move_instance("b", "b-0123abcd")
    assert not mv.is_move_instance("x", new) and new != mv.new_instance_id("b", "m2")


@pytest.mark.parametrize(("req", "block", "insts", "why"), [
    (MoveRequested("b", "m", "b-0"), None, {}, "unknown block b"),
    (MoveRequested("b", "m", "b-0", gen=3), BLOCK, _insts(**{"b-0": "running"}), "block generation is 7, the move was for 3"),
    (MoveRequested("b", "m", "b-0"), {**BLOCK, "status": "placing"}, _insts(**{"b-0": "running"}),
     "block is placing: only a ready block's instances move"),
    (MoveRequested("b", "m", "b-9"), BLOCK, _insts(**{"b-0": "running"}), "no such instance: b-9"),
    (MoveRequested("b", "m", "b-0"), BLOCK, _insts(**{"b-0": "starting", "b-1": "running"}),
     "instance b-0 is starting: only a running instance moves"),
    (MoveRequested("b", "m", "b-0", to_node="zz"), BLOCK, _insts(**{"b-0": "running", "b-1": "running"}),
     "node zz is not a node of cluster c1"),
    (MoveRequested("b", "m", "b-0", to_node="n-b-0"), BLOCK, _insts(**{"b-0": "running", "b-1": "running"}),
     "instance b-0 is already on node n-b-0"),
    (MoveRequested("b", "m", "b-0"), BLOCK, _insts(**{"b-0": "running", "b-1": "removing"}),
     "the block has 1 ready instance(s), fewer than minInstances 2: it is made whole first"),
    (MoveRequested("b", "m", "b-0", to_node="n9"), BLOCK, _insts(**{"b-0": "running", "b-1": "running"}), ""),
])
def test_what_a_request_is_refused_for(req: MoveRequested, block: dict[str, Any] | None, insts: dict[str, Any], why: str) -> None:
    assert mv.refusal(req, block, insts, {"n-b-0", "n-b-1", "n9"}) == why


def test_the_budget_is_max_moving_else_one() -> None:
    assert mv.budget({}) == 1 and mv.budget({"maxMoving": 3}) == 3 and mv.budget({"maxMoving": 0}) == 1
    assert mv.claim_refusal("budget", "2", 2) == "disruption budget: 2 of the block's moves open, maxMoving 2"


def test_the_switch_drains_the_old_one_only_once_the_block_keeps_min_instances_without_it() -> None:
    rec = _rec(MovePhase.STARTED)
    new = rec["new"]
    ok = mv.switch(rec, BLOCK, _insts(**{"b-0": "running", "b-1": "running", new: "running"}), NOW, 20.0)
    assert ok.record is not None and ok.record["phase"] == "switched" and ok.expected == ("started",)
    assert ok.effects[0] == SetInstance("b", "b-0", InstanceStatus.REMOVING)
    (switched, remove) = _events(ok)
    assert switched[0] == "block.move.switched" and switched[1].reason == "defrag"
    assert switched[1].detail == {"ready_without_old": 2, "minInstances": 2}
    assert remove[0] == E.node_instance_remove.name and remove[1].instance_id == "b-0" and remove[1].drain_s == 20.0
    # b-1 went unready meanwhile: without b-0 only the new one serves (1 < 2): nothing yet
    wait = mv.switch(rec, BLOCK, _insts(**{"b-0": "running", "b-1": "starting", new: "running"}), NOW, 20.0)
    assert wait.record is None and wait.effects == [] and wait.due > NOW


def test_a_switch_whose_old_instance_is_gone_completes_and_one_already_going_waits_for_its_removal() -> None:
    rec = _rec(MovePhase.STARTED)
    new = rec["new"]
    gone = mv.switch(rec, BLOCK, _insts(**{"b-1": "running", new: "running"}), NOW, 20.0)
    assert gone.record is not None and gone.record["phase"] == "completed" and [n for n, _ in _events(gone)] == ["block.move.completed"]
    going = mv.switch(rec, BLOCK, _insts(**{"b-0": "removing", "b-1": "running", new: "running"}), NOW, 20.0)
    assert going.record is not None and going.record["phase"] == "switched"
    assert [n for n, _ in _events(going)] == ["block.move.switched"]  # no second remove command
    assert mv.on_old_removed(going.record, NOW).record["phase"] == "completed"  # type: ignore[index]


def test_a_failed_move_removes_the_new_instance_only() -> None:
    rec = _rec(MovePhase.STARTED)
    new = rec["new"]
    plan = mv.failed(rec, "boom", NOW, _insts(**{"b-0": "running", "b-1": "running", new: "starting"}))
    assert plan.record is not None and plan.record["phase"] == "failed" and plan.record["why"] == "boom"
    assert set(plan.expected) == {"claimed", "started", "switched"}
    assert plan.effects[0] == SetInstance("b", new, InstanceStatus.REMOVING)
    (remove, failed) = _events(plan)
    assert remove[1].instance_id == new and failed[0] == "block.move.failed" and failed[1].reason == "boom"
    # nothing placed yet: only the event
    assert [n for n, _ in _events(mv.failed(_rec(MovePhase.CLAIMED), "no room", NOW, _insts(**{"b-0": "running"})))] == ["block.move.failed"]


def test_the_new_instance_failing_before_the_switch_fails_the_move_after_it_does_not() -> None:
    insts = _insts(**{"b-0": "running"})
    assert mv.on_new_gone(_rec(MovePhase.STARTED), insts, NOW, "failed: exit 1").record["phase"] == "failed"  # type: ignore[index]
    assert mv.on_new_gone(_rec(MovePhase.SWITCHED), insts, NOW, "failed: exit 1").record is None


def test_the_sweep_fails_a_lapsed_claim_and_a_new_instance_never_ready_switches_a_missed_ready() -> None:
    new = mv.new_instance_id("b", "m1")
    both = _insts(**{"b-0": "running", "b-1": "running"})
    lapsed = mv.on_due(_rec(MovePhase.CLAIMED, due=NOW - 1), BLOCK, both, NOW, 20.0, 120.0)
    assert lapsed.record["phase"] == "failed" and "claim lapsed" in lapsed.record["why"]  # type: ignore[index]
    early = mv.on_due(_rec(MovePhase.CLAIMED, due=NOW + 5), BLOCK, both, NOW, 20.0, 120.0)
    assert early.record is None and early.due == NOW + 5
    slow = mv.on_due(_rec(MovePhase.STARTED, due=NOW - 1), BLOCK, {**both, **_insts(**{new: "starting"})}, NOW, 20.0, 120.0)
    assert slow.record["why"] == f"new instance {new} not ready within 120 s (AIOS_MOVE_READY_TIMEOUT_S)"  # type: ignore[index]
    missed = mv.on_due(_rec(MovePhase.STARTED, due=NOW + 50), BLOCK, {**both, **_insts(**{new: "running"})}, NOW, 20.0, 120.0)
    assert missed.record["phase"] == "switched"  # type: ignore[index]
    done = mv.on_due(_rec(MovePhase.SWITCHED, due=NOW + 50), BLOCK, _insts(**{"b-1": "running", new: "running"}), NOW, 20.0, 120.0)
    assert done.record["phase"] == "completed"  # type: ignore[index]
    gone = mv.on_due(_rec(MovePhase.STARTED, due=NOW + 50), {**BLOCK, "status": "deleting"}, both, NOW, 20.0, 120.0)
    assert gone.record["phase"] == "failed" and gone.record["why"] == "block is deleting"  # type: ignore[index]
