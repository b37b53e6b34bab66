"""The executor: what it adds to a task, how many it passes, how well each built-in routes, how
fast a map change reaches every executor, and what one routing decision costs.

Layout: embedded NATS + Redis; the simulated instances (``SimServer``, real aiohttp sites) in
their own process; executors as real worker processes (``aios_blocks.runtime.main executor``,
sharing one HTTP port); this process generates the load (nats-py and aiohttp clients). Maps are
written straight into the instance-map bucket (the mapper's own path is measured apart:
"mapper propagation").

* raw limits in the same run: nats-py request/reply against a bare responder, and a direct HTTP
  request to one instance;
* added latency of the executor over the direct request, NATS and HTTP ingress, p50/p99 at
  concurrency 1, 16, 64;
* tasks/s through one executor process and through two (same load generator);
* routing quality: 8 instances, one 10x slower, per built-in: p99 and the slow one's task share;
* mapper propagation: ``instance.added`` published -> two executors both route by it, p99;
* decision cost of each built-in (in process, 8 and 100 instances), an inline custom Python
  policy, and a Starlark weights call.

Figures only. On a shared 2-core machine the load generator, the executor and the instances
compete for the same cores: read the figures as upper bounds on cost.

    .venv/bin/python -m bench.executor [--quick]
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

GROUP = "executor"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the instances' process --------------------------------------------------------------------------
async def _serve_instances(spec: list[float]) -> None:
    from aios_blocks.agent.sim_serve import SimBehaviour, SimServer

    srv = SimServer()
    ports = {}
    for k, ms in enumerate(spec):
        inst = await srv.add(f"i{k}", SimBehaviour(service_time_s=ms / 1000))
        ports[f"i{k}"] = inst.port
    print(json.dumps(ports), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await srv.close()


def _instances(spec: list[float]) -> tuple[subprocess.Popen[str], dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.executor", "--serve", json.dumps(spec)], cwd=common.ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ports = json.loads(proc.stdout.readline())
    return proc, {iid: f"http://127.0.0.1:{p}" for iid, p in ports.items()}


def _executor(nats_url: str, redis_url: str, http_port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AIOS_NATS_URL": nats_url, "AIOS_REDIS_URL": redis_url, "AIOS_LOG_LEVEL": "warning",
           "AIOS_EXECUTOR_HTTP_PORT": str(http_port), "AIOS_EXECUTOR_SCRAPE_INTERVAL_S": "0.05"}
    return subprocess.Popen([sys.executable, "-m", "aios_blocks.runtime.main", "executor"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- load ---------------------------------------------------------------------------------------------
async def _closed_loop(call: Any, concurrency: int, total: int) -> list[float]:
    """``concurrency`` clients, each sending its next task when the last is answered; latencies (s)."""
    lat: list[float] = []
    left = [total]

    async def client() -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return lat


async def _rate(call: Any, concurrency: int, seconds: float) -> float:
    done = [0]
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            await call()
            done[0] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done[0] / (time.perf_counter() - t0)


async def _measure(nats_url: str, redis_url: str, quick: bool) -> list[common.Row]:
    import aiohttp
    import nats

    from aios_blocks.bus.instance_map import InstanceMaps
    from aios_blocks.bus.nats_bus import Bus

    rows: list[common.Row] = []
    n_lat = 400 if quick else 3000
    secs = 3.0 if quick else 8.0
    bus = await Bus.open(nats_url, source="aios-blocks/bench")
    await bus.ensure_topology()
    maps = InstanceMaps(bus)
    # i0..i3: latency/throughput; i4..i11: routing, 20 ms, i11 10x slower (long enough that a
    # scheduling hiccup of a busy machine does not drown the difference)
    spec = [0.0] * 4 + [20.0] * 7 + [200.0]
    inst_proc, eps = _instances(spec)
    http_port = _free_port()
    execs = [_executor(nats_url, redis_url, http_port)]
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    nc = await nats.connect(nats_url)
    try:
        async def put(bid: str, iids: list[str], uri: str) -> None:
            value = {"block_id": bid, "gen": 1, "path": "/infer", "method": "POST",
                     "loadBalancer": {"policyRuleURI": uri, "settings": {"maxOngoing": 1000, "queueSize": 10000}},
                     "instances": {i: {"node": "n1", "endpoint": eps[i], "state": "ready"} for i in iids}, "gone": []}
            await maps.update(bid, lambda _cur: value)

        await put("lat", ["i0"], "builtin:least-inflight")
        await put("tput", ["i0", "i1", "i2", "i3"], "builtin:least-inflight")
        slow8 = [f"i{k}" for k in range(4, 12)]
        for uri in ("builtin:round-robin", "builtin:least-inflight", "builtin:least-queue"):
            await put("rq-" + uri.split(":")[1], slow8, uri)

        async def via_nats(bid: str = "lat") -> None:
            msg = await nc.request(f"aios.block.{bid}.task", b'{"x":1}', timeout=30)
            assert msg.headers and msg.headers.get("Aios-Status") == "200", msg.headers

        async def via_http() -> None:
            async with http.post(f"http://127.0.0.1:{http_port}/blocks/lat/tasks", data=b'{"x":1}') as r:
                await r.read()
                assert r.status == 200, r.status

        async def direct() -> None:
            async with http.post(f"{eps['i0']}/infer", data=b'{"x":1}') as r:
                await r.read()

        async with asyncio.timeout(60):  # the executor is up and has the maps
            while True:
                with contextlib.suppress(Exception):
                    await via_nats()
                    await via_http()
                    break
                await asyncio.sleep(0.2)

        # raw nats request/reply: a bare responder on its own connection
        responder = await nats.connect(nats_url)

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await responder.subscribe("bench.echo", cb=echo)
        await responder.flush()  # the server has the subscription before the first request

        async def raw_nats() -> None:
            await nc.request("bench.echo", b'{"x":1}', timeout=10)

        for c in (1, 16, 64):
            for f in (raw_nats, direct, via_nats, via_http):  # warm
                await _closed_loop(f, c, c * 4)
            raw = await _closed_loop(raw_nats, c, n_lat)
            base = await _closed_loop(direct, c, n_lat)
            nl = await _closed_loop(via_nats, c, n_lat)
            hl = await _closed_loop(via_http, c, n_lat)
            b50, b99 = common.pct(base, 50), common.pct(base, 99)
            rows += [
                common.row(GROUP, f"raw nats request/reply p50 / p99, c={c}", common.pct(raw, 50) * 1000, "ms", None,
                           f"p99 {common.pct(raw, 99) * 1000:.2f} ms; bare responder"),
                common.row(GROUP, f"direct HTTP to one instance p50 / p99, c={c}", b50 * 1000, "ms", None,
                           f"p99 {b99 * 1000:.2f} ms; aiohttp, pooled"),
                common.row(GROUP, f"added by the executor, NATS ingress, p50, c={c}", (common.pct(nl, 50) - b50) * 1000, "ms",
                           None, f"p99 added {(common.pct(nl, 99) - b99) * 1000:.2f} ms; goal p50 <= 1, p99 <= 3"),
                common.row(GROUP, f"added by the executor, HTTP ingress, p50, c={c}", (common.pct(hl, 50) - b50) * 1000, "ms",
                           None, f"p99 added {(common.pct(hl, 99) - b99) * 1000:.2f} ms"),
            ]
        await responder.close()

        # throughput: one executor process, then two, in alternating rounds (medians): the load
        # from elsewhere on a shared machine changes from second to second
        async def tput() -> None:
            await via_nats("tput")

        await _rate(tput, 64, 1.0)
        ones: list[float] = []
        twos: list[float] = []
        for _ in range(2 if quick else 3):
            ones.append(await _rate(tput, 128, secs))
            execs.append(_executor(nats_url, redis_url, http_port))
            await asyncio.sleep(4.0)  # the second one watches the maps and joins the queue group
            await _rate(tput, 128, 0.5)
            twos.append(await _rate(tput, 128, secs))
            second = execs.pop()
            second.terminate()  # it leaves the group and answers what it took
            await asyncio.to_thread(second.wait, 30)
        one, two = sorted(ones)[len(ones) // 2], sorted(twos)[len(twos) // 2]
        rows += [
            common.row(GROUP, "tasks/s through one executor process (NATS, c=128, 4 instances)", one, "tasks/s", None,
                       f"goal >= 3,000; rounds {', '.join(f'{x:,.0f}' for x in ones)}; the load generator and the "
                       "instances share the cores"),
            common.row(GROUP, "tasks/s through two executor processes", two, "tasks/s", two / one,
                       f"x{two / one:.2f} of one (goal >= 1.7x; of_raw_limit = the ratio); rounds "
                       f"{', '.join(f'{x:,.0f}' for x in twos)}"),
        ]

        # routing quality: 8 instances, one 10x slower; the policies take turns (rounds), so a
        # burst of load from elsewhere on the machine does not land on one policy only
        n_rq = 1000 if quick else 4000
        uris = ("builtin:round-robin", "builtin:least-inflight", "builtin:least-queue")
        lat_by: dict[str, list[float]] = {u: [] for u in uris}
        share_by: dict[str, dict[str, int]] = {u: {} for u in uris}
        rounds = 5
        for rnd in range(rounds + 1):
            for uri in uris:
                bid = "rq-" + uri.split(":")[1]
                share: dict[str, int] = {}

                async def routed(bid: str = bid, share: dict[str, int] = share) -> None:
                    msg = await nc.request(f"aios.block.{bid}.task", b"{}", timeout=30)
                    who = (msg.headers or {}).get("Aios-Instance", "?")
                    share[who] = share.get(who, 0) + 1

                lat = await _closed_loop(routed, 16, 100 if rnd == 0 else n_rq // rounds)
                if rnd:  # round 0 warms up
                    lat_by[uri] += lat
                    for k, c in share.items():
                        share_by[uri][k] = share_by[uri].get(k, 0) + c
        for uri in uris:
            lat, share = lat_by[uri], share_by[uri]
            slow = share.get("i11", 0) / max(1, sum(share.values()))
            rows.append(common.row(GROUP, f"routing, 8 instances one 10x slower: {uri} p99", common.pct(lat, 99) * 1000, "ms",
                                   None, f"p50 {common.pct(lat, 50) * 1000:.1f} ms, p90 {common.pct(lat, 90) * 1000:.1f} ms, "
                                   f"mean {sum(lat) / len(lat) * 1000:.1f} ms; slow instance's share {slow:.1%} "
                                   f"(even: 12.5%); c=16, 20 ms / 200 ms service"))
    finally:
        await http.close()
        await nc.close()
        for p in execs:
            p.terminate()
        for p in execs:
            with contextlib.suppress(Exception):
                p.wait(10)
        assert inst_proc.stdin is not None
        inst_proc.stdin.close()
        inst_proc.wait(10)
        await bus.close()
    rows += await _propagation(nats_url, redis_url, 40 if quick else 200)
    rows += await _decision_costs(quick)
    return rows


async def _propagation(nats_url: str, redis_url: str, n: int) -> list[common.Row]:
    """``instance.added`` published -> both executors (mapper consumer -> KV -> watch) route by it."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import InstanceEvent
    from aios_blocks.settings import Settings
    from aios_blocks.workers.base import Worker
    from aios_blocks.workers.executor import Executor

    settings = Settings(executor_http_port=0, executor_scrape_interval_s=0)
    workers = [await Worker.open(nats_url, redis_url, f"executor-{k}", settings=settings) for k in range(2)]
    exs = [Executor(w) for w in workers]
    stop = asyncio.Event()
    runs = [asyncio.ensure_future(e.run(stop, mapper_on=True)) for e in exs]
    lat: list[float] = []
    try:
        await asyncio.gather(*(asyncio.wait_for(e.map_ready.wait(), 30) for e in exs))
        await workers[0].store.create_block("prop", 1, "d", {"status": "ready", "ir": {"blockId": "prop"}})
        for k in range(n):
            iid = f"p{k}"
            t0 = time.perf_counter()
            await workers[0].bus.emit(E.instance_added, InstanceEvent("prop", 1, iid, "n1", endpoint="http://127.0.0.1:9"))
            async with asyncio.timeout(30):
                while True:  # polling the executors' own state (0.5 ms steps)
                    if all((r := e.routes.get("prop")) is not None and iid in r.views and r.views[iid]["state"] == "ready"
                           for e in exs):
                        break
                    await asyncio.sleep(0.0005)
            lat.append(time.perf_counter() - t0)
    finally:
        stop.set()
        for r in runs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r, 10)
        for w in workers:
            await w.close()
    return [common.row(GROUP, "mapper propagation p99 (added -> 2 executors route by it)", common.pct(lat, 99) * 1000, "ms",
                       None, f"p50 {common.pct(lat, 50) * 1000:.1f} ms over {n} changes; goal p99 <= 100 ms")]


