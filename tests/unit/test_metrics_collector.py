"""The metrics system without servers: reading instance and executor pages, histogram quantiles,
the collector's windows (rates, resets, latency), the metrics store on an in-memory Redis
(windows bounded, block_metrics shape), the controller's block_metrics, the Prometheus config and
the `blocks top` table."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import fakeredis.aioredis
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from rich.console import Console

from aios_blocks.cli import top
from aios_blocks.executor.engine import InlinePolicy, Limits, Route
from aios_blocks.executor.stats import ExecutorCollector
from aios_blocks.instance.metrics import SystemMetrics
from aios_blocks.metrics import promconfig
from aios_blocks.metrics.scrape import Histogram, read_executor, read_instance
from aios_blocks.metrics.window import BlockInput, Windows
from aios_blocks.policies.runtime import BUILTINS
from aios_blocks.state.store import Store
from aios_blocks.workers.controller import block_metrics

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 5.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:request_success_total{finished_reason="stop",model_name="m"} 10.0
vllm:request_success_total{finished_reason="length",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 12.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 12.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 12.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.0
"""


def sdk_page(requests: int, errors: int = 0, seconds: float = 0.02, running: int = 0) -> str:
    m = SystemMetrics(running=running, ready=True)
    for k in range(requests):
        m.observe(seconds, error=k < errors)
    return m.render()


def test_an_sdk_page_and_a_vllm_page_are_read() -> None:
    r = read_instance(sdk_page(10, errors=2, running=3))
    assert (r.requests, r.errors, r.running, r.waiting) == (10, 2, 3, 0)
    assert r.latency is not None and r.latency.count == 10
    assert r.latency.quantile(0.5) is not None and 0.01 < r.latency.quantile(0.5) <= 0.025  # type: ignore[operator]
    v = read_instance(VLLM_PAGE)
    assert (v.requests, v.running, v.waiting, v.kv_cache_usage_perc) == (12, 3, 5, 0.42)
    assert v.latency is not None and v.latency.mean() == 0.25
    assert read_instance("garbage\n{{{ 1\nx notanumber\n") == read_instance("")  # bad lines are skipped


def test_histogram_quantile_is_linear_within_a_bucket_like_promql() -> None:
    h = Histogram({0.1: 50.0, 0.2: 100.0, math.inf: 100.0}, 10.0, 100.0)
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert h.quantile(0.75) == pytest.approx(0.15)
    assert Histogram({math.inf: 5.0}, 1.0, 5.0).quantile(0.5) == 0.0  # all in +Inf: the largest finite bound
    assert Histogram().quantile(0.5) is None


def executor_page(route: Route) -> str:
    reg = CollectorRegistry()
    reg.register(ExecutorCollector(lambda: {route.block_id: route}, lambda: 0))
    return generate_latest(reg).decode()


async def test_executor_pages_sum_over_executors() -> None:
    routes = []
    for _ in range(2):
        r = Route("b", InlinePolicy(BUILTINS["builtin:round-robin"]("b.lb", {}, {}), "builtin:round-robin"), Limits())
        r.apply({"i0": {"node": "n", "endpoint": "http://h:1", "state": "ready"}}, 1, 1)
        v = await r.acquire({})
        r.release(v, 0.01, ok=True)
        await r.acquire({})  # one left in flight
        routes.append(r)
    ex = read_executor(executor_page(routes[0]))
    read_executor(executor_page(routes[1]), ex)
    i0 = ex["b"].instances["i0"]
    assert (i0.ok, i0.errors, i0.inflight, i0.dispatch.count) == (2, 0, 2, 2)
    assert ex["b"].queue_wait.count == 4


def test_windows_give_rates_latency_and_restart_after_a_counter_reset() -> None:
    w = Windows(span_s=10)
    maps = {"i0": {"state": "ready", "node": "n0"}}
    first = w.tick(100.0, {"b": BlockInput("c0", maps, {"i0": read_instance(sdk_page(0))})})
    s = first["b"][1]["i0"]
    assert s["rate"] is None and s["up"] is True and first["b"][0]["cluster"] == "c0"
    out = w.tick(102.0, {"b": BlockInput("c0", maps, {"i0": read_instance(sdk_page(40, errors=4, seconds=0.02))})})
    block, insts = out["b"]
    s = insts["i0"]
    assert s["rate"] == 20.0 and s["error_rate"] == 2.0
    assert 10 <= s["latency_p50_ms"] <= 25 and s["latency_mean_ms"] == pytest.approx(20.0)
    assert block["rate"] == 20.0 and block["instances"] == 1 and block["ready"] == 1
    # the instance restarted (its counter went down): the span starts again, no negative rate
    again = w.tick(104.0, {"b": BlockInput("c0", maps, {"i0": read_instance(sdk_page(3))})})["b"][1]["i0"]
    assert again["rate"] is None
    # an instance that does not answer is reported down, and a gone block is forgotten
    down = w.tick(105.0, {"b": BlockInput("c0", maps, {"i0": None})})["b"][1]["i0"]
    assert down["up"] is False
    w.tick(106.0, {})
    assert not w._inst and not w._block


