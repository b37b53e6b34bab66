"""The simulated fleet: one process serving every simulated node (those registered by
``blocks cluster add`` / ``node add``, whose ``agent`` is empty) through the shared ``agent-sim``
durable. Each node gets a real :class:`NodeAgent` with the simulated runtime — the same lifecycle
code as a real agent — minus what a simulated node has no use for (registration, heartbeats,
working directories, probes).

Commands for nodes served by their own agent (``blocks agent``) are acked and left to that agent.
``AIOS_SIM_START_DELAY_S`` / ``AIOS_SIM_FAIL_RATE`` shape the simulated starts; with
``AIOS_SIM_SERVE`` (the default) every simulated instance is a real HTTP server on 127.0.0.1 of
this process (``agent/sim_serve.py``), its endpoint carried by ``instance.added``.

Simulated instances live in this process's memory: they die with it. A fleet that starts
(``started``) reports, for each simulated node the state has instances on, what it really runs
there (``E.node_inventory``: nothing yet) before it takes a command: the controller marks those
instances lost at once, and the executors stop routing to them (docs/agents.md "Inventory").
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import structlog

from ..bus import subjects
from ..bus.nats_bus import Bus
from ..bus.router import Inbound
from ..runtime.instance_key import node_key
from ..schemas.events import InstanceCommand, SidecarCommand
from ..schemas.records import JSONObject, NodeMeta
from ..schemas.spec import Node
from ..settings import Settings
from .gpus import NoGpus
from .node_agent import AgentConfig, NodeAgent, command_router, new_boot
from .runtime_sim import SimRuntime
from .sim_serve import SimServer

log = structlog.get_logger("aios.agent_sim")

OWNER_TTL_S = 5.0


class FleetState(Protocol):
    """The two reads of the state the fleet makes (``state.store.Store`` has them): the agent
    package imports no state, the worker passes its store in."""

    async def simulated_nodes_with_instances(self) -> list[JSONObject]: ...

    async def node_meta(self, nid: str, cluster: str = "") -> NodeMeta | None: ...


class FleetHost(Protocol):
    """What the fleet takes from the worker process that runs it (``workers.base.Worker``)."""

    @property
    def bus(self) -> Bus: ...

    @property
    def store(self) -> FleetState: ...

    @property
    def settings(self) -> Settings: ...


class Fleet:
    def __init__(self, w: FleetHost):
        self.w = w
        server = SimServer() if w.settings.sim_serve else None
        self.runtime = SimRuntime(start_delay_s=w.settings.sim_start_delay_s, fail_rate=w.settings.sim_fail_rate, server=server)
        self.agents: dict[str, NodeAgent] = {}
        self._owner: dict[str, tuple[float, str | None]] = {}
        self._owner_reads: dict[str, asyncio.Future[str | None]] = {}
        #: this start of the fleet: the boot id of every node agent it runs
        self.boot = new_boot()

    async def announce(self) -> int:
        """``E.node_inventory`` of every simulated node with instances recorded, under this fleet's
        boot: what the simulated runtime runs there (after a restart, nothing). Called before the
        fleet takes a command. Returns the number of nodes announced."""
        specs = await self.w.store.simulated_nodes_with_instances()
        for spec in specs:
            node = Node.model_validate(spec)
            agent = self.agents.get(node.id)
            if agent is None:
                agent = self.agents[node.id] = self._agent(node)
            await agent.announce_running()
        return len(specs)

    async def owner(self, nid: str, cluster: str = "") -> str | None:
        """"" when the fleet serves the node, an agent name when a real agent does, None if unknown.
        ``cluster``: the command's, read with the node index in one exchange (``Store.node_meta``)."""
        now = time.monotonic()
        hit = self._owner.get(nid)
        if hit and now - hit[0] < OWNER_TTL_S:
            return hit[1]
        # one read for the commands to a node that arrive together (a burst placing on it): the
        # first reads in its caller's task (no task of its own: one turn of the loop less on every
        # first command to a node), the others wait for its answer
        pending = self._owner_reads.get(nid)
        if pending is not None:
            return await asyncio.shield(pending)
        shared = self._owner_reads[nid] = asyncio.get_running_loop().create_future()
        try:
            owner = await self._read_owner(nid, cluster)
        except BaseException as exc:
            # the others' reads fail too (their commands come back), whatever ended this one
            shared.set_exception(exc if isinstance(exc, Exception) else ConnectionError(f"owner read ended: {exc!r}"))
            shared.exception()  # retrieved: nobody else may be waiting
            raise
        else:
            shared.set_result(owner)
            return owner
        finally:
            self._owner_reads.pop(nid, None)

    async def _read_owner(self, nid: str, cluster: str = "") -> str | None:
        meta = await self.w.store.node_meta(nid, cluster)
        owner = None if meta is None else meta["agent"]
        self._owner[nid] = (time.monotonic(), owner)
        if meta is not None and owner == "" and nid not in self.agents:
            self.agents[nid] = self._agent(Node.model_validate(meta["spec"]))
        return owner

    def _agent(self, node: Node) -> NodeAgent:
        """A NodeAgent for a simulated node: no registration, heartbeats, directories or probes."""
        cfg = AgentConfig(
            node=node, runtime_name="sim", register=False, inventory=False, reconcile=False, heartbeat=False, workdirs=False,
            probes=False, drain_grace_s=self.w.settings.drain_grace_s,
            # it plays every simulated node: it holds K and gives each node's agent only K_N
            instance_node_key=node_key(key, node.id) if (key := self.w.settings.instance_key) else "",
        )
        return NodeAgent(self.w.bus, self.runtime, NoGpus(), cfg, boot=self.boot)

    async def on_command(self, m: Inbound[InstanceCommand]) -> None:
        nid = m.tokens["nid"]
        owner = await self.owner(nid, m.data.cluster_id)
        if owner is None:
            # a node nobody registered: answer for it so the block's story still ends
            if nid not in self.agents:
                self.agents[nid] = self._agent(Node(id=nid, cluster="unknown"))
        elif owner != "":
            return  # served by its own agent
        await self.agents[nid].on_command(m)


    async def on_command_sidecar(self, m: Inbound[SidecarCommand]) -> None:
        """A side-car of a simulated node: run (as a record) by the simulated runtime."""
        nid = m.tokens["nid"]
        owner = await self.owner(nid, m.data.cluster_id)
        if owner is None and nid not in self.agents:
            self.agents[nid] = self._agent(Node(id=nid, cluster="unknown"))
        elif owner not in (None, ""):
            return
        await self.agents[nid].on_sidecar(m)


def bindings(w: FleetHost, fleet: Fleet | None = None) -> list[tuple[subjects.ConsumerSpec, Any]]:
    fleet = fleet or Fleet(w)
    return [command_router(subjects.agent(), fleet.on_command, fleet.on_command_sidecar).binding()]


async def started(w: FleetHost) -> list[tuple[subjects.ConsumerSpec, Any]]:
    """The fleet of a worker process that starts: its inventories out first (``Fleet.announce``),
    then its consumer's bindings. A failed read of the state is logged; the fleet serves anyway
    (its instances' health checks are the fallback)."""
    fleet = Fleet(w)
    try:
        n = await fleet.announce()
        log.info("agent_sim.announced", boot=fleet.boot, nodes=n)
    except Exception as exc:
        log.warning("agent_sim.announce_failed", error=repr(exc))
    return bindings(w, fleet)
