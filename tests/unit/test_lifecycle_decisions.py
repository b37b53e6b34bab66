"""The lifecycle consumer's decisions, without servers: each fact and snapshot gives exactly the
effects the rules say (docs/agents.md)."""

from __future__ import annotations

from typing import Any

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers.effects import (
    DeletedIfEmpty,
    Publish,
    ReadyIfRunning,
    Release,
    RemoveAll,
    Replace,
    SetInstance,
    Transition,
)
from aios_blocks.schemas.events import InstanceEvent
from aios_blocks.schemas.lifecycle import InstanceStatus, Step


def block(status: str, gen: int = 7, min_instances: int = 2, **extra: Any) -> dict[str, Any]:
    return {"status": status, "gen": gen, "ir": {"blockId": "b", "minInstances": min_instances}, "cluster": "c1", **extra}


def inst(node: str = "n1", status: str = "starting") -> dict[str, Any]:
    return {"node": node, "cluster": "c1", "gpus": ["g0"], "status": status}


def fact(iid: str = "b-0", node: str = "n1", gen: int = 7, reason: str = "") -> InstanceEvent:
    return InstanceEvent("b", gen, iid, node, ["g0"], reason)


def test_added_makes_the_instance_running_and_the_block_possibly_ready() -> None:
    effects = lc.on_added(fact(), lc.View(block("placing"), {"b-0": inst()}))
    assert effects == [SetInstance("b", "b-0", InstanceStatus.RUNNING), ReadyIfRunning("b", 7, 2, "c1")]


def test_one_more_instance_of_a_ready_block_runs_without_announcing_ready_again() -> None:
    """A scale-up of a ready block: its ``ready`` went out when it became ready, so the instance
    only starts running (no readiness check, no re-publish per added instance)."""
    assert lc.on_added(fact("b-9"), lc.View(block("ready"), {"b-9": inst()})) == [SetInstance("b", "b-9", InstanceStatus.RUNNING)]
    # but the redelivered ``added`` that made the block ready (its instance already running) checks
    # again, so an announcement lost to a crash between the transition and the publish goes out
    effects = lc.on_added(fact(), lc.View(block("ready"), {"b-0": inst(status="running")}))
    assert effects == [SetInstance("b", "b-0", InstanceStatus.RUNNING), ReadyIfRunning("b", 7, 2, "c1")]


def test_added_for_a_copy_nobody_wants_stops_it_on_the_reporting_node_only() -> None:
    for view in (lc.View(None), lc.View(block("placing", gen=8), {"b-0": inst()}), lc.View(block("placing"), {"b-0": inst("n2")})):
        (effect,) = lc.on_added(fact(), view)
        assert isinstance(effect, Publish)
        (cmd,) = effect.events
        assert cmd.event is E.node_instance_remove and cmd.payload.node_id == "n1" and cmd.qualifier == "n1"
        assert cmd.subject() == "aios.node.n1.instance.remove" and cmd.payload.reason == "not wanted here"


def test_added_while_deleting_stops_it_again_and_a_removing_one_is_left_alone() -> None:
    effects = lc.on_added(fact(), lc.View(block("deleting"), {"b-0": inst()}))
    assert effects[0] == SetInstance("b", "b-0", InstanceStatus.RUNNING)
    assert effects[1] == SetInstance("b", "b-0", InstanceStatus.REMOVING)
    assert isinstance(effects[2], Publish) and effects[2].events[0].payload.reason == "block deleted"
    assert lc.on_added(fact(), lc.View(block("placing"), {"b-0": inst(status="removing")})) == []


def test_removed_releases_and_a_deleting_block_may_end() -> None:
    rec = inst()
    assert lc.on_removed(fact(), lc.View(block("ready"), {"b-0": rec})) == [Release("b", "b-0", rec)]
    assert lc.on_removed(fact(), lc.View(block("deleting"), {"b-0": rec})) == [Release("b", "b-0", rec), DeletedIfEmpty("b", 7)]
    # another node's copy, an older generation: nothing to release
    assert lc.on_removed(fact(node="n2"), lc.View(block("ready"), {"b-0": rec})) == []
    assert lc.on_removed(fact(gen=6), lc.View(block("ready"), {"b-0": rec})) == []


def test_a_redelivered_removal_of_a_deleted_block_says_deleted_again() -> None:
    """The first handling took the DELETED step in Redis and died before publishing ``deleted``
    (a controller SIGKILLed, issue 39's soak): the redelivery finds the block deleted and the
    instance gone, and must still end in DeletedIfEmpty (its transition redoes the publish)."""
    assert lc.on_removed(fact(), lc.View(block("deleted"), {})) == [DeletedIfEmpty("b", 7)]


def test_a_lost_instance_of_a_live_block_is_replaced_before_it_is_released() -> None:
    effects = lc.on_removed(fact(reason="lost"), lc.View(block("ready"), {"b-0": inst(status="running")}))
    assert effects == [Replace("b", 7, "c1", "b-0", "lost", "b-0:lost", avoid_node="n1")]
    # unless it was on its way out anyway
    rec = inst(status="removing")
    assert lc.on_removed(fact(reason="lost"), lc.View(block("ready"), {"b-0": rec})) == [Release("b", "b-0", rec)]


def test_faults_replace_until_the_limit_then_fail_or_degrade() -> None:
    verdict, effects = lc.on_fault(fact(reason="exit 1"), "failed", lc.View(block("placing"), {"b-0": inst()}), 3)
    assert verdict.action == "reassign" and effects == [Replace("b", 7, "c1", "b-0", "instance b-0 failed: exit 1", "b-0:failed", avoid_node="n1")]
    verdict, effects = lc.on_fault(fact(), "unhealthy", lc.View(block("placing", replacements="3"), {"b-0": inst()}), 3)
    assert verdict.action == "fail_block"
    assert isinstance(effects[0], Transition) and effects[0].step is Step.FAIL_PLACEMENT
    assert effects[1] == RemoveAll("b", 7, "block failed")
    verdict, effects = lc.on_fault(fact(), "unhealthy", lc.View(block("ready", replacements="3"), {"b-0": inst()}), 3)
    assert verdict.action == "give_up"
    (pub,) = effects
    assert isinstance(pub, Publish) and pub.events[0].event is E.block_reassignment_failed
    verdict, effects = lc.on_fault(fact(node="n9"), "failed", lc.View(block("ready"), {"b-0": inst()}), 3)
    assert verdict.action == "ignore" and effects == []


def test_delete_moves_to_deleting_then_stops_everything() -> None:
    (t,) = lc.on_delete("b", lc.View(block("ready"), {"b-0": inst()}))
    assert isinstance(t, Transition) and t.step is Step.DELETE and not t.redo
    assert t.then == (RemoveAll("b", 7, "block deleted"), DeletedIfEmpty("b", 7))
    assert lc.on_delete("b", lc.View(None)) == []


def test_added_records_the_endpoint_the_agent_reports_and_keeps_it_when_a_repeat_has_none() -> None:
    ev = InstanceEvent("b", 7, "b-0", "n1", ["g0"], "", "http://127.0.0.1:41234")
    effects = lc.on_added(ev, lc.View(block("placing"), {"b-0": inst()}))
    assert effects[0] == SetInstance("b", "b-0", InstanceStatus.RUNNING, "http://127.0.0.1:41234")
    # an agent that reports no endpoint (an instance with no port) leaves what is recorded alone
    assert lc.on_added(fact(), lc.View(block("placing"), {"b-0": inst()}))[0].endpoint is None  # type: ignore[union-attr]