def test_the_rate_comes_from_the_executor_when_the_instance_reports_none() -> None:
    ex = read_executor('aios_executor_tasks_total{block="b",instance="i0",outcome="ok"} 0\n')
    w = Windows(10)
    maps = {"i0": {"state": "ready", "node": "n0"}}
    w.tick(0.0, {"b": BlockInput("c", maps, {"i0": None}, ex.get("b"))})
    ex = read_executor('aios_executor_tasks_total{block="b",instance="i0",outcome="ok"} 30\n'
                       'aios_executor_tasks_total{block="b",instance="i0",outcome="error"} 10\n'
                       'aios_executor_rejected_total{block="b",reason="overloaded"} 5\n')
    block, insts = w.tick(10.0, {"b": BlockInput("c", maps, {"i0": None}, ex.get("b"))})["b"]
    assert insts["i0"]["rate"] == 4.0 and insts["i0"]["error_rate"] == 1.0
    assert block["rejected_rate"] == 0.5


@pytest.fixture
def store() -> Store:
    return Store(fakeredis.aioredis.FakeRedis(decode_responses=True))


async def test_the_store_keeps_bounded_windows_and_the_block_metrics_shape(store: Store) -> None:
    w = Windows(10)
    maps = {"i0": {"state": "ready", "node": "n0"}, "i1": {"state": "ready", "node": "n1"}}
    for t in range(5):
        pages = {i: read_instance(sdk_page(10 * t)) for i in maps}
        await store.metrics.write(w.tick(float(t), {"b": BlockInput("c0", maps, pages)}), keep=3, ttl_s=60)
    assert len(await store.metrics.window("b")) == 3 and len(await store.metrics.window("b", "i0")) == 3
    assert [s["t"] for s in await store.metrics.window("b", "i1")] == [2.0, 3.0, 4.0]  # oldest first
    bm = await store.metrics.block_metrics("b")
    assert bm["rate"] == 20.0 and bm["cluster"] == "c0" and set(bm["per_instance"]) == {"i0", "i1"}
    assert bm["per_instance"]["i0"]["rate"] == 10.0 and len(bm["history"]) == 3
    assert await store.metrics.block_metrics("nope") == {}
    # a block the writer no longer covers is dropped from the latest samples
    await store.metrics.write({}, keep=3, ttl_s=60, gone=["b"])
    assert await store.metrics.blocks() == {} and await store.metrics.instances("b") == {}


async def test_the_controller_gives_the_collectors_figures_with_the_requests_on_top(store: Store) -> None:
    w = SimpleNamespace(store=store)
    assert await block_metrics(w, "b", {}) == {}  # type: ignore[arg-type]
    assert await block_metrics(w, "b", {"rate": 7}) == {"rate": 7}  # type: ignore[arg-type]
    win = Windows(10)
    maps = {"i0": {"state": "ready", "node": "n0"}}
    for t in (0.0, 1.0):
        await store.metrics.write(win.tick(t, {"b": BlockInput("c0", maps, {"i0": read_instance(sdk_page(int(5 * t)))})}), 60, 60)
    got = await block_metrics(w, "b", {"note": "autoscaler"})  # type: ignore[arg-type]
    assert got["rate"] == 5.0 and got["note"] == "autoscaler" and "i0" in got["per_instance"]


async def test_worker_targets_lapse_unless_refreshed(store: Store) -> None:
    t = {"id": "executor-h-1", "kind": "executor", "cluster": "", "url": "http://127.0.0.1:9/metrics"}
    await store.metrics.register_target(t, ttl_s=60)
    await store.metrics.register_target({**t, "id": "old", "kind": "parser"}, ttl_s=-1)
    assert await store.metrics.targets() == [t] and await store.metrics.targets("parser") == []
    assert await store.metrics.prune_targets() == 1
    await store.metrics.unregister_target(t)
    assert await store.metrics.targets() == []


async def test_one_collector_holds_a_scope(store: Store) -> None:
    assert await store.metrics.lead("all", "a", 5) and await store.metrics.lead("all", "a", 5)
    assert not await store.metrics.lead("all", "b", 5)
    assert await store.metrics.lead("c1", "b", 5)  # another scope


