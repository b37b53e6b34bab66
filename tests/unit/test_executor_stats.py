"""The executor's own figures (``executor.stats``): what a route counts on the task path, and the
Prometheus series its collector renders (bounded labels: block, instance, outcome, reason)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from aios_blocks.executor.engine import InlinePolicy, Limits, Refused, Route
from aios_blocks.executor.stats import ExecutorCollector
from aios_blocks.instance.metrics import parse_text
from aios_blocks.policies.runtime import BUILTINS


def route(n: int = 2, **limits: float) -> Route:
    uri = "builtin:least-inflight"
    r = Route("b", InlinePolicy(BUILTINS[uri]("b.loadBalancer", {}, {}), uri), Limits(**limits))  # type: ignore[arg-type]
    r.apply({f"i{k}": {"node": "n", "endpoint": f"http://h:{k}", "state": "ready"} for k in range(n)}, 1, 1)
    return r


def scrape(routes: dict[str, Route], unknown: int = 0) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(ExecutorCollector(lambda: routes, lambda: unknown))
    return parse_text(generate_latest(reg).decode())


async def test_tasks_inflight_dispatch_queue_and_rejections_are_counted_and_rendered() -> None:
    r = route(2, max_ongoing=1, queue_size=1, queue_timeout_s=5)
    a = await r.acquire({})
    b = await r.acquire({})
    waiter = asyncio.ensure_future(r.acquire({}))  # queued: both instances are at maxOngoing
    await asyncio.sleep(0)
    with pytest.raises(Refused):
        await r.acquire({})  # the queue (1) is full: overloaded
    page = scrape({"b": r}, unknown=3)
    assert page['aios_executor_inflight{block="b",instance="i0"}'] + page['aios_executor_inflight{block="b",instance="i1"}'] == 2
    assert page['aios_executor_queue_length{block="b"}'] == 1
    assert page['aios_executor_rejected_total{block="b",reason="overloaded"}'] == 1
    assert page["aios_executor_unknown_block_total"] == 3
    r.release(a, 0.004, ok=True)
    c = await waiter
    r.release(b, 0.2, ok=False)
    r.release(c, 0.003, ok=True)
    page = scrape({"b": r})
    ok = sum(v for k, v in page.items() if k.startswith("aios_executor_tasks_total") and 'outcome="ok"' in k)
    err = sum(v for k, v in page.items() if k.startswith("aios_executor_tasks_total") and 'outcome="error"' in k)
    assert (ok, err) == (2, 1)
    assert page[f'aios_executor_dispatch_seconds_bucket{{block="b",instance="{b["id"]}",le="0.25"}}'] >= 1
    assert page['aios_executor_queue_wait_seconds_count{block="b"}'] == 3
    assert page['aios_executor_policy_seconds_count{block="b"}'] == 1  # one decision: the first, among two free instances
    labels = {pair.split("=")[0] for k in page if "{" in k for pair in k[k.index("{") + 1 : -1].split(",")}
    assert labels == {"block", "instance", "outcome", "reason", "le"}  # bounded: never a task id


async def test_an_instance_that_leaves_the_map_takes_its_series_with_it() -> None:
    r = route(2)
    v = await r.acquire({})
    r.release(v, 0.01, ok=True)
    assert any(f'instance="{v["id"]}"' in k for k in scrape({"b": r}) if k.startswith("aios_executor_tasks_total"))
    other = "i1" if v["id"] == "i0" else "i0"
    r.apply({other: {"node": "n", "endpoint": "http://h:9", "state": "ready"}}, 2, 1)
    page = scrape({"b": r})
    assert not any(f'instance="{v["id"]}"' in k for k in page), page
    assert scrape({}) == {"aios_executor_unknown_block_total": 0.0}  # a deleted block: no series
