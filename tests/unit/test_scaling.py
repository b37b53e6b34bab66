"""Scaling decisions without servers: the target's clamp and plan, the ``scale_down`` payload's
instances, the default choice (least loaded, newest first), the rules for a policy's answer, the
built-in allocator's ``scale_down``, the seed-shaped example that does not know the action, and the
agent's bounded drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aios_blocks.agent import node_agent as na
from aios_blocks.agent.gpus import detect
from aios_blocks.agent.runtime_sim import SimRuntime
from aios_blocks.handlers import controller
from aios_blocks.handlers import scaling as sc
from aios_blocks.policies import contract
from aios_blocks.policies.builtin.resource import BinPackPolicy, SpreadPolicy
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.errors import PolicyFailed
from aios_blocks.schemas.spec import Node

from .views import EXAMPLES


def inst(status: str = "running", since: float = 0.0, node: str = "n1") -> dict[str, Any]:
    return {"node": node, "gpus": ["g0"], "cluster": "c1", "status": status, "since": since}


def iid(rid: str) -> str:
    return controller.instance_id("b1", rid)


@pytest.mark.parametrize(("target", "want"), [(0, (1, "0 raised to minInstances 1")), (1, (1, "")), (4, (4, "")),
                                             (5, (4, "5 lowered to maxInstances 4"))])
def test_clamp_says_what_it_did(target: int, want: tuple[int, str]) -> None:
    assert sc.clamp(target, 1, 4) == want


def test_plan_up_names_one_request_per_missing_instance_and_skips_those_made() -> None:
    insts = {"b1-0": inst()}
    plan = sc.plan_target("t1", 3, insts, iid)
    assert plan.up == ["t1:0", "t1:1"] and plan.down == 0
    # a redelivery after the first ask was placed asks only for what is still missing
    insts[iid("t1:0")] = inst("starting")
    assert sc.plan_target("t1", 3, insts, iid).up == ["t1:1"]
    insts[iid("t1:1")] = inst("starting")
    assert sc.plan_target("t1", 3, insts, iid) == sc.TargetPlan(3)


def test_plan_down_is_one_step_and_removing_instances_do_not_count() -> None:
    insts = {"b1-0": inst(), "b1-1": inst(), "b1-2": inst(), "b1-3": inst("removing")}
    plan = sc.plan_target("t2", 1, insts, iid)
    assert (plan.up, plan.down, plan.down_request) == ([], 2, "t2:down")
    assert sc.plan_target("t3", 3, insts, iid) == sc.TargetPlan(3)


def test_candidates_carry_node_gpus_age_and_load_and_skip_removing() -> None:
    insts = {"b1-0": inst(since=100.0), "b1-1": inst("starting", since=150.0), "b1-2": inst("removing")}
    metrics = {"b1-0": {"inflight": 2, "running": 2, "waiting": 1, "rate": 3.5}}
    out = sc.candidates(insts, metrics, now=160.0)
    assert [c["instance_id"] for c in out] == ["b1-0", "b1-1"]
    first, second = out
    assert first["load"] == 3.0 and first["inflight"] == 2 and first["rate"] == 3.5 and first["age_s"] == 60.0
    assert second["load"] is None and second["status"] == "starting" and second["node_id"] == "n1" and second["gpus"] == ["g0"]


def test_default_pick_least_loaded_then_newest() -> None:
    def c(i: str, load: float | None, since: float, status: str = "running") -> dict[str, Any]:
        return {"instance_id": i, "load": load, "since": since, "status": status}

    assert sc.default_pick([c("a", 2, 1), c("b", 0, 1), c("c", 1, 9)]) == "b"  # least loaded
    assert sc.default_pick([c("a", 0, 1), c("b", 0, 5), c("c", 0, 3)]) == "b"  # newest among equals
    assert sc.default_pick([c("a", None, 1), c("b", 1, 5)]) == "a"  # no sample counts as idle
    assert sc.default_pick([c("a", 0, 9), c("b", 0, 1, "starting")]) == "b"  # never started: goes first
    assert sc.default_pick([c("a", 0, 0), c("b", 0, 0)]) == "b"  # then the greatest id (deterministic)
    with pytest.raises(sc.ChoiceRefused):
        sc.default_pick([])


def test_choice_rules() -> None:
    cands = [{"instance_id": "b1-0", "load": 0, "since": 1, "status": "running"},
             {"instance_id": "b1-1", "load": 0, "since": 2, "status": "running"}]
    assert sc.choice({"instance_id": "b1-0"}, cands) == ("b1-0", "policy")
    for nothing in (None, {}, {"node_id": "n1", "gpus": []}, {"instance_id": ""}):
        assert sc.choice(nothing, cands) == ("b1-1", "default")
    with pytest.raises(sc.ChoiceRefused, match="not a live instance"):
        sc.choice({"instance_id": "other-9"}, cands)


def test_contract_of_scale_down() -> None:
    for ok in (None, {}, {"instance_id": "b1-0"}, {"node_id": "n1", "gpus": ["g0"]}):
        contract.check("scale_down", ok)
    for bad in ("b1-0", [1], {"instance_id": 7}, {"instance_id": ""}):
        with pytest.raises(contract.WrongShape):
            contract.check("scale_down", bad)


def payload(instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": "scale_down", "payload": {
        "block": {"blockId": "b1", "resources": {"gpus": 1}, "instances": {}}, "cluster": {"id": "c1"},
        "cluster_metrics": {"nodes": {}}, "block_metrics": {}, "healthy_nodes": [], "instances": instances}}


@pytest.mark.parametrize("cls", [BinPackPolicy, SpreadPolicy])
def test_builtin_allocators_take_the_default(cls: type) -> None:
    cands = [{"instance_id": "b1-0", "load": 0, "since": 1, "status": "running"},
             {"instance_id": "b1-1", "load": 4, "since": 9, "status": "running"},
             {"instance_id": "b1-2", "load": 0, "since": 5, "status": "running"}]
    assert cls("r", {}, {}).eval({}, payload(cands), {}) == {"instance_id": "b1-2"}


async def test_seed_example_without_scale_down_answers_nothing_and_a_raising_one_fails() -> None:
    rt = PolicyRuntime(allow_files=True)
    rule = {"name": "resourceAllocator", "policyRuleURI": str(EXAMPLES / "first_fit.py"), "parameters": {}, "settings": {}}
    cands = [{"instance_id": "b1-0", "load": 0, "since": 1, "status": "running"}]
    out = await rt.invoke(rule, "b1.resourceAllocator", payload(cands), {})
    assert out is None and sc.choice(out, cands) == ("b1-0", "default")


async def test_a_policy_that_raises_on_scale_down_fails_the_call(tmp_path: Path) -> None:
    src = tmp_path / "raises.py"
    src.write_text("class R:\n    def __init__(self, a, b, c):\n        pass\n\n"
                   "    def eval(self, p, input_data, ctx):\n        raise RuntimeError('no removals')\n")
    rt = PolicyRuntime(allow_files=True)
    rule = {"name": "resourceAllocator", "policyRuleURI": str(src), "parameters": {}, "settings": {}}
    with pytest.raises(PolicyFailed, match="no removals"):
        await rt.invoke(rule, "b1.resourceAllocator", payload([]), {})


# -- the agent's bounded drain ----------------------------------------------------------------------
def agent(tmp_path: Path) -> na.NodeAgent:
    cfg = na.AgentConfig(node=Node(id="n1", cluster="c1"), data_dir=tmp_path, register=False, reconcile=False,
                         heartbeat=False, workdirs=False, probes=False, drain_grace_s=0)
    a = na.NodeAgent(None, SimRuntime(start_delay_s=0, state_dir=tmp_path / "sim"), detect(None, "n1"), cfg)  # type: ignore[arg-type]
    facts: list[str] = []

    async def fact(bid: str, gen: int, iid: str, kind: str, reason: str, gpus: list[str], **kw: Any) -> None:
        facts.append(f"{kind}:{iid}")

    a._fact = fact  # type: ignore[method-assign]
    a.facts = facts  # type: ignore[attr-defined]
    return a


async def test_drain_waits_for_tasks_in_flight_then_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [2.0, 1.0, 0.0]

    async def in_flight(endpoint: str, timeout_s: float = 1.0) -> float | None:
        return answers.pop(0)

    monkeypatch.setattr(na, "in_flight", in_flight)
    a = agent(tmp_path)
    assert await a.drain("b1-0", "http://127.0.0.1:9", 5.0, poll_s=0.01) == "idle" and answers == []


async def test_drain_is_bounded_and_an_instance_without_the_figure_gets_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def busy(endpoint: str, timeout_s: float = 1.0) -> float | None:
        return 3.0

    monkeypatch.setattr(na, "in_flight", busy)
    a = agent(tmp_path)
    assert await a.drain("b1-0", "http://127.0.0.1:9", 0.05, poll_s=0.01) == "grace"

    async def silent(endpoint: str, timeout_s: float = 1.0) -> float | None:
        return None

    monkeypatch.setattr(na, "in_flight", silent)
    assert await a.drain("b1-0", "http://127.0.0.1:9", 0.05, poll_s=0.01) == "no-figure"


async def test_remove_with_drain_s_drains_a_serving_instance_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drained: list[str] = []

    async def drain(self: na.NodeAgent, iid: str, endpoint: str, grace_s: float, poll_s: float = 0.1) -> str:
        drained.append(f"{iid}:{grace_s}")
        return "idle"

    monkeypatch.setattr(na.NodeAgent, "drain", drain)
    a = agent(tmp_path)
    a.meta["b1-0"] = {"block_id": "b1", "gen": 1, "endpoint": "http://127.0.0.1:9"}
    a.meta["b1-1"] = {"block_id": "b1", "gen": 1, "endpoint": ""}
    await a.remove("b1", 1, "b1-0", "scale down (t:down)", drain_s=7.0)
    await a.remove("b1", 1, "b1-1", "scale down (t:down)", drain_s=7.0)
    a.meta["b1-2"] = {"block_id": "b1", "gen": 1, "endpoint": "http://127.0.0.1:9"}
    await a.remove("b1", 1, "b1-2", "block deleted")
    assert drained == ["b1-0:7.0"]
    assert a.facts == ["removed:b1-0", "removed:b1-1", "removed:b1-2"]  # type: ignore[attr-defined]


async def test_in_flight_reads_the_instance_metrics_page(tmp_path: Path) -> None:
    from aios_blocks.agent.sim_serve import SimBehaviour, SimServer

    server = SimServer()
    try:
        inst = await server.add("b1-0", SimBehaviour())
        assert await na.in_flight(f"http://127.0.0.1:{inst.port}") == 0.0
        inst.metrics.running = 2
        assert await na.in_flight(f"http://127.0.0.1:{inst.port}") == 2.0
    finally:
        await server.close()
    assert await na.in_flight("http://127.0.0.1:9") is None  # nothing there
