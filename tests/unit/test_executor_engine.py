"""The executor's decisions without I/O: every built-in loadBalancer, the route contract, admission
(maxOngoing, the bounded queue, overload), draining, a policy that raises / hangs / answers wrong,
the mapper's map decisions and the metrics the least-queue policy reads."""

from __future__ import annotations

import asyncio
import collections
import time
from types import SimpleNamespace
from typing import Any

import pytest

from aios_blocks.executor.dispatch import MAX_TASK_TIMEOUT_MS, task_timeout_s
from aios_blocks.executor.engine import InlinePolicy, InstanceState, Limits, Refused, Route, Weighted
from aios_blocks.handlers import mapper
from aios_blocks.policies import contract, uris
from aios_blocks.policies.builtin.balancer import LeastInflightPolicy, LeastQueuePolicy, RoundRobinPolicy
from aios_blocks.policies.runtime import BUILTINS, PolicyRuntime
from aios_blocks.workers.executor import parse_queue_metrics


def inst(iid: str, inflight: int = 0, **metrics: float) -> dict[str, Any]:
    return {"id": iid, "node": "n", "endpoint": f"http://h/{iid}", "state": "ready", "inflight": inflight,
            "max_ongoing": 10, "metrics": metrics}


def route_input(insts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": "route", "payload": {"block": "b", "task": {}, "instances": insts}}


def the_map(n: int, state: str = "ready") -> dict[str, dict[str, Any]]:
    return {f"i{k}": {"node": f"n{k}", "endpoint": f"http://127.0.0.1:{9000 + k}", "state": state} for k in range(n)}


def builtin_route(uri: str = "builtin:least-inflight", n: int = 3, **limits: Any) -> Route:
    r = Route("b", InlinePolicy(BUILTINS[uri]("b.loadBalancer", {}, {}), uri), Limits(**limits))
    r.apply(the_map(n), 1, 1)
    return r


# -- built-ins ------------------------------------------------------------------------------------
def test_builtins_are_registered_for_the_load_balancer_slot_only() -> None:
    for uri in ("builtin:round-robin", "builtin:least-inflight", "builtin:least-queue"):
        assert uri in BUILTINS and uris.BUILTIN_KINDS[uri] == ("loadBalancer",)
        assert uris.uri_problem(uri, "loadBalancer") is None
        assert "not a resourceAllocator" in (uris.uri_problem(uri, "resourceAllocator") or "")
    assert "for loadBalancer" in (uris.uri_problem("builtin:binpack", "loadBalancer") or "")


def test_round_robin_takes_each_instance_in_turn() -> None:
    p = RoundRobinPolicy("r", {}, {})
    insts = [inst("a"), inst("b"), inst("c")]
    picks = [p.eval({}, route_input(insts), {})["instance_id"] for _ in range(9)]
    assert picks == ["a", "b", "c"] * 3


def test_least_inflight_never_picks_the_busier_of_two_and_spreads_ties() -> None:
    p = LeastInflightPolicy("r", {}, {})
    two = [inst("idle", 0), inst("busy", 5)]
    assert {p.eval({}, route_input(two), {})["instance_id"] for _ in range(200)} == {"idle"}
    # with many instances, the busiest one is never chosen (it loses every pair it is drawn in)
    many = [inst(f"i{k}", k) for k in range(8)]
    picks = collections.Counter(p.eval({}, route_input(many), {})["instance_id"] for _ in range(4000))
    assert "i7" not in picks and picks["i0"] > picks["i6"]
    even = [inst(f"i{k}") for k in range(4)]
    assert len({p.eval({}, route_input(even), {})["instance_id"] for _ in range(200)}) == 4


def test_least_queue_uses_engine_queue_and_kv_cache_when_reported() -> None:
    p = LeastQueuePolicy("r", {}, {})
    insts = [inst("a", 0, num_requests_waiting=7, num_requests_running=2), inst("b", 3), inst("c", 1, num_requests_running=4)]
    assert {p.eval({}, route_input(insts), {})["instance_id"] for _ in range(50)} == {"b"}
    # b's KV cache is nearly full: scored as if 8 more tasks waited
    insts[1]["metrics"] = {"kv_cache_usage_perc": 0.97}
    assert {p.eval({}, route_input(insts), {})["instance_id"] for _ in range(50)} == {"c"}
    # nothing reported: the executor's own in-flight counts decide; ties spread
    plain = [inst("x", 2), inst("y", 2), inst("z", 2)]
    assert len({p.eval({}, route_input(plain), {})["instance_id"] for _ in range(200)}) == 3
    # sampling above `sample` instances still answers one of them
    big = [inst(f"i{k}", k % 5) for k in range(100)]
    assert p.eval({}, route_input(big), {})["instance_id"].startswith("i")


@pytest.mark.parametrize("uri", ["builtin:round-robin", "builtin:least-inflight", "builtin:least-queue"])
async def test_each_builtin_through_the_policy_runtime_meets_the_route_contract(uri: str) -> None:
    rt = PolicyRuntime()
    out = await rt.invoke({"name": "loadBalancer", "policyRuleURI": uri}, "b.lb", route_input([inst("a"), inst("b")]))
    assert out["instance_id"] in ("a", "b")
    with pytest.raises(Exception, match="no instance"):
        await rt.invoke({"name": "loadBalancer", "policyRuleURI": uri}, "b.lb", route_input([]))


def test_route_and_weights_contract() -> None:
    contract.check("route", {"instance_id": "a"})
    contract.check("weights", {"weights": {"a": 1, "b": 0.5}})
    for bad in (None, {}, {"instance_id": 3}, {"instance_id": ""}, "a"):
        with pytest.raises(contract.WrongShape, match="route must return"):
            contract.check("route", bad)
    for bad in ({"weights": {"a": -1}}, {"weights": [1]}, {"weights": {"a": float("nan")}}):
        with pytest.raises(contract.WrongShape, match="weights must return"):
            contract.check("weights", bad)


# -- admission --------------------------------------------------------------------------------------
async def test_max_ongoing_bounds_each_instance_and_a_release_admits_the_next() -> None:
    r = builtin_route(n=2, max_ongoing=2, queue_size=10)
    held = [await r.acquire({}) for _ in range(4)]
    assert collections.Counter(v["id"] for v in held) == {"i0": 2, "i1": 2}
    waiter = asyncio.ensure_future(r.acquire({}))
    await asyncio.sleep(0.01)
    assert not waiter.done() and len(r.waiting) == 1
    r.release(held[0], 0.01)
    v = await asyncio.wait_for(waiter, 1)
    assert v["id"] == held[0]["id"] and v["inflight"] == 2


async def test_a_full_queue_is_refused_at_once_with_retry_after() -> None:
    r = builtin_route(n=1, max_ongoing=1, queue_size=2)
    first = await r.acquire({})
    waiters = [asyncio.ensure_future(r.acquire({})) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Refused) as exc:
        await r.acquire({})
    assert exc.value.status == 503 and "overloaded" in exc.value.reason and exc.value.retry_after_ms and exc.value.retry_after_ms >= 5
    assert r.rejected == 1
    # the queue is FIFO: the first waiter gets the freed slot first
    r.release(first, 0.01)
    got = await asyncio.wait_for(waiters[0], 1)
    assert got["id"] == "i0" and not waiters[1].done()
    r.release(got)
    r.release(await asyncio.wait_for(waiters[1], 1))


async def test_a_queued_task_is_refused_after_the_queue_timeout() -> None:
    r = builtin_route(n=1, max_ongoing=1, queue_size=5, queue_timeout_s=0.05)
    await r.acquire({})
    with pytest.raises(Refused, match="no instance free within"):
        await r.acquire({})


async def test_no_ready_instance_is_refused_not_queued() -> None:
    r = builtin_route(n=2)
    r.apply(the_map(2, "draining"), 2)
    with pytest.raises(Refused, match="no ready instance") as exc:
        await r.acquire({})
    assert exc.value.status == 503


async def test_draining_gets_no_new_task_and_its_tasks_in_flight_finish() -> None:
    r = builtin_route("builtin:round-robin", n=3)
    before = [await r.acquire({}) for _ in range(3)]
    drained = dict(the_map(3))
    drained["i1"] = {**drained["i1"], "state": InstanceState.DRAINING}
    r.apply(drained, 2)
    after = [await r.acquire({}) for _ in range(60)]
    assert "i1" not in {v["id"] for v in after}
    # the task in flight on i1 keeps its count and is released normally
    v1 = next(v for v in before if v["id"] == "i1")
    assert v1["inflight"] == 1
    r.release(v1)
    assert r.views["i1"]["inflight"] == 0
    # gone from the map entirely: still no task, and a late release is harmless
    gone = {k: v for k, v in the_map(3).items() if k != "i1"}
    r.apply(gone, 3)
    assert "i1" not in {(await r.acquire({}))["id"] for _ in range(30)}


async def test_map_changes_wake_waiters() -> None:
    r = builtin_route(n=1, max_ongoing=1)
    await r.acquire({})
    waiter = asyncio.ensure_future(r.acquire({}))
    await asyncio.sleep(0.01)
    r.apply(the_map(2), 2)  # a new instance: the waiter takes it
    assert (await asyncio.wait_for(waiter, 1))["id"] == "i1"


async def test_excluded_instances_are_skipped_for_a_retry() -> None:
    r = builtin_route(n=2)
    assert (await r.acquire({}, frozenset({"i0"})))["id"] == "i1"
    with pytest.raises(Refused, match="no ready instance"):
        await r.acquire({}, frozenset({"i0", "i1"}))


# -- policies that misbehave ------------------------------------------------------------------------
class Raises:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        raise KeyError("boom")


class Hangs:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        while True:  # a policy's own handler cannot swallow the time limit
            try:
                time.sleep(0.001)
            except Exception:
                pass


class Spins:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        n = 0
        while True:  # burns CPU: the CPU limit stops it
            n += 1


class Stranger:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"instance_id": "not-given"}


