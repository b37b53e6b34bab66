"""One node agent: turns ``aios.node.{nid}.instance.create`` / ``.remove`` into running (or
stopped) instances through a runtime, and tells the world.

* start: announce the node (``registered``) and what the runtime really runs (``inventory``, under
  a boot id new at each start: instances the state has there but that do not run are lost at once),
  reconcile what the runtime runs against what the state expects (adopt / dangling / lost), then
  serve commands and heartbeat;
* create: idempotent — a runner that exists, or an instance the runtime already runs under this
  id, is (re-)adopted and reported ``added`` again (the message id makes the repeat a no-op);
* remove: closes the runner (every stage torn down in reverse) or, for an instance with no runner,
  stops it by its labels; always answers ``removed``;
* faults seen by the probe: ``failed`` (exited) / ``unhealthy`` (probe) — the runner stays until
  the controller replaces the instance and removes this one (seed 001);
* shutdown: runners are cancelled, not closed: instances keep running for the next agent.

Only NATS is needed: the agent never talks to Redis; the controller records what it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import structlog
from prometheus_client import Counter, Gauge

from ..bus.catalog import E
from ..bus.nats_bus import Bus
from ..bus.router import Inbound, Router
from ..bus.subjects import ConsumerSpec
from ..runtime.instance_key import instance_token
from ..schemas.events import (
    Dangling,
    Heartbeat,
    InstanceCommand,
    InstanceEvent,
    InventoryItem,
    NodeInventory,
    NodeRegistered,
    SidecarCommand,
)
from ..schemas.policy_io import as_float, as_int
from ..schemas.protocol import INSTANCE_TOKEN_ENV, METRICS_PATH, endpoint_port, endpoint_url
from ..schemas.records import InstanceRecord, JSONObject
from ..schemas.sharing import GPU_MEMORY_LIMIT_ENV
from ..schemas.spec import Launch, Node
from . import adoption
from .gpus import GpuSource, GpuSourceKind
from .lifecycle import DerivedSpec, FixedSpec, ProvisionStage, Runner, Stage, StageFailed
from .provisioners import (
    ContainerProvisioner,
    GpuAssignment,
    GpuProvisioner,
    GpuSpec,
    NodeGpu,
    PortProvisioner,
    PortSpec,
    Probe,
    ProbeProvisioner,
    ProbeSpec,
    WorkdirProvisioner,
    WorkdirSpec,
)
from .runtime import LaunchSpec, Runtime, RuntimeError_, RuntimeInstance, json_text, labels_to_resources
from .sidecars import SidecarManager

log = structlog.get_logger("aios.agent")

#: a create that carries no launch (every simulated one): the default, validated once and only read
#: (``_build`` copies its lists), not an empty dict validated again per command
NO_LAUNCH = Launch()

#: removed instance ids an agent remembers (stale creates of them start nothing)
REMOVED_KEEP = 4096

INSTANCES = Gauge("aios_agent_instances", "Instances this agent runs", ["node"])
EVENTS = Counter("aios_agent_instance_events_total", "Instance facts published", ["node", "event"])
HEARTBEATS = Counter("aios_agent_heartbeats_total", "Heartbeats sent", ["node"])


@dataclass
class AgentConfig:
    node: Node
    agent_name: str = ""
    runtime_name: str = "sim"
    data_dir: Path = Path(".aios-data/agent")
    heartbeat_s: float = 2.0
    register: bool = True
    #: publish ``node.inventory`` when it starts (the simulated fleet publishes its nodes' itself)
    inventory: bool = True
    reconcile: bool = True
    heartbeat: bool = True
    workdirs: bool = True
    probes: bool = True
    #: give up waiting for the controller's expected list after this long, then serve commands
    #: anyway (reconciling keeps retrying in the background)
    reconcile_wait_s: float = 15.0
    #: the host part of instance endpoints (``http://{advertise_host}:{port}``): an address the
    #: block's services can reach this node at (instances bind their ports on the host)
    advertise_host: str = "127.0.0.1"
    #: between a planned remove command and the stop of an instance that serves HTTP: the mapper
    #: marks it ``draining`` on the same command, and the executors must see that before the
    #: instance stops listening (a task sent on a kept-alive connection that closes under it is
    #: lost for a non-idempotent task); evictions (the node is gone) do not wait
    drain_grace_s: float = 0.25
    #: what side-cars are given (docs/sidecars.md): NATS URL (the side-car role's) and CA file
    sidecar_nats_url: str = ""
    sidecar_nats_ca: str = ""
    sidecar_restart_s: float = 1.0
    #: a user per block for its side-cars (``runtime.sidecar_users.SidecarUsers``; ``None``: every
    #: side-car gets ``sidecar_nats_url``)
    sidecar_users: Any = None
    #: this node's instance key ``K_N`` (``AIOS_INSTANCE_NODE_KEY``; ``runtime.instance_key``): each
    #: instance starts with its token in ``AIOS_INSTANCE_TOKEN``; "" gives none (any caller's tasks)
    instance_node_key: str = field(default="", repr=False)
    #: this agent's own ``/metrics`` URL (``--metrics-port``), sent in each heartbeat ("" none)
    metrics_url: str = ""


class Placed(TypedDict):
    """What the agent keeps of an instance it runs (``NodeAgent.meta``): its block and generation,
    what it was given (``InstanceCommand.resources``, the GPUs) and where it serves."""

    block_id: str
    gen: int
    #: ``schemas.records.Needs`` as the command carries it (JSON)
    resources: JSONObject
    gpus: list[str]
    endpoint: str


class _Found(adoption.Found):
    """An instance the runtime has, with its handle (``reconcile_once``)."""

    inst: RuntimeInstance


@dataclass
class NodeAgent:
    bus: Bus
    runtime: Runtime
    gpus: GpuSource
    cfg: AgentConfig
    runners: dict[str, Runner] = field(default_factory=dict)
    meta: dict[str, Placed] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _ports: PortProvisioner = field(default_factory=PortProvisioner)
    _gpu_prov: GpuProvisioner | None = None
    reconciled: asyncio.Event = field(default_factory=asyncio.Event)
    #: instance id -> the newest generation this agent removed (the last REMOVED_KEEP): a create of
    #: that generation or an older one delivered after its remove is stale (a redelivery, e.g. of a
    #: create whose ack was not out when the agent was stopped) and starts nothing
    removed: OrderedDict[str, int] = field(default_factory=OrderedDict)
    sidecars: SidecarManager | None = None
    #: this start of the agent (``new_boot``): carried by its ``inventory`` and every fact it reports
    boot: str = field(default_factory=lambda: new_boot())
    #: this node's children of ``INSTANCES`` and ``EVENTS`` (by fact), made at their first use
    _instances_gauge: Gauge | None = None
    _event_counters: dict[str, Counter] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.cfg.node.id

    @property
    def attaches_gpus(self) -> bool:
        """Instances get their GPUs as devices: real (NVML) GPUs and a runtime that can attach them."""
        return self.runtime.gpu_devices and self.gpus.kind == GpuSourceKind.NVML

    def __post_init__(self) -> None:
        found = {g.id: g.index for g in self.gpus.gpus()}  # host indices as the source numbers them
        gpus: dict[str, NodeGpu] = {g.id: {"index": found.get(g.id, i), "memory": g.memory} for i, g in enumerate(self.cfg.node.gpus)}
        self._gpu_prov = GpuProvisioner(gpus)
        if self.sidecars is None:
            self.sidecars = SidecarManager(self.bus, self.runtime, self.node_id, self.cfg.data_dir, self.cfg.sidecar_nats_url,
                                           self.cfg.sidecar_nats_ca, self.cfg.sidecar_restart_s, self.cfg.workdirs,
                                           users=self.cfg.sidecar_users)

    # -- start / stop ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.cfg.register:
            await self.register()
        if self.cfg.inventory:
            await self.announce_running()
        if self.cfg.reconcile:
            self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="reconcile"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reconciled.wait(), self.cfg.reconcile_wait_s)
            if not self.reconciled.is_set():
                log.warning("agent.reconcile_pending", node=self.node_id, note="serving commands; reconcile keeps retrying")
        if self.cfg.heartbeat:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        if self.cfg.reconcile and self.sidecars is not None:
            with contextlib.suppress(Exception):  # side-cars that outlived the last agent: watched again
                await self.sidecars.adopt_running()

    async def shutdown(self) -> None:
        """Seed 001 graceful shutdown: runners are cancelled without reclaiming; instances stay."""
        for t in self._tasks:
            t.cancel()
        if self.sidecars is not None:
            self.sidecars.shutdown()
        for runner in self.runners.values():
            runner.cancel()
            with contextlib.suppress(Exception):
                probe = runner.stage("probe")
                if isinstance(probe, ProvisionStage) and isinstance(probe.resource, Probe) and probe.resource.task:
                    probe.resource.task.cancel()
        self.runners.clear()

    async def register(self) -> None:
        node = self.cfg.node
        await self.bus.emit(
            E.node_registered, NodeRegistered(node.model_dump(mode="json"), self.cfg.agent_name, self.cfg.runtime_name),
            qualifier=str(int(time.time() * 1000)), nid=node.id,
        )

    async def announce(self, items: list[InventoryItem]) -> None:
        """``node.inventory``: what this agent runs now, under its boot id. Published before it
        takes a command, so every later ``added`` of this boot follows it in the stream."""
        inv = NodeInventory(self.node_id, self.boot, sorted(items, key=lambda i: i.instance_id), round(time.time(), 3))
        await self.bus.emit(E.node_inventory, inv)
        log.info("agent.inventory", node=self.node_id, boot=self.boot, instances=len(items))

    async def announce_running(self) -> None:
        """The inventory of a starting agent: the instances its runtime really runs (side-cars
        apart), whether or not reconciling adopts them later. Retried for ``reconcile_wait_s`` at
        most (then the agent serves anyway: its instances' probes are the fallback)."""
        delay, deadline = 0.2, time.monotonic() + self.cfg.reconcile_wait_s
        while True:
            try:
                found = [i for i in await self.runtime.list(self.node_id) if not i.is_sidecar and i.instance_id and i.running]
                await self.announce([InventoryItem(i.instance_id, i.block_id, i.gen, self._endpoint_of(i, _ports_of(i)))
                                     for i in found])
                return
            except Exception as exc:
                if time.monotonic() + delay > deadline:
                    log.error("agent.inventory_failed", node=self.node_id, error=repr(exc))
                    return
                log.warning("agent.inventory_retry", node=self.node_id, error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- commands ----------------------------------------------------------------------------------
    async def on_command(self, m: Inbound[InstanceCommand]) -> None:
        cmd = m.data
        if cmd.node_id != self.node_id:
            return  # not ours (a misrouted command): never act on another node's instance
        log.info("agent.command", node=self.node_id, command=m.event.name, instance=cmd.instance_id, gen=cmd.gen,
                 reason=cmd.reason, deliveries=m.deliveries)
        if m.event is E.node_instance_create:
            await self.create(cmd)
        elif m.event is E.node_instance_restart:
            await self.restart(cmd, str(m.stream_seq))
        else:
            await self.remove(cmd.block_id, cmd.gen, cmd.instance_id, cmd.reason or "removed", cmd.drain_s)

    async def on_sidecar(self, m: Inbound[SidecarCommand]) -> None:
        """``node.sidecar.start`` / ``.stop`` (``agent/sidecars.py``)."""
        cmd = m.data
        if cmd.node_id != self.node_id or self.sidecars is None:
            return
        if m.event is E.node_sidecar_start:
            await self.sidecars.start(cmd)
        else:
            await self.sidecars.stop(cmd)

    async def create(self, cmd: InstanceCommand, msg_key: str = "") -> None:
        iid = cmd.instance_id
        async with self._locks[iid]:
            if self.removed.get(iid, -1) >= cmd.gen:
                log.warning("agent.stale_create", node=self.node_id, instance=iid, gen=cmd.gen,
                            note="already removed here: a late or redelivered create starts nothing")
                return
            if iid in self.runners:
                await self._fact(cmd.block_id, cmd.gen, iid, "added", "", cmd.gpus, endpoint=self.endpoint(iid), msg_key=msg_key)
                return
            existing = await self.runtime.find(self.node_id, iid)
            if existing is not None and existing.running:
                self._adopt(existing)
                await self._fact(cmd.block_id, cmd.gen, iid, "added", "adopted a running instance", cmd.gpus,
                                 endpoint=self.endpoint(iid), msg_key=msg_key)
                return
            runner = self._build(cmd, msg_key)
            try:
                await runner.start()
            except StageFailed as exc:
                reason = f"setup failed: {exc}"
                if runner.teardown_errors:
                    reason += f" (teardown errors: {'; '.join(runner.teardown_errors)})"
                await self._fact(cmd.block_id, cmd.gen, iid, "failed", reason, cmd.gpus, msg_key=msg_key)
                return
            self.runners[iid] = runner
            endpoint = self._endpoint_of(_resource(runner, self.runtime.name), _resource(runner, "ports") or {})
            self.meta[iid] = {"block_id": cmd.block_id, "gen": cmd.gen, "resources": cmd.resources, "gpus": cmd.gpus,
                              "endpoint": endpoint}
            self._count_instances()
            await self._fact(cmd.block_id, cmd.gen, iid, "added", "", cmd.gpus, endpoint=endpoint, msg_key=msg_key)

    async def restart(self, cmd: InstanceCommand, key: str = "") -> None:
        """A health checker's ``restart`` verdict: stop the instance (every stage torn down, as a
        remove does, but no ``removed`` fact: the instance keeps its id and its reservation) and
        create it again from the command; the new ``added`` (or ``failed``) fact carries a key of
        its own so it is not taken for the first one. Works alike for every runtime."""
        iid = cmd.instance_id
        async with self._locks[iid]:
            await self._stop(iid)
        log.info("instance.restarted", node=self.node_id, instance=iid, reason=cmd.reason)
        await self.create(cmd, msg_key=f"restart:{key or int(time.time() * 1000)}")

    async def remove(self, bid: str, gen: int, iid: str, reason: str, drain_s: float = 0.0) -> None:
        endpoint = self.endpoint(iid)
        if endpoint and not reason.startswith("evicted"):
            if self.cfg.drain_grace_s > 0:
                await asyncio.sleep(self.cfg.drain_grace_s)  # let every executor see ``draining`` first
            if drain_s > 0:  # a scale-down: the tasks in flight finish first (bounded)
                await self.drain(iid, endpoint, drain_s)
        async with self._locks[iid]:
            self.removed[iid] = max(gen, self.removed.pop(iid, gen))
            while len(self.removed) > REMOVED_KEEP:
                self.removed.popitem(last=False)
            await self._stop(iid)
            self._count_instances()
            await self._fact(bid, gen, iid, "removed", reason, [])

    async def _stop(self, iid: str) -> None:
        """Tear the instance down (every stage, in reverse), whether this agent runs it or only
        finds it by its labels (adopted later, dangling, or after a restart). Under its lock."""
        runner = self.runners.pop(iid, None)
        self.meta.pop(iid, None)
        if runner is not None:
            await runner.close()
        else:
            found = await self.runtime.find(self.node_id, iid)
            if found is not None:
                await self._adopt(found, watch=False).close()

    async def drain(self, iid: str, endpoint: str, grace_s: float, poll_s: float = 0.1) -> str:
        """Wait until the instance has no task in flight (its ``/metrics`` says
        ``aios_instance_requests_running 0``), for at most ``grace_s``; an instance that gives no
        such figure gets the whole grace. Returns how it ended: ``idle``, ``grace`` or ``no-figure``."""
        deadline = time.monotonic() + grace_s
        while True:
            running = await in_flight(endpoint)
            left = deadline - time.monotonic()
            if running is None:
                log.info("instance.drain", node=self.node_id, instance=iid, how="no in-flight figure: the whole grace", grace_s=grace_s)
                await asyncio.sleep(max(left, 0.0))
                return "no-figure"
            if running <= 0:
                return "idle"
            if left <= 0:
                log.warning("instance.drain_grace_over", node=self.node_id, instance=iid, running=running, grace_s=grace_s)
                return "grace"
            await asyncio.sleep(min(poll_s, left))

    # -- building and adopting runners ---------------------------------------------------------------
    def _build(self, cmd: InstanceCommand, msg_key: str = "") -> Runner:
        iid = cmd.instance_id
        launch = Launch.model_validate(cmd.launch) if cmd.launch else NO_LAUNCH
        assert self._gpu_prov is not None
        stages: list[tuple[Stage[Any, Any], Any]] = []
        gpu_stage = ProvisionStage(self._gpu_prov)
        attach = self.attaches_gpus
        stages.append((gpu_stage, FixedSpec(GpuSpec(iid, list(cmd.gpus), attach, memory_limit(cmd.env)))))
        work_stage: ProvisionStage[Any, Any] | None = None
        if self.cfg.workdirs:
            work_stage = ProvisionStage(WorkdirProvisioner())
            files = {f"{k}.json": cmd.env.get(k, {}) for k in ("blockInitData", "initSettings", "parameters")}
            stages.append((work_stage, FixedSpec(WorkdirSpec(self.workdir(iid), files))))
        port_stage = ProvisionStage(self._ports)
        stages.append((port_stage, FixedSpec(PortSpec(list(launch.ports)))))

        def launch_spec(gpu: GpuAssignment, ports: dict[str, int], workdir: Path | None = None) -> LaunchSpec:
            return LaunchSpec(
                instance_id=iid, block_id=cmd.block_id, node_id=self.node_id, gen=cmd.gen, image=cmd.image,
                command=list(launch.command),
                env={**instance_env(cmd.env, gpu.env, ports, bind_host(self.cfg.advertise_host)), **self._token_env(iid)},
                workdir=workdir,
                ports=ports, gpus=list(cmd.gpus), gpu_devices=attach, resources=cmd.resources,
                stop_grace_s=launch.stopGraceS,
            )

        deps: list[Stage[Any, Any]] = [gpu_stage, port_stage]
        if work_stage is not None:
            deps.append(work_stage)
        container = ProvisionStage(ContainerProvisioner(self.runtime))
        stages.append((container, DerivedSpec(launch_spec, *deps)))
        probe = launch.probe
        if self.cfg.probes and probe.type != "none":

            def probe_spec(inst: RuntimeInstance, ports: dict[str, int]) -> ProbeSpec:
                kind = probe.type
                if kind in ("http", "tcp") and probe.port not in ports:
                    raise RuntimeError_(f"probe port {probe.port!r} is not one of the launch ports {sorted(ports)}")
                return ProbeSpec(
                    inst.handle, kind, ports.get(probe.port, 0), probe.path, probe.intervalS, probe.timeoutS,
                    probe.failureThreshold, probe.startTimeoutS,
                )

            stages.append((ProvisionStage(self._probe_provisioner(cmd.block_id, cmd.gen, iid, msg_key)), DerivedSpec(probe_spec, container, port_stage)))
        return Runner(iid, stages)

    def _token_env(self, iid: str) -> dict[str, str]:
        """``AIOS_INSTANCE_TOKEN`` of instance ``iid`` when this node has its instance key: only in
        the instance's environment, never in its start command (stored, read by observers) or a log."""
        key = self.cfg.instance_node_key
        return {INSTANCE_TOKEN_ENV: instance_token(key, iid)} if key else {}

    def _probe_provisioner(self, bid: str, gen: int, iid: str, msg_key: str = "") -> ProbeProvisioner:
        """``msg_key``: that of the create (``restart:<seq>`` after an in-place restart), so a fault
        of the restarted instance is a fact of its own, not a repeat of the first run's."""

        async def on_event(kind: str, reason: str) -> None:
            log.warning("instance.fault", node=self.node_id, instance=iid, kind=kind, reason=reason)
            await self._fact(bid, gen, iid, kind, reason, [], msg_key=msg_key)

        return ProbeProvisioner(self.runtime, on_event)

    def _adopt(self, inst: RuntimeInstance, watch: bool = True) -> Runner:
        """Wrap an instance that already runs (seed 001: a runner around the container as-is); its
        resources are read back from its labels so closing it later releases them all."""
        res = labels_to_resources(inst.labels)
        iid = inst.instance_id
        assert self._gpu_prov is not None
        for g in res["gpus"]:
            self._gpu_prov.claims.setdefault(g, set()).add(iid)
        ports = {str(k): int(v) for k, v in res["ports"].items()}
        self._ports.claimed.update(ports.values())
        stages: list[Stage[Any, Any]] = [
            ProvisionStage.adopted(self._gpu_prov, GpuAssignment(iid, res["gpus"], {})),
        ]
        if res["workdir"]:
            stages.append(ProvisionStage.adopted(WorkdirProvisioner(), Path(res["workdir"])))
        stages.append(ProvisionStage.adopted(self._ports, ports))
        stages.append(ProvisionStage.adopted(ContainerProvisioner(self.runtime, grace_s=res["stop_grace_s"]), inst))
        if watch and self.cfg.probes:
            prov = self._probe_provisioner(inst.block_id, inst.gen, iid)
            spec = ProbeSpec(inst.handle, "running")
            probe = Probe(spec, asyncio.create_task(prov.watch(spec), name=f"probe:{iid}"))
            stages.append(ProvisionStage.adopted(prov, probe))
        runner = Runner.adopted(iid, stages)
        if watch:
            self.runners[iid] = runner
            self.meta[iid] = {"block_id": inst.block_id, "gen": inst.gen, "resources": res["resources"], "gpus": res["gpus"],
                              "endpoint": self._endpoint_of(inst, ports)}
            self._count_instances()
        return runner

    def _endpoint_of(self, inst: RuntimeInstance | None, ports: dict[str, int]) -> str:
        """Where the instance serves HTTP: what the runtime says, else this node's address and the
        launch port named ``http`` (or the first); "" for an instance with no port."""
        if inst is not None and inst.endpoint:
            return inst.endpoint
        return endpoint_url(self.cfg.advertise_host, endpoint_port(ports))

    def endpoint(self, iid: str) -> str:
        placed = self.meta.get(iid)
        return placed["endpoint"] if placed is not None else ""

    def workdir(self, iid: str) -> Path:
        return (self.cfg.data_dir / "instances" / iid).resolve()

    # -- reconcile ---------------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.reconcile_once()
                self.reconciled.set()
                return
            except Exception as exc:
                log.warning("agent.reconcile_retry", node=self.node_id, error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def expected(self) -> dict[str, InstanceRecord]:
        """Ask the controllers (request/reply) which instances the state has on this node."""
        msg = await self.bus.nc.request(E.node_expected.subject(nid=self.node_id), b"{}", timeout=5)
        reply = json.loads(msg.data)
        if not isinstance(reply, dict) or "instances" not in reply:
            raise ValueError(f"unexpected reply: {reply!r:.200}")
        return reply["instances"]

    async def reconcile_once(self) -> dict[str, list[str]]:
        found_list = [i for i in await self.runtime.list(self.node_id) if not i.is_sidecar]  # side-cars: SidecarManager
        expected = await self.expected()
        found: dict[str, _Found] = {
            i.instance_id: {"gen": i.gen, "running": i.running, "inst": i} for i in found_list if i.instance_id
        }
        plan = adoption.reconcile(found, expected)
        for iid in plan["adopt"]:
            async with self._locks[iid]:
                if iid not in self.runners:
                    self._adopt(found[iid]["inst"])
        for iid in plan["dangling"]:
            inst: RuntimeInstance = found[iid]["inst"]
            await self.bus.emit(
                E.node_dangling, Dangling(self.node_id, iid, inst.block_id, inst.gen, self.runtime.name, inst.handle, inst.labels),
            )
        for iid in plan["lost"]:
            if iid in self.runners:
                continue
            exp = expected[iid]
            await self._fact(exp["block_id"], int(exp["gen"]), iid, "removed", "lost", [], msg_key=f"lost:{int(time.time())}")
        log.info("agent.reconciled", node=self.node_id, **{k: len(v) for k, v in plan.items()})
        return plan

    # -- facts and heartbeats -----------------------------------------------------------------------
    async def _fact(
        self, bid: str, gen: int, iid: str, event: str, reason: str, gpus: list[str], msg_key: str = "", endpoint: str = "",
    ) -> None:
        ev = InstanceEvent(bid, gen, iid, self.node_id, list(gpus), reason, endpoint, self.boot)
        await self.bus.emit(FACTS[event], ev, qualifier=msg_key)
        counter = self._event_counters.get(event)
        if counter is None:  # ``labels`` locks and checks its values at each call: once per kind here
            counter = self._event_counters[event] = EVENTS.labels(self.node_id, event)
        counter.inc()

    def _count_instances(self) -> None:
        """``aios_agent_instances`` of this node: the runners it holds."""
        if self._instances_gauge is None:
            self._instances_gauge = INSTANCES.labels(self.node_id)
        self._instances_gauge.set(len(self.runners))

    def heartbeat_data(self, seq: int) -> Heartbeat:
        node = self.cfg.node
        cpu = sum(as_float(m["resources"].get("cpu", 0)) for m in self.meta.values())
        mem = sum(as_int(m["resources"].get("memory", 0)) for m in self.meta.values())
        used = {g for m in self.meta.values() for g in m["gpus"]}
        load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return Heartbeat(
            node.id, node.cluster, seq, round(node.cpu - cpu, 3), node.memory - mem,
            len([g for g in node.gpus if g.id not in used]), len(self.runners), load1, self.gpus.utilization(),
            self.cfg.metrics_url,
        )

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            seq += 1
            with contextlib.suppress(Exception):  # a missed beat is what the monitor is for
                await self.bus.emit(E.node_heartbeat, self.heartbeat_data(seq))
                HEARTBEATS.labels(self.node_id).inc()
            await asyncio.sleep(self.cfg.heartbeat_s)


#: the instance facts an agent publishes, by the word its lifecycle uses
FACTS = {"added": E.instance_added, "removed": E.instance_removed, "failed": E.instance_failed, "unhealthy": E.instance_unhealthy}


async def in_flight(endpoint: str, timeout_s: float = 1.0) -> float | None:
    """Tasks the instance at ``endpoint`` handles now, from its ``/metrics``
    (``aios_instance_requests_running``); None when it does not say (no page, no such figure)."""
    import aiohttp

    from ..instance.metrics import RUNNING, parse_text

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, \
                session.get(endpoint + METRICS_PATH) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except Exception:
        return None
    return parse_text(text).get(RUNNING)


def new_boot() -> str:
    """A boot id: the start time in ms (hex) and random bits, unique to one start of one agent."""
    return f"{int(time.time() * 1000):x}-{os.urandom(4).hex()}"


def _ports_of(inst: RuntimeInstance) -> dict[str, int]:
    """The ports an instance's labels record (none: {})."""
    try:
        return {str(k): int(v) for k, v in labels_to_resources(inst.labels)["ports"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}


def _resource(runner: Runner, stage: str) -> Any:
    """The resource a runner's stage holds (None: no such stage, or not set up)."""
    try:
        s = runner.stage(stage)
    except KeyError:
        return None
    return s.resource if isinstance(s, ProvisionStage) else None


def command_router(spec: ConsumerSpec, handler: Any, sidecar_handler: Any = None) -> Router:
    """The agent's consumer: instance create, remove and restart commands, all to ``handler``;
    side-car start and stop commands to ``sidecar_handler`` (absent: acknowledged and ignored)."""
    router = Router(spec)
    router.add(E.node_instance_create, handler)
    router.add(E.node_instance_remove, handler)
    router.add(E.node_instance_restart, handler)

    async def ignore(m: Inbound[Any]) -> None:
        log.info("agent.sidecar_ignored", event=m.event.name, **m.tokens)

    router.add(E.node_sidecar_start, sidecar_handler or ignore)
    router.add(E.node_sidecar_stop, sidecar_handler or ignore)
    return router


def memory_limit(cmd_env: JSONObject) -> int:
    """The GPU memory cap (MiB per GPU) the controller gave a sharing instance, else 0."""
    try:
        return max(as_int(cmd_env.get(GPU_MEMORY_LIMIT_ENV, 0)), 0)
    except (TypeError, ValueError):
        return 0


def bind_host(advertise_host: str) -> str:
    """The address instances bind: loopback when the endpoints advertise loopback, else all."""
    return "127.0.0.1" if advertise_host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"


def instance_env(cmd_env: JSONObject, gpu_env: dict[str, str], ports: dict[str, int], host: str = "") -> dict[str, str]:
    """The instance's environment: ids, GPUs, ports (``AIOS_PORT_<NAME>``, the first also as
    ``AIOS_PORT``), the address to bind (``AIOS_HOST``), and the seed's ``blockInitData``,
    ``initSettings``, ``parameters`` and ``inputProtocol`` as JSON (the first three are also files
    in the working directory)."""
    env: dict[str, str] = {"AIOS_HOST": host} if host else {}
    for k, v in cmd_env.items():
        env[k] = v if isinstance(v, str) else json_text(v)
    env.update(gpu_env)
    for n, (name, port) in enumerate(ports.items()):
        env[f"AIOS_PORT_{name.upper().replace('-', '_')}"] = str(port)
        if n == 0:
            env["AIOS_PORT"] = str(port)
    return env
