"""The executor on real NATS JetStream and Redis, run in this process (so the test sees when it
applied a map), in front of real HTTP servers (aiohttp test servers that count what reaches
them): draining under load, idempotent and non-idempotent failures, misbehaving policies, the
mapper from lifecycle facts, and the NATS and HTTP ingress with error statuses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from aios_blocks.bus.catalog import E
from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import InstanceCommand, InstanceEvent
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker
from aios_blocks.workers.executor import Executor

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Backend:
    """One instance: an HTTP server that records every task that reaches it."""

    name: str
    delay_s: float = 0.0
    #: "ok", "503" (answers 503), "drop" (closes the connection without an answer)
    mode: str = "ok"
    hits: list[tuple[float, bytes]] = field(default_factory=list)
    #: when set, a task that reaches the instance waits for it (the test decides when it is answered)
    gate: asyncio.Event | None = None
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.hits.append((time.monotonic(), body))
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "503":
            return web.json_response({"error": "busy"}, status=503)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if request.path == "/stream":
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for n in range(5):
                await resp.write(b'{"chunk": %d}\n' % n)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        return web.json_response({"instance": self.name, "echo": body.decode(), "path": request.path})

    async def start(self) -> Backend:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Rig:
    client: Client
    executor: Executor
    maps: InstanceMaps
    http: str
    backends: list[Backend]
    urls: tuple[str, str] = ("", "")

    async def backend(self, name: str, **kw: Any) -> Backend:
        b = await Backend(name, **kw).start()
        self.backends.append(b)
        return b

    async def put_map(self, bid: str, insts: dict[str, tuple[Backend, str]], lb: dict[str, Any] | None = None,
                      gen: int = 1, cluster: str = "c0") -> int:
        value = {"block_id": bid, "gen": gen, "cluster": cluster, "path": "/infer", "method": "POST", "loadBalancer": lb or {},
                 "instances": {iid: {"node": "n1", "endpoint": b.endpoint, "state": st} for iid, (b, st) in insts.items()},
                 "gone": []}
        rev = await self.maps.update(bid, lambda _cur: value)
        assert rev is not None
        await self.seen(bid, rev)
        return rev

    async def seen(self, bid: str, rev: int, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while self.executor.seen.get(bid, (0, 0))[0] < rev:
                await asyncio.sleep(0.005)

    async def task(self, bid: str, body: bytes = b"{}", **headers: str) -> tuple[int, bytes, dict[str, str]]:
        return await self.client.task(bid, body, {k.replace("_", "-"): v for k, v in headers.items()}, timeout=30)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    port = free_port()
    settings = Settings(executor_http_port=port, executor_retries=2, executor_queue_timeout_s=5,
                        executor_policy_time_limit_ms=20, executor_scrape_interval_s=0)
    w = await Worker.open(servers.nats_url, servers.redis_url, "executor", settings=settings)
    ex = Executor(w)
    stop = asyncio.Event()
    run = asyncio.ensure_future(ex.run(stop, mapper_on=True))
    client = await Client.open(servers.nats_url, servers.redis_url)
    r = Rig(client, ex, InstanceMaps(client.bus), f"http://127.0.0.1:{port}", [], (servers.nats_url, servers.redis_url))
    try:
        async with asyncio.timeout(20):  # serving: the unknown-block answer comes back
            while True:
                try:
                    status, _, _ = await client.task("nothing", b"", timeout=2)
                    if status == 404:
                        break
                except TimeoutError:
                    pass
                await asyncio.sleep(0.05)
        yield r
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 10)
        for b in r.backends:
            await b.stop()
        await client.close()
        await w.close()
        servers.stop()


async def test_tasks_over_nats_and_http_and_their_error_statuses(rig: Rig) -> None:
    a, b = await rig.backend("a"), await rig.backend("b")
    await rig.put_map("blk", {"i-a": (a, "ready"), "i-b": (b, "ready")})
    answers = await asyncio.gather(*(rig.task("blk", b'{"n": %d}' % n) for n in range(40)))
    assert all(s == 200 for s, _, _ in answers)
    by = {h["Aios-Instance"] for _, _, h in answers}
    assert by == {"i-a", "i-b"}
    body = msgspec.json.decode(answers[0][1])
    assert body["path"] == "/infer" and body["echo"].startswith('{"n":')
    assert len(a.hits) + len(b.hits) == 40

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{rig.http}/blocks/blk/tasks", data=b'{"x": 1}') as r:
            assert r.status == 200 and r.headers["Aios-Instance"] in ("i-a", "i-b")
            assert (await r.json())["echo"] == '{"x": 1}'
        # pass-through keeps the path and the query; a streamed answer arrives chunk by chunk
        async with http.get(f"{rig.http}/blocks/blk/v1/models?x=1") as r:
            assert r.status == 200 and (await r.json())["path"] == "/v1/models"
        async with http.post(f"{rig.http}/blocks/blk/stream") as r:
            lines = [line async for line in r.content]
            assert r.status == 200 and [msgspec.json.decode(x)["chunk"] for x in lines] == [0, 1, 2, 3, 4]
        async with http.post(f"{rig.http}/blocks/nope/tasks") as r:
            assert r.status == 404 and "unknown block" in r.headers["Aios-Error"]
    status, body, h = await rig.task("nope")
    assert status == 404 and "unknown block 'nope'" in h["Aios-Error"] and msgspec.json.decode(body)["status"] == 404

    # a time limit that is no time, or none, is the requester's mistake: 400 both ways (inf was a
    # 500 with an OverflowError, -5 a 504 with an empty reason, nan went on to the instance)
    hits = len(a.hits) + len(b.hits)
    async with aiohttp.ClientSession() as http:
        for bad in ("inf", "1e309", "nan", "0", "-5", "soon"):
            async with http.post(f"{rig.http}/blocks/blk/tasks", data=b"{}", headers={"Aios-Timeout-Ms": bad}) as r:
                assert r.status == 400 and "Aios-Timeout-Ms" in r.headers["Aios-Error"], (bad, r.status)
            status, _, h = await rig.task("blk", b"{}", Aios_Timeout_Ms=bad)
            assert status == 400 and "Aios-Timeout-Ms" in h["Aios-Error"] and h.get("Aios-Task-Id"), (bad, h)
        # every wrong request header in one refusal (a bad task id hid a bad time limit, and
        # Aios-Idempotent: maybe was taken as no)
        wrong = {"Aios-Task-Id": "a b", "Aios-Timeout-Ms": "soon", "Aios-Idempotent": "maybe"}
        async with http.post(f"{rig.http}/blocks/blk/tasks", data=b"{}", headers=wrong) as r:
            says = (await r.json())["error"]
            assert r.status == 400 and says == r.headers["Aios-Error"], (r.status, says)
        status, body, h = await rig.task("blk", b"{}", **{k.replace("-", "_"): v for k, v in wrong.items()})
        assert status == 400 and msgspec.json.decode(body)["error"] == says == h["Aios-Error"], (status, h)
        assert all(f"{name} must" in says for name in wrong), says
        assert "got 'a b'" in says and "got 'soon'" in says and "got 'maybe'" in says, says
        status, _, h = await rig.task("blk", b"{}", Aios_Idempotent="maybe")
        assert status == 400 and h["Aios-Error"] == "Aios-Idempotent must be true or false, got 'maybe'" and h["Aios-Task-Id"]
        # a block id that is no id is the caller's mistake (400, with the others), not an unknown block (404)
        async with http.post(f"{rig.http}/blocks/a%20b/tasks", data=b"{}", headers={"Aios-Timeout-Ms": "soon"}) as r:
            says = (await r.json())["error"]
            assert r.status == 400 and says.startswith("block id 'a b' is not a valid id") and "Aios-Timeout-Ms" in says, says
        status, _, h = await rig.task("*")  # (a literal `*` token: what the subject permissions let through)
        assert status == 400 and h["Aios-Error"].startswith("block id '*' is not a valid id"), (status, h)
        # header names in any case (HTTP's are case-insensitive): AIOS-TIMEOUT-MS was forwarded unread
        async with http.post(f"{rig.http}/blocks/blk/tasks", data=b"{}", headers={"AIOS-TIMEOUT-MS": "soon"}) as r:
            assert r.status == 400 and "Aios-Timeout-Ms must be" in (await r.json())["error"], r.status
        status, _, h = await rig.task("blk", b"{}", AIOS_TIMEOUT_MS="soon")
        assert status == 400 and "Aios-Timeout-Ms must be" in h["Aios-Error"], (status, h)
    assert len(a.hits) + len(b.hits) == hits  # none reached an instance
    async with aiohttp.ClientSession() as http:  # and a task id given as AIOS-TASK-ID is the task's
        async with http.post(f"{rig.http}/blocks/blk/tasks", data=b"{}", headers={"AIOS-TASK-ID": "mine-1"}) as r:
            assert r.status == 200 and r.headers["Aios-Task-Id"] == "mine-1", dict(r.headers)
    status, _, h = await rig.task("blk", b"{}", AIOS_TASK_ID="mine-2")
    assert status == 200 and h["Aios-Task-Id"] == "mine-2", h


async def test_an_upstream_client_gets_its_answer_on_its_own_inbox(rig: Rig, tmp_path: Path) -> None:
    import nats

    from aios_blocks.bus.nats_bus import security_options
    from aios_blocks.runtime.auth import read_endpoints

    ep = read_endpoints(tmp_path / "data")
    assert ep is not None and ep.auth
    a = await rig.backend("a")
    await rig.put_map("blk", {"i-a": (a, "ready")})
    url = ep.nats_url("upstream")
    nc = await nats.connect(url, **security_options(url))
    try:
        msg = await nc.request(E.block_task.subject(bid="blk"), b'{"q": 1}', timeout=10)
        assert msg.headers and msg.headers["Aios-Status"] == "200" and msgspec.json.decode(msg.data)["instance"] == "a"
    finally:
        await nc.close()


async def test_overload_is_answered_with_retry_after_never_a_timeout(rig: Rig) -> None:
    slow = await rig.backend("slow", delay_s=1.2)  # the 12 requests all arrive while 2 are served
    await rig.put_map("blk", {"i0": (slow, "ready")}, {"policyRuleURI": "builtin:least-inflight",
                                                        "settings": {"maxOngoing": 2, "queueSize": 3}})
    answers = await asyncio.gather(*(rig.task("blk") for _ in range(12)))
    ok = [x for x in answers if x[0] == 200]
    refused = [x for x in answers if x[0] == 503]
    assert len(ok) + len(refused) == 12
    assert len(ok) >= 5 and len(refused) >= 1  # 2 running + 3 queued at the most
    for _, _, h in refused:
        assert "overloaded" in h["Aios-Error"] and int(h["Retry-After-Ms"]) >= 5
    assert len(slow.hits) == len(ok)  # a refused task never reached the instance
    async with aiohttp.ClientSession() as http:
        jobs = [http.post(f"{rig.http}/blocks/blk/tasks") for _ in range(12)]
        statuses = []
        for resp in await asyncio.gather(*jobs):
            statuses.append((resp.status, resp.headers.get("Retry-After")))
            resp.release()
    assert any(s == 503 and ra is not None and int(ra) >= 1 for s, ra in statuses)


async def test_draining_under_load_loses_no_task_and_sends_none_to_the_draining_instance(rig: Rig) -> None:
    backends = [await rig.backend(f"b{k}", delay_s=0.05) for k in range(3)]
    insts = {f"i{k}": (b, "ready") for k, b in enumerate(backends)}
    await rig.put_map("blk", insts)
    results: list[tuple[int, str]] = []
    drained_at: list[float] = []
    after: list[str] = []

    async def load(n: int) -> None:
        for _ in range(n):
            started = time.monotonic()
            status, _, h = await rig.task("blk", idempotent="false")
            results.append((status, h.get("Aios-Instance", "")))
            if drained_at and started > drained_at[0]:  # sent once the executor had applied `draining`
                after.append(h.get("Aios-Instance", ""))

    loaders = [asyncio.ensure_future(load(15)) for _ in range(8)]
    await asyncio.sleep(0.2)
    # the remove command, as the controller sends it: the mapper marks i1 draining
    rec, rev = await rig.maps.get("blk")
    assert rec is not None
    await rig.client.bus.emit(E.node_instance_remove, InstanceCommand("blk", 1, "c0", "i1", "n1", [], reason="test"))
    async with asyncio.timeout(10):
        while True:
            cur, rev = await rig.maps.get("blk")
            if cur and cur["instances"]["i1"]["state"] == "draining":
                break
            await asyncio.sleep(0.01)
    await rig.seen("blk", rev)
    drained_at.append(time.monotonic())
    route = rig.executor.routes["blk"]
    in_flight_then = route.views["i1"]["inflight"]
    await asyncio.gather(*loaders)
    assert len(results) == 120 and all(s == 200 for s, _ in results), [r for r in results if r[0] != 200]
    assert after and "i1" not in after, "a task sent after draining reached the draining instance"
    assert route.views["i1"]["inflight"] == 0
    # the tasks it had in flight when draining began finished with answers (counted in results)
    assert in_flight_then >= 0 and sum(1 for _, i in results if i == "i1") == len(backends[1].hits)
    # then the instance goes: removed drops it from the map
    await rig.client.bus.emit(E.instance_removed, InstanceEvent("blk", 1, "i1", "n1", reason="removed"))
    async with asyncio.timeout(10):
        while "i1" in ((await rig.maps.get("blk"))[0] or {}).get("instances", {}):
            await asyncio.sleep(0.01)


async def test_a_non_idempotent_task_is_never_sent_twice(rig: Rig) -> None:
    bad, good = await rig.backend("bad", mode="drop"), await rig.backend("good")
    await rig.put_map("blk", {"i-bad": (bad, "ready"), "i-good": (good, "ready")},
                      {"policyRuleURI": "builtin:round-robin"})
    outcomes = []
    for _ in range(6):
        outcomes.append(await rig.task("blk", b"once"))
    failed = [o for o in outcomes if o[0] != 200]
    assert failed and len(bad.hits) == len(failed)  # each failed task reached the bad instance once...
    assert all(body == b"once" for _, body in good.hits) and len(good.hits) == 6 - len(failed)  # ...and never the good one
    for status, _, h in failed:
        assert status == 502 and "not retried" in h["Aios-Error"] and "Aios-Idempotent" in h["Aios-Error"]
    assert len(failed) == 1  # its first failed dispatch ejected it (docs/health.md): no task went there after

    # marked idempotent, once its ejection is over: retried on the other instance, every task answered
    route = rig.executor.routes["blk"]
    async with asyncio.timeout(10):
        while route.views["i-bad"]["state"] != "ready":
            await asyncio.sleep(0.02)
    bad.hits.clear()
    good.hits.clear()
    answers = [await rig.task("blk", b"again", Aios_Idempotent="true") for _ in range(6)]
    assert all(s == 200 and h["Aios-Instance"] == "i-good" for s, _, h in answers)
    assert len(good.hits) == 6 and len(bad.hits) >= 1
    assert rig.executor.routes["blk"].retried == len(bad.hits)


async def test_a_503_from_an_instance_is_retried_only_when_idempotent(rig: Rig) -> None:
    busy, good = await rig.backend("busy", mode="503"), await rig.backend("good")
    await rig.put_map("blk", {"i-busy": (busy, "ready"), "i-good": (good, "ready")}, {"policyRuleURI": "builtin:round-robin"})
    plain = [await rig.task("blk") for _ in range(4)]
    assert sorted(s for s, _, _ in plain) == [200, 200, 503, 503]  # the instance's answer, as it was
    assert len(busy.hits) == 2
    marked = [await rig.task("blk", Aios_Idempotent="true") for _ in range(4)]
    assert all(s == 200 for s, _, _ in marked)


async def test_an_unreachable_instance_is_skipped_even_for_a_plain_task(rig: Rig) -> None:
    good = await rig.backend("good")
    dead = Backend("dead", port=free_port())  # nothing listens: the task never reached it
    await rig.put_map("blk", {"i-dead": (dead, "ready"), "i-good": (good, "ready")}, {"policyRuleURI": "builtin:round-robin"})
    answers = [await rig.task("blk") for _ in range(4)]
    assert all(s == 200 and h["Aios-Instance"] == "i-good" for s, _, h in answers)


class RaisingPolicy:
    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        pass

    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        raise RuntimeError("no idea")


class HangingPolicy(RaisingPolicy):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        while True:
            time.sleep(0.001)


class PickLast(RaisingPolicy):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"instance_id": input_data["payload"]["instances"][-1]["id"]}


async def test_a_policy_that_raises_or_hangs_fails_its_tasks_and_the_executor_lives(rig: Rig) -> None:
    a, b = await rig.backend("a"), await rig.backend("b")
    mod = __name__
    await rig.put_map("raises", {"i-a": (a, "ready")}, {"policyRuleURI": f"{mod}:RaisingPolicy"})
    await rig.put_map("hangs", {"i-a": (a, "ready")}, {"policyRuleURI": f"{mod}:HangingPolicy"})
    await rig.put_map("missing", {"i-a": (a, "ready")}, {"policyRuleURI": "registry:nothing-here"})
    await rig.put_map("custom", {"i-a": (a, "ready"), "i-b": (b, "ready")}, {"policyRuleURI": f"{mod}:PickLast"})
    s, _, h = await rig.task("raises")
    assert s == 500 and "raised RuntimeError: no idea" in h["Aios-Error"]
    s, _, h = await rig.task("hangs")
    assert s == 500 and "timed out after 20 ms" in h["Aios-Error"]
    s, _, h = await rig.task("missing")
    assert s == 500 and "cannot be loaded" in h["Aios-Error"]
    assert not a.hits and not b.hits
    # the executor goes on: a custom inline policy is obeyed, every time
    answers = [await rig.task("custom") for _ in range(5)]
    assert all(s == 200 and h["Aios-Instance"] == "i-b" for s, _, h in answers)


async def test_the_mapper_keeps_the_map_from_lifecycle_facts(rig: Rig) -> None:
    a = await rig.backend("a")
    bus = rig.client.bus
    # a block record, as the parser writes it: the mapper takes its input path and policy from it
    ir = {"blockId": "real", "inputProtocol": {"path": "/run"}, "policies": {"loadBalancer": {"policyRuleURI": "builtin:least-queue"}}}
    ok, _ = await rig.client.store.create_block("real", 7, "d", {"status": "ready", "ir": ir})
    assert ok
    await bus.emit(E.instance_added, InstanceEvent("real", 7, "r0", "n1", endpoint=a.endpoint))
    async with asyncio.timeout(10):
        while (rig.executor.routes.get("real") is None or rig.executor.routes["real"].views.get("r0", {}).get("state") != "ready"):
            await asyncio.sleep(0.01)
    route = rig.executor.routes["real"]
    assert route.path == "/run" and route.chooser.name == "builtin:least-queue"
    s, body, _ = await rig.task("real")
    assert s == 200 and msgspec.json.decode(body)["path"] == "/run"
    await bus.emit(E.instance_failed, InstanceEvent("real", 7, "r0", "n1", reason="exit 1"))
    async with asyncio.timeout(10):
        while route.views["r0"]["state"] != "stopping":
            await asyncio.sleep(0.01)
    s, _, h = await rig.task("real")
    assert s == 503 and "no ready instance" in h["Aios-Error"]
    from aios_blocks.schemas.events import BlockStatusReport

    await bus.emit(E.block_deleted, BlockStatusReport(block_id="real", gen=7, status="deleted"))
    async with asyncio.timeout(10):
        while "real" in rig.executor.routes:
            await asyncio.sleep(0.01)
    s, _, _ = await rig.task("real")
    assert s == 404


async def test_an_executor_pinned_to_a_cluster_serves_its_blocks_only_and_no_task_is_answered_twice(rig: Rig) -> None:
    a, b = await rig.backend("a"), await rig.backend("b")
    await rig.put_map("on-c1", {"i-a": (a, "ready")}, cluster="c1")
    await rig.put_map("on-c2", {"i-b": (b, "ready")}, cluster="c2")
    w = await Worker.open(*rig.urls, "executor", settings=Settings(executor_http_port=0, executor_scrape_interval_s=0))
    pinned = Executor(w, cluster="c1")
    stop = asyncio.Event()
    run = asyncio.ensure_future(pinned.run(stop, mapper_on=False))
    try:
        async with asyncio.timeout(10):
            while "on-c1" not in pinned._serving:
                await asyncio.sleep(0.01)
        assert set(pinned.routes) == {"on-c1"}
        answers = await asyncio.gather(*(rig.task(bid) for bid in ["on-c1", "on-c2"] * 60))
        assert all(s == 200 for s, _, _ in answers)
        assert len(a.hits) == 60 and len(b.hits) == 60  # each task reached its instance once
        # both the pinned and the unpinned executor took some of c1's tasks (one queue group)
        assert pinned.routes["on-c1"].dispatched > 0 and rig.executor.routes["on-c1"].dispatched > 0
        assert pinned.routes["on-c1"].dispatched + rig.executor.routes["on-c1"].dispatched == 60
        # the block moves to another cluster: the pinned executor lets it go
        await rig.put_map("on-c1", {"i-a": (a, "ready")}, cluster="c3")
        async with asyncio.timeout(10):
            while "on-c1" in pinned._serving or "on-c1" in pinned.routes:
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
        await w.close()


WEIGHTS = '''
def eval(parameters, input_data, context):
    ids = sorted([i["id"] for i in input_data["payload"]["instances"]])
    return {"weights": {iid: (1.0 if iid == ids[-1] else 0.0) for iid in ids}}
'''

BROKEN = '''
def eval(parameters, input_data, context):
    return {"weights": "all of them"}
'''


async def test_a_starlark_policy_routes_by_the_weights_it_computes_periodically(rig: Rig) -> None:
    a, b = await rig.backend("a"), await rig.backend("b")
    await rig.client.policy_put("lbweights", WEIGHTS, "starlark")
    await rig.client.policy_put("lbbroken", BROKEN, "starlark")
    await rig.put_map("star", {"i-a": (a, "ready"), "i-b": (b, "ready")}, {"policyRuleURI": "registry:lbweights"})
    await rig.put_map("star-broken", {"i-a": (a, "ready"), "i-b": (b, "ready")}, {"policyRuleURI": "registry:lbbroken"})
    chooser = rig.executor.routes["star"].chooser
    assert type(chooser).__name__ == "Weighted"
    async with asyncio.timeout(30):  # the first weights call (sandbox start) comes within an interval or so
        while not getattr(chooser, "weights", None):
            await asyncio.sleep(0.05)
    answers = [await rig.task("star") for _ in range(20)]
    assert all(s == 200 and h["Aios-Instance"] == "i-b" for s, _, h in answers)  # weight 0 for i-a
    # a weights call with the wrong shape keeps the last weights (none: uniform) and names the error
    broken = rig.executor.routes["star-broken"].chooser
    async with asyncio.timeout(30):
        while not getattr(broken, "error", ""):
            await asyncio.sleep(0.05)
    assert "weights must return" in broken.error  # type: ignore[attr-defined]
    served = {h["Aios-Instance"] for s, _, h in [await rig.task("star-broken") for _ in range(30)] if s == 200}
    assert served == {"i-a", "i-b"}


async def test_the_task_time_limit_covers_queue_and_instance_and_is_answered(rig: Rig) -> None:
    slow = await rig.backend("slow", delay_s=1.0)
    await rig.put_map("slow", {"i0": (slow, "ready")}, {"settings": {"maxOngoing": 1}})
    status, _, h = await rig.task("slow", Aios_Timeout_Ms="200")
    assert status == 504 and "timed out" in h["Aios-Error"] and len(slow.hits) == 1
    # queued behind a task holding the only slot: the time limit ends the wait too
    slow.gate = asyncio.Event()  # the held task stays on the instance until the test lets it go
    held = asyncio.ensure_future(rig.task("slow", Aios_Timeout_Ms="30000"))
    async with asyncio.timeout(30):
        while len(slow.hits) < 2:  # the held task has the slot
            await asyncio.sleep(0.02)
    status, _, h = await rig.task("slow", Aios_Timeout_Ms="300")
    assert status in (503, 504) and "the task's time limit" in h["Aios-Error"], h
    # answered by its own limit while the slot was still held, and it never reached the instance
    assert not held.done() and len(slow.hits) == 2
    slow.gate.set()
    assert (await held)[0] == 200
    status, _, h = await rig.task("slow", Aios_Timeout_Ms="soon")
    assert status == 400 and "milliseconds" in h["Aios-Error"]


async def test_a_stopping_executor_answers_every_task_it_took(rig: Rig) -> None:
    slow = await rig.backend("slow", delay_s=0.2)
    await rig.put_map("blk", {"i0": (slow, "ready")})
    w = await Worker.open(*rig.urls, "executor", settings=Settings(executor_http_port=0, executor_scrape_interval_s=0))
    second = Executor(w)
    stop = asyncio.Event()
    run = asyncio.ensure_future(second.run(stop, mapper_on=False))
    try:
        async with asyncio.timeout(10):
            while "blk" not in second.routes:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # subscribed
        pending = [asyncio.ensure_future(rig.task("blk")) for _ in range(40)]
        async with asyncio.timeout(10):  # the second executor has tasks in flight
            while second.routes["blk"].views["i0"]["inflight"] == 0:
                await asyncio.sleep(0.005)
        stop.set()  # it leaves the queue group and finishes what it took
        answers = await asyncio.gather(*pending)
        assert [s for s, _, _ in answers] == [200] * 40
        assert second.routes["blk"].dispatched > 0 and len(slow.hits) == 40
        await asyncio.wait_for(run, 10)
    finally:
        stop.set()
        await w.close()


async def test_a_task_for_a_block_scaled_to_zero_is_held_until_an_instance_is_ready(rig: Rig) -> None:
    """The activator: a block of minInstances 0 gets its map when it becomes ready (no placement),
    its tasks are held while the executor asks once for an instance (block.scale.target, target 1,
    source activator), and answered by the instance the mapper then shows ready."""
    from aios_blocks.schemas.events import BlockStatusReport

    bus = rig.client.bus
    ir = {"blockId": "zed", "minInstances": 0, "maxInstances": 2}
    ok, _ = await rig.client.store.create_block("zed", 3, "d", {"status": "ready", "ir": ir, "cluster": "c-zed"})
    assert ok
    targets: list[dict[str, Any]] = []

    async def on_target(m: Any) -> None:
        targets.append(msgspec.json.decode(m.data)["data"])

    sub = await bus.nc.subscribe(E.block_scale_target.subject(bid="zed"), cb=on_target)
    await bus.emit(E.block_ready, BlockStatusReport("zed", 3, "ready", "", "c-zed", []))
    async with asyncio.timeout(10):
        while rig.executor.routes.get("zed") is None:
            await asyncio.sleep(0.01)
    route = rig.executor.routes["zed"]
    assert route.scale_to_zero and not route.views

    # a task with a time limit shorter than the hold is answered at its limit, with the reason
    s, body, h = await rig.task("zed", Aios_Timeout_Ms="300")
    assert s == 503 and "scaled to zero" in h["Aios-Error"] and msgspec.json.decode(body)["status"] == 503

    held = [asyncio.ensure_future(rig.task("zed", b'{"n": %d}' % n)) for n in range(3)]
    async with asyncio.timeout(10):
        while route.held < 3:
            await asyncio.sleep(0.01)
    assert not any(t.done() for t in held)
    async with asyncio.timeout(10):
        while not targets:
            await asyncio.sleep(0.01)
    t = targets[0]
    assert (t["block_id"], t["target"], t["source"], t["gen"]) == ("zed", 1, "activator", 3)

    # the controller scaled it up: the agent reports the instance, the mapper marks it ready
    a = await rig.backend("a")
    await bus.emit(E.instance_added, InstanceEvent("zed", 3, "zed-0", "n-zed", endpoint=a.endpoint))
    answers = await asyncio.wait_for(asyncio.gather(*held), 15)
    assert [s for s, _, _ in answers] == [200, 200, 200]
    assert sorted(b for _, b in a.hits) == [b'{"n": %d}' % n for n in range(3)]
    assert route.held == 0
    # one request for the whole hold period (the first task's, the 300 ms one), not one per task
    await sub.unsubscribe()
    assert len(targets) == 1, targets
    s, _, _ = await rig.task("zed")
    assert s == 200


async def test_a_task_finds_a_map_the_bucket_holds_before_the_watch_brings_it(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that saw block.ready and sent a task at once got 404 "no instance map" when this
    executor's watch had not yet applied the map the bucket held (the activator test, in CI): the
    executor now reads the bucket itself when a task finds no route."""
    a = await rig.backend("a")
    watched = rig.executor.on_map

    async def trailing(bid: str, value: Any, rev: int) -> None:  # the watch never brings "late"
        if bid != "late":
            await watched(bid, value, rev)

    monkeypatch.setattr(rig.executor, "on_map", trailing)
    value = {"block_id": "late", "gen": 1, "cluster": "c0", "path": "/infer", "method": "POST", "loadBalancer": {},
             "instances": {"i-a": {"node": "n1", "endpoint": a.endpoint, "state": "ready"}}, "gone": []}
    assert await rig.maps.update("late", lambda _cur: value) is not None
    unknown = rig.executor.unknown_tasks
    answers = await asyncio.gather(*(rig.task("late", b'{"n": %d}' % n) for n in range(3)))
    assert [s for s, _, _ in answers] == [200, 200, 200], answers
    assert {h["Aios-Instance"] for _, _, h in answers} == {"i-a"} and len(a.hits) == 3
    assert rig.executor.unknown_tasks == unknown
    status, _, h = await rig.task("never-placed")  # no map in the bucket either: still 404
    assert status == 404 and "unknown block 'never-placed'" in h["Aios-Error"]
    assert rig.executor.unknown_tasks == unknown + 1