class Exits:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        raise SystemExit(3)


@pytest.mark.parametrize(("policy", "why"), [
    (Raises(), "raised KeyError"), (Hangs(), "timed out after 20 ms"), (Spins(), "timed out after 20 ms"),
    (Stranger(), "not one of the 2 instances"),
    (Exits(), "raised SystemExit"),
])
async def test_a_bad_policy_fails_that_task_only(policy: Any, why: str) -> None:
    r = Route("b", InlinePolicy(policy, "registry:bad", time_limit_s=0.02), Limits())
    r.apply(the_map(2), 1, 1)
    with pytest.raises(Refused, match=why) as exc:
        await r.acquire({})
    assert exc.value.status == 500 and r.policy_errors == 1
    assert all(v["inflight"] == 0 for v in r.views.values())  # nothing taken
    # the same route with a good policy goes on
    r.chooser = InlinePolicy(RoundRobinPolicy("b", {}, {}), "builtin:round-robin")
    assert (await r.acquire({}))["id"] in ("i0", "i1")


class WrongShape:
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return ["i0"]


async def test_a_wrong_shape_is_named() -> None:
    r = Route("b", InlinePolicy(WrongShape(), "x.py"), Limits())
    r.apply(the_map(2), 1, 1)
    with pytest.raises(Refused, match="wrong return shape"):
        await r.acquire({})


