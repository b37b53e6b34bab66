"""`blocks up` serves a placed block's tasks: the executor it starts answers over NATS (the admin's
and the upstream role's clients, `blocks task`) and over HTTP (the port in endpoints.json), in
front of the simulated fleet's real HTTP instances; an instance moved away under load loses no
task."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

import aiohttp
import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import resolve_urls

from .conftest import COMPONENT
from .test_lifecycle import BLOCKS, Up, _env

pytestmark = pytest.mark.integration


async def _answered(client: Client, bid: str, n: int, timeout: float = 30) -> None:
    """The mapper has the block's ``n`` instances ready (it runs a little after `ready`), and the
    executor answers."""
    maps = InstanceMaps(client.bus)
    async with asyncio.timeout(timeout):
        while True:
            m, _ = await maps.get(bid)
            if m and sum(1 for i in m["instances"].values() if i["state"] == "ready") == n:
                break
            await asyncio.sleep(0.05)
        while (await client.task(bid, b"{}", timeout=5))[0] != 200:
            await asyncio.sleep(0.1)


async def test_blocks_up_serves_a_block_over_nats_http_and_the_cli(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = _env()
    up = await asyncio.to_thread(Up, data, env)
    try:
        ep = json.loads((data / "endpoints.json").read_text())
        assert ep["http"].startswith("http://127.0.0.1:")
        comp = tmp_path / "component.json"
        comp.write_text(json.dumps(COMPONENT))
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": "svc", "minInstances": 3,
                                    "maxInstances": 4, "parameters": {"sim": {"serviceTimeMs": 20}}}))
        for args in (("component", "add", str(comp)), ("cluster", "add", "c0", "--nodes", "2", "--gpus", "2"),
                     ("submit", str(spec), "--wait")):
            r = await asyncio.to_thread(up.cli, *args)
            assert r.returncode == 0, r.stdout + r.stderr
        urls = resolve_urls(data)
        assert urls is not None
        client = await Client.open(*urls)
        try:
            await _answered(client, "svc", 3)
            insts = await client.store.instances("svc")
            answers = await asyncio.gather(*(client.task("svc", b'{"n": %d}' % n) for n in range(30)))
            assert all(s == 200 for s, _, _ in answers), answers
            served = {msgspec.json.decode(b)["instance_id"] for _, b, _ in answers}
            assert served == set(insts)  # every instance took some (least-inflight, the default)
            assert all(msgspec.json.decode(b)["output"] == {"n": n} for n, (_, b, _) in enumerate(answers))

            # the HTTP port asks for an upstream client's credentials (HTTP Basic, docs/security.md)
            password = auth.Secrets.load(data, create=False).nats["upstream"]
            upstream = "Basic " + base64.b64encode(f"upstream:{password}".encode()).decode()
            async with aiohttp.ClientSession(headers={"Authorization": upstream}) as http:
                async with http.post(f"{ep['http']}/blocks/svc/tasks", json={"x": 1}) as r:
                    assert r.status == 200 and (await r.json())["output"] == {"x": 1}
                async with http.post(f"{ep['http']}/blocks/svc/tasks", json={"stream": 4}) as r:
                    lines = [json.loads(x) async for x in r.content]
                    assert r.status == 200 and [x["chunk"] for x in lines] == [0, 1, 2, 3]
                async with http.get(f"{ep['http']}/blocks/svc/health") as r:  # pass-through
                    assert r.status == 200 and (await r.json())["status"] == "ready"

            # `blocks task`, as the admin and as an upstream client (NATS only)
            r = await asyncio.to_thread(up.cli, "task", "svc", "--data", '{"cli": true}')
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["output"] == {"cli": True}
            r = await asyncio.to_thread(subprocess.run, [*BLOCKS, "task", "svc", "-d", '{"u": 1}', "--data-dir", str(data)],
                                        env={**env, "AIOS_ROLE": "upstream"}, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and json.loads(r.stdout)["output"] == {"u": 1}, r.stderr
            # a command the role may not run says which right was missing (it was "nats: timeout", exit 2)
            r = await asyncio.to_thread(subprocess.run, [*BLOCKS, "submit", str(spec), "--data-dir", str(data)],
                                        env={**env, "AIOS_ROLE": "upstream"}, capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "refused:" in r.stderr and "permissions violation" in r.stderr, r.stderr
            assert "AIOS_ROLE=upstream" in r.stderr and "Traceback" not in r.stderr
            r = await asyncio.to_thread(up.cli, "task", "nope")
            assert r.returncode == 1 and "unknown block" in r.stderr
            r = await asyncio.to_thread(up.cli, "task", "svc", "--data", "{not json")
            assert r.returncode == 2 and "not JSON" in r.stderr

            # an instance moved away under load: every task answered, idempotent or not
            results: list[int] = []
            stop = asyncio.Event()

            async def load() -> None:
                while not stop.is_set():
                    results.append((await client.task("svc", b'{"load": 1}'))[0])

            loaders = [asyncio.ensure_future(load()) for _ in range(6)]
            await asyncio.sleep(0.3)
            moved = sorted(insts)[0]
            await client.reassign_request("svc", moved)
            async with asyncio.timeout(60):
                while moved in await client.store.instances("svc"):
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*loaders)
            assert results and all(s == 200 for s in results), {s: results.count(s) for s in set(results)}

            # the instance-map bucket lost with its stream: the next fact makes it anew, and the
            # blocks already running are refilled from the state (they answered 404 until their
            # own next fact, and after a restart for good)
            await client.bus.js.delete_stream(f"KV_{subjects.INSTANCE_BUCKET}")
            spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": "svc2", "minInstances": 1,
                                        "maxInstances": 1}))
            r = await asyncio.to_thread(up.cli, "submit", str(spec), "--wait")
            assert r.returncode == 0, r.stdout + r.stderr
            await _answered(client, "svc2", 1)
            await _answered(client, "svc", 3)
        finally:
            await client.close()
    finally:
        assert await asyncio.to_thread(up.stop) == 0, up.output()
