"""Instances that serve: what 1,000 simulated instances cost in one process, and the raw latency
of a direct HTTP request to one instance (the floor under the executor's added latency).

* 1,000 simulated instances (``agent/sim_serve.py``, as the simulated fleet runs them) in
  a child process: set-up time and memory per instance; then tasks spread over all of them by a
  closed loop of 64 concurrent aiohttp clients in this process: tasks/s, p50/p99 (service time 0);
* one SDK instance (``python -m aios_blocks.examples.echo``, a child process): a direct
  ``POST /infer`` at concurrency 1 (p50/p99) and 16 (tasks/s);
* the OCR example's model time per image on CPU, when the ``ocr`` extra is installed.

Both sides share this machine's cores: figures, not limits.

    .venv/bin/python -m bench.instances [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

GROUP = "7 instances"

SIM_CHILD = r"""
import asyncio, json, sys, psutil
from aios_blocks.agent.sim_serve import SimBehaviour, SimServer
async def main(n):
    proc = psutil.Process()
    server = SimServer()
    await server.add("warm", SimBehaviour())
    rss0 = proc.memory_info().rss
    loop = asyncio.get_running_loop()
    t = loop.time()
    ports = [(await server.add(f"i{i}", SimBehaviour())).port for i in range(n)]
    took = loop.time() - t
    print(json.dumps({"ports": ports, "add_s": took, "rss_per": (proc.memory_info().rss - rss0) / n}), flush=True)
    await asyncio.Event().wait()
try:
    import uvloop  # as the simulated fleet's worker process runs
    uvloop.run(main(int(sys.argv[1])))
except ImportError:
    asyncio.run(main(int(sys.argv[1])))
"""


def _spawn(args: list[str], **kw: Any) -> subprocess.Popen[Any]:
    """Start a child (Popen returns at once; kept out of the coroutines for the linter)."""
    return subprocess.Popen(args, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _load(urls: list[str], concurrency: int, total: int) -> tuple[float, list[float]]:
    import aiohttp

    lat: list[float] = []
    next_i = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker() -> None:
            nonlocal next_i
            while next_i < total:
                url = urls[next_i % len(urls)]
                next_i += 1
                t = time.perf_counter()
                async with http.post(url, data=b'{"x": 1}', headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.perf_counter() - t)

        # warm the connections, then measure
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        lat.clear()
        next_i = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - t0), lat


async def _wait_health(url: str, timeout: float = 30) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready")
            await asyncio.sleep(0.1)


async def _figures(quick: bool) -> list[common.Row]:
    rows: list[common.Row] = []
    n = 200 if quick else 1000
    child = _spawn([sys.executable, "-c", SIM_CHILD, str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        info = json.loads(await asyncio.to_thread(child.stdout.readline))
        rows.append(common.row(GROUP, f"{n:,} simulated instances: set-up per instance", info["add_s"] / n * 1e6, "us"))
        rows.append(common.row(GROUP, f"{n:,} simulated instances: memory per instance", info["rss_per"] / 1024, "KiB"))
        urls = [f"http://127.0.0.1:{p}/infer" for p in info["ports"]]
        import psutil

        cpu = psutil.Process(child.pid)
        cpu0 = sum(cpu.cpu_times()[:2])
        total = 4000 if quick else 20000
        rate, lat = await _load(urls, 64, total)
        per_task = (sum(cpu.cpu_times()[:2]) - cpu0) / (2 * total)  # warm-up pass + measured pass
        rows.append(common.row(GROUP, f"sim instances' server CPU per task ({n:,} instances, one process)", per_task * 1e6, "us",
                               note="capacity of the simulated fleet's process ~ 1 / this, per core"))
        rows.append(common.row(GROUP, f"tasks spread over {n:,} sim instances, 64 clients: tasks/s", rate, "tasks/s"))
        rows.append(common.row(GROUP, f"tasks spread over {n:,} sim instances, 64 clients: p50", common.pct(lat, 50) * 1000, "ms"))
        rows.append(common.row(GROUP, f"tasks spread over {n:,} sim instances, 64 clients: p99", common.pct(lat, 99) * 1000, "ms"))
    finally:
        child.kill()
        await asyncio.to_thread(child.wait)

    port = _free_port()
    env = {**os.environ, "AIOS_PORT": str(port), "AIOS_INSTANCE_ID": "bench-0"}
    sdk = _spawn([sys.executable, "-m", "aios_blocks.examples.echo"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await _wait_health(f"http://127.0.0.1:{port}/health")
        url = f"http://127.0.0.1:{port}/infer"
        _, lat = await _load([url], 1, 500 if quick else 3000)
        rows.append(common.row(GROUP, "direct request to one SDK instance, concurrency 1: p50", common.pct(lat, 50) * 1000, "ms"))
        rows.append(common.row(GROUP, "direct request to one SDK instance, concurrency 1: p99", common.pct(lat, 99) * 1000, "ms"))
        rate, _ = await _load([url], 16, 2000 if quick else 10000)
        rows.append(common.row(GROUP, "one SDK instance, 16 clients: tasks/s", rate, "tasks/s"))
    finally:
        sdk.terminate()
        await asyncio.to_thread(sdk.wait, 10)

    from aios_blocks.examples import ocr

    if ocr.available() is None:
        from aios_blocks.instance import Context, InstanceApp

        app = InstanceApp(ocr.handle, ocr.init, Context())
        await app.start()
        png = ocr.sample_png()
        ms: list[float] = []
        for _ in range(3 if quick else 10):
            reply = await app.call(png)
            ms.append(reply.json()["elapsed_ms"])
        rows.append(common.row(GROUP, "OCR example (PP-OCRv4, CPU, 1 thread): model time per 360x80 image, p50",
                               common.pct(ms, 50), "ms"))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    return list(common.run(_figures(quick)))


if __name__ == "__main__":
    out: Any = figures("--quick" in sys.argv)
    common.print_table(out, title="instances")
