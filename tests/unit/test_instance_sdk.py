"""The instance SDK (aios_blocks.instance): handlers called without a server (InstanceApp.call),
then the same app behind its real aiohttp server on a free port."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from aios_blocks.instance import Context, InstanceApp, Reply, Task, TaskError, web_app
from aios_blocks.instance.metrics import parse_text


async def started(handler: Any, init: Any = None, **kw: Any) -> InstanceApp:
    app = InstanceApp(handler, init, **kw)
    await app.start()
    return app


def sample(app: InstanceApp) -> dict[str, float]:
    return parse_text(app.metrics.render().decode())


async def test_answers_by_type_and_errors_by_status() -> None:
    async def h(task: Task, ctx: Context) -> Any:
        kind = task.json()["kind"]
        if kind == "refuse":
            raise TaskError(422, "no")
        if kind == "raise":
            raise ValueError("bad")
        return {"json": {"a": 1}, "text": "hi", "bytes": b"\x00\x01", "reply": Reply({"x": 2}, 201, headers={"X-A": "1"})}[kind]

    app = await started(h)
    r = await app.call({"kind": "json"})
    assert (r.status, r.content_type, r.json()) == (200, "application/json", {"a": 1})
    r = await app.call({"kind": "text"})
    assert (r.body, r.content_type) == (b"hi", "text/plain; charset=utf-8")
    assert (await app.call({"kind": "bytes"})).body == b"\x00\x01"
    r = await app.call({"kind": "reply"})
    assert (r.status, r.json(), r.headers) == (201, {"x": 2}, {"X-A": "1"})
    r = await app.call({"kind": "refuse"})
    assert (r.status, r.json()) == (422, {"error": "no"})
    r = await app.call({"kind": "raise"})
    assert r.status == 500 and r.json() == {"error": "ValueError: bad"}
    r = await app.call(b"not json")
    assert r.status == 400 and "not JSON" in r.json()["error"]
    m = sample(app)
    # 7 tasks; errors are the instance's failures (5xx), not refused tasks
    assert m["aios_instance_requests_total"] == 7 and m["aios_instance_errors_total"] == 1
    assert m['aios_instance_request_latency_seconds_bucket{le="+Inf"}'] == 7
    assert m["aios_instance_requests_running"] == 0


async def test_not_ready_until_init_is_done_and_a_failed_init_says_why() -> None:
    gate = asyncio.Event()

    async def init(ctx: Context) -> None:
        await gate.wait()
        ctx.state["model"] = "loaded"

    app = InstanceApp(lambda t, c: c.state["model"], init)
    starting = asyncio.create_task(app.start())
    await asyncio.sleep(0)
    assert app.health() == (503, {"status": "starting"}) and (await app.call({})).status == 503
    gate.set()
    await starting
    assert app.health()[0] == 200 and (await app.call({})).body == b"loaded"
    assert sample(app)["aios_instance_ready"] == 1

    def bad_init(ctx: Context) -> None:
        raise RuntimeError("no weights")

    broken = InstanceApp(lambda t, c: None, bad_init)
    with pytest.raises(RuntimeError):
        await broken.start()
    assert broken.health() == (503, {"status": "failed", "error": "RuntimeError: no weights"})


async def test_a_plain_def_handler_runs_in_a_thread_and_the_limit_queues_the_rest() -> None:
    release = threading.Event()
    threads: set[str] = set()

    def slow(task: Task, ctx: Context) -> str:
        threads.add(threading.current_thread().name)
        release.wait(10)
        return "done"

    app = await started(slow, max_concurrency=1)
    calls = [asyncio.create_task(app.call({})) for _ in range(3)]
    async with asyncio.timeout(5):
        while app.metrics.system.waiting != 2:
            await asyncio.sleep(0.01)
    m = sample(app)  # the loop is free while the handler computes
    assert m["aios_instance_requests_running"] == 1 and m["aios_instance_requests_waiting"] == 2
    release.set()
    assert [r.body for r in await asyncio.gather(*calls)] == [b"done"] * 3
    assert threading.main_thread().name not in threads
    assert sample(app)["aios_instance_requests_running"] == 0


async def test_a_streamed_answer_counts_as_running_until_drained_and_a_broken_one_is_an_error() -> None:
    async def h(task: Task, ctx: Context) -> AsyncIterator[Any]:
        for i in range(3):
            yield {"n": i} if i != 1 else "text\n"
        if task.json().get("break"):
            raise RuntimeError("cut")

    app = await started(h)
    r = await app.call({})
    assert r.stream and r.content_type == "application/x-ndjson"
    assert app.metrics.system.running == 1
    chunks = [c async for c in r.body]
    assert chunks == [b'{"n": 0}\n', b"text\n", b'{"n": 2}\n']
    assert app.metrics.system.running == 0 and app.metrics.system.errors == 0
    broken = await app.call({"break": True})
    with pytest.raises(RuntimeError):
        async for _ in broken.body:
            pass
    closed = await app.call({})
    await closed.body.aclose()  # the client went away before reading
    s = app.metrics.system
    assert (s.running, s.requests, s.errors) == (0, 3, 2)


async def test_custom_metrics_are_rendered_with_the_system_ones() -> None:
    def init(ctx: Context) -> None:
        ctx.state["tokens"] = ctx.metrics.counter("tokens_total", "Tokens generated", ("kind",))
        ctx.state["kv"] = ctx.metrics.gauge("kv_cache_usage_perc", "KV cache in use")

    def h(task: Task, ctx: Context) -> str:
        ctx.state["tokens"].labels("output").inc(5)
        ctx.state["kv"].set(0.25)
        return "ok"

    app = await started(h, init)
    await app.call({})
    m = sample(app)
    assert m['tokens_total{kind="output"}'] == 5 and m["kv_cache_usage_perc"] == 0.25
    assert m["aios_instance_requests_total"] == 1


def test_context_from_the_agents_environment() -> None:
    ctx = Context.from_env({
        "AIOS_INSTANCE_ID": "b-0", "AIOS_BLOCK_ID": "b", "AIOS_PORT": "9000", "AIOS_PORT_HTTP": "9001",
        "blockInitData": '{"model": "m"}', "initSettings": '{"threads": 2}', "parameters": "not json",
        "inputProtocol": '{"type": "http", "path": "v1/ocr", "method": "put"}',
    })
    assert (ctx.instance_id, ctx.block_id, ctx.port, ctx.host) == ("b-0", "b", 9001, "127.0.0.1")
    assert (ctx.init_data, ctx.settings, ctx.parameters) == ({"model": "m"}, {"threads": 2}, {})
    assert (ctx.task_path, ctx.task_method) == ("/v1/ocr", "PUT")
    assert Context.from_env({}).task_path == "/infer" and Context.from_env({}).port == 8000


async def test_the_server_answers_the_protocol_path_health_metrics_and_streams_chunked() -> None:
    gate = asyncio.Event()

    async def init(ctx: Context) -> None:
        await gate.wait()

    async def h(task: Task, ctx: Context) -> Any:
        data = task.json()
        if data.get("stream"):
            async def chunks() -> AsyncIterator[dict[str, int]]:
                for i in range(data["stream"]):
                    yield {"chunk": i}
            return chunks()
        return {"got": data, "ct": task.headers.get("Content-Type")}

    ctx = Context(instance_id="i-1", input_protocol={"path": "/v1/run"})
    app = InstanceApp(h, init, ctx)
    server = TestServer(web_app(app))
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    try:
        starting = asyncio.create_task(app.start())
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as r:
                assert r.status == 503
            gate.set()
            await starting
            async with http.get(f"{base}/health") as r:
                assert r.status == 200 and (await r.json())["instance_id"] == "i-1"
            async with http.post(f"{base}/v1/run", json={"q": 1}) as r:
                assert r.status == 200 and await r.json() == {"got": {"q": 1}, "ct": "application/json"}
            async with http.post(f"{base}/infer", json={}) as r:
                assert r.status == 404  # only the block's input path takes tasks
            async with http.post(f"{base}/v1/run", json={"stream": 4}) as r:
                assert r.headers.get("Transfer-Encoding") == "chunked"
                lines = [json.loads(line) async for line in r.content]
            assert lines == [{"chunk": i} for i in range(4)]
            async with http.get(f"{base}/metrics") as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                m = parse_text(await r.text())
            assert m["aios_instance_requests_total"] == 2 and m["aios_instance_requests_running"] == 0
    finally:
        await server.close()


async def test_a_task_meant_for_another_instance_is_refused_421_unrun() -> None:
    """An executor whose map is behind sends a task for i-old to a port that now serves i-new
    (another block's): the SDK answers 421 from its Aios-Instance header and never runs it."""
    ran: list[Any] = []

    async def h(task: Task, ctx: Context) -> Any:
        ran.append(task.json())
        return {"by": ctx.instance_id}

    app = await started(h, context=Context(instance_id="i-new"))
    r = await app.call(Task(b'{"n": 1}', {"Aios-Instance": "i-old"}))
    assert r.status == 421 and "this is instance i-new, not i-old" in r.json()["error"]
    assert r.headers["Aios-Instance"] == "i-new"
    assert ran == [] and app.metrics.system.requests == 0  # not run, not counted
    for headers in ({"Aios-Instance": "i-new"}, {}):  # its own id, or a direct caller with no header
        assert (await app.call(Task(b'{"n": 2}', headers))).status == 200
    anonymous = await started(h)  # no AIOS_INSTANCE_ID (run by hand): nothing to check against
    assert (await anonymous.call(Task(b'{"n": 3}', {"Aios-Instance": "i-old"}))).status == 200
    assert ran == [{"n": 2}, {"n": 2}, {"n": 3}]

    server = TestServer(web_app(app))  # the same over HTTP, whatever the header's case
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            for name in ("Aios-Instance", "aios-instance"):
                async with http.post(f"http://127.0.0.1:{server.port}/infer", json={"n": 4}, headers={name: "i-old"}) as resp:
                    assert resp.status == 421 and resp.headers["Aios-Instance"] == "i-new"
                    assert "not i-old" in (await resp.json())["error"]
            async with http.post(f"http://127.0.0.1:{server.port}/infer", json={"n": 5}, headers={"Aios-Instance": "i-new"}) as resp:
                assert resp.status == 200
            # an executor's scrape of the queue figures, named the same way: not the other's figures
            for path in ("/metrics", "/health"):  # and the checker's probe
                async with http.get(f"http://127.0.0.1:{server.port}" + path, headers={"Aios-Instance": "i-old"}) as resp:
                    assert resp.status == 421 and "not i-old" in (await resp.json())["error"], path
            async with http.get(f"http://127.0.0.1:{server.port}/health", headers={"Aios-Instance": "i-new"}) as resp:
                assert resp.status == 200
            for headers in ({"Aios-Instance": "i-new"}, {}):  # its own, or Prometheus with no header
                async with http.get(f"http://127.0.0.1:{server.port}/metrics", headers=headers) as resp:
                    assert resp.status == 200 and "aios_instance_" in await resp.text()
    finally:
        await server.close()
    assert ran[3:] == [{"n": 5}]


def test_the_metrics_page_is_valid_prometheus_text() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from aios_blocks.instance import Metrics

    metrics = Metrics()
    metrics.system.observe(0.003)
    metrics.system.observe(0.2, error=True)
    metrics.system.kv_cache_usage = 0.5
    metrics.gauge("engine_batch", "Batch size").set(3)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    latency = families["aios_instance_request_latency_seconds"]
    assert latency.type == "histogram"
    buckets = {s.labels.get("le"): s.value for s in latency.samples if s.name.endswith("_bucket")}
    assert buckets["0.0025"] == 0 and buckets["0.005"] == 1 and buckets["0.25"] == 2 and buckets["+Inf"] == 2
    assert families["aios_instance_errors"].samples[0].value == 1  # counters lose _total in the parser
    assert families["aios_instance_kv_cache_usage_perc"].samples[0].value == 0.5
    assert families["engine_batch"].samples[0].value == 3