def test_the_prometheus_config_with_http_sd_and_static_targets() -> None:
    doc = yaml.safe_load(promconfig.config("http://127.0.0.1:7000", scrape_interval="1s", refresh_interval="2s"))
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert jobs["aios-workers"]["http_sd_configs"] == [{"url": "http://127.0.0.1:7000/sd/workers", "refresh_interval": "2s"}]
    assert jobs["aios-workers"]["honor_labels"] is True  # the executor's own `instance` label stays
    assert jobs["aios-instances"]["http_sd_configs"][0]["url"] == "http://127.0.0.1:7000/sd/instances"
    workers = promconfig.worker_targets([{"id": "executor-h-1", "kind": "executor", "cluster": "c1", "url": "http://10.0.0.2:9100/metrics"}])
    insts = promconfig.instance_targets(
        {"b": {"instances": {"b-0": {"endpoint": "http://10.0.0.3:8000", "node": "n1", "state": "ready"},
                             "b-1": {"endpoint": "http://10.0.0.4:8000", "node": "n2", "state": "stopping"},
                             "b-2": {"endpoint": "", "node": "n2", "state": "starting"}}}}, {"b": "c1"})
    assert insts == [{"targets": ["10.0.0.3:8000"], "labels": {"block": "b", "instance": "b-0", "cluster": "c1", "node": "n1"}}]
    static = yaml.safe_load(promconfig.config(None, workers, insts))
    sj = {j["job_name"]: j for j in static["scrape_configs"]}
    assert sj["aios-workers"]["static_configs"] == [{"targets": ["10.0.0.2:9100"], "labels": {"kind": "executor", "worker": "executor-h-1", "cluster": "c1"}}]
    assert sj["aios-instances"]["static_configs"] == insts


def render(data: dict[str, object], bid: str | None = None) -> str:
    out = io.StringIO()
    Console(file=out, width=220).print(top.table(data, bid, now=101.0))
    return out.getvalue()


def test_the_top_table_shows_blocks_and_instances() -> None:
    text = render({"blocks": {"b": {"t": 100.0, "cluster": "c0", "instances": 2, "ready": 2, "inflight": 3.0, "queue": 0.0,
                                    "rate": 12.5, "error_rate": 0.0, "dispatch_p99_ms": 4.2}}})
    assert "b" in text and "12.5" in text and "2/2" in text and "1s" in text
    text = render({"block": {"t": 100.0, "rate": 3.0}, "instances": {"b-0": {"node": "n0", "state": "ready", "up": True,
                                                                            "inflight": 2.0, "rate": 3.0, "latency_p99_ms": 9.5}}}, "b")
    assert "b-0" in text and "9.5" in text and "ready" in text and "yes" in text


def test_the_metrics_role_reads_the_instance_maps_and_publishes_nothing_else() -> None:
    from aios_blocks.runtime import auth

    perms = auth.permissions("metrics")
    assert perms is not None and "metrics" in auth.WORKER_ROLES and auth.REDIS_ROLE["metrics"] == "aios"
    assert not [p for p in perms.publish if p.startswith(("aios.", "$KV."))]  # no event, no bucket write
    assert not [p for p in perms.publish if ".STREAM.CREATE." in p or ".STREAM.DELETE." in p or ".STREAM.PURGE." in p]
    assert "$JS.API.CONSUMER.CREATE.KV_aios-instances.>" in perms.publish  # its watch
    assert not perms.allow_responses


async def test_a_worker_serves_its_metrics_and_announces_them_until_it_stops(store: Store) -> None:
    import asyncio

    import aiohttp

    from aios_blocks.settings import Settings
    from aios_blocks.workers import telemetry

    w = SimpleNamespace(settings=Settings(metrics_target_ttl_s=30), store=store)
    stop = asyncio.Event()
    served = asyncio.ensure_future(telemetry.serve(w, "parser", None, stop))  # type: ignore[arg-type]
    async with asyncio.timeout(10):
        while not await store.metrics.targets():
            await asyncio.sleep(0.01)
    (target,) = await store.metrics.targets()
    assert target["kind"] == "parser" and target["url"].startswith("http://127.0.0.1:")
    async with aiohttp.ClientSession() as http, http.get(target["url"]) as r:
        assert r.status == 200 and "process_cpu_seconds_total" in await r.text()
    stop.set()
    await asyncio.wait_for(served, 10)
    assert await store.metrics.targets() == []  # a clean stop withdraws it
