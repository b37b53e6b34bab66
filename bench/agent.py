"""Node agent figures: instance start/stop time per runtime, and the heartbeat cost of 1,000
simulated agents.

* start = ``NodeAgent.create`` (every stage: GPUs, working dir, port, the container/process, the
  first passing health probe, the ``added`` fact acked by JetStream); stop = ``remove`` (teardown
  in reverse, ``removed`` acked). Sequential, one instance at a time.
* heartbeats: 1,000 agents in one process beat every 2 s into a real controller process (its
  health monitor batches them into Redis). CPU per beat on both sides, from the processes' own
  CPU counters, against an idle window of the same length measured in the same run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

from aios_blocks.agent.gpus import NoGpus
from aios_blocks.agent.node_agent import AgentConfig, NodeAgent
from aios_blocks.agent.runtime import Runtime
from aios_blocks.agent.runtime_process import ProcessRuntime
from aios_blocks.agent.runtime_sim import SimRuntime
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.schemas.events import InstanceCommand
from aios_blocks.schemas.spec import Gpu, Node

PROCESS_CMD = ["/bin/sh", "-c", f"exec {sys.executable} -m http.server $AIOS_PORT --bind 127.0.0.1"]


def _docker() -> tuple[Runtime, str] | None:
    try:
        import docker

        from aios_blocks.agent.busybox_image import ensure_image
        from aios_blocks.agent.runtime_docker import DockerRuntime

        client = docker.from_env()
        client.ping()
        return DockerRuntime(), ensure_image(client)
    except Exception:
        return None


async def _start_stop(bus: Bus, runtime: Runtime, image: str, command: list[str], probe: dict[str, Any], n: int, base: Path) -> tuple[list[float], list[float]]:
    node = Node(id=f"bench-{runtime.name}", cluster="bench", gpus=[Gpu(id=f"g{i}") for i in range(2)])
    cfg = AgentConfig(node=node, runtime_name=runtime.name, data_dir=base / runtime.name, register=False, reconcile=False, heartbeat=False)
    agent = NodeAgent(bus, runtime, NoGpus(), cfg)
    starts, stops = [], []
    for i in range(n):
        cmd = InstanceCommand(
            f"bench-{runtime.name}", 1, "bench", f"bench-{runtime.name}-{i}-{int(time.time())}", node.id, ["g0"], image,
            {"blockInitData": {"i": i}}, launch={"command": command, "ports": ["http"], "probe": probe, "stopGraceS": 2},
            resources={"cpu": 1, "memory": 64},
        )
        t = time.perf_counter()
        await agent.create(cmd)
        starts.append(time.perf_counter() - t)
        if cmd.instance_id not in agent.runners:
            raise RuntimeError(f"{runtime.name}: instance did not start (see the failed fact)")
        t = time.perf_counter()
        await agent.remove(cmd.block_id, cmd.gen, cmd.instance_id, "bench")
        stops.append(time.perf_counter() - t)
    return starts, stops


async def _heartbeats(nats_url: str, redis_url: str, agents: int, window_s: float) -> dict[str, float]:
    from aios_blocks.runtime.supervisor import Supervisor
    from aios_blocks.state.store import Store

    sup = Supervisor(nats_url, redis_url, {"controller": 1}).start()
    store = Store.open(redis_url)
    bus = await Bus.open(nats_url, source="bench/agents")
    try:
        await asyncio.sleep(3)  # controller up
        ctl = psutil.Process(sup.pids("controller")[0])
        me = psutil.Process()

        def cpu(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system

        c0, m0 = cpu(ctl), cpu(me)
        await asyncio.sleep(window_s)
        idle_ctl, idle_me = cpu(ctl) - c0, cpu(me) - m0
        fleet = []
        for i in range(agents):
            node = Node(id=f"hb-{i}", cluster="hb", gpus=[Gpu(id=f"hb-{i}-g{g}") for g in range(8)])
            cfg = AgentConfig(node=node, register=False, reconcile=False, heartbeat=True, heartbeat_s=2.0)
            fleet.append(NodeAgent(bus, SimRuntime(start_delay_s=0), NoGpus(), cfg))
        for a in fleet:
            await a.start()
            await asyncio.sleep(2.0 / agents)  # spread the beats over the period
        await asyncio.sleep(2.5)
        c0, m0 = cpu(ctl), cpu(me)
        t0 = time.perf_counter()
        await asyncio.sleep(window_s)
        elapsed = time.perf_counter() - t0
        busy_ctl, busy_me = cpu(ctl) - c0, cpu(me) - m0
        beats = agents * elapsed / 2.0
        seen = await store.r.zcount("aios:heartbeats", time.time() - 5, "+inf")
        for a in fleet:
            await a.shutdown()
        return {
            "beats_per_s": beats / elapsed,
            "ctl_us_per_beat": max(0.0, busy_ctl - idle_ctl) / beats * 1e6,
            "agent_us_per_beat": max(0.0, busy_me - idle_me) / beats * 1e6,
            "ctl_cpu_share": max(0.0, busy_ctl - idle_ctl) / elapsed,
            "nodes_seen": float(seen),
        }
    finally:
        await bus.close()
        await store.close()
        sup.stop()


async def _figures(quick: bool) -> list[common.Row]:
    rows: list[common.Row] = []
    n = 3 if quick else 10
    async with common.servers("agent") as (nats_url, redis_url, base):
        bus = await Bus.open(nats_url, source="bench/agent")
        await bus.ensure_stream()
        try:
            cases: list[tuple[Runtime, str, list[str], dict[str, Any], str]] = [
                (SimRuntime(start_delay_s=0.0), "", [], {"type": "running"}, "simulated, no delay"),
                (ProcessRuntime(), "", PROCESS_CMD, {"type": "http", "port": "http", "path": "/", "intervalS": 0.05}, "python -m http.server"),
            ]
            dock = _docker()
            if dock is not None:
                cases.append((dock[0], dock[1], [], {"type": "http", "port": "http", "path": "/health", "intervalS": 0.05}, "busybox httpd, dockerd vfs (httpd as PID 1 ignores SIGTERM: stop waits the 2 s grace, then kills)"))
            else:
                rows.append(common.row("agent", "docker start/stop", float("nan"), "ms", None, "skipped: no Docker engine"))
            for rt, image, command, probe, note in cases:
                starts, stops = await _start_stop(bus, rt, image, command, probe, n, base)
                rows.append(common.row("agent", f"{rt.name} instance start p50", common.pct(starts, 50) * 1e3, "ms", None, f"{note}; {n} sequential; create -> probe passes -> added acked"))
                rows.append(common.row("agent", f"{rt.name} instance stop p50", common.pct(stops, 50) * 1e3, "ms", None, f"{note}; teardown in reverse -> removed acked"))
                await rt.close()
        finally:
            await bus.close()
        agents = 200 if quick else 1000
        window = 5.0 if quick else 10.0
        hb = await _heartbeats(nats_url, redis_url, agents, window)
        rows += [
            common.row("agent", f"heartbeats, {agents} agents every 2 s", hb["beats_per_s"], "beats/s", None, f"all {int(hb['nodes_seen'])} nodes recorded in Redis"),
            common.row("agent", "controller CPU per heartbeat", hb["ctl_us_per_beat"], "us", None, f"{hb['ctl_cpu_share'] * 100:.1f}% of one core for {agents} agents; idle window subtracted"),
            common.row("agent", "agent-side CPU per heartbeat", hb["agent_us_per_beat"], "us", None, f"{agents} agents in one process"),
        ]
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    # quiet agents while this module runs only: `make bench` runs every module in one process, and
    # a later one (footprint) reads the workers' info lines
    with common.env_set("AIOS_LOG_LEVEL", os.environ.get("AIOS_LOG_LEVEL", "warning")):
        return common.run(_figures(quick))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