def test_weights_choose_by_share_and_new_instances_get_the_mean() -> None:
    w = Weighted("lb.star")
    w.set({"a": 3.0, "b": 1.0})
    cands = [inst("a"), inst("b")]
    picks = collections.Counter(w.choose("b", {}, cands) for _ in range(4000))
    assert 2.4 < picks["a"] / picks["b"] < 3.8
    picks = collections.Counter(w.choose("b", {}, [*cands, inst("new")]) for _ in range(4000))
    assert picks["new"] > 500
    w.set({"a": 0, "b": 0})
    assert {w.choose("b", {}, cands) for _ in range(100)} == {"a", "b"}


# -- mapper decisions --------------------------------------------------------------------------------
def ev(iid: str = "i0", gen: int = 1, node: str = "n0", endpoint: str = "http://127.0.0.1:9000") -> SimpleNamespace:
    return SimpleNamespace(block_id="b", gen=gen, instance_id=iid, node_id=node, endpoint=endpoint, placements=[])


BLOCK = {"gen": 1, "ir": {"inputProtocol": {"path": "v1/x", "method": "put"},
                          "policies": {"loadBalancer": {"policyRuleURI": "builtin:least-queue"}}}}


def test_mapper_walks_an_instance_through_its_states() -> None:
    placed = SimpleNamespace(block_id="b", gen=1, cluster_id="c7", placements=[SimpleNamespace(instance_id="i0", node_id="n0")])
    m = mapper.on_placement(placed, None, BLOCK, 1.0)
    assert m is not None and m["instances"]["i0"]["state"] == "starting" and m["path"] == "/v1/x" and m["method"] == "PUT"
    assert m["cluster"] == "c7"
    assert m["loadBalancer"]["policyRuleURI"] == "builtin:least-queue"
    m = mapper.on_added(ev(), m, BLOCK, 2.0)
    assert m is not None and m["instances"]["i0"] == {"state": "ready", "since": 2.0, "node": "n0", "endpoint": "http://127.0.0.1:9000"}
    assert mapper.on_added(ev(), m, BLOCK, 3.0) is None  # a redelivery changes nothing
    m = mapper.on_remove_command(ev(endpoint=""), m, BLOCK, 4.0)
    assert m is not None and m["instances"]["i0"]["state"] == "draining" and m["instances"]["i0"]["endpoint"]
    assert mapper.on_added(ev(), m, BLOCK, 5.0) is None  # never back to ready
    m = mapper.on_removed(ev(), m, BLOCK, 6.0)
    assert m is not None and "i0" not in m["instances"] and m["gone"] == ["i0"]
    assert mapper.on_added(ev(), m, BLOCK, 7.0) is None  # a late added does not bring it back


