"""An agent's ``failed`` / ``unhealthy`` report goes through the block's stabilityChecker
(docs/health.md, "Agent reports"): the pure decisions (``handlers.lifecycle``), the default
policy's answer, and the controller's thin glue (``workers.controller.fault_verdict``) over the
real policy runtime with in-memory stand-ins for the bus and the store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from aios_blocks.bus.catalog import E, Emit
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers import stability as st
from aios_blocks.handlers.effects import Publish, Replace, Transition
from aios_blocks.policies.builtin.stability import ProbeThresholdPolicy
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.events import InstanceEvent
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker
from aios_blocks.workers.controller import fault_verdict


def block(status: str = "ready", rule: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    ir: dict[str, Any] = {"blockId": "b", "minInstances": 2, "image": "img", "launch": {}, "resources": {}, "policies": {}}
    if rule is not None:
        ir["policies"]["stabilityChecker"] = rule
    return {"status": status, "gen": 7, "ir": ir, "cluster": "c1", **extra}


def view(status: str = "ready", rule: dict[str, Any] | None = None, **extra: Any) -> lc.View:
    return lc.View(block(status, rule, **extra),
                   {"b-0": {"node": "n1", "cluster": "c1", "gpus": ["g0"], "status": "running", "endpoint": "http://h:1"}})


def fact(node: str = "n1", gen: int = 7) -> InstanceEvent:
    return InstanceEvent("b", gen, "b-0", node, ["g0"], "exited with code 137")


# -- the pure parts ------------------------------------------------------------------------------------
def test_the_input_is_the_health_check_shape_for_that_one_instance_with_the_agent_signal() -> None:
    data = lc.fault_input(fact(), "failed", view())
    assert data is not None and data["action"] == "health_check"
    (entry,) = data["payload"]["instances"]
    assert entry["instance_id"] == "b-0" and entry["node_id"] == "n1" and entry["endpoint"] == "http://h:1"
    assert entry["agent"] == {"report": "failed", "reason": "exited with code 137"}
    assert entry["state"] == "stopping" and entry["restarts"] == 0
    # a fact about an instance not live there asks nobody (and is ignored as before)
    assert lc.fault_input(fact(node="n9"), "failed", view()) is None
    assert lc.fault_input(fact(gen=6), "unhealthy", view()) is None


def test_the_default_policy_answers_replace_so_the_default_behaviour_is_the_old_rule() -> None:
    data = lc.fault_input(fact(), "unhealthy", view())
    assert data is not None
    out = ProbeThresholdPolicy("b.stabilityChecker", {}, {}).eval({}, data, {})
    verdict = lc.fault_verdict(out, data, "b-0")
    assert verdict["verdict"] == "replace" and "unhealthy" in verdict["reason"]
    what, effects = lc.on_fault_verdict(fact(), "unhealthy", view(), 3, verdict, qualifier="unhealthy:9")
    # exactly what on_fault did (and does) for this report: same request id, same reason
    assert effects == lc.on_fault(fact(), "unhealthy", view(), 3)[1]
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 unhealthy: exited with code 137", "b-0:unhealthy", avoid_node="n1")]
    assert what.startswith("replace: reassign")
    # the framework's bounds, not the policy's: past the limit a placing block fails, a ready one gives up
    _, effects = lc.on_fault_verdict(fact(), "failed", view("placing", replacements="3"), 3, verdict)
    assert isinstance(effects[0], Transition)
    what, effects = lc.on_fault_verdict(fact(), "failed", view("ready", replacements="3"), 3, verdict)
    assert "give_up" in what and isinstance(effects[0], Publish)
    assert effects[0].events[0].event is E.block_reassignment_failed


def test_a_restart_verdict_sends_the_checkers_restart_command_keyed_by_the_report() -> None:
    what, effects = lc.on_fault_verdict(fact(), "failed", view(), 3, {"verdict": "restart", "reason": "crash: try again"},
                                        qualifier="failed:42")
    assert what == "restart"
    (effect,) = effects
    assert isinstance(effect, Publish)
    (cmd,) = effect.events
    assert isinstance(cmd, Emit) and cmd.event is E.node_instance_restart and cmd.qualifier == "failed:42"
    p = cmd.payload
    assert (p.block_id, p.gen, p.instance_id, p.node_id, p.gpus, p.image) == ("b", 7, "b-0", "n1", ["g0"], "img")
    assert "crash: try again" in p.reason and "failed" in p.reason


@pytest.mark.parametrize("word", ["healthy", "degrade", "unready"])
def test_other_verdicts_keep_the_instance(word: str) -> None:
    what, effects = lc.on_fault_verdict(fact(), "unhealthy", view(), 3, {"verdict": word, "reason": "flaky probe, leave it"})
    assert effects == [] and what.startswith(f"{word}: kept")


def test_a_failed_policy_leaves_the_old_rule() -> None:
    what, effects = lc.on_fault_verdict(fact(), "failed", view(), 3, None, "raised RuntimeError: no idea")
    assert effects == lc.on_fault(fact(), "failed", view(), 3)[1] and isinstance(effects[0], Replace)
    assert "raised RuntimeError: no idea" in what and "old rule: reassign" in what


@pytest.mark.parametrize("result,why", [
    ({"verdicts": {}}, "no verdict on b-0"),
    ({"verdicts": {"b-0": {"verdict": "explode", "reason": "x"}}}, "wrong return shape"),
    ({"verdicts": {"b-9": {"verdict": "replace", "reason": "x"}}}, "not given: b-9"),
    ("nonsense", "wrong return shape"),
])
def test_an_answer_of_the_wrong_shape_or_without_the_instance_is_refused(result: Any, why: str) -> None:
    data = lc.fault_input(fact(), "failed", view())
    assert data is not None
    with pytest.raises(st.BadVerdicts, match=why):
        lc.fault_verdict(result, data, "b-0")


# -- the controller's glue over the real policy runtime ---------------------------------------------
class Restarts:
    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        pass

    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"verdicts": {i["instance_id"]: {"verdict": "restart", "reason": f"agent said {i['agent']['report']}"}
                             for i in input_data["payload"]["instances"] if i.get("agent")}}


class Keeps(Restarts):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"verdicts": {i["instance_id"]: {"verdict": "healthy", "reason": "keep it"} for i in input_data["payload"]["instances"]}}


class Raises(Restarts):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        raise RuntimeError("no idea")


class Hangs(Restarts):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        time.sleep(2)
        return {"verdicts": {}}


class Garbage(Restarts):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"verdicts": {"b-0": {"verdict": "explode"}}}


@dataclass
class Bus:
    sent: list[Emit] = field(default_factory=list)

    async def emit(self, event: Any, payload: Any, qualifier: str = "", **_: Any) -> None:
        self.sent.append(Emit(event, payload, qualifier=qualifier))

    async def emit_all(self, emits: list[Emit]) -> None:
        self.sent += emits


class Store:
    async def context_load(self, rule_id: str) -> dict[str, Any]:
        return {}

    async def context_save(self, rule_id: str, changed: Any, deleted: Any) -> None:
        pass


def worker(timeout_s: float = 0.5) -> tuple[Worker, Bus]:
    bus = Bus()
    s = Settings(policy_timeout_s=timeout_s, max_replacements=3)
    return Worker(bus, Store(), None, PolicyRuntime(timeout_s=timeout_s), "test", s), bus


async def run(rule: dict[str, Any] | None, kind: str = "failed") -> tuple[str, list[Any], Bus]:
    w, bus = worker()
    v = view(rule=rule)
    data = lc.fault_input(fact(), kind, v)
    assert data is not None
    what, effects = await fault_verdict(w, fact(), kind, v, data, f"{kind}:5")
    return what, effects, bus


async def test_glue_default_policy_replaces_and_records_its_decision() -> None:
    what, effects, bus = await run(None)
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 failed: exited with code 137", "b-0:failed", avoid_node="n1")]
    (rec,) = bus.sent
    assert rec.event is E.block_decision and rec.qualifier == "failed:5"
    d = rec.payload
    assert (d.kind, d.uri, d.action, d.error) == ("stabilityChecker", "builtin:probe-threshold", "health_check", "")


async def test_glue_a_policy_that_restarts_gets_a_restart_and_one_that_keeps_keeps() -> None:
    what, effects, bus = await run({"name": "stabilityChecker", "policyRuleURI": f"{__name__}:Restarts"})
    assert what == "restart" and effects[0].events[0].event is E.node_instance_restart
    assert [e.event for e in bus.sent] == [E.block_decision]
    what, effects, bus = await run({"name": "stabilityChecker", "policyRuleURI": f"{__name__}:Keeps"}, "unhealthy")
    assert effects == [] and what.startswith("healthy: kept")


@pytest.mark.parametrize("cls,why", [("Raises", "raised RuntimeError: no idea"), ("Hangs", "timed out"),
                                     ("Garbage", "wrong return shape"),
                                     ("Nowhere", "cannot load"), ("Nowhere", "has no attribute 'Nowhere'")])
async def test_glue_a_failing_policy_falls_back_to_the_old_rule_and_the_failure_is_recorded(cls: str, why: str) -> None:
    what, effects, bus = await run({"name": "stabilityChecker", "policyRuleURI": f"{__name__}:{cls}"})
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 failed: exited with code 137", "b-0:failed", avoid_node="n1")]
    (rec,) = bus.sent
    assert rec.event is E.block_health_failed
    f = rec.payload
    assert f.step == "agent_report" and f.request_id == "failed:5" and why in f.reason and "old rule: reassign" in f.reason
    (d,) = f.decisions
    assert d.error and why in d.error
