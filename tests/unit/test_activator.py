"""Scale-to-zero in the executor (the activator), without servers: a block of ``minInstances`` 0
with no ready instance holds its tasks (bounded, with a deadline), asks once per hold period for
an instance, and dispatches the held tasks in order once a map shows a ready one; blocks of
``minInstances`` >= 1 keep refusing at once. Also the mapper's side: the map carries
``minInstances`` and is made when a block of 0 becomes ready (it had no placement)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from aios_blocks.executor.engine import InlinePolicy, Limits, Refused, Route
from aios_blocks.executor.stats import ExecutorCollector, Reject
from aios_blocks.handlers import mapper
from aios_blocks.policies.runtime import BUILTINS


def the_map(n: int, state: str = "ready") -> dict[str, dict[str, Any]]:
    return {f"i{k}": {"node": f"n{k}", "endpoint": f"http://127.0.0.1:{9000 + k}", "state": state} for k in range(n)}


def zero_route(calls: list[Route] | None = None, **limits: Any) -> Route:
    uri = "builtin:round-robin"
    r = Route("z", InlinePolicy(BUILTINS[uri]("z.loadBalancer", {}, {}), uri), Limits(**limits), gen=1,
              scale_to_zero=True, on_activate=(calls.append if calls is not None else None))
    r.apply({}, 1, 1)
    return r


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_task_for_a_block_at_zero_is_held_and_dispatched_when_an_instance_is_ready() -> None:
    calls: list[Route] = []
    r = zero_route(calls, hold_s=5)
    tasks = [asyncio.ensure_future(r.acquire({"n": k})) for k in range(5)]
    await settle()
    assert not any(t.done() for t in tasks)
    assert r.held == 5 and len(calls) == 1 and r.activations == 1  # asked once, not per task
    # a starting instance is not ready: still held, no new request within the hold period
    r.apply(the_map(1, "starting"), 2)
    await settle()
    assert not any(t.done() for t in tasks) and len(calls) == 1
    order: list[int] = []
    for k, t in enumerate(tasks):
        t.add_done_callback(lambda _t, k=k: order.append(k))
    r.apply(the_map(1), 3)
    got = await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert [v["id"] for v in got] == ["i0"] * 5 and order == [0, 1, 2, 3, 4]  # in the order they came
    assert r.held == 0 and r.views["i0"]["inflight"] == 5


async def test_held_tasks_wait_in_order_for_a_free_slot_after_the_first_instance_is_ready() -> None:
    r = zero_route(hold_s=5, max_ongoing=1, queue_timeout_s=5)
    tasks = [asyncio.ensure_future(r.acquire({})) for _ in range(3)]
    await settle()
    r.apply(the_map(1), 2)
    first = await asyncio.wait_for(tasks[0], 1)
    await settle()
    assert not tasks[1].done() and not tasks[2].done() and r.held == 0  # queued now, no longer held
    r.release(first, 0.01)
    second = await asyncio.wait_for(tasks[1], 1)
    assert not tasks[2].done()
    r.release(second, 0.01)
    r.release(await asyncio.wait_for(tasks[2], 1))


async def test_a_held_task_gets_503_with_the_reason_at_the_hold_deadline() -> None:
    calls: list[Route] = []
    r = zero_route(calls, hold_s=0.05)
    with pytest.raises(Refused) as exc:
        await r.acquire({})
    assert exc.value.status == 503 and "scaled to zero" in exc.value.reason and "activator_hold_s" in exc.value.reason
    assert exc.value.retry_after_ms and r.held == 0 and r.stats.rejected[Reject.HOLD_TIMEOUT] == 1
    # the task's own limit, shorter than the hold, is named as such
    loop = asyncio.get_running_loop()
    r2 = zero_route(hold_s=30)
    with pytest.raises(Refused, match="task's time limit") as exc:
        await r2.acquire({}, deadline=loop.time() + 0.05)
    assert exc.value.status == 503


async def test_beyond_the_bound_a_task_is_refused_with_429_at_once() -> None:
    r = zero_route(hold_s=5, max_held=3)
    held = [asyncio.ensure_future(r.acquire({})) for _ in range(3)]
    await settle()
    with pytest.raises(Refused) as exc:
        await r.acquire({})
    assert exc.value.status == 429 and "holds 3 tasks" in exc.value.reason and exc.value.retry_after_ms
    assert r.stats.rejected[Reject.HOLD_FULL] == 1 and r.held == 3
    r.apply(the_map(1), 2)
    assert len(await asyncio.wait_for(asyncio.gather(*held), 1)) == 3


async def test_activation_is_asked_once_per_hold_period_and_again_after_an_instance_was_ready() -> None:
    calls: list[Route] = []
    r = zero_route(calls, hold_s=0.1)
    with pytest.raises(Refused):
        await asyncio.gather(*(r.acquire({}) for _ in range(4)))
    assert len(calls) == 1
    await asyncio.sleep(0.02)
    with pytest.raises(Refused):  # the next hold period asks again (the controller may have failed)
        await r.acquire({})
    assert len(calls) == 2
    r.apply(the_map(1), 2)
    r.release(await r.acquire({}))
    r.apply({}, 3)  # back at zero (scaled down): the next task asks at once
    t = asyncio.ensure_future(r.acquire({}))
    await settle()
    assert len(calls) == 3
    r.apply(the_map(1), 4)
    r.release(await asyncio.wait_for(t, 1))


async def test_a_hook_that_raises_does_not_fail_the_task() -> None:
    def boom(_r: Route) -> None:
        raise RuntimeError("no bus")

    r = zero_route(hold_s=5)
    r.on_activate = boom
    t = asyncio.ensure_future(r.acquire({}))
    await settle()
    r.apply(the_map(1), 2)
    assert (await asyncio.wait_for(t, 1))["id"] == "i0"


async def test_a_block_with_min_instances_is_refused_at_once_as_before() -> None:
    calls: list[Route] = []
    r = zero_route(calls, hold_s=5)
    r.scale_to_zero = False
    with pytest.raises(Refused, match="no ready instance") as exc:
        await r.acquire({})
    assert exc.value.status == 503 and not calls and r.held == 0


async def test_held_tasks_are_answered_at_once_when_the_route_closes() -> None:
    r = zero_route(hold_s=30)
    t = asyncio.ensure_future(r.acquire({}))
    await settle()
    r.close(2)  # a new generation, or the block deleted
    with pytest.raises(Refused, match="redeployed or deleted") as exc:
        await asyncio.wait_for(t, 1)
    assert exc.value.status == 503 and r.held == 0


async def test_the_collector_shows_held_tasks_and_activations() -> None:
    r = zero_route([], hold_s=5)
    t = asyncio.ensure_future(r.acquire({}))
    await settle()
    fams = {m.name: m for m in ExecutorCollector(lambda: {"z": r}, lambda: 0).collect()}
    assert fams["aios_executor_held"].samples[0].value == 1
    assert fams["aios_executor_activations"].samples[0].value == 1
    assert fams["aios_executor_queue_length"].samples[0].value == 0
    r.apply(the_map(1), 2)
    await asyncio.wait_for(t, 1)


# -- the mapper --------------------------------------------------------------------------------------
def block(min_instances: int, status: str = "ready", gen: int = 1) -> dict[str, Any]:
    return {"gen": gen, "status": status, "cluster": "c9", "ir": {"minInstances": min_instances}}


def test_the_map_carries_min_instances_and_is_made_when_a_block_of_zero_becomes_ready() -> None:
    ready = SimpleNamespace(block_id="b", gen=1, cluster_id="c9", status="ready", instances=[])
    m = mapper.on_ready(ready, None, block(0), 1.0)
    assert m is not None and m["minInstances"] == 0 and m["instances"] == {} and m["cluster"] == "c9"
    assert mapper.on_ready(ready, m, block(0), 2.0) is None  # a redelivery changes nothing
    # an instance added later (the controller scaled it up) keeps the field
    added = SimpleNamespace(block_id="b", gen=1, instance_id="i0", node_id="n0", endpoint="http://127.0.0.1:1")
    m2 = mapper.on_added(added, m, block(0), 3.0)
    assert m2 is not None and m2["minInstances"] == 0 and m2["instances"]["i0"]["state"] == "ready"
    # a block of 1 has its map from the placement; ready changes nothing there
    placed = SimpleNamespace(block_id="b", gen=1, cluster_id="c9", placements=[SimpleNamespace(instance_id="i0", node_id="n0")])
    m1 = mapper.on_placement(placed, None, block(1), 1.0)
    assert m1 is not None and m1["minInstances"] == 1
    assert mapper.on_ready(ready, m1, block(1), 2.0) is None


def test_ready_never_brings_back_the_map_of_a_deleted_or_older_block() -> None:
    ready = SimpleNamespace(block_id="b", gen=1, cluster_id="c9", status="ready", instances=[])
    assert mapper.on_ready(ready, None, block(0, "deleted"), 1.0) is None
    assert mapper.on_ready(ready, None, block(0, "ready", gen=2), 1.0) is None
    assert mapper.on_ready(ready, None, None, 1.0) is None
