"""The health checker's reaction times (docs/health.md), on real NATS and Redis with the real
executor (and its mapper) and checker in this process, in front of instances that are processes
of their own (so one can be SIGKILLed), default settings (checker tick 1 s, probe limit 0.5 s,
passive counts every 0.5 s) but no startup grace:

* **kill**: 4 instances under 8 closed-loop callers (plain, non-idempotent tasks); one is
  SIGKILLed; figures: kill -> out of this executor's routing (the route ejects it, right after
  its first failed dispatch), kill -> ``unready`` in the instance map (the checker's verdict, every
  executor), kill -> the ``restart`` verdict, and the tasks that failed meanwhile (those it held);
* **hang**: 3 instances, one never answers a task (its /health still passes);
  ``stallS`` = 1 s; figure: first task at it -> the ``restart`` verdict.

Rounds: 5 (2 with --quick). Figures, not limits: both sides share this machine's cores.

    .venv/bin/python -m bench.health [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

GROUP = "9 health"

CHILD = r"""
import asyncio, sys
from aiohttp import web
port, hang = int(sys.argv[1]), sys.argv[2] == "hang"
async def infer(request):
    await request.read()
    if hang:
        await asyncio.Event().wait()
    await asyncio.sleep(0.005)
    return web.json_response({"ok": True})
async def health(request):
    return web.json_response({"status": "ready"})
app = web.Application()
app.router.add_post("/infer", infer)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(_figures(2 if quick else 5))  # type: ignore[no-any-return]


async def _wait_up(ports: list[int]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        for p in ports:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{p}/health") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.05)


async def _figures(rounds: int) -> list[common.Row]:
    from aios_blocks.bus.instance_map import InstanceMaps
    from aios_blocks.cli.client import Client
    from aios_blocks.settings import Settings
    from aios_blocks.workers.base import Worker
    from aios_blocks.workers.checker import Checker
    from aios_blocks.workers.executor import Executor

    kills: dict[str, list[float]] = {"eject": [], "unready": [], "restart": [], "failed": []}
    hangs: list[float] = []
    async with common.servers("health") as (nats_url, redis_url, _data):
        settings = Settings(health_startup_grace_s=0, executor_scrape_interval_s=0)
        wx = await Worker.open(nats_url, redis_url, "executor", settings=settings)
        wc = await Worker.open(nats_url, redis_url, "checker", settings=settings)
        ex, ch = Executor(wx), Checker(wc)
        stop = asyncio.Event()
        runs = [asyncio.ensure_future(ex.run(stop, mapper_on=True)), asyncio.ensure_future(ch.run(stop))]
        client = await Client.open(nats_url, redis_url)
        maps = InstanceMaps(client.bus)
        children: list[subprocess.Popen[bytes]] = []

        async def put(bid: str, ports: list[int], checker: dict[str, Any] | None = None) -> None:
            value: dict[str, Any] = {"block_id": bid, "gen": 1, "path": "/infer", "method": "POST", "loadBalancer": {}, "gone": [],
                                     "instances": {f"i{k}": {"node": "n", "endpoint": f"http://127.0.0.1:{p}", "state": "ready",
                                                             "since": time.time()} for k, p in enumerate(ports)}}
            if checker:
                value["stabilityChecker"] = checker
            rev = await maps.update(bid, lambda _c: value)
            while ex.seen.get(bid, (0, 0))[0] < (rev or 0):  # noqa: ASYNC110 - the executor's own counter
                await asyncio.sleep(0.005)

        async def verdict(bid: str, iid: str, what: str) -> bool:
            m, _ = await maps.get(bid)
            return bool(m) and m["instances"].get(iid, {}).get("health") == what  # type: ignore[index]

        try:
            for r in range(rounds):
                # -- kill ---------------------------------------------------------------------------
                bid = f"kill{r}"
                ports = [_port() for _ in range(4)]
                procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(p), "ok"]) for p in ports]  # noqa: ASYNC220
                children += procs
                await _wait_up(ports)
                await put(bid, ports)
                failed = 0
                halt = asyncio.Event()

                async def load(b: str = bid, halt: asyncio.Event = halt) -> None:
                    nonlocal failed
                    while not halt.is_set():
                        if (await client.task(b, b"{}", timeout=30))[0] != 200:
                            failed += 1

                loaders = [asyncio.ensure_future(load()) for _ in range(8)]
                await asyncio.sleep(1.0)
                os.kill(procs[1].pid, signal.SIGKILL)
                t0 = time.monotonic()
                route = ex.routes[bid]
                marks: dict[str, float] = {}
                async with asyncio.timeout(60):
                    while len(marks) < 3:
                        now = time.monotonic() - t0
                        if "eject" not in marks and route.views["i1"]["state"] != "ready":
                            marks["eject"] = now
                        if "unready" not in marks and await verdict(bid, "i1", "unready"):
                            marks["unready"] = now
                        if "restart" not in marks and ch.busy.get("i1"):
                            marks["restart"] = now
                        await asyncio.sleep(0.001)
                halt.set()
                await asyncio.gather(*loaders)
                for k, v in marks.items():
                    kills[k].append(v)
                kills["failed"].append(failed)
                await maps.delete(bid)
                # -- hang ---------------------------------------------------------------------------
                bid = f"hang{r}"
                ports = [_port() for _ in range(3)]
                procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(p), "hang" if k == 2 else "ok"])  # noqa: ASYNC220
                         for k, p in enumerate(ports)]
                children += procs
                await _wait_up(ports)
                await put(bid, ports, {"policyRuleURI": "builtin:probe-threshold", "settings": {"stallS": 1}})
                t0 = time.monotonic()
                pending = [asyncio.ensure_future(client.task(bid, b"{}", {"Aios-Timeout-Ms": "60000"}, timeout=70)) for _ in range(6)]
                async with asyncio.timeout(60):
                    while not ch.busy.get("i2"):  # noqa: ASYNC110 - the checker's own record
                        await asyncio.sleep(0.001)
                hangs.append(time.monotonic() - t0)
                for p in pending:
                    p.cancel()
                await maps.delete(bid)
        finally:
            stop.set()
            for run in runs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(run, 10)
            for c in children:
                c.kill()
                c.wait()
            await client.close()
            await wx.close()
            await wc.close()
    note = f"{rounds} rounds, checker tick {settings.health_interval_s:g} s"
    return [
        common.row(GROUP, "kill -> out of the executor's routing (ejected), p50", common.pct(kills["eject"], 50) * 1000, "ms", None, note),
        common.row(GROUP, "kill -> out of the executor's routing (ejected), max", max(kills["eject"]) * 1000, "ms"),
        common.row(GROUP, "kill -> unready in the instance map (checker verdict), p50", common.pct(kills["unready"], 50) * 1000, "ms"),
        common.row(GROUP, "kill -> restart verdict (6 failed probes), p50", common.pct(kills["restart"], 50) * 1000, "ms"),
        common.row(GROUP, "tasks failed per kill (8 callers, plain tasks), max", max(kills["failed"]), "tasks"),
        common.row(GROUP, "hang -> restart verdict (stallS 1 s), p50", common.pct(hangs, 50) * 1000, "ms"),
    ]


if __name__ == "__main__":
    common.standalone(figures)
