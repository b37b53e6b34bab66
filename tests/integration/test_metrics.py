"""The metrics system on a running system: `blocks up` (embedded NATS and Redis, every worker,
the collector) serving a block of simulated instances that take tasks through the executor; a
real Prometheus server (Debian's `prometheus`) started with `blocks prometheus-config` scrapes it
and answers PromQL; `blocks top` shows the collector's windows; the resourceAllocator's `scale`
call gets them as `block_metrics`; the executor puts them in the loadBalancer's input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from aios_blocks.cli.client import Client
from aios_blocks.metrics.scrape import read_instance
from aios_blocks.metrics.window import BlockInput, Windows
from aios_blocks.runtime.embedded import EmbeddedServers, resolve_urls
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker
from aios_blocks.workers.executor import Executor

from .conftest import COMPONENT
from .test_executor_system import _answered
from .test_lifecycle import Up, _env

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus(config: Path, data: Path) -> Iterator[str]:
    assert PROMETHEUS is not None
    port = free_port()
    log = (data.parent / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                             f"--storage.tsdb.path={data}", "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def promql(http: aiohttp.ClientSession, base: str, query: str) -> list[dict[str, Any]]:
    try:
        async with http.get(f"{base}/api/v1/query", params={"query": query}) as r:
            if r.status != 200:
                return []
            doc = await r.json()
    except aiohttp.ClientError:  # not listening yet
        return []
    return list(doc["data"]["result"]) if doc.get("status") == "success" else []


async def until(fn: Any, timeout: float = 90, every: float = 0.5) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            got = await fn()
            if got:
                return got
            await asyncio.sleep(every)


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)")
async def test_a_real_prometheus_scrapes_a_running_system_and_top_and_scale_see_the_windows(tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = await asyncio.to_thread(Up, data, _env())
    try:
        comp = tmp_path / "component.json"
        comp.write_text(json.dumps(COMPONENT))
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": "svc", "minInstances": 2,
                                    "maxInstances": 3, "parameters": {"sim": {"serviceTimeMs": 5}}}))
        for args in (("component", "add", str(comp)), ("cluster", "add", "c0", "--nodes", "2", "--gpus", "2"),
                     ("submit", str(spec), "--wait")):
            r = await asyncio.to_thread(up.cli, *args)
            assert r.returncode == 0, r.stdout + r.stderr
        urls = resolve_urls(data)
        assert urls is not None
        client = await Client.open(*urls)
        stop = asyncio.Event()
        sent: list[int] = []

        async def load() -> None:
            while not stop.is_set():
                sent.append((await client.task("svc", b'{"x": 1}', timeout=10))[0])
                await asyncio.sleep(0.01)

        loaders: list[asyncio.Future[None]] = []
        try:
            await _answered(client, "svc", 2)
            loaders = [asyncio.ensure_future(load()) for _ in range(4)]

            r = await asyncio.to_thread(up.cli, "prometheus-config", "--scrape-interval", "1s", "--refresh-interval", "1s")
            assert r.returncode == 0, r.stderr
            assert "http_sd_configs" in r.stdout and json.loads((data / "endpoints.json").read_text())["metrics"] in r.stdout
            config = tmp_path / "prometheus.yml"
            config.write_text(r.stdout)
            r = await asyncio.to_thread(up.cli, "prometheus-config", "--static")
            assert r.returncode == 0, r.stderr
            jobs = {j["job_name"]: j for j in yaml.safe_load(r.stdout)["scrape_configs"]}
            static = jobs["aios-instances"]["static_configs"]
            assert {g["labels"]["instance"] for g in static} == set(await client.store.instances("svc"))
            assert all(g["labels"]["block"] == "svc" and g["labels"]["cluster"] == "c0" for g in static)
            workers = jobs["aios-workers"]["static_configs"]
            # a group process (parser+gateway+metrics+...) is one target labelled with its kinds:
            # each process scraped once, so no series counted twice
            assert {k for g in workers for k in g["labels"]["kind"].split("+")} >= {"executor", "metrics"}
            assert len({a for g in workers for a in g["targets"]}) == len(workers)
            r = await asyncio.to_thread(subprocess.run, [str(Path(PROMETHEUS).with_name("promtool")), "check", "config", str(config)],
                                        capture_output=True, text=True) if Path(PROMETHEUS).with_name("promtool").exists() else None
            assert r is None or r.returncode == 0, (r.stdout, r.stderr)

            with prometheus(config, tmp_path / "tsdb") as base:
                async with aiohttp.ClientSession() as http:
                    # the block's task rate, as the executors count it (job aios-workers)
                    rate = await until(lambda: promql(http, base, 'sum(rate(aios_executor_tasks_total{block="svc"}[30s])) > 0'))
                    assert float(rate[0]["value"][1]) > 0
                    # each instance's own counter, labelled with its block, instance id and cluster (job aios-instances)
                    # each instance's series appears after its own second scrape: wait for both
                    # (until() times out, failing the test, if one never shows)
                    want = set(await client.store.instances("svc"))

                    async def every_instance() -> list[dict[str, Any]]:
                        got = await promql(http, base, 'sum by (instance, cluster) (rate(aios_instance_requests_total{block="svc"}[30s])) > 0')
                        return got if {p["metric"]["instance"] for p in got} == want else []

                    per = await until(every_instance)
                    assert {p["metric"]["instance"] for p in per} == want and len(want) == 2
                    assert {p["metric"]["cluster"] for p in per} == {"c0"}
                    kinds = await until(lambda: promql(http, base, 'up{job="aios-workers"} == 1'))
                    assert {n for k in kinds for n in k["metric"]["kind"].split("+")} >= {"parser", "gateway", "controller", "executor", "metrics"}

            # `blocks top`: the collector's latest samples
            async def served() -> dict[str, Any] | None:
                r = await asyncio.to_thread(up.cli, "top", "svc", "--json")
                doc = json.loads(r.stdout) if r.returncode == 0 else {}
                insts = doc.get("instances", {})
                # every instance up, serving, with a latency figure: on 2 busy cores one scrape may
                # time out (up false) or one window may hold no finished request (p50 None); the
                # next samples have them, and until() fails the test if they never come
                full = len(insts) == 2 and all(
                    (s.get("rate") or 0) > 0 and s.get("up") and s.get("latency_p50_ms") is not None for s in insts.values()
                )
                return doc if full else None

            doc = await until(served, 30)
            assert doc["block"]["rate"] > 0 and doc["block"]["ready"] == 2 and doc["block"]["cluster"] == "c0"
            assert all(s["up"] and s["latency_p50_ms"] is not None for s in doc["instances"].values())
            r = await asyncio.to_thread(up.cli, "top", "--once")
            assert r.returncode == 0 and "svc" in r.stdout, r.stderr
            r = await asyncio.to_thread(up.cli, "top", "nope", "--json")
            assert r.returncode == 1 and "no metrics for block nope" in r.stderr

            # the resourceAllocator's scale call gets the collector's figures as block_metrics
            r = await asyncio.to_thread(up.cli, "scale", "svc")
            assert r.returncode == 0, r.stdout + r.stderr
            calls = [d for d in await client.decisions(bid="svc") if d.get("action") == "scale"]
            assert calls, "no scale decision recorded"
            bm = calls[-1]["input"]["payload"]["block_metrics"]
            assert bm["rate"] > 0 and len(bm["per_instance"]) == 2 and bm["history"], bm
        finally:
            stop.set()
            await asyncio.gather(*loaders, return_exceptions=True)
            await client.close()
        assert sent and all(s == 200 for s in sent), {s: sent.count(s) for s in set(sent)}
    finally:
        assert await asyncio.to_thread(up.stop) == 0, up.output()


async def test_the_executor_puts_the_collectors_figures_in_the_load_balancers_input(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    w = await Worker.open(servers.nats_url, servers.redis_url, "executor",
                          settings=Settings(metrics_interval_s=0.1, executor_scrape_interval_s=0, metrics_port=-1))
    ex = Executor(w)
    stop = asyncio.Event()
    run = asyncio.ensure_future(ex.run(stop, mapper_on=False))
    try:
        await ex.maps.update("b", lambda _: {"block_id": "b", "gen": 1, "path": "/infer", "method": "POST", "loadBalancer": {},
                                             "instances": {"b-0": {"node": "n0", "endpoint": "http://127.0.0.1:9", "state": "ready"}},
                                             "gone": []})
        win = Windows(10)
        page = "aios_instance_requests_total 0\naios_instance_requests_waiting 4\n"
        for t, n in ((0.0, 0), (1.0, 25)):
            rd = read_instance(page.replace("total 0", f"total {n}"))
            await w.store.metrics.write(win.tick(t, {"b": BlockInput("c0", {"b-0": {"state": "ready", "node": "n0"}}, {"b-0": rd})}), 60, 60)

        async def seen() -> dict[str, Any] | None:
            route = ex.routes.get("b")
            m = route.views["b-0"]["metrics"] if route and "b-0" in route.views else {}
            return m if m.get("rate") == 25.0 else None

        m = await until(seen, 20, 0.05)
        # the candidate dict the policy gets: its own in-flight count plus the collector's figures
        assert m["waiting"] == 4 and m["up"] is True and m["state"] == "ready"
        cands = ex.routes["b"].candidates()
        assert [c["metrics"]["rate"] for c in cands] == [25.0]
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
        await w.close()
        servers.stop()
