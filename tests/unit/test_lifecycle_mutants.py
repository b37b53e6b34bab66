"""Lifecycle decisions the mutation run (``make mutate``) found only partly asserted: every effect
here is compared whole (the command's block, generation, cluster, instance, node, reason, the
event's status and its qualifier), since an agent or a watcher acts on each of those fields."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.bus.catalog import E, Emit
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers import stability
from aios_blocks.handlers.controller import env_for
from aios_blocks.handlers.effects import (
    DeletedIfEmpty,
    ReadyIfRunning,
    Release,
    RemoveAll,
    Replace,
    SetInstance,
    Transition,
    publish,
)
from aios_blocks.schemas.events import (
    BlockStatusReport,
    InstanceCommand,
    InstanceEvent,
    InstanceVerdict,
    InventoryItem,
    NodeInventory,
    SidecarCommand,
    StepFailed,
)
from aios_blocks.schemas.lifecycle import InstanceStatus, Step

SIDECAR = {"name": "log", "image": "busybox"}


def block(status: str, gen: int = 7, min_instances: int = 2, **extra: Any) -> dict[str, Any]:
    ir = {"blockId": "b", "minInstances": min_instances, "image": "img:1", "launch": {"command": ["serve"]},
          "resources": {"cpu": 1}}
    return {"status": status, "gen": gen, "ir": ir, "cluster": "c1", **extra}


def inst(node: str = "n1", status: str = "running", cluster: str = "c1", **extra: Any) -> dict[str, Any]:
    return {"node": node, "cluster": cluster, "gpus": ["g0"], "status": status, **extra}


def fact(iid: str = "b-0", node: str = "n1", gen: int = 7, reason: str = "") -> InstanceEvent:
    return InstanceEvent("b", gen, iid, node, ["g0"], reason)


def remove(cid: str, iid: str, node: str, reason: str, gen: int = 7, qualifier: str = "") -> Emit:
    return Emit(E.node_instance_remove, InstanceCommand("b", gen, cid, iid, node, [], reason=reason), qualifier=qualifier)


def test_a_copy_nobody_wants_is_stopped_with_the_whole_command() -> None:
    # a known instance reported from another node: the command names its cluster
    assert lc.on_added(fact(node="n2"), lc.View(block("placing"), {"b-0": inst()})) == [
        publish(remove("c1", "b-0", "n2", "not wanted here", qualifier="n2"))]
    # an unknown instance: no cluster to name
    assert lc.on_added(fact("b-9", gen=8), lc.View(block("placing"), {})) == [
        publish(remove("", "b-9", "n1", "not wanted here", gen=8, qualifier="n1"))]


def test_an_instance_started_while_its_block_is_deleted_is_stopped_where_it_runs() -> None:
    view = lc.View(block("deleting"), {"b-0": inst(status="starting", cluster="c9")})
    assert lc.on_added(fact(), view) == [
        SetInstance("b", "b-0", InstanceStatus.RUNNING),
        SetInstance("b", "b-0", InstanceStatus.REMOVING),
        publish(remove("c9", "b-0", "n1", "block deleted")),
    ]
    # a deleted block too
    assert lc.on_added(fact(), lc.View(block("deleted"), {"b-0": inst(status="starting")}))[1:] == [
        SetInstance("b", "b-0", InstanceStatus.REMOVING), publish(remove("c1", "b-0", "n1", "block deleted"))]


def test_ready_check_names_the_blocks_cluster_and_none_when_unknown() -> None:
    b = block("placing")
    del b["cluster"]
    assert lc.on_added(fact(), lc.View(b, {"b-0": inst(status="starting")}))[1] == ReadyIfRunning("b", 7, 2, "")
    # a failed block: the instance runs, nothing more
    assert lc.on_added(fact(), lc.View(block("failed"), {"b-0": inst(status="starting")})) == [
        SetInstance("b", "b-0", InstanceStatus.RUNNING)]


def test_removed_of_an_unknown_block_or_instance() -> None:
    assert lc.on_removed(fact(), lc.View(None, {})) == []
    assert lc.on_removed(fact(), lc.View(block("deleting"), {})) == [DeletedIfEmpty("b", 7)]
    # a lost instance of a block that is not live is released, not replaced
    rec = inst()
    assert lc.on_removed(fact(reason="lost"), lc.View(block("deleting"), {"b-0": rec})) == [
        Release("b", "b-0", rec), DeletedIfEmpty("b", 7)]
    assert lc.on_removed(fact(reason="lost"), lc.View(None, {"b-0": rec})) == [Release("b", "b-0", rec)]


def test_inventory_reports_as_lost_each_running_instance_it_does_not_list() -> None:
    on_node = {
        "b-0": {"block_id": "b", "gen": 7, "node": "n1", "status": "running"},
        "b-1": {"block_id": "b", "gen": 7, "node": "n1", "status": "running"},  # listed
        "b-2": {"block_id": "b", "gen": 7, "node": "n1", "status": "starting"},  # its create still waits
        "b-3": {"block_id": "b", "gen": 7, "node": "n2", "status": "running"},  # moved elsewhere
        "c-0": {"block_id": "c", "node": "n1", "status": "running"},  # no gen recorded: 0
    }
    inv = NodeInventory("n1", "boot-2", [InventoryItem("b-1", "b", 7)])
    assert lc.on_inventory(inv, on_node) == [publish(
        Emit(E.instance_removed, InstanceEvent("b", 7, "b-0", "n1", [], "lost", "", "boot-2"), qualifier="lost:boot-2"),
        Emit(E.instance_removed, InstanceEvent("c", 0, "c-0", "n1", [], "lost", "", "boot-2"), qualifier="lost:boot-2"),
    )]
    assert lc.on_inventory(NodeInventory("n1", "boot-3", [InventoryItem(i) for i in on_node]), on_node) == []


def test_a_fault_past_the_limit_fails_a_placing_block_with_the_whole_reason() -> None:
    view = lc.View(block("placing", replacements="3"), {"b-0": inst(cluster="c2")})
    verdict, effects = lc.on_fault(fact(reason="exit 1"), "failed", view, 3)
    assert verdict.action == "fail_block"
    reason = f"instance b-0 failed: exit 1; {verdict.why}"
    failed = Emit(E.block_failed, BlockStatusReport("b", 7, "failed", reason, "c2"))
    assert effects == [Transition("b", 7, Step.FAIL_PLACEMENT, (("reason", reason),), then=(publish(failed),)),
                       RemoveAll("b", 7, "block failed")]


def test_a_fault_past_the_limit_on_a_ready_block_reports_the_step_failed() -> None:
    view = lc.View(block("ready", replacements="3"), {"b-0": inst()})
    verdict, effects = lc.on_fault(fact(reason="probe"), "unhealthy", view, 3)
    assert verdict.action == "give_up"
    failed = StepFailed("b", 7, "reassignment", f"instance b-0 unhealthy: probe; {verdict.why}", "b-0:unhealthy")
    assert effects == [publish(Emit(E.block_reassignment_failed, failed))]
    # the count read from the block: under the limit it is replaced
    verdict, effects = lc.on_fault(fact(reason="probe"), "unhealthy", lc.View(block("ready", replacements="2"),
                                                                              view.instances), 3)
    assert verdict.action == "reassign"
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 unhealthy: probe", "b-0:unhealthy", "n1")]


def test_failing_a_placing_block_stops_its_sidecars_too() -> None:
    b = block("placing")
    b["ir"]["sidecars"] = [SIDECAR]
    out = lc.fail_placing("b", 7, "c1", "no room", lc.View(b, {"b-0": inst()}))
    stop = Emit(E.node_sidecar_stop, SidecarCommand("b", 7, "c1", "n1", "log", dict(SIDECAR), "block failed"), qualifier="n1")
    failed = Emit(E.block_failed, BlockStatusReport("b", 7, "failed", "no room", "c1"))
    assert out == [Transition("b", 7, Step.FAIL_PLACEMENT, (("reason", "no room"),), then=(publish(failed),)),
                   RemoveAll("b", 7, "block failed"), publish(stop)]
    assert lc.fail_placing("b", 7, "c1", "no room") == out[:2]  # no view: nothing to stop


def test_stability_rule_defaults() -> None:
    assert lc.stability_rule({}) == {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold"}
    assert lc.stability_rule({"policies": {"stabilityChecker": {"policyRuleURI": "file:///x.py"}}}) == {
        "name": "stabilityChecker", "policyRuleURI": "file:///x.py"}
    assert lc.stability_rule({"policies": {"stabilityChecker": {"name": "mine"}}}) == {
        "name": "mine", "policyRuleURI": "builtin:probe-threshold"}


def test_fault_input_is_the_one_instance_with_the_agent_signal() -> None:
    view = lc.View(block("ready"), {"b-0": inst(endpoint="http://h:1", restarts="2")})
    data = lc.fault_input(fact(reason="exit 3"), "failed", view)
    assert data == stability.payload("b", [stability.agent_input("b-0", "n1", "http://h:1", "failed", "exit 3", 2)], 0.0, 1)
    assert lc.fault_input(fact(node="n2"), "failed", view) is None
    assert lc.fault_input(fact(), "failed", lc.View(None, view.instances)) is None


def test_fault_verdict_must_name_the_reported_instance() -> None:
    view = lc.View(block("ready"), {"b-0": inst(), "b-1": inst()})
    data = lc.fault_input(fact(), "failed", view)
    assert data is not None
    got = lc.fault_verdict({"verdicts": {"b-0": {"verdict": "restart", "reason": "flaky"}}}, data, "b-0")
    assert got["verdict"] == "restart" and got["reason"] == "flaky"
    with pytest.raises(stability.BadVerdicts, match=r"^no verdict on b-0, the instance its node agent reported$"):
        lc.fault_verdict({"verdicts": {}}, data, "b-0")


def test_a_restart_verdict_sends_the_whole_restart_command_to_the_instances_node() -> None:
    view = lc.View(block("ready"), {"b-0": inst()})
    what, effects = lc.on_fault_verdict(fact(reason="exit 1"), "failed", view, 3, {"verdict": "restart", "reason": "flaky"},
                                        qualifier="q1")
    ir = view.block["ir"]  # type: ignore[index]
    cmd = InstanceCommand("b", 7, "c1", "b-0", "n1", ["g0"], "img:1", env_for(ir, "b-0", ["g0"]),
                          reason="failed (exit 1); stabilityChecker: restart: flaky",
                          launch={"command": ["serve"]}, resources={"cpu": 1})
    assert (what, effects) == ("restart", [publish(Emit(E.node_instance_restart, cmd, qualifier="q1"))])
    # not there: ignored, and why
    what, effects = lc.on_fault_verdict(fact(node="n2"), "failed", view, 3, {"verdict": "restart"})
    assert effects == [] and what == "restart ignored: instance runs on n1 now (duplicate)"


def test_a_long_restart_reason_is_cut_at_500_characters() -> None:
    view = lc.View(block("ready"), {"b-0": inst()})
    ev = InstanceVerdict("b", 7, "b-0", "n1", "restart", "x" * 600, seq="s9")
    what, [pub] = lc.on_verdict(ev, view, 3)
    (cmd,) = pub.events  # type: ignore[attr-defined]
    assert what == "restart" and cmd.qualifier == "s9"
    assert cmd.payload.reason == ("health checker: " + "x" * 600)[:500]


def test_the_other_verdicts_keep_the_instance_and_say_so() -> None:
    view = lc.View(block("ready"), {"b-0": inst()})
    assert lc.on_fault_verdict(fact(), "unhealthy", view, 3, {"verdict": "degrade", "reason": "slow"}) == (
        "degrade: kept (slow)", [])
    what, effects = lc.on_fault_verdict(fact(reason="exit 1"), "failed", view, 3, {"verdict": "replace"})
    assert what.startswith("replace: reassign (") and effects == [
        Replace("b", 7, "c1", "b-0", "instance b-0 failed: exit 1", "b-0:failed", "n1")]
    what, effects = lc.on_fault_verdict(fact(reason="exit 1"), "failed", view, 3, None, failure="timed out")
    assert what.startswith("stabilityChecker failed (timed out); old rule: reassign (") and len(effects) == 1


def test_delete_moves_the_block_and_stops_its_sidecars_on_their_nodes() -> None:
    b = block("ready")
    b["ir"]["sidecars"] = [SIDECAR]
    out = lc.on_delete("b", lc.View(b, {"b-0": inst(), "b-1": inst("n2")}))
    stops = [Emit(E.node_sidecar_stop, SidecarCommand("b", 7, "c1", nid, "log", dict(SIDECAR), "block deleted"),
                  qualifier=nid) for nid in ("n1", "n2")]
    assert out == [Transition("b", 7, Step.DELETE, then=(RemoveAll("b", 7, "block deleted"), DeletedIfEmpty("b", 7)),
                              redo=False),
                   publish(*stops)]


def test_a_replace_verdict_goes_the_way_of_a_fault_with_the_checkers_words() -> None:
    view = lc.View(block("ready"), {"b-0": inst()})
    what, effects = lc.on_verdict(InstanceVerdict("b", 7, "b-0", "n1", "replace", "p50 over 2 s"), view, 3)
    assert what.startswith("replace: reassign (")
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 replace: health checker: p50 over 2 s", "b-0:replace", "n1")]
    assert lc.on_verdict(InstanceVerdict("b", 7, "b-0", "n1", "unready", "x"), view, 3) == ("routing only", [])


def test_a_restart_of_an_instance_without_gpus_or_image_sends_empty_ones() -> None:
    b = block("ready")
    del b["ir"]["image"], b["ir"]["launch"], b["ir"]["resources"]
    rec = inst()
    del rec["gpus"]
    what, [pub] = lc.on_verdict(InstanceVerdict("b", 7, "b-0", "n1", "restart", "hung", seq="s1"), lc.View(b, {"b-0": rec}), 3)
    cmd = InstanceCommand("b", 7, "c1", "b-0", "n1", [], "", env_for(b["ir"], "b-0", []), reason="health checker: hung")
    assert what == "restart" and pub == publish(Emit(E.node_instance_restart, cmd, qualifier="s1"))