def test_a_fact_of_a_deleted_block_after_its_map_was_deleted_makes_no_map_again() -> None:
    # blocks delete: the instances' removed and the block's deleted were handled concurrently;
    # a removal handled after the map's deletion made it anew ({"instances": {}, "gone": [...]}),
    # and the deleted block stayed in the bucket (the collector sampled it, /blocks listed it)
    deleted = {**BLOCK, "status": "deleted"}
    assert mapper.on_removed(ev(), None, deleted, 1.0) is None
    assert mapper.on_remove_command(ev(), None, deleted, 1.0) is None
    assert mapper.on_added(ev(), None, deleted, 1.0) is None
    # a write that lost its compare-and-set to the deletion decides again with the record it read
    assert mapper.on_removed(ev(), None, {**BLOCK, "status": "deleting"}, 1.0) is None
    # a live block's removal that comes before any map still remembers the instance as gone
    m = mapper.on_removed(ev(), None, {**BLOCK, "status": "ready"}, 1.0)
    assert m is not None and m["gone"] == ["i0"]
    # a block made again under that id (a new generation) gets its map
    assert mapper.on_added(ev(gen=2), None, {**deleted, "gen": 2, "status": "ready"}, 1.0) is not None


def test_mapper_ignores_facts_of_older_generations_and_other_nodes() -> None:
    m = mapper.on_added(ev(gen=2), None, {**BLOCK, "gen": 2}, 1.0)
    assert m is not None and m["gen"] == 2
    assert mapper.on_added(ev("i9", gen=1), m, BLOCK, 2.0) is None
    assert mapper.on_remove_command(ev(gen=2, node="other"), m, None, 2.0) is None
    assert mapper.on_removed(ev(gen=2, node="other"), m, None, 2.0) is None
    # a newer generation starts a fresh map
    m3 = mapper.on_added(ev("j0", gen=3), m, None, 3.0)
    assert m3 is not None and set(m3["instances"]) == {"j0"} and m3["gen"] == 3


