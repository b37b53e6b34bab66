"""``blocks agent``: one node agent process. Needs only NATS (``AIOS_NATS_URL``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog
from prometheus_client import start_http_server

from ..bus import subjects
from ..bus.nats_bus import Bus
from ..bus.runner import ConsumerRunner, RunnerOptions
from ..schemas.protocol import endpoint_url
from ..schemas.spec import Gpu, Node
from .gpus import GpuSource, detect
from .node_agent import AgentConfig, NodeAgent, bind_host, command_router
from .runtime import RUNTIMES, Runtime

T = TypeVar("T")

log = structlog.get_logger("aios.agent")


@dataclass
class AgentOptions:
    node_id: str
    cluster: str
    runtime: str = "docker"
    labels: dict[str, str] = field(default_factory=dict)
    cpu: float | None = None
    memory: int | None = None
    sim_gpus: int | None = None
    #: the simulated GPUs' topology profile (``--gpu-topology``; docs/topology.md)
    gpu_topology: str = ""
    data_dir: Path = Path(".aios-data/agent")
    heartbeat_s: float = 2.0
    metrics_port: int = 0
    sim_start_delay_s: float = 0.05
    #: host part of the instances' endpoints
    advertise_host: str = "127.0.0.1"
    #: AgentConfig.drain_grace_s
    drain_grace_s: float = 0.25


def make_runtime(kind: str, data_dir: Path, sim_delay: float = 0.05, agent_dir: Path | None = None) -> Runtime:
    """``agent_dir``: the agents' directory (``--agent-dir``); the process runtime is scoped by it
    (``runtime_process.process_scope``), so agents of another system on this host with the same
    node names are never seen."""
    if kind == "docker":
        from .runtime_docker import DockerRuntime

        rt = DockerRuntime()
        rt.client()  # fail now, with the reason, if there is no engine
        return rt
    if kind == "process":
        from .runtime_process import ProcessRuntime, process_scope

        return ProcessRuntime(scope=process_scope(agent_dir if agent_dir is not None else data_dir))
    if kind == "sim":
        from .runtime_sim import SimRuntime
        from .sim_serve import SimServer

        return SimRuntime(start_delay_s=sim_delay, state_dir=data_dir / "sim-engine", server=SimServer())
    raise ValueError(f"unknown runtime {kind!r}: {', '.join(RUNTIMES)}")


def strip_userinfo(url: str) -> str:
    """``nats://user:pw@host:4222,...`` -> ``nats://host:4222,...``: side-cars never get the agent's
    credentials (without ``sidecar_nats_url`` they get the bare URL: fine without auth)."""
    from urllib.parse import urlsplit, urlunsplit

    out = []
    for u in url.split(","):
        p = urlsplit(u.strip())
        out.append(urlunsplit((p.scheme, p.netloc.rsplit("@", 1)[-1], p.path, p.query, p.fragment)) if p.scheme else u.strip())
    return ",".join(out)


def _sidecar_users(bus: Bus, sidecar_url: str) -> Any:
    """A user per block for the side-cars: made in the config of ``blocks up`` when the agent runs
    next to it with credentials (``AIOS_SIDECAR_USERS_DIR``, from ``Endpoints.agent_env``;
    ``runtime.sidecar_users``), else asked of ``blocks sidecar-auth`` on an external NATS with
    ``AIOS_SIDECAR_AUTH=callout`` (``runtime.sidecar_callout``); ``None``: the shared user."""
    if users_dir := os.environ.get("AIOS_SIDECAR_USERS_DIR"):
        from ..runtime.sidecar_users import SidecarUsers

        return SidecarUsers(Path(users_dir))
    if os.environ.get("AIOS_SIDECAR_AUTH", "").strip().lower() == "callout":
        from ..runtime.sidecar_callout import CalloutSidecarUsers

        return CalloutSidecarUsers(bus.nc, asyncio.get_running_loop(), strip_userinfo(sidecar_url))
    return None


def describe_node(opts: AgentOptions, gpus: GpuSource) -> Node:
    """The node as its agent announces it: host figures unless given, GPUs from the source."""
    import psutil

    cpu = opts.cpu if opts.cpu is not None else float(psutil.cpu_count() or 1)
    memory = opts.memory if opts.memory is not None else int(psutil.virtual_memory().total // (1024 * 1024))
    return Node(
        id=opts.node_id, cluster=opts.cluster, labels=dict(opts.labels), cpu=cpu, memory=memory,
        gpus=[Gpu(id=g.id, model=g.model, memory=g.memory) for g in gpus.gpus()], topology=gpus.topology(),
    )


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """``(True, work's result)``, or ``(False, None)`` when ``stop`` comes first (``work`` is then
    cancelled). A SIGTERM only sets ``stop``: an agent waiting on something else would not see it."""
    doing = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([doing, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if doing.done():
        return True, doing.result()
    doing.cancel()
    with contextlib.suppress(BaseException):
        await doing
    return False, None


async def _open_unless_stopped(nats_url: str, node_id: str, stop: asyncio.Event) -> Bus | None:
    """The agent's bus, or ``None`` when ``stop`` comes first. An agent started before its NATS
    waits for it for ever (``connect``), and a SIGTERM meanwhile only set ``stop``, which nothing
    looked at until NATS answered: ``kill PID`` left it running, ``kill -9`` was the only way."""
    return (await _unless_stopped(Bus.open(nats_url, source=f"aios-blocks/agent/{node_id}"), stop))[1]


async def run_agent(opts: AgentOptions, nats_url: str, stop: asyncio.Event) -> None:
    gpus = detect(opts.sim_gpus, opts.node_id, profile=opts.gpu_topology)
    node = describe_node(opts, gpus)
    data_dir = opts.data_dir / opts.node_id
    runtime = make_runtime(opts.runtime, data_dir, opts.sim_start_delay_s, agent_dir=opts.data_dir)
    metrics_url = ""
    if opts.metrics_port:  # on the address it advertises (a Prometheus elsewhere scrapes it), found via its heartbeats
        start_http_server(opts.metrics_port, addr=bind_host(opts.advertise_host))
        metrics_url = f"{endpoint_url(opts.advertise_host, opts.metrics_port)}/metrics"
    bus = await _open_unless_stopped(nats_url, opts.node_id, stop)
    if bus is None:  # stopped (SIGTERM, Ctrl-C) before its NATS ever answered
        log.info("agent.stop", node=node.id, note="stopped before NATS answered")
        return
    spec = subjects.agent(opts.node_id)
    while True:  # the stream may not exist yet when an agent starts before the control plane
        try:
            await bus.ensure_consumer(spec)
            break
        except Exception as exc:
            if stop.is_set():
                await bus.close()
                return
            log.warning("agent.waiting_for_stream", error=repr(exc))
            await asyncio.sleep(1.0)
    sidecar_url = bus.settings.sidecar_nats_url or strip_userinfo(nats_url)
    sidecar_users = _sidecar_users(bus, sidecar_url)
    if not bus.settings.sidecar_nats_url and sidecar_url != nats_url and sidecar_users is None:
        log.warning("agent.sidecar_url_without_credentials", node=opts.node_id,
                    note="AIOS_SIDECAR_NATS_URL is not set: side-cars get this agent's URL without its credentials")
    cfg = AgentConfig(
        node=node, agent_name=f"{opts.runtime}@{socket.gethostname()}", runtime_name=opts.runtime,
        data_dir=data_dir, heartbeat_s=opts.heartbeat_s, advertise_host=opts.advertise_host,
        drain_grace_s=opts.drain_grace_s,
        sidecar_nats_url=sidecar_url, sidecar_nats_ca=bus.settings.nats_ca or "",
        sidecar_restart_s=bus.settings.sidecar_restart_s, sidecar_users=sidecar_users,
        instance_node_key=bus.settings.instance_node_key or "",  # its instances' tokens (docs/security.md)
        metrics_url=metrics_url,
    )
    agent = NodeAgent(bus, runtime, gpus, cfg)
    log.info("agent.start", node=node.id, cluster=node.cluster, runtime=opts.runtime, gpus=len(node.gpus), gpu_source=gpus.kind)
    try:
        # its start-up reconcile waits up to reconcile_wait_s (15 s) for the controllers' answer:
        # a SIGTERM then stops it at once, not after that wait (its instances keep running)
        started, _ = await _unless_stopped(agent.start(), stop)
        if not started:
            log.info("agent.stop", node=node.id, note="stopped during its start-up reconcile")
            return
        runner = ConsumerRunner(bus, spec, command_router(spec, agent.on_command, agent.on_sidecar), RunnerOptions(batch=16, concurrency=32, fetch_timeout_s=5.0))
        await runner.run(stop)
    finally:
        await agent.shutdown()  # cancel, don't reclaim: instances keep running
        with contextlib.suppress(Exception):
            await runtime.close()
        await bus.close()
        log.info("agent.stop", node=node.id)
