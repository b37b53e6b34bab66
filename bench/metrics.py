"""The metrics collector's cost: one tick over N simulated instances (the real ``Collector`` of
``workers/collector.py``: every instance's ``/metrics`` over HTTP, the windows, one pipelined
write to Redis), N = 1,000 (200 with --quick).

* the instances are ``agent/sim_serve.py`` sites in a child process (as the simulated
  fleet runs them), each page holding a filled latency histogram;
* figures: tick wall time p50/max, the collector's CPU time per tick, page parse cost, and the
  Redis write of the tick alone.

Both sides share this machine's cores: figures, not limits.

    .venv/bin/python -m bench.metrics [--quick]
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

GROUP = "8 metrics"

SIM_CHILD = r"""
import asyncio, json, sys
from aios_blocks.agent.sim_serve import SimBehaviour, SimServer
async def main(n):
    server = SimServer()
    ports = []
    for i in range(n):
        inst = await server.add(f"i{i}", SimBehaviour())
        for k in range(50):
            inst.metrics.observe(0.001 * (1 + k % 20), error=k == 0)
        ports.append(inst.port)
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main(int(sys.argv[1])))
"""


def figures(quick: bool = False) -> list[common.Row]:
    n = 200 if quick else 1000
    child = subprocess.Popen([sys.executable, "-c", SIM_CHILD, str(n)], stdout=subprocess.PIPE, text=True)
    try:
        return common.run(_figures(child, n, 5 if quick else 10))
    finally:
        child.terminate()
        child.wait(timeout=10)


async def _figures(child: subprocess.Popen[str], n: int, ticks: int) -> list[common.Row]:
    from aios_blocks.metrics.scrape import read_instance
    from aios_blocks.settings import Settings
    from aios_blocks.state.store import Store
    from aios_blocks.workers.collector import Collector

    assert child.stdout is not None
    line = await asyncio.to_thread(child.stdout.readline)
    ports: list[int] = json.loads(line)["ports"]
    async with common.servers("metrics") as (_nats, redis_url, _data):
        settings = Settings(metrics_scrape_timeout_s=5.0)
        store = Store.open(redis_url, settings=settings)
        w: Any = SimpleNamespace(settings=settings, store=store)
        c = Collector(w)
        import aiohttp

        c.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        per_block = 10
        for b in range(n // per_block):
            bid = f"b{b}"
            c.maps[bid] = {"instances": {f"{bid}-{k}": {"state": "ready", "node": "n", "endpoint": f"http://127.0.0.1:{ports[b * per_block + k]}"}
                                         for k in range(per_block)}}
            c.clusters[bid] = (0, "c0")
        walls, cpus = [], []
        await c.tick()  # warm: connections opened
        for _ in range(ticks):
            t0, c0 = time.perf_counter(), time.process_time()
            assert await c.tick()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            await asyncio.sleep(0.2)
        async with c.session.get(f"http://127.0.0.1:{ports[0]}/metrics") as r:
            page = await r.text()
        reps = 2000
        t0 = time.perf_counter()
        for _ in range(reps):
            read_instance(page)
        parse_us = (time.perf_counter() - t0) / reps * 1e6
        samples = c.windows.tick(time.time(), await c.read())
        t0 = time.perf_counter()
        await store.metrics.write(samples, 60, 70)
        write_s = time.perf_counter() - t0
        blocks = len(await store.metrics.blocks())
        await c.session.close()
        await store.close()
    note = f"{n} sim instances in {n // per_block} blocks, one child process; {ticks} ticks"
    return [
        common.row(GROUP, f"collector tick over {n} instances, p50", common.pct(walls, 50) * 1000, "ms", None, note),
        common.row(GROUP, f"collector tick over {n} instances, max", max(walls) * 1000, "ms"),
        common.row(GROUP, "collector CPU per tick, per instance", common.pct(cpus, 50) / n * 1e6, "µs",
                   None, "scrape + parse + windows + write, the collector process only"),
        common.row(GROUP, "instance page parse (read_instance)", parse_us, "µs", None, f"{len(page)} bytes"),
        common.row(GROUP, f"Redis write of one tick ({n} instances, {blocks} blocks)", write_s * 1000, "ms"),
    ]


if __name__ == "__main__":
    common.standalone(figures)