def test_a_map_rebuilt_from_the_state_routes_to_what_runs() -> None:
    # a lost bucket made anew is refilled from Redis (workers/mapper.py, Mapper.refill)
    insts = {
        "i0": {"node": "n0", "status": "running", "endpoint": "http://127.0.0.1:9000"},
        "i1": {"node": "n1", "status": "starting"},
        "i2": {"node": "n2", "status": "removing", "endpoint": "http://127.0.0.1:9002"},
        "i3": {"node": "n3", "status": "removing"},  # never reachable: left out
        "i4": {"node": "n4", "status": "running"},  # no address yet: starting, not ready
    }
    m = mapper.from_state("b", {**BLOCK, "status": "ready"}, insts, 5.0)
    assert m is not None and m["block_id"] == "b" and m["gen"] == BLOCK["gen"] and m["path"] == "/v1/x"
    assert {k: v["state"] for k, v in m["instances"].items()} == {"i0": "ready", "i1": "starting", "i2": "draining",
                                                                 "i4": "starting"}
    assert m["instances"]["i0"] == {"node": "n0", "endpoint": "http://127.0.0.1:9000", "state": "ready", "since": 5.0}
    # then facts apply to it as to any map: a redelivered added changes nothing
    assert mapper.on_added(ev(), m, BLOCK, 6.0) is None
    for status in ("failed", "deleted", "rejected", "parsed"):
        assert mapper.from_state("b", {**BLOCK, "status": status}, insts, 5.0) is None
    assert mapper.from_state("b", None, insts, 5.0) is None
    assert mapper.from_state("b", {**BLOCK, "status": "placing"}, {}, 5.0) is None  # nothing placed yet
    empty = mapper.from_state("b", {**BLOCK, "status": "ready"}, {}, 5.0)  # scaled to zero: known, held
    assert empty is not None and empty["instances"] == {}


def test_a_removal_before_its_addition_keeps_it_gone() -> None:
    m = mapper.on_removed(ev(), None, BLOCK, 1.0)
    assert m is not None and m["gone"] == ["i0"]
    assert mapper.on_added(ev(), m, BLOCK, 2.0) is None


def test_queue_metrics_are_read_from_vllm_and_sdk_names() -> None:
    text = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="n"} 2.0
vllm:num_requests_running{model_name="m"} 4
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:kv_cache_usage_perc{model_name="n"} 0.75
aios_instance_requests_waiting 1
other_metric 9
"""
    assert parse_queue_metrics(text) == {"num_requests_waiting": 5.0, "num_requests_running": 4.0, "kv_cache_usage_perc": 0.75}
    assert parse_queue_metrics("aios_instance_requests_running 2\naios_instance_requests_waiting 0\n") == {
        "num_requests_running": 2.0, "num_requests_waiting": 0.0}


def test_the_candidate_list_always_equals_the_filtered_one() -> None:
    """The route keeps a count of instances at their limit so that, with none full, candidates
    cost nothing; whatever the sequence of picks, releases and map changes, it is the plain filter."""
    import random

    rnd = random.Random(7)
    r = builtin_route(n=4, max_ongoing=2)
    held: list[dict[str, Any]] = []
    for step in range(2000):
        op = rnd.random()
        if op < 0.5:
            v = r.try_pick({})
            if v is not None:
                held.append(v)
        elif op < 0.95 and held:
            r.release(held.pop(rnd.randrange(len(held))))
        else:
            m = the_map(4)
            m[f"i{rnd.randrange(4)}"]["state"] = rnd.choice(["ready", "draining"])
            r.apply(m, step, 1)
        expected = [v for v in r._ready if v["inflight"] < 2]
        assert [v["id"] for v in r.candidates()] == [v["id"] for v in expected]


@pytest.mark.parametrize("header", ["abc", "", "inf", "-inf", "1e309", "nan", "0", "-5", str(MAX_TASK_TIMEOUT_MS + 1)])
def test_a_task_time_limit_that_is_no_time_or_none_is_refused_with_400(header: str) -> None:
    # "inf" and "1e309" once crashed the executor (500, OverflowError); "-5" answered 504 with an
    # empty reason; "nan" went on to the instance
    with pytest.raises(Refused) as exc:
        task_timeout_s(header)
    assert exc.value.status == 400
    assert "Aios-Timeout-Ms" in str(exc.value) and repr(header) in str(exc.value)


def test_a_task_time_limit_is_read_in_milliseconds() -> None:
    assert task_timeout_s("2500") == 2.5
    assert task_timeout_s("0.5") == 0.0005
    assert task_timeout_s(str(MAX_TASK_TIMEOUT_MS)) == MAX_TASK_TIMEOUT_MS / 1000
