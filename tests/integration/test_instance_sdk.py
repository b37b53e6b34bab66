"""Instances written with the SDK, run by a real node agent with the process runtime: the echo
example (light) and the OCR example (a real PP-OCRv4 model on CPU; needs the `ocr` extra)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from aios_blocks.examples import ocr
from aios_blocks.instance.metrics import parse_text

from .conftest import COMPONENT, System
from .test_agent import Agents, until

ECHO = dict(
    COMPONENT, componentURI="aios://test/echo-sdk", componentInputProtocol={"type": "http", "path": "/v1/echo"},
    resources={"gpus": 0, "cpu": 1, "memory": 128},
    launch={"command": [sys.executable, "-m", "aios_blocks.examples.echo"], "ports": ["http"],
            "probe": {"type": "http", "port": "http", "path": "/health", "intervalS": 0.5, "startTimeoutS": 30}, "stopGraceS": 2},
)


@pytest.fixture
async def process_agents(system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    a = Agents(system, "process", tmp_path)
    try:
        yield a
    finally:
        a.stop_all()
        rt = a.runtime()
        for nid in list(a.procs):
            for inst in await rt.list(nid):
                await rt.stop(inst.handle, 0)


async def test_an_sdk_instance_under_the_process_runtime_serves_its_protocol_path(process_agents: Agents) -> None:
    c = process_agents.system.client
    process_agents.start("n1")
    await process_agents.wait_registered("n1")
    await c.add_component(ECHO)
    bid, kind, env = await process_agents.system.submit_and_wait(
        {"blockComponentURI": "aios://test/echo-sdk", "minInstances": 1, "maxInstances": 1}, timeout=120)
    assert kind == "ready", env
    ((iid, rec),) = (await c.store.instances(bid)).items()
    endpoint = rec["endpoint"]
    # straight to its port, as only the executors may: with its token (docs/security.md)
    async with aiohttp.ClientSession(headers=process_agents.system.instance_headers("n1", iid)) as http:
        async with http.get(f"{endpoint}/health") as r:  # the agent's probe saw it ready before `added`
            assert r.status == 200 and (await r.json())["instance_id"] == iid
        async with http.post(f"{endpoint}/v1/echo", json={"q": "hi"}) as r:
            assert r.status == 200 and await r.json() == {"instance_id": iid, "output": {"q": "hi"}}
        async with http.post(f"{endpoint}/v1/echo", json={"fail": True}) as r:
            assert r.status == 500
        async with http.post(f"{endpoint}/v1/echo", json={"stream": 3}) as r:
            assert [json.loads(line)["chunk"] async for line in r.content] == [0, 1, 2]
        async with http.get(f"{endpoint}/metrics") as r:
            m = parse_text(await r.text())
    assert m["aios_instance_requests_total"] == 3 and m["aios_instance_errors_total"] == 1
    assert m["aios_instance_ready"] == 1

    await c.delete(bid)

    async def deleted() -> bool:
        b = await c.store.get_block(bid)
        return bool(b and b["status"] == "deleted")

    await until(deleted, 60, "block deleted")
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as http, http.get(f"{endpoint}/health"):
            pass


@pytest.mark.skipif(ocr.available() is not None, reason=f"{ocr.available()}")
async def test_the_ocr_block_reads_the_text_of_an_image(system: System) -> None:
    from aios_blocks.examples.ocr import demo

    await system.client.add_sim_cluster("sim-0", nodes=2, gpus=2)  # as in `blocks demo`: the block must still go to the agent
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url}
    env.pop("AIOS_REDIS_URL", None)
    if system.servers is not None:
        env.update(system.servers.agent_env(demo.NODE_ID))
    results = await demo.run(system.client, system.data_dir, texts=("Hello Blocks 42", "AIOS OCR demo"),
                             agent_env=env, say=lambda line: None)
    assert [r["text"] for r in results] == ["Hello Blocks 42", "AIOS OCR demo"]
    assert all(r["lines"] and 0 < r["lines"][0]["score"] <= 1 for r in results)