async def test_a_task_for_an_instance_whose_port_now_serves_another_block_s_is_not_run_there(rig: Rig) -> None:
    """The map (behind) still names i-old at an endpoint where an SDK instance of another block,
    i-new, now listens on the same port. The executor names the instance it means
    (Aios-Instance); i-new answers 421 without running the task, and the executor tries the
    block's other instance (a plain task too: nothing ran), or says why when it has none."""
    from prometheus_client import CollectorRegistry, generate_latest

    from aios_blocks.executor.stats import ExecutorCollector
    from aios_blocks.instance import Context, InstanceApp, Task, web_app
    from aios_blocks.instance.metrics import parse_text

    ran: list[bytes] = []

    async def other_block(task: Task, ctx: Context) -> Any:
        ran.append(task.body)
        return {"instance": ctx.instance_id, "block": ctx.block_id}

    app = InstanceApp(other_block, context=Context(instance_id="i-new", block_id="other"))
    await app.start()
    runner = web.AppRunner(web_app(app), access_log=None)
    await runner.setup()
    reused = Backend("reused-port", port=free_port())  # only its endpoint: the SDK instance listens there
    await web.TCPSite(runner, "127.0.0.1", reused.port).start()
    try:
        good = await rig.backend("good")
        await rig.put_map("blk", {"i-old": (reused, "ready"), "i-good": (good, "ready")}, {"policyRuleURI": "builtin:round-robin"})
        answers = [await rig.task("blk", b'{"n": %d}' % n) for n in range(6)]  # not marked idempotent
        assert [(s, h["Aios-Instance"]) for s, _, h in answers] == [(200, "i-good")] * 6
        assert ran == [] and app.metrics.system.requests == 0  # the other block's handler never ran
        assert len(good.hits) == 6
        route = rig.executor.routes["blk"]
        assert route.stats.misdirected >= 1 and route.views["i-old"]["state"] == "ejected"
        reg = CollectorRegistry()
        reg.register(ExecutorCollector(lambda: rig.executor.routes, lambda: 0))
        page = parse_text(generate_latest(reg).decode())
        assert page['aios_executor_misdirected_total{block="blk"}'] == route.stats.misdirected

        # the block's only instance in the map is the one that left: a clear error, nothing run
        await rig.put_map("lone", {"i-old": (reused, "ready")})
        status, _, h = await rig.task("lone", b'{"n": 9}')
        assert status in (502, 503) and "421 Misdirected Request" in h["Aios-Error"] and "not run" in h["Aios-Error"], h
        assert ran == []

        # the executor's scrape of i-old's queue figures (builtin:least-queue reads them) is named
        # too: the other block's instance answers 421, so i-old gets none of its figures
        lone = rig.executor.routes["lone"]
        await rig.executor._scrape(lone, lone.views["i-old"], aiohttp.ClientTimeout(total=5))
        assert "i-old" not in lone._scraped
    finally:
        await runner.cleanup()
