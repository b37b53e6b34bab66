"""The simulated fleet's turn on ``node.instance.create`` (docs/trace.md "Where a create's time
goes"): a first command to a node reads the node's registration once (one read for the commands to
a node that arrive together) and starts no task of its own (the read in the handler's task, no
task per runner waiting for its end); the instance serves, ``added`` carries its endpoint, and a
remove tears it down once."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any, cast

import pytest

from aios_blocks.agent import fleet as fl
from aios_blocks.agent.lifecycle import FixedSpec, Provisioner, ProvisionStage, Runner
from aios_blocks.bus.catalog import E
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.schemas.events import InstanceCommand
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.settings import Settings


class _Bus:
    def __init__(self) -> None:
        self.facts: list[tuple[str, Any]] = []

    async def emit(self, event: Any, payload: Any, **_: Any) -> None:
        self.facts.append((event.name, payload))


class _Store:
    def __init__(self, *nodes: Node) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.reads: list[str] = []

    async def node_meta(self, nid: str, cluster: str = "") -> Any:
        self.reads.append(nid)
        await asyncio.sleep(0)  # an exchange: the other commands of the same turn come meanwhile
        n = self.nodes.get(nid)
        return None if n is None else {"cluster": n.cluster, "agent": "", "healthy": True, "spec": n.model_dump(mode="json")}

    async def simulated_nodes_with_instances(self) -> list[Any]:
        return []


class _Host:
    def __init__(self, *nodes: Node) -> None:
        self.bus = _Bus()
        self.store = _Store(*nodes)
        self.settings = Settings(sim_start_delay_s=0)


def _fleet(host: _Host) -> fl.Fleet:
    return fl.Fleet(cast(Any, host))  # a host with the fleet's few needs, not a Worker


def _node(nid: str) -> Node:
    return Node(id=nid, cluster="c0", gpus=[Gpu(id=f"{nid}-g0")])


def _command(event: Any, nid: str, i: int) -> Inbound[InstanceCommand]:
    cmd = InstanceCommand(f"b{i}", 1, "c0", f"b{i}-0", nid, [f"{nid}-g0"] if event is E.node_instance_create else [],
                          env={"AIOS_INSTANCE_ID": f"b{i}-0", "blockInitData": {}, "initSettings": {}, "parameters": {}},
                          resources={"gpus": 1, "cpu": 1.0})
    subject = event.subject(nid=nid)
    return Inbound(event, cmd, {"nid": nid}, Delivery(subject, b"", {}, 1, i + 1))


class _Tasks:
    """Every task made on the running loop while inside (a task factory)."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def __enter__(self) -> _Tasks:
        loop = asyncio.get_running_loop()
        self._before = loop.get_task_factory()

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
            self.made.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kw)

        loop.set_task_factory(factory)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.get_running_loop().set_task_factory(self._before)


async def test_a_first_command_to_a_node_starts_no_task_and_its_instance_serves() -> None:
    host = _Host(_node("n1"))
    fleet = _fleet(host)
    server = fleet.runtime.server
    assert server is not None
    await server._ensure()  # the server's one-time setup apart
    try:
        with _Tasks() as tasks:
            await fleet.on_command(_command(E.node_instance_create, "n1", 0))
        assert tasks.made == []  # the read of the node's owner and the runner: no task of their own
        assert host.store.reads == ["n1"]
        [(name, fact)] = host.bus.facts
        assert name == E.instance_added.name and fact.instance_id == "b0-0" and fact.endpoint.startswith("http://127.0.0.1:")
        ok = await asyncio.to_thread(urllib.request.urlopen, f"{fact.endpoint}/health", timeout=5)
        assert ok.status == 200

        await fleet.on_command(_command(E.node_instance_remove, "n1", 0))
        assert [n for n, _ in host.bus.facts] == [E.instance_added.name, E.instance_removed.name]
        assert server.by_id == {}  # torn down: it serves no more
    finally:
        await fleet.runtime.close()


async def test_a_create_without_a_launch_validates_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated create carries no launch: its runner takes the default one, validated once for
    the process (``node_agent.NO_LAUNCH``), not ``{}`` validated again per command (a pydantic
    model with a Python validator per field, ~5 % of the fleet's turn in a py-spy profile); a
    create with a launch is validated as before."""
    from aios_blocks.agent import node_agent
    from aios_blocks.schemas.spec import Launch

    validated: list[Any] = []

    class _Seen(Launch):
        @classmethod
        def model_validate(cls, obj: Any, **kw: Any) -> Launch:  # type: ignore[override]
            validated.append(obj)
            return Launch.model_validate(obj, **kw)

    monkeypatch.setattr(node_agent, "Launch", _Seen)
    host = _Host(_node("n1"))
    fleet = _fleet(host)
    try:
        await fleet.on_command(_command(E.node_instance_create, "n1", 0))
        assert validated == []  # old code: [{}]
        with_launch = _command(E.node_instance_create, "n1", 1)
        with_launch.data.launch = {"stopGraceS": 3}
        await fleet.on_command(with_launch)
        assert validated == [{"stopGraceS": 3}]
        assert [f.instance_id for _, f in host.bus.facts] == ["b0-0", "b1-0"]
        assert node_agent.NO_LAUNCH == Launch.model_validate({})  # the same launch as before
    finally:
        await fleet.runtime.close()


async def test_commands_to_a_node_that_arrive_together_read_it_once() -> None:
    host = _Host(_node("n1"))
    fleet = _fleet(host)
    try:
        await asyncio.gather(*(fleet.on_command(_command(E.node_instance_create, "n1", i)) for i in range(3)))
        assert host.store.reads == ["n1"]
        assert sorted(f.instance_id for _, f in host.bus.facts) == ["b0-0", "b1-0", "b2-0"]
        assert fleet._owner_reads == {}
    finally:
        await fleet.runtime.close()


async def test_a_failed_read_fails_every_command_waiting_for_it() -> None:
    host = _Host(_node("n1"))

    async def broken(nid: str, cluster: str = "") -> Any:
        await asyncio.sleep(0)
        raise ConnectionError("redis away")

    host.store.node_meta = broken  # type: ignore[method-assign]
    fleet = _fleet(host)
    got = await asyncio.gather(*(fleet.on_command(_command(E.node_instance_create, "n1", i)) for i in range(2)),
                               return_exceptions=True)
    assert [type(g) for g in got] == [ConnectionError, ConnectionError]  # each comes back (retried by its runner)
    assert host.bus.facts == [] and fleet._owner_reads == {}


class _Counted(Provisioner[int, str]):
    def __init__(self) -> None:
        self.teardowns = 0

    @property
    def name(self) -> str:
        return "counted"

    async def setup(self, spec: int) -> str:
        return f"r{spec}"

    async def teardown(self, resource: str) -> None:
        await asyncio.sleep(0)
        self.teardowns += 1


@pytest.mark.parametrize("adopted", [False, True])
async def test_a_runner_closed_twice_at_once_tears_down_once(adopted: bool) -> None:
    prov = _Counted()
    if adopted:
        runner = Runner.adopted("i", [ProvisionStage.adopted(prov, "r1")])
    else:
        runner = Runner("i", [(ProvisionStage(prov), FixedSpec(1))])
        await runner.start()
    await asyncio.gather(runner.close(), runner.close())
    await runner.close()
    assert prov.teardowns == 1
