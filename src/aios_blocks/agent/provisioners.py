"""The resources of one instance, each a Provisioner (set up / torn down as a pair):

GPU assignment -> working directory -> network ports -> the container or process -> health probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import structlog

from ..schemas.records import JSONObject
from .gpus import HeldGpu, gpu_env
from .lifecycle import Provisioner, with_timeout
from .runtime import LaunchSpec, Runtime, RuntimeError_, RuntimeInstance

log = structlog.get_logger("aios.agent.provisioners")
#: how long a probe watcher is given to end once cancelled (``ProbeProvisioner.teardown``)
PROBE_STOP_S = 5.0


# -- GPUs -----------------------------------------------------------------------------------------
@dataclass
class GpuSpec:
    instance_id: str
    gpus: list[str]
    #: the runtime attaches them as devices (a container sees only them, numbered from 0)
    attached: bool = False
    #: MiB per GPU when the instance shares its GPUs (0: it holds them whole)
    memory_limit_mib: int = 0


@dataclass
class GpuAssignment:
    instance_id: str
    gpus: list[str]
    env: dict[str, str]


class NodeGpu(TypedDict):
    """One GPU of the node as the provisioner checks claims against it."""

    #: its host index (as the GPU source numbers it)
    index: int
    #: MiB
    memory: int


@dataclass
class GpuProvisioner(Provisioner[GpuSpec, GpuAssignment]):
    """Checks the GPUs exist on this node and records which instance holds them (the control
    plane reserved them; this is the node-side check that it asked for real devices), and makes
    the instance's GPU environment in the view it will have (``gpus.gpu_env``)."""

    #: by GPU UUID
    node_gpus: dict[str, NodeGpu]
    claims: dict[str, set[str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "gpus"

    async def setup(self, spec: GpuSpec) -> GpuAssignment:
        unknown = [g for g in spec.gpus if g not in self.node_gpus]
        if unknown:
            raise RuntimeError_(f"GPU(s) {unknown} are not on this node (it has {sorted(self.node_gpus)})")
        for g in spec.gpus:
            self.claims.setdefault(g, set()).add(spec.instance_id)
        held = [HeldGpu(g, self.node_gpus[g]["index"], self.node_gpus[g]["memory"]) for g in spec.gpus]
        return GpuAssignment(spec.instance_id, list(spec.gpus), gpu_env(held, spec.attached, spec.memory_limit_mib))

    async def teardown(self, resource: GpuAssignment) -> None:
        for g in resource.gpus:
            holders = self.claims.get(g)
            if holders is not None:
                holders.discard(resource.instance_id)
                if not holders:
                    self.claims.pop(g, None)


# -- working directory ---------------------------------------------------------------------------
@dataclass
class WorkdirSpec:
    path: Path
    #: file name -> its content (JSON)
    files: JSONObject


class WorkdirProvisioner(Provisioner[WorkdirSpec, Path]):
    """A directory per instance holding its init data as JSON files (``blockInitData.json``...)."""

    @property
    def name(self) -> str:
        return "workdir"

    async def setup(self, spec: WorkdirSpec) -> Path:
        spec.path.mkdir(parents=True, exist_ok=True)
        for fname, content in spec.files.items():
            (spec.path / fname).write_text(json.dumps(content, indent=1, sort_keys=True))
        return spec.path

    async def teardown(self, resource: Path) -> None:
        await asyncio.to_thread(shutil.rmtree, resource, True)


# -- ports -----------------------------------------------------------------------------------------
@dataclass
class PortSpec:
    names: list[str]


@dataclass
class PortProvisioner(Provisioner[PortSpec, dict[str, int]]):
    """Free host ports, one per name, never handed to two live instances of this agent."""

    claimed: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return "ports"

    async def setup(self, spec: PortSpec) -> dict[str, int]:
        out: dict[str, int] = {}
        for pname in spec.names:
            for _ in range(50):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                if port not in self.claimed:
                    break
            else:  # pragma: no cover - 50 collisions in a row
                raise RuntimeError_("no free port")
            self.claimed.add(port)
            out[pname] = port
        return out

    async def teardown(self, resource: dict[str, int]) -> None:
        for port in resource.values():
            self.claimed.discard(port)


# -- the container or process ----------------------------------------------------------------------
@dataclass
class ContainerProvisioner(Provisioner[LaunchSpec, RuntimeInstance]):
    runtime: Runtime
    start_timeout_s: float = 120.0
    grace_s: float = 10.0

    @property
    def name(self) -> str:
        return self.runtime.name

    async def setup(self, spec: LaunchSpec) -> RuntimeInstance:
        self.grace_s = spec.stop_grace_s
        return await with_timeout(f"{self.runtime.name} start", self.runtime.start(spec), self.start_timeout_s)

    async def teardown(self, resource: RuntimeInstance) -> None:
        await self.runtime.stop(resource.handle, self.grace_s)


# -- health probe ----------------------------------------------------------------------------------
@dataclass
class ProbeSpec:
    handle: str
    #: "http" (GET path on port), "tcp" (connect to port) or "running" (the runtime says so)
    kind: str = "running"
    port: int = 0
    path: str = "/"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    start_timeout_s: float = 30.0


OnEvent = Callable[[str, str], Awaitable[None]]


@dataclass
class Probe:
    spec: ProbeSpec
    task: asyncio.Task[None] | None = None


async def check_http(port: int, path: str, timeout: float) -> str:
    """'' when ``GET path`` on 127.0.0.1:port answers 2xx/3xx, else why not."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"cannot connect to port {port}: {exc or type(exc).__name__}"
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, TimeoutError) as exc:
        return f"no answer on port {port}: {exc or type(exc).__name__}"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    parts = line.decode("latin-1").split()
    if len(parts) >= 2 and parts[1].isdigit() and 200 <= int(parts[1]) < 400:
        return ""
    return f"GET {path} on port {port} answered {line.decode('latin-1').strip()!r}"


async def check_tcp(port: int, timeout: float) -> str:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"cannot connect to port {port}: {exc or type(exc).__name__}"
    writer.close()
    return ""


@dataclass
class ProbeProvisioner(Provisioner[ProbeSpec, Probe]):
    """Setup waits until the instance first passes its probe (so ``added`` means serving); then a
    task keeps watching: an exit is reported ``failed``, ``failure_threshold`` failed probes in a
    row ``unhealthy`` (seed 001: the runner is not shut down, an event is raised)."""

    runtime: Runtime
    on_event: OnEvent

    @property
    def name(self) -> str:
        return "probe"

    async def _check(self, spec: ProbeSpec) -> tuple[bool, str]:
        """(alive, why not healthy or '')"""
        st = await self.runtime.status(spec.handle)
        if st is None:
            return False, "instance disappeared"
        if not st.running:
            return False, f"exited with code {st.exit_code}" + (f": {st.detail}" if st.detail else "")
        if spec.kind == "http":
            return True, await check_http(spec.port, spec.path, spec.timeout_s)
        if spec.kind == "tcp":
            return True, await check_tcp(spec.port, spec.timeout_s)
        return True, ""

    async def setup(self, spec: ProbeSpec) -> Probe:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.start_timeout_s
        why = ""
        while True:
            alive, why = await self._check(spec)
            if not alive:
                raise RuntimeError_(f"instance {why} before passing its {spec.kind} probe")
            if not why:
                break
            if loop.time() >= deadline:
                raise RuntimeError_(f"{spec.kind} probe not passing after {spec.start_timeout_s:g}s: {why}")
            await asyncio.sleep(min(0.2, spec.interval_s))
        probe = Probe(spec)
        probe.task = asyncio.create_task(self.watch(spec), name=f"probe:{spec.handle}")
        return probe

    async def watch(self, spec: ProbeSpec) -> None:
        """Watch a running instance until it exits or fails its probe too often (reported once)."""
        failures = 0
        while True:
            await asyncio.sleep(spec.interval_s)
            try:
                alive, why = await self._check(spec)
            except Exception as exc:  # the runtime itself is unreachable: not the instance's fault
                failures, why, alive = 0, repr(exc), True
                continue
            if not alive:
                await self.on_event("failed", why)
                return
            failures = failures + 1 if why else 0
            if failures >= spec.failure_threshold:
                await self.on_event("unhealthy", f"{failures} {spec.kind} probes failed in a row: {why}")
                return

    async def teardown(self, resource: Probe) -> None:
        task = resource.task
        if task is not None:
            task.cancel()
            # bounded: a watcher that does not end on cancel (stuck in a report, say) must not hold
            # the instance's remove forever (it was seen to, once, in CI); where it stuck is logged
            done, _ = await asyncio.wait({task}, timeout=PROBE_STOP_S)
            if not done:
                stack = "; ".join(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack())
                log.warning("probe.teardown_stuck", handle=resource.spec.handle, seconds=PROBE_STOP_S, stack=stack)
            elif not task.cancelled():
                with contextlib.suppress(Exception):
                    task.result()
