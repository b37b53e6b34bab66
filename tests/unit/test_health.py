"""The health checker's pure parts: the executor's passive ejection (``executor.outlier`` and the
route), ``builtin:probe-threshold``, the verdict checks and what the framework carries out
(``handlers.stability``), the mapper's health fields and the controller's restart/replace."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.executor.engine import InlinePolicy, Route
from aios_blocks.executor.outlier import Outliers, max_out
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers import mapper
from aios_blocks.handlers import stability as st
from aios_blocks.handlers.effects import Publish, Replace
from aios_blocks.policies.builtin.balancer import LeastInflightPolicy, LeastQueuePolicy, RoundRobinPolicy
from aios_blocks.policies.builtin.stability import ProbeThresholdPolicy
from aios_blocks.schemas.events import InstanceVerdict


# -- passive: the executor's ejection ------------------------------------------------------------------
def test_max_out_is_one_or_ten_percent() -> None:
    assert [max_out(n, 0.1) for n in (0, 1, 5, 10, 19, 20, 100)] == [0, 1, 1, 1, 1, 2, 10]


def test_a_transport_failure_ejects_at_once_for_a_growing_time() -> None:
    o = Outliers(base_s=1.0, max_s=2.5)
    assert o.record("a", "connect", 10, now=0.0) == 1.0
    assert "a" in o.ejected
    assert o.record("a", "connect", 10, now=0.5) == 0.0  # already out
    assert o.expire(now=1.0) == ["a"]
    assert o.record("a", "timeout", 10, now=1.1) == 2.0  # second ejection: twice as long
    o.expire(now=10)
    assert o.record("a", "reset", 10, now=10) == 2.5  # capped
    assert o.get("a").timeouts == 1 and o.get("a").ejections == 3


def test_5xx_eject_only_after_consecutive_ones_and_a_success_resets() -> None:
    o = Outliers(consecutive_5xx=3)
    assert o.record("a", "5xx", 10, now=0) == 0 and o.record("a", "5xx", 10, now=0) == 0
    assert o.record("a", "ok", 10, now=0, seconds=0.01) == 0
    assert o.get("a").consecutive_errors == 0
    for _ in range(2):
        assert o.record("a", "5xx", 10, now=0) == 0
    assert o.record("a", "5xx", 10, now=0) > 0


def test_ejection_never_takes_more_than_the_cap_out() -> None:
    o = Outliers()
    assert o.record("a", "connect", 10, now=0) > 0
    assert o.record("b", "connect", 10, now=0) == 0  # max(1, 10 % of 10) = 1
    assert set(o.ejected) == {"a"}
    o2 = Outliers()
    assert all(o2.record(f"i{n}", "connect", 20, now=0) > 0 for n in range(2))
    assert o2.record("i2", "connect", 20, now=0) == 0


def test_the_snapshot_shows_progress_and_stalls() -> None:
    o = Outliers()
    o.record("a", "ok", 2, now=10.0, seconds=0.05)
    o.get("a").busy_since = 11.0
    snap = o.snapshot({"a": {"inflight": 2}, "b": {"inflight": 0}}, now=15.0)
    assert snap["a"]["stalled_s"] == 4.0 and snap["a"]["since_done_s"] == 5.0 and snap["a"]["latency_s"] == 0.05
    assert snap["b"]["stalled_s"] == 0 and snap["b"]["since_done_s"] == -1


def _route(n: int = 3, **extra: dict[str, Any]) -> Route:
    r = Route("b", InlinePolicy(RoundRobinPolicy("b", {}, {}), "builtin:round-robin"))
    r.apply({f"i{k}": {"node": "n", "endpoint": f"http://x:{k}", "state": "ready", **extra.get(f"i{k}", {})} for k in range(n)}, 1)
    return r


def test_an_ejected_instance_gets_no_task_from_this_route_until_its_ejection_ends() -> None:
    r = _route()
    v = r.views["i1"]
    assert r.record(v, "connect", "refused") > 0
    assert v["state"] == "ejected" and r.live() == 3
    picked = {r.try_pick({})["id"] for _ in range(9)}  # type: ignore[index]
    assert picked == {"i0", "i2"}
    r.outliers.ejected["i1"] = 0.0  # its time is up
    r._unexpire()
    assert v["state"] == "ready" and len(r.candidates()) == 3
    r.apply({k: {"node": "n", "endpoint": vv["endpoint"], "state": "ready"} for k, vv in r.views.items()}, 2)
    assert r.views["i1"]["state"] == "ready"


def test_the_map_health_and_weight_reach_the_route_and_the_policy_input() -> None:
    r = _route(i0={"health": "unready"}, i1={"health": "degraded", "weight": 0.2})
    assert r.views["i0"]["state"] == "unready"
    cands = r.candidates()
    assert [c["id"] for c in cands] == ["i1", "i2"]
    assert cands[0]["weight"] == 0.2 and cands[1]["weight"] == 1.0


def test_the_builtin_balancers_give_a_degraded_instance_less_work() -> None:
    insts = [{"id": "slow", "inflight": 0, "weight": 0.1}, {"id": "fast", "inflight": 0, "weight": 1.0}]
    data = {"action": "route", "payload": {"instances": insts}}
    for cls in (LeastInflightPolicy, LeastQueuePolicy, RoundRobinPolicy):
        p = cls("b", {}, {})
        picks = [p.eval({}, data, {})["instance_id"] for _ in range(400)]
        assert picks.count("slow") < picks.count("fast") / 3, cls.__name__
        assert cls is not RoundRobinPolicy or picks.count("slow") > 0  # less, not none


# -- builtin:probe-threshold ----------------------------------------------------------------------------
def _inst(iid: str = "i0", fails: int = 0, oks: int = 1, health: str = "ok", latency: float = 0.01, inflight: int = 0,
          stalled: float = 0.0, since_done: float = -1.0, ejected: bool = False, cerr: int = 0, restarts: int = 0,
          age: float = 100.0, state: str = "ready", weight: float = 1.0) -> dict[str, Any]:
    return {"instance_id": iid, "node_id": "n1", "state": state, "health": health, "weight": weight, "age_s": age,
            "probe": {"consecutive_failures": fails, "consecutive_successes": oks, "error": "refused" if fails else ""},
            "passive": {"latency_s": latency, "ejected": ejected, "consecutive_errors": cerr},
            "progress": {"inflight": inflight, "stalled_s": stalled, "since_done_s": since_done}, "restarts": restarts}


def _verdicts(*insts: dict[str, Any], **settings: Any) -> dict[str, dict[str, Any]]:
    p = ProbeThresholdPolicy("b.stabilityChecker", settings, {})
    out = p.eval({}, {"action": "health_check", "payload": {"block": "b", "instances": list(insts)}}, {})
    return {k: v["verdict"] for k, v in st.validate(out, list(insts)).items()}


def test_probe_failures_make_an_instance_unready_then_restarted_then_replaced() -> None:
    assert _verdicts(_inst(fails=2, oks=0))["i0"] == "healthy"
    assert _verdicts(_inst(fails=3, oks=0))["i0"] == "unready"
    assert _verdicts(_inst(fails=6, oks=0))["i0"] == "restart"
    assert _verdicts(_inst(fails=6, oks=0, restarts=1))["i0"] == "replace"
    assert _verdicts(_inst(fails=1, oks=0, ejected=True, cerr=1))["i0"] == "unready"  # refused by the executors too


def test_a_busy_instance_that_completes_tasks_is_not_failed_by_its_probe() -> None:
    busy = _inst(fails=8, oks=0, inflight=50, since_done=0.2, stalled=0.2)
    assert _verdicts(busy)["i0"] == "healthy"


def test_a_hang_is_found_by_progress_even_with_a_passing_probe() -> None:
    hung = _inst(inflight=3, stalled=12.0, since_done=30.0)
    assert _verdicts(hung)["i0"] == "restart"
    assert _verdicts(_inst(inflight=3, stalled=2.0, since_done=2.0), stallS=1)["i0"] == "restart"


def test_a_slow_instance_is_degraded_by_the_block_median_not_removed() -> None:
    insts = [_inst("a", latency=0.02), _inst("b", latency=0.022), _inst("c", latency=0.2)]
    p = ProbeThresholdPolicy("b", {}, {})
    out = p.eval({}, {"action": "health_check", "payload": {"block": "b", "instances": insts}}, {})["verdicts"]
    assert out["c"]["verdict"] == "degrade" and 0 < out["c"]["weight"] < 0.2
    assert out["a"]["verdict"] == out["b"]["verdict"] == "healthy"
    healed = [_inst("a", latency=0.02), _inst("b", latency=0.022), _inst("c", latency=0.025, health="degraded", weight=0.1)]
    assert _verdicts(*healed)["c"] == "healthy"


def test_an_unready_instance_comes_back_after_passing_probes() -> None:
    assert _verdicts(_inst(health="unready", oks=0, fails=0))["i0"] == "unready"
    assert _verdicts(_inst(health="unready", oks=1))["i0"] == "healthy"
    with pytest.raises(ValueError):
        ProbeThresholdPolicy("b", {"failureThreshold": 5, "restartThreshold": 2}, {})


# -- the verdict contract and what the framework carries out ------------------------------------------------
@pytest.mark.parametrize("bad", [None, [], {"verdicts": []}, {"verdicts": {"i0": "unready"}},
                                 {"verdicts": {"i0": {"verdict": "explode"}}}, {"verdicts": {"i0": {"verdict": "degrade", "weight": 2}}},
                                 {"verdicts": {"i0": {"verdict": "healthy", "reason": 3}}}, {"verdicts": {"zz": {"verdict": "healthy"}}}])
def test_garbage_verdicts_are_refused_with_the_reason(bad: Any) -> None:
    with pytest.raises(st.BadVerdicts) as e:
        st.validate(bad, [_inst()])
    assert str(e.value)


def _decide(insts: list[dict[str, Any]], verdicts: dict[str, str], grace: float = 5.0,
            busy: dict[str, float] | None = None) -> list[tuple[str, str]]:
    actions, _ = st.decide(insts, {k: {"verdict": v, "reason": "r"} for k, v in verdicts.items()}, grace, 0.1,
                           busy or {}, now=1000.0, cooldown_s=10.0)
    return [(a.instance_id, a.verdict) for a in actions]


def test_only_changes_are_carried_out() -> None:
    insts = [_inst("a"), _inst("b", health="unready"), _inst("c", health="degraded", weight=0.1)]
    assert _decide(insts, {"a": "healthy", "b": "unready", "c": "degrade"}) == []
    assert sorted(_decide(insts, {"a": "healthy", "b": "healthy", "c": "healthy"})) == [("b", "healthy"), ("c", "healthy")]


def test_no_verdict_inside_the_startup_grace_nor_right_after_a_restart() -> None:
    assert _decide([_inst("a", age=2.0)], {"a": "unready"}) == []
    assert _decide([_inst("a", age=6.0)], {"a": "unready"}) == [("a", "unready")]
    assert _decide([_inst("a")], {"a": "restart"}, busy={"a": 998.0}) == []  # within the grace again
    assert _decide([_inst("a")], {"a": "restart"}, busy={"a": 992.0}) == []  # within the cooldown
    assert _decide([_inst("a")], {"a": "restart"}, busy={"a": 980.0}) == [("a", "restart")]
    assert _decide([_inst("a", state="starting")], {"a": "unready"}) == []


def test_at_most_max_1_10_percent_out_of_routing_worst_first() -> None:
    insts = [_inst(f"i{k}") for k in range(10)]
    assert _decide(insts, {"i3": "unready", "i4": "replace", "i5": "restart"}) == [("i4", "replace")]
    insts[0]["health"] = "unready"  # one is out already
    assert _decide(insts, {"i3": "unready", "i0": "restart"}) == [("i0", "restart")]  # already out: no more of the cap
    assert _decide(insts, {"i3": "degrade"}) == [("i3", "degrade")]  # degrade keeps it in routing


# -- the mapper and the controller -------------------------------------------------------------------------
def _verdict(v: str, weight: float = 1.0, gen: int = 7, iid: str = "b-0", node: str = "n1") -> InstanceVerdict:
    return InstanceVerdict("b", gen, iid, node, v, "because", weight, "builtin:probe-threshold", "1")


def test_the_mapper_sets_health_and_weight_of_ready_instances_only() -> None:
    cur = {"block_id": "b", "gen": 7, "instances": {"b-0": {"node": "n1", "endpoint": "http://x", "state": "ready", "since": 1}},
           "gone": []}
    out = mapper.on_verdict(_verdict("degrade", 0.25), cur, None, 5.0)
    assert out is not None and out["instances"]["b-0"]["health"] == "degraded" and out["instances"]["b-0"]["weight"] == 0.25
    assert out["instances"]["b-0"]["since"] == 1  # not a state change: the age stays
    assert mapper.on_verdict(_verdict("degrade", 0.25), out, None, 6.0) is None  # no change
    out2 = mapper.on_verdict(_verdict("restart"), out, None, 6.0)
    assert out2 is not None and out2["instances"]["b-0"]["health"] == "unready"
    back = mapper.on_verdict(_verdict("healthy"), out2, None, 7.0)
    assert back is not None and back["instances"]["b-0"]["health"] == "ok" and back["instances"]["b-0"]["weight"] == 1.0
    assert mapper.on_verdict(_verdict("unready", gen=6), cur, None, 5.0) is None
    assert mapper.on_verdict(_verdict("unready", iid="b-9"), cur, None, 5.0) is None
    draining = {**cur, "instances": {"b-0": {**cur["instances"]["b-0"], "state": "draining"}}}
    assert mapper.on_verdict(_verdict("unready"), draining, None, 5.0) is None
    # a late `added` (the agent's restart) keeps the verdict's health
    again = mapper.on_added(type("Ev", (), {"block_id": "b", "gen": 7, "instance_id": "b-0", "node_id": "n1",
                                            "endpoint": "http://y"})(), out2, None, 8.0)
    assert again is not None and again["instances"]["b-0"]["health"] == "unready" and again["instances"]["b-0"]["endpoint"] == "http://y"


def _block(**extra: Any) -> dict[str, Any]:
    return {"status": "ready", "gen": 7, "ir": {"blockId": "b", "minInstances": 2, "image": "img", "launch": {"command": ["x"]},
                                                "resources": {"cpu": 1}}, "cluster": "c1", **extra}


def test_the_controller_restarts_in_place_and_replaces_through_the_old_bound() -> None:
    view = lc.View(_block(), {"b-0": {"node": "n1", "cluster": "c1", "gpus": ["g0"], "status": "running"}})
    what, effects = lc.on_verdict(_verdict("restart"), view, max_replacements=5)
    assert what == "restart" and len(effects) == 1 and isinstance(effects[0], Publish)
    emit = effects[0].events[0]
    assert emit.event is E.node_instance_restart and emit.payload.instance_id == "b-0" and emit.payload.node_id == "n1"
    assert emit.payload.gpus == ["g0"] and emit.payload.launch == {"command": ["x"]}
    what, effects = lc.on_verdict(_verdict("replace"), view, max_replacements=5)
    assert [type(e) for e in effects] == [Replace] and "health checker" in effects[0].reason  # type: ignore[union-attr]
    _, effects = lc.on_verdict(_verdict("replace"), lc.View(_block(replacements=5), view.instances), max_replacements=5)
    assert effects and isinstance(effects[0], Publish) and effects[0].events[0].event is E.block_reassignment_failed
    assert lc.on_verdict(_verdict("restart", node="n2"), view, 5)[1] == []  # not there
    assert lc.on_verdict(_verdict("degrade"), view, 5) == ("routing only", [])


def test_merged_passive_counts_take_a_completion_just_now_as_progress() -> None:
    passive, progress = st.merge_passive([{"ok": 3, "since_done_s": 0.0, "inflight": 2, "stalled_s": 0.0, "latency_s": 0.02},
                                          {"ok": 1, "since_done_s": 4.0, "inflight": 1, "stalled_s": 4.0, "ejected": True,
                                           "consecutive_errors": 2, "latency_s": 0.04}])
    assert passive["ok"] == 4 and passive["ejected"] and passive["consecutive_errors"] == 2 and passive["latency_s"] == 0.03
    assert progress == {"inflight": 3, "stalled_s": 0.0, "since_done_s": 0.0}


def test_explain_shows_verdicts_with_their_reasons_and_failed_ticks() -> None:
    from aios_blocks.projections.explain import explain

    events = [
        # (the payloads as published: explain reads each into its catalog struct)
        ("aios.block.b.instance.b-0.added", {"data": {"block_id": "b", "gen": 1, "instance_id": "b-0", "node_id": "n1", "gpus": []}}),
        ("aios.block.b.instance.b-0.verdict", {"data": {"block_id": "b", "gen": 1, "instance_id": "b-0", "node_id": "n1",
                                                        "verdict": "restart", "reason": "no task completed",
                                                        "policy": "builtin:probe-threshold"}}),
        ("aios.block.b.health.failed", {"data": {"block_id": "b", "gen": 1, "step": "health_check", "reason": "policy raised"}}),
    ]
    x = explain(events)
    inst = x["instances"]["b-0"]
    assert inst["status"] == "running" and inst["health"] == "restart"
    assert inst["verdicts"] == [{"verdict": "restart", "reason": "no task completed", "policy": "builtin:probe-threshold"}]
    assert {"step": "health_check", "reason": "policy raised"} in x["failures"]


# -- the probe path never queues behind real work ---------------------------------------------------------
async def test_the_sdk_answers_health_while_every_task_slot_is_busy() -> None:
    import asyncio
    import threading

    import aiohttp
    from aiohttp.test_utils import TestServer

    from aios_blocks.instance import InstanceApp, web_app

    release = threading.Event()

    def handler(task: Any, ctx: Any) -> Any:  # a CPU-bound model: a worker thread
        release.wait(20)
        return {"ok": True}

    app = InstanceApp(handler, None, max_concurrency=2)
    await app.start()
    server = TestServer(web_app(app))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            url = str(server.make_url("/"))
            tasks = [asyncio.ensure_future(http.post(url + app.ctx.task_path.lstrip("/"), data=b"{}")) for _ in range(5)]
            while app.metrics.system.running < 2 or app.metrics.system.waiting < 3:
                await asyncio.sleep(0.01)
            async with http.get(url + "health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ready"
            assert not any(t.done() for t in tasks)  # answered while every slot is taken and tasks wait
            release.set()
            for t in tasks:
                async with await t as r:
                    assert r.status == 200
    finally:
        release.set()
        await server.close()


async def test_a_simulated_instance_answers_health_while_its_tasks_queue() -> None:
    import asyncio

    import aiohttp

    from aios_blocks.agent.sim_serve import SimBehaviour, SimServer

    server = SimServer()
    try:
        inst = await server.add("q", SimBehaviour(service_time_s=2.0, max_concurrency=1))
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{inst.port}"
            tasks = [asyncio.ensure_future(http.post(base + "/infer", json={})) for _ in range(3)]
            await asyncio.sleep(0.2)
            async with http.get(base + "/health") as r:
                assert r.status == 200
            assert not any(t.done() for t in tasks)
            for t in tasks:
                t.cancel()
    finally:
        await server.close()


async def test_an_ejection_ends_by_itself_even_when_its_timer_fires_early() -> None:
    import asyncio

    r = _route()
    r.outliers.base_s = 0.05
    assert r.record(r.views["i0"], "timeout", "slow") > 0
    assert r.views["i0"]["state"] == "ejected"
    async with asyncio.timeout(5):
        while r.views["i0"]["state"] != "ready":
            await asyncio.sleep(0.01)
    assert not r.outliers.ejected and r._timer is None
    # a second ejection of another instance while one is out: one timer, both end
    r.outliers.base_s, r.outliers.max_out_ratio = 0.05, 1.0
    r.record(r.views["i1"], "connect")
    r.record(r.views["i2"], "connect")
    async with asyncio.timeout(5):
        while {v["state"] for v in r.views.values()} != {"ready"}:
            await asyncio.sleep(0.01)
