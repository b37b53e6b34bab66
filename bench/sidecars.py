"""Side-cars (docs/sidecars.md): what publishing task outputs for side-cars costs a task.

Layout as ``bench.executor``: embedded NATS + Redis, the simulated instances in their own
process, one executor worker process, the load from this process (nats-py requests, c=16). Three
blocks, each with two instances (2 ms service time), differ only in their side-cars:

* **absent**: no side-car, outputs not published (the baseline);
* **consuming**: outputs published to ``AIOS_OUTPUTS``, a side-car (``aios_blocks.sidecar``, its
  own process) storing each in a SQLite file;
* **stalled**: outputs published, the side-car's handler sleeping (its consumer falls behind:
  the outputs pile up in the stream).

The blocks take turns in rounds (medians of the rounds' p50 / p99), so load from elsewhere on a
shared machine does not land on one variant only. The figures are the ratios to "absent"
(goal: within 5 %). Figures only.

    .venv/bin/python -m bench.sidecars [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from . import common
    from .executor import _closed_loop, _executor, _free_port, _instances
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    from executor import _closed_loop, _executor, _free_port, _instances  # type: ignore[no-redef]

GROUP = "sidecars"
VARIANTS = ("absent", "consuming", "stalled")


def _sidecar(nats_url: str, bid: str, mode: str, db: Path) -> subprocess.Popen[bytes]:
    """A side-car process for ``bid``: ``consuming`` (SQLite) or ``stalled`` (a handler that sleeps)."""
    spec = {"name": "bench", "maxDeliver": 5, "ackWaitS": 60, "parameters": {"path": str(db), "mode": mode}}
    import json

    env = {**os.environ, "AIOS_NATS_URL": nats_url, "AIOS_BLOCK_ID": bid, "AIOS_GEN": "1", "AIOS_SIDECAR": json.dumps(spec),
           "AIOS_LOG_LEVEL": "warning"}
    return subprocess.Popen([sys.executable, "-m", "bench.sidecars", "--sidecar"], cwd=common.ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _run_sidecar() -> None:
    from aios_blocks import sidecar
    from aios_blocks.examples.sidecars.sqlite_store import Store

    cfg = sidecar.Config.from_env()
    if cfg.parameters.get("mode") == "stalled":
        def stall(out: sidecar.Output, ctx: sidecar.Context) -> None:
            time.sleep(30)

        sidecar.run(stall, cfg)
    else:
        sidecar.run(Store(cfg.parameters), cfg)


async def _measure(nats_url: str, redis_url: str, quick: bool, data_dir: Path) -> list[common.Row]:
    import nats

    from aios_blocks.bus import subjects
    from aios_blocks.bus.instance_map import InstanceMaps
    from aios_blocks.bus.nats_bus import Bus

    n_round = 200 if quick else 500
    rounds = 6 if quick else 20
    bus = await Bus.open(nats_url, source="aios-blocks/bench")
    await bus.ensure_topology()
    maps = InstanceMaps(bus)
    inst_proc, eps = _instances([2.0] * 6)
    execs = [_executor(nats_url, redis_url, _free_port())]
    tmp = Path(tempfile.mkdtemp(prefix="aios-bench-sidecars-"))
    cars = [_sidecar(nats_url, "sc-consuming", "consuming", tmp / "out.db"), _sidecar(nats_url, "sc-stalled", "stalled", tmp / "x.db")]
    nc = await nats.connect(nats_url)
    try:
        for k, v in enumerate(VARIANTS):
            value = {"block_id": f"sc-{v}", "gen": 1, "path": "/infer", "method": "POST", "outputs": v != "absent",
                     "loadBalancer": {"policyRuleURI": "builtin:least-inflight", "settings": {"maxOngoing": 1000}},
                     "instances": {f"i{j}": {"node": "n1", "endpoint": eps[f"i{j}"], "state": "ready"} for j in (2 * k, 2 * k + 1)},
                     "gone": []}
            await maps.update(f"sc-{v}", lambda _cur, value=value: value)  # type: ignore[misc]

        def call(bid: str) -> Any:
            async def one() -> None:
                msg = await nc.request(f"aios.block.{bid}.task", b'{"x":1}', timeout=30)
                assert msg.headers and msg.headers.get("Aios-Status") == "200", msg.headers
            return one

        async with asyncio.timeout(60):  # the executor is up and has the maps
            for v in VARIANTS:
                while True:
                    with contextlib.suppress(Exception):
                        await call(f"sc-{v}")()
                        break
                    await asyncio.sleep(0.2)
        for v in VARIANTS:  # warm
            await _closed_loop(call(f"sc-{v}"), 16, 200)
        p50s: dict[str, list[float]] = {v: [] for v in VARIANTS}
        p99s: dict[str, list[float]] = {v: [] for v in VARIANTS}
        # CPU seconds of the executor and of nats-server per variant (what each output costs them,
        # whatever else runs on the machine)
        import psutil

        ex = psutil.Process(execs[0].pid)
        server = next((p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"] == "nats-server"
                       and str(data_dir) in " ".join(p.info["cmdline"] or [])), None)
        cpu: dict[str, list[float]] = {v: [0.0, 0.0] for v in VARIANTS}

        def used(p: Any) -> float:
            if p is None:
                return 0.0
            t = p.cpu_times()
            return float(t.user + t.system)

        for rnd in range(rounds):
            order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                e0, s0 = used(ex), used(server)
                lat = await _closed_loop(call(f"sc-{v}"), 16, n_round)
                cpu[v][0] += used(ex) - e0
                cpu[v][1] += used(server) - s0
                p50s[v].append(common.pct(lat, 50))
                p99s[v].append(common.pct(lat, 99))
        await asyncio.sleep(2.0)  # let the consuming side-car catch up before counting
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        p50 = {v: med(p50s[v]) for v in VARIANTS}
        p99 = {v: med(p99s[v]) for v in VARIANTS}
        info = await bus.js.stream_info(subjects.STREAM_OUTPUTS)
        stored = 0
        with contextlib.suppress(Exception):
            import sqlite3

            with sqlite3.connect(tmp / "out.db") as db:
                stored = db.execute("SELECT COUNT(*) FROM outputs").fetchone()[0]
        sent = rounds * n_round + 200 + 1  # rounds, warm-up, the first answered call
        rows = [common.row(GROUP, f"executor task latency p50 / p99, side-cars {v}", p50[v] * 1000, "ms", None,
                           f"p99 {p99[v] * 1000:.2f} ms; c=16, 2 ms service, medians of {rounds} rounds of {n_round}")
                for v in VARIANTS]
        for v in ("consuming", "stalled"):
            rows.append(common.row(GROUP, f"latency ratio {v} / absent, p50", p50[v] / p50["absent"], "x", None,
                                   f"p99 ratio {p99[v] / p99['absent']:.3f}; goal within 5 %"))
        per_task = {v: (cpu[v][0] / (rounds * n_round) * 1e6, cpu[v][1] / (rounds * n_round) * 1e6) for v in VARIANTS}
        for v in VARIANTS:
            rows.append(common.row(GROUP, f"executor CPU per task, side-cars {v}", per_task[v][0], "µs", None,
                                   f"nats-server {per_task[v][1]:.0f} µs per task"
                                   + ("" if v == "absent" else f"; outputs add {per_task[v][0] - per_task['absent'][0]:.0f} µs "
                                      f"(executor) + {per_task[v][1] - per_task['absent'][1]:.0f} µs (server)")))
        rows.append(common.row(GROUP, "outputs stored by the consuming side-car", stored, "outputs", None,
                               f"of ~{sent} tasks; AIOS_OUTPUTS holds {info.state.messages} outputs (both blocks)"))
        return rows
    finally:
        await nc.close()
        await bus.close()
        for p in [*execs, *cars]:
            p.terminate()
        for p in [*execs, *cars]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # the stalled side-car sleeps in its handler
                p.kill()
                p.wait(10)
        if inst_proc.stdin:
            inst_proc.stdin.close()
        inst_proc.wait(10)


def _offer_cost(quick: bool) -> list[common.Row]:
    """What a task pays for its output on its own path: ``OutputPublisher.offer`` (in process)."""
    from aios_blocks.executor.outputs import OutputPublisher
    from aios_blocks.settings import Settings

    n = 50_000 if quick else 500_000
    pub = OutputPublisher(None, Settings(outputs_buffer=n + 1))
    body = b'{"instance_id": "b1-0", "output": {"x": 1}}' * 4
    t0 = time.perf_counter()
    for k in range(n):
        pub.offer("b1", f"t{k}", "b1-0", 200, body, "application/json", gen=1)
    us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    m = min(n, 20_000)
    for p in list(pub._queue)[:m]:
        pub._event(p)
    enc = (time.perf_counter() - t0) / m * 1e6
    return [common.row(GROUP, "output hand-off on the task's path (offer), per task", us, "µs", None,
                       f"in process, 176-byte output; the event is built off the path ({enc:.1f} µs each) and published in batches")]


async def _run(quick: bool) -> list[common.Row]:
    async with common.servers("sidecars") as (nats_url, redis_url, data_dir):
        return [*_offer_cost(quick), *await _measure(nats_url, redis_url, quick, data_dir)]


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(_run(quick))  # type: ignore[no-any-return]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sidecar":
        _run_sidecar()
        return
    common.standalone(figures)


if __name__ == "__main__":
    main()
