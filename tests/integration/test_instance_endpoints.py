"""Every placed instance has an endpoint (carried by ``instance.added``, recorded with the
instance, shown by ``blocks get --json``) where a real HTTP server answers: here the simulated
fleet of ``blocks up``'s workers, whose instances serve the task path, /health and /metrics.
The process and Docker runtimes are covered in test_agent.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import aiohttp

from aios_blocks.instance.metrics import parse_text

from .conftest import COMPONENT, System


async def _placed(system: System, **spec: Any) -> tuple[str, dict[str, dict[str, Any]]]:
    await system.client.add_sim_cluster("c0", nodes=2, gpus=2)
    bid, kind, env = await system.submit_and_wait({"blockComponentURI": COMPONENT["componentURI"], **spec})
    assert kind == "ready", env
    return bid, await system.client.store.instances(bid)


async def test_sim_instances_have_endpoints_that_serve_health_tasks_and_metrics(system: System) -> None:
    bid, insts = await _placed(system, minInstances=3, maxInstances=3)
    assert len(insts) == 3
    endpoints = {iid: rec["endpoint"] for iid, rec in insts.items()}
    assert all(e.startswith("http://127.0.0.1:") for e in endpoints.values()) and len(set(endpoints.values())) == 3
    # the added facts carried them
    added = {env["data"]["instance_id"]: env["data"]["endpoint"] for s, env, _ in await system.client.history(bid) if s.endswith(".added")}
    assert added == endpoints
    async with aiohttp.ClientSession() as http:
        for iid, endpoint in endpoints.items():
            async with http.get(f"{endpoint}/health") as r:
                assert r.status == 200 and (await r.json())["instance_id"] == iid
            token = system.instance_headers(insts[iid]["node"], iid)  # as the executors send it
            async with http.post(f"{endpoint}/infer", json={"x": 1}, headers=token) as r:  # the default input path
                assert r.status == 200 and await r.json() == {"instance_id": iid, "output": {"x": 1}}
            async with http.get(f"{endpoint}/metrics") as r:
                samples = parse_text(await r.text())
            assert samples["aios_instance_requests_total"] == 1 and samples["aios_instance_errors_total"] == 0
            assert samples['aios_instance_request_latency_seconds_bucket{le="+Inf"}'] == 1

    # `blocks get --json` shows them
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "aios_blocks.cli", "get", bid, "--json"], env=env, capture_output=True,
        text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)["instances"]
    assert {iid: rec["endpoint"] for iid, rec in shown.items()} == endpoints

    # a deleted block's instances stop serving
    await system.client.delete(bid)

    async def gone() -> bool:
        b = await system.client.store.get_block(bid)
        return bool(b and b["status"] == "deleted")

    async with asyncio.timeout(60):
        while not await gone():
            await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as http:
        for endpoint in endpoints.values():
            try:
                async with http.get(f"{endpoint}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    assert r.status != 200
            except aiohttp.ClientError:
                pass  # refused: nothing listens there any more


async def test_sim_instances_take_their_path_and_behaviour_from_the_block(system: System) -> None:
    comp = dict(COMPONENT, componentURI="aios://test/llm", componentInputProtocol={"type": "http", "path": "/v1/completions"})
    await system.client.add_component(comp)
    await system.client.add_sim_cluster("c0", nodes=1, gpus=2)
    bid, kind, env = await system.submit_and_wait({
        "blockComponentURI": "aios://test/llm", "minInstances": 1, "maxInstances": 1,
        "parameters": {"sim": {"failureRate": 1.0}},
    })
    assert kind == "ready", env
    ((iid, rec),) = (await system.client.store.instances(bid)).items()
    token = system.instance_headers(rec["node"], iid)  # as the executors send it
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{rec['endpoint']}/v1/completions", json={"prompt": "x"}, headers=token) as r:
            assert r.status == 500 and (await r.json())["error"] == "simulated failure"
        async with http.post(f"{rec['endpoint']}/infer", json={}, headers=token) as r:
            assert r.status == 404  # only the block's own input path takes tasks
        async with http.get(f"{rec['endpoint']}/metrics") as r:
            m = parse_text(await r.text())
    assert m["aios_instance_errors_total"] == 1
