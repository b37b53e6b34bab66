"""The health checker on real NATS JetStream and Redis: an executor (with its mapper) and a
checker run in this process in front of real HTTP instances (in-process servers, or processes
that can be SIGKILLed). Every assertion is about behaviour: where tasks go, which verdicts are
published, what the instance map says."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker
from aios_blocks.workers.checker import Checker
from aios_blocks.workers.executor import Executor

pytestmark = pytest.mark.integration
APP = Path(__file__).with_name("health_app.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Inst:
    """An in-process instance: tasks take ``delay_s`` (or never end: ``hang``), its /health
    takes ``health_delay_s``."""

    name: str
    delay_s: float = 0.0
    hang: bool = False
    health_delay_s: float = 0.0
    done: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def infer(self, request: web.Request) -> web.Response:
        await request.read()
        if self.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        self.done += 1
        return web.json_response({"instance": self.name})

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.json_response({"status": "ready"})

    async def start(self) -> Inst:
        app = web.Application()
        app.router.add_post("/infer", self.infer)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self


@dataclass
class Proc:
    """An instance in its own process (health_app.py)."""

    name: str
    delay_s: float = 0.01
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        self.proc = subprocess.Popen([sys.executable, str(APP), str(self.port), self.name, str(self.delay_s)])
        return self

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class Rig:
    client: Client
    executor: Executor
    checker: Checker
    maps: InstanceMaps
    verdicts: list[dict[str, Any]]
    servers: list[Any] = field(default_factory=list)

    async def put_map(self, bid: str, insts: dict[str, str], checker: dict[str, Any] | None = None) -> None:
        value: dict[str, Any] = {
            "block_id": bid, "gen": 1, "cluster": "hc0", "path": "/infer", "method": "POST", "loadBalancer": {},
            "instances": {iid: {"node": "hn1", "endpoint": ep, "state": "ready", "since": time.time()} for iid, ep in insts.items()},
            "gone": []}
        if checker:
            value["stabilityChecker"] = checker
        rev = await self.maps.update(bid, lambda _cur: value)
        assert rev is not None
        async with asyncio.timeout(10):
            while self.executor.seen.get(bid, (0, 0))[0] < rev:
                await asyncio.sleep(0.005)

    async def task(self, bid: str, **headers: str) -> tuple[int, str]:
        status, _, h = await self.client.task(bid, b"{}", {k.replace("_", "-"): v for k, v in headers.items()}, timeout=30)
        return status, h.get("Aios-Instance", "")

    async def inst(self, bid: str, iid: str) -> dict[str, Any]:
        m, _ = await self.maps.get(bid)
        assert m is not None
        return dict(m["instances"][iid])

    def of(self, iid: str, verdict: str | None = None) -> list[dict[str, Any]]:
        return [v for v in self.verdicts if v["instance_id"] == iid and (verdict is None or v["verdict"] == verdict)]

    async def until(self, cond: Any, timeout: float = 20.0) -> None:
        async with asyncio.timeout(timeout):
            while not await cond() if asyncio.iscoroutinefunction(cond) else not cond():
                await asyncio.sleep(0.05)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    settings = Settings(executor_queue_timeout_s=5, executor_scrape_interval_s=0, health_interval_s=0.2,
                        health_probe_timeout_s=0.3, health_startup_grace_s=0, outlier_publish_s=0.1, policy_timeout_s=0.5,
                        health_failure_record_s=60)
    wx = await Worker.open(servers.nats_url, servers.redis_url, "executor", settings=settings)
    wc = await Worker.open(servers.nats_url, servers.redis_url, "checker", settings=settings)
    ex, ch = Executor(wx), Checker(wc)
    stop = asyncio.Event()
    runs = [asyncio.ensure_future(ex.run(stop, mapper_on=True)), asyncio.ensure_future(ch.run(stop))]
    client = await Client.open(servers.nats_url, servers.redis_url)
    verdicts: list[dict[str, Any]] = []

    async def on_verdict(msg: Any) -> None:
        verdicts.append(msgspec.json.decode(msg.data)["data"])

    sub = await client.bus.nc.subscribe("aios.block.*.instance.*.verdict", cb=on_verdict)
    r = Rig(client, ex, ch, InstanceMaps(client.bus), verdicts)
    try:
        async with asyncio.timeout(20):
            while not ex.map_ready.is_set():
                await asyncio.sleep(0.05)
        yield r
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        for run in runs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 10)
        for s in r.servers:
            if isinstance(s, Inst) and s.runner is not None:
                await s.runner.cleanup()
            elif isinstance(s, Proc) and s.proc is not None and s.proc.poll() is None:
                s.kill()
        await client.close()
        await wx.close()
        await wc.close()
        servers.stop()


async def _up(*endpoints: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, asyncio.timeout(20):
        for ep in endpoints:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(ep + "/health") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.05)


async def test_a_killed_instance_is_out_of_routing_after_its_first_failed_dispatch(rig: Rig) -> None:
    procs = [Proc(f"p{k}").start() for k in range(4)]
    rig.servers += procs
    await _up(*(p.endpoint for p in procs))
    await rig.put_map("hk", {f"i{k}": p.endpoint for k, p in enumerate(procs)})
    results: list[tuple[int, int, str]] = []  # (loader, status, instance), in the order answered
    stop = asyncio.Event()
    # this executor's attempts at i2: (when it began, when its outcome was recorded, answered)
    at_i2: list[tuple[float, float, bool]] = []
    attempt = rig.executor.dispatcher._attempt

    async def watched(route: Any, v: dict[str, Any], *args: Any) -> tuple[bool, Any, str]:
        if v["id"] != "i2":
            return await attempt(route, v, *args)
        began, answered = time.monotonic(), False
        try:
            out = await attempt(route, v, *args)
            answered = out[0]
            return out
        finally:  # after the dispatcher recorded the outcome (and ejected on a failure)
            at_i2.append((began, time.monotonic(), answered))

    rig.executor.dispatcher._attempt = watched

    async def load(k: int) -> None:
        while not stop.is_set():
            status, iid = await rig.task("hk")  # plain tasks: never retried once they reached an instance
            results.append((k, status, iid))

    loaders = [asyncio.ensure_future(load(k)) for k in range(8)]
    await rig.until(lambda: {iid for _, s, iid in results if s == 200} == {"i0", "i1", "i2", "i3"}, 30)
    procs[2].kill()
    await rig.until(lambda: rig.of("i2", "unready"), 15)
    marked = len(results)
    await rig.until(lambda: len(results) >= marked + 40, 30)  # 40 more tasks answered once it is out
    stop.set()
    await asyncio.gather(*loaders)
    failed = [k for k, s, _ in results if s != 200]
    # the tasks it had when it died may fail; after the first failure, ejection: no later failure,
    # so a loader (one task at a time) fails at most once: with the task it had in flight there
    assert len(failed) == len(set(failed)) <= 8, failed
    after = results[marked:]
    assert after and all(s == 200 and iid != "i2" for _, s, iid in after), after
    # this executor's dispatches to i2 that failed: those that began before its first failure was
    # recorded (in flight when it died, or picking it just after: concurrent tasks may), then only
    # one per later ejection (when an ejection ends before the health checker's verdict, one refused
    # dispatch, retried elsewhere, ejects it again); with no ejection every dispatch until then failed
    counts = rig.executor.routes["hk"].outliers.get("i2")
    failures = [(b, e) for b, e, answered in at_i2 if not answered]
    assert failures and counts.errors == len(failures), (counts, failures)
    first = min(e for _, e in failures)
    began_after = [b for b, _ in failures if b > first]
    assert counts.ejections >= 1 and len(began_after) <= counts.ejections - 1, (counts, [round(b - first, 3) for b in began_after])
    assert len(failures) - len(began_after) <= 8  # one task in flight per loader at most
    # and each of those began once an ejection had ended: at least its time after the failure before
    base_s = rig.executor.routes["hk"].outliers.base_s
    for b in began_after:
        assert b - max(e for _, e in failures if e < b) >= base_s - 0.01, [(round(b - first, 3), round(e - first, 3)) for b, e in failures]
    inst = await rig.inst("hk", "i2")
    assert inst["health"] == "unready" and inst["state"] == "ready"
    assert not [v for v in rig.verdicts if v["instance_id"] != "i2"]  # no false verdict on the others
    # its probes keep failing: the policy asks for a restart (the controller's to carry out)
    await rig.until(lambda: rig.of("i2", "restart"), 15)


async def test_a_hung_instance_is_found_by_progress_and_restarted(rig: Rig) -> None:
    insts = [await Inst("a", 0.01).start(), await Inst("b", 0.01).start(), await Inst("h", hang=True).start()]
    rig.servers += insts
    await rig.put_map("hh", {s.name: s.endpoint for s in insts}, {"policyRuleURI": "builtin:probe-threshold", "settings": {"stallS": 1}})
    tasks = [asyncio.ensure_future(rig.task("hh", Aios_Timeout_Ms="20000")) for _ in range(12)]
    await rig.until(lambda: rig.of("h", "restart"), 15)
    v = rig.of("h", "restart")[0]
    assert "no task completed" in v["reason"] and v["policy"] == "builtin:probe-threshold"
    assert not rig.of("a") and not rig.of("b")

    async def out() -> bool:
        return (await rig.inst("hh", "h")).get("health") == "unready"

    await rig.until(out, 10)  # the mapper applied it
    # no new task goes to it while it is out; the others answer
    answers = [await rig.task("hh") for _ in range(10)]
    assert all(s == 200 and iid in ("a", "b") for s, iid in answers)
    for t in tasks:
        t.cancel()


async def test_a_slow_instance_is_degraded_not_removed(rig: Rig) -> None:
    insts = [await Inst("a", 0.01).start(), await Inst("b", 0.01).start(), await Inst("s", 0.1).start()]
    rig.servers += insts
    await rig.put_map("hs", {s.name: s.endpoint for s in insts})
    stop = asyncio.Event()
    answered: list[tuple[int, str]] = []

    async def load() -> None:
        while not stop.is_set():
            answered.append(await rig.task("hs"))

    loaders = [asyncio.ensure_future(load()) for _ in range(6)]
    await rig.until(lambda: rig.of("s", "degrade"), 20)

    async def degraded() -> bool:
        return (await rig.inst("hs", "s")).get("health") == "degraded"

    await rig.until(degraded, 10)  # the mapper applied it
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*loaders)
    inst = await rig.inst("hs", "s")
    assert inst["health"] == "degraded" and 0 < inst["weight"] < 0.5 and inst["state"] == "ready"
    # only degraded (its weight may be adjusted), never unready, restarted or replaced; nobody else judged
    assert rig.verdicts and {(v["instance_id"], v["verdict"]) for v in rig.verdicts} == {("s", "degrade")}
    assert all(s == 200 for s, _ in answered)
    assert rig.executor.routes["hs"].views["s"]["weight"] == inst["weight"]  # the balancer's input has it


async def test_probes_failing_on_a_busy_instance_that_completes_tasks_bring_no_verdict(rig: Rig) -> None:
    # its /health answers after the probe's time limit (a probe queued behind work): only progress speaks
    busy = await Inst("busy", 0.02, health_delay_s=1.0).start()
    other = await Inst("other", 0.02).start()
    rig.servers += [busy, other]
    await rig.put_map("hb", {"busy": busy.endpoint, "other": other.endpoint})
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            await rig.task("hb")

    loaders = [asyncio.ensure_future(load()) for _ in range(8)]
    await rig.until(lambda: rig.checker.probes.get("busy") is not None and rig.checker.probes["busy"].consecutive_failures >= 6, 20)
    done = busy.done
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*loaders)
    assert busy.done > done  # it kept completing tasks
    assert rig.verdicts == []
    assert (await rig.inst("hb", "busy")).get("health", "ok") == "ok"


class GarbagePolicy:
    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        pass

    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"verdicts": {i["instance_id"]: {"verdict": "explode"} for i in input_data["payload"]["instances"]}}


class RaisingPolicy(GarbagePolicy):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        raise RuntimeError("no idea")


class HangingPolicy(GarbagePolicy):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        time.sleep(3)
        return {"verdicts": {i["instance_id"]: {"verdict": "replace"} for i in input_data["payload"]["instances"]}}


class StrangerPolicy(GarbagePolicy):
    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"verdicts": {"someone-else": {"verdict": "replace", "reason": "x"}}}


@pytest.mark.parametrize("policy,reason", [("GarbagePolicy", "wrong return shape"), ("RaisingPolicy", "raised RuntimeError: no idea"),
                                           ("HangingPolicy", "timed out"), ("StrangerPolicy", "not given: someone-else")])
async def test_a_failing_policy_changes_nothing_and_its_tick_failure_is_recorded(rig: Rig, policy: str, reason: str) -> None:
    a = await Inst("a").start()
    rig.servers.append(a)
    bid = f"hf-{policy.lower()}"
    await rig.put_map(bid, {"a": a.endpoint}, {"policyRuleURI": f"{__name__}:{policy}"})
    await rig.until(lambda: reason in rig.checker.last.get(bid, ""), 20)
    await asyncio.sleep(1.0)  # several failed ticks
    history = await rig.client.history(bid)
    failed = [env["data"] for subj, env, _ in history if subj.endswith(".health.failed")]
    assert len(failed) == 1 and reason in failed[0]["reason"] and failed[0]["step"] == "health_check"  # rate-limited
    assert rig.verdicts == []
    inst = await rig.inst(bid, "a")
    assert "health" not in inst and inst["state"] == "ready"
    assert (await rig.task(bid))[0] == 200


# -- the whole system: checker, mapper, controller and the simulated fleet's agents -------------------------
@pytest.fixture
def fast_health(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AIOS_HEALTH_INTERVAL_S": "0.25", "AIOS_OUTLIER_PUBLISH_S": "0.1", "AIOS_HEALTH_STARTUP_GRACE_S": "0"}.items():
        monkeypatch.setenv(k, v)


async def test_a_hung_instance_is_restarted_in_place_then_replaced(fast_health: None, system: Any) -> None:
    from .conftest import COMPONENT

    client: Client = system.client
    await client.add_sim_cluster("hcs0", nodes=2, gpus=2)
    spec = {"blockComponentURI": COMPONENT["componentURI"], "blockId": "hsys", "minInstances": 3, "maxInstances": 4,
            "parameters": {"sim": {"serviceTimeMs": 5, "instances": {"0": {"serviceTimeMs": 600000}}}},
            "policyRulesSpec": [{"values": {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold",
                                            "settings": {"stallS": 1, "maxRestarts": 1}}}]}
    bid, kind, _ = await system.submit_and_wait(spec)
    assert kind == "ready"
    hung = f"{bid}-0"
    maps = InstanceMaps(client.bus)
    async with asyncio.timeout(30):
        while True:
            m, _ = await maps.get(bid)
            if m and sum(1 for i in m["instances"].values() if i["state"] == "ready") == 3:
                break
            await asyncio.sleep(0.05)
    assert m["stabilityChecker"]["settings"]["stallS"] == 1
    stop = asyncio.Event()
    statuses: list[int] = []

    async def load() -> None:
        while not stop.is_set():
            try:
                statuses.append((await client.task(bid, b"{}", {"Aios-Timeout-Ms": "3000"}, timeout=10))[0])
            except TimeoutError:  # a slow round trip on a loaded machine: the load goes on
                statuses.append(0)

    loaders = [asyncio.ensure_future(load()) for _ in range(4)]

    def verdicts(history: list[tuple[str, dict[str, Any], int]]) -> list[tuple[str, str]]:
        return [(env["data"]["instance_id"], env["data"]["verdict"]) for subj, env, _ in history if subj.endswith(".verdict")]

    try:
        async with asyncio.timeout(90):
            while hung in await client.store.instances(bid):
                await asyncio.sleep(0.25)
            while len(await client.store.instances(bid)) < 3:
                await asyncio.sleep(0.25)
    except TimeoutError:
        raise AssertionError(f"not replaced: verdicts {verdicts(await client.history(bid))}, "
                             f"passive {await client.store.health.passive(bid, 60)}, map {(await maps.get(bid))[0]}") from None
    finally:
        stop.set()
        await asyncio.gather(*loaders)
    history = await client.history(bid)
    got = verdicts(history)
    acts = [v for v in got if v[1] in ("restart", "replace")]
    assert acts[:2] == [(hung, "restart"), (hung, "replace")], got
    assert all(iid == hung for iid, v in got if v != "healthy"), got  # nobody else judged
    added = [env["data"] for subj, env, _ in history if subj.endswith(f"{hung}.added")]
    assert len(added) >= 2  # started, then restarted in place (same id) by its agent
    assert (await client.task(bid, b"{}", timeout=10))[0] == 200
    assert 200 in statuses


async def test_the_probe_path_is_the_rules_and_probes_can_be_turned_off(rig: Rig) -> None:
    a, b = await Inst("a").start(), await Inst("b").start()
    rig.servers += [a, b]
    # a path the instance does not serve: its probes fail (404) -> unready
    await rig.put_map("hp", {"a": a.endpoint}, {"policyRuleURI": "builtin:probe-threshold", "settings": {"probePath": "/nope"}})
    # the same path with probes off: passive and progress only -> no verdict
    await rig.put_map("hp-off", {"b": b.endpoint},
                      {"policyRuleURI": "builtin:probe-threshold", "settings": {"probePath": "/nope", "probe": False}})
    await rig.until(lambda: rig.of("a", "unready"), 20)
    assert "HTTP 404" in rig.of("a", "unready")[0]["reason"]
    await rig.until(lambda: len(rig.checker.last) >= 2, 20)  # both blocks decided at least once
    await asyncio.sleep(1.5)  # several more ticks
    assert not rig.of("b") and "b" not in rig.checker.probes


async def test_a_probe_of_a_port_another_instance_now_serves_is_no_reading(rig: Rig) -> None:
    """The map (behind) names i-old at an address where an SDK instance of another block, i-new,
    now listens. The checker's probe names the instance it means (Aios-Instance); i-new answers
    421, and the probe counts neither for nor against i-old (it read i-new's health as i-old's)."""
    from aios_blocks.instance import Context, InstanceApp, web_app

    app = InstanceApp(lambda task, ctx: {}, context=Context(instance_id="i-new", block_id="other"))
    await app.start()
    runner = web.AppRunner(web_app(app), access_log=None)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        ep = f"http://127.0.0.1:{port}"
        await rig.put_map("left", {"i-old": ep})
        await rig.put_map("other", {"i-new": ep})
        # two ticks that probed i-new: the same ticks probed i-old's address
        await rig.until(lambda: rig.checker.probes.get("i-new") is not None and rig.checker.probes["i-new"].probes >= 2)
        assert "i-old" not in rig.checker.probes, rig.checker.probes["i-old"]
        assert rig.checker.probes["i-new"].consecutive_failures == 0
        assert not rig.of("i-old") and not rig.of("i-new")
    finally:
        await runner.cleanup()