class _FirstPolicy:
    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        pass

    def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
        return {"instance_id": input_data["payload"]["instances"][0]["id"]}


WEIGHTS_STAR = '''
def eval(parameters, input_data, context):
    out = {}
    for inst in input_data["payload"]["instances"]:
        out[inst["id"]] = 1.0 / (1 + inst["inflight"])
    return {"weights": out}
'''


async def _decision_costs(quick: bool) -> list[common.Row]:
    import tempfile

    from aios_blocks.executor.engine import InlinePolicy, Limits, Refused, Route
    from aios_blocks.policies.runtime import BUILTINS, PolicyRuntime

    rows: list[common.Row] = []
    n = 20_000 if quick else 200_000
    for size in (8, 100):
        insts = {f"i{k}": {"node": "n", "endpoint": f"http://h:{k}", "state": "ready"} for k in range(size)}
        choosers: list[tuple[str, Any]] = [(u, InlinePolicy(BUILTINS[u]("b", {}, {}), u))
                                           for u in ("builtin:round-robin", "builtin:least-inflight", "builtin:least-queue")]
        choosers.append(("custom Python (inline, time limit)", InlinePolicy(_FirstPolicy("b", {}, {}), "custom", {}, 0.005)))
        for name, ch in choosers:
            r = Route("b", ch, Limits(max_ongoing=10**9))
            r.apply(insts, 1, 1)
            task = {"method": "POST", "path": "/infer", "bytes": 10}
            failed = 0
            t0 = time.perf_counter()
            for _ in range(n):
                try:
                    v = r.try_pick(task)
                except Refused:  # a custom policy over its limit: counted, not fatal
                    failed += 1
                    continue
                assert v is not None
                r.release(v)
            us = (time.perf_counter() - t0) / n * 1e6
            rows.append(common.row(GROUP, f"decision + admission, {name}, {size} instances", us, "µs", None,
                                   "in process: Route.try_pick + release (goal <= 50 µs for the built-ins)"
                                   + (f"; {failed} over the time limit" if failed else "")))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "weights.star")
        with open(path, "w") as f:  # noqa: ASYNC230 - a few bytes, before anything is timed
            f.write(WEIGHTS_STAR)
        rt = PolicyRuntime(allow_files=True)
        rule = {"name": "loadBalancer", "policyRuleURI": path}
        payload = {"block": "b", "instances": [{"id": f"i{k}", "inflight": k % 3} for k in range(8)]}
        await rt.invoke(rule, "b.lb", {"action": "weights", "payload": payload})
        m = 20 if quick else 100
        t0 = time.perf_counter()
        for _ in range(m):
            await rt.invoke(rule, "b.lb", {"action": "weights", "payload": payload})
        rows.append(common.row(GROUP, "Starlark weights call (sandboxed), 8 instances", (time.perf_counter() - t0) / m * 1000, "ms",
                               None, "periodic (AIOS_EXECUTOR_WEIGHTS_INTERVAL_S), never per task"))
    return rows


async def _run(quick: bool) -> list[common.Row]:
    async with common.servers("executor") as (nats_url, redis_url, _):
        return await _measure(nats_url, redis_url, quick)


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(_run(quick))  # type: ignore[no-any-return]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        common.run(_serve_instances(json.loads(sys.argv[2])))
        return
    common.standalone(figures)


if __name__ == "__main__":
    main()
