"""Seed 000: the metrics system "actively writes" to the global metrics DBs. `blocks up` with
``AIOS_METRICS_REMOTE_WRITE_URL`` pointing at a real Prometheus (Debian's `prometheus`, started
with ``--web.enable-remote-write-receiver`` and no scrape job at all) serving a block of simulated
instances under load: while the receiver is down the collector keeps its samples; once it is up,
those and the new ones arrive, and Prometheus's HTTP API answers for the pushed series."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aios_blocks.cli.client import Client
from aios_blocks.metrics.remote_write import RemoteWrite
from aios_blocks.runtime.embedded import resolve_urls

from .conftest import COMPONENT
from .test_executor_system import _answered
from .test_lifecycle import Up, _env
from .test_metrics import PROMETHEUS, free_port, promql, until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)"),
]


@contextlib.contextmanager
def receiver(port: int, tmp: Path) -> Iterator[str]:
    """A Prometheus that only receives (remote write), scrapes nothing."""
    assert PROMETHEUS is not None
    config = tmp / "receiver.yml"
    config.write_text("global: {scrape_interval: 1m}\n")
    log = (tmp / "receiver.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                             f"--storage.tsdb.path={tmp / 'rw-tsdb'}", "--web.enable-remote-write-receiver"],
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


async def _health(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/health") as r:
        return dict(await r.json())


async def test_the_collector_pushes_its_samples_to_a_real_prometheus_remote_write_receiver(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/api/v1/write"
    env = {**_env(), "AIOS_METRICS_REMOTE_WRITE_URL": url, "AIOS_METRICS_REMOTE_WRITE_INTERVAL_S": "1"}
    data = tmp_path / "data"
    up = await asyncio.to_thread(Up, data, env)
    try:
        comp = tmp_path / "component.json"
        comp.write_text(json.dumps(COMPONENT))
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": "svc", "minInstances": 2,
                                    "maxInstances": 2, "parameters": {"sim": {"serviceTimeMs": 5}}}))
        for args in (("component", "add", str(comp)), ("cluster", "add", "c0", "--nodes", "2", "--gpus", "2"),
                     ("submit", str(spec), "--wait")):
            r = await asyncio.to_thread(up.cli, *args)
            assert r.returncode == 0, r.stdout + r.stderr
        urls = resolve_urls(data)
        assert urls is not None
        client = await Client.open(*urls)
        collector = json.loads((data / "endpoints.json").read_text())["metrics"]
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                await client.task("svc", b'{"x": 1}', timeout=10)
                await asyncio.sleep(0.01)

        loaders: list[asyncio.Future[None]] = []
        try:
            await _answered(client, "svc", 2)
            loaders = [asyncio.ensure_future(load()) for _ in range(2)]
            want = set(await client.store.instances("svc"))
            async with aiohttp.ClientSession() as http:
                # the receiver is down: the collector keeps what it takes (several ticks' worth), and says why
                async def kept() -> dict[str, Any] | None:
                    rw = (await _health(http, collector)).get("remote_write", {}).get(url, {})
                    return rw if rw.get("pending", 0) >= 100 and rw.get("last_error") else None

                down = await until(kept, 30)
                assert down["sent"] == 0
                before = time.time()
                with receiver(port, tmp_path) as base:
                    ready = await until(lambda: promql(http, base, 'aios_block_ready{block="svc"}'))
                    assert [(p["metric"]["cluster"], p["value"][1]) for p in ready] == [("c0", "2")]

                    async def every_instance() -> list[dict[str, Any]]:
                        got = await promql(http, base, 'aios_block_instance_up{block="svc"} == 1')
                        return got if {p["metric"]["instance"] for p in got} == want else []

                    per = await until(every_instance)
                    assert {p["metric"]["node"] for p in per} <= {"c0-n0", "c0-n1"} and {p["metric"]["cluster"] for p in per} == {"c0"}
                    rate = await until(lambda: promql(http, base, 'aios_block_rate{block="svc"} > 0'))
                    assert float(rate[0]["value"][1]) > 0
                    # what was taken while the receiver was down arrived too, at the time it was taken
                    history = await promql(http, base, 'aios_block_ready{block="svc"}[10m]')
                    taken_down = [float(t) for t, _ in history[0]["values"] if float(t) < before] if history else []
                    assert len(taken_down) >= 3, json.dumps([history, before, down])

                    async def caught_up() -> dict[str, Any] | None:
                        rw = (await _health(http, collector))["remote_write"][url]
                        return rw if rw["sent"] > 0 and rw["last_error"] == "" and rw["dropped"] == 0 else None

                    await until(caught_up, 30)
                    # a sample the receiver refuses as bad (far older than what it holds: HTTP 400) is
                    # dropped, not retried for ever; a good one after it still goes through
                    rw = RemoteWrite([url])
                    old = (("__name__", "aios_block_ready"), ("block", "svc"), ("cluster", "c0"))
                    rw.add([(old, 1.0, int((before - 7200) * 1000))])
                    await rw.flush(http)
                    st = rw.status()[url]
                    assert (st["sent"], st["dropped"], st["pending"]) == (0, 1, 0) and "HTTP 400" in st["last_error"], st
                    fresh = (("__name__", "aios_test_pushed"), ("block", "svc"))
                    rw.add([(fresh, 7.0, int(time.time() * 1000))])
                    await rw.flush(http)
                    assert rw.status()[url]["sent"] == 1
                    got = await until(lambda: promql(http, base, 'aios_test_pushed{block="svc"}'))
                    assert got[0]["value"][1] == "7"
        finally:
            stop.set()
            await asyncio.gather(*loaders, return_exceptions=True)
            await client.close()
    finally:
        assert await asyncio.to_thread(up.stop) == 0, up.output()
