"""Node agents with real runtimes: the Docker engine (dockerd) and local processes, over real NATS
JetStream and Redis, with the real worker processes. Each lifecycle test runs on both runtimes
where the runtime is what it proves (start, labels, stages, cleanup, exit, re-adoption, restart
in place); those whose point is the controller's and health checker's handling of what the agent
reports (``PROCESS_ONLY``) run on the process runtime only, the runtime parts of their path
being proven on both by the others.

Docker cases need an engine: `.ci/run` starts one; without one they are skipped, loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.agent.runtime import LaunchSpec, Runtime, RuntimeInstance
from aios_blocks.agent.runtime_process import ProcessRuntime, process_scope
from aios_blocks.cli.client import Client
from aios_blocks.runtime.auth import url_user

from .conftest import COMPONENT, System

APP = str(Path(__file__).with_name("agent_app.py"))
#: the controllers' node timeout (fast fault handling); a test whose agent is restarted and must be
#: back before it sets a longer one (``node_timeout`` marker): a cold `blocks agent` start takes
#: seconds on a loaded machine, and a node silent that long has its instances moved
NODE_TIMEOUT_S = 3.0
RESTART_NODE_TIMEOUT_S = 120.0


# -- the Docker engine ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def docker_image() -> Iterator[str]:
    try:
        import docker

        from aios_blocks.agent.busybox_image import ensure_image

        client = docker.from_env()
        client.ping()
        tag = ensure_image(client)
    except Exception as exc:
        msg = f"DOCKER TESTS SKIPPED: no Docker engine could be reached ({exc}); `.ci/run` starts dockerd"
        print(f"\n{'!' * 20} {msg} {'!' * 20}", file=sys.stderr)
        pytest.skip(msg)
    yield tag
    with contextlib.suppress(Exception):
        for c in client.containers.list(all=True, filters={"label": "aios.test=1"}):
            c.remove(force=True)


RUNTIMES = ["process", "docker"]
#: a test whose runtime part (start, exit, stop) the twin tests prove on both runtimes: it runs on
#: the process runtime only (a docker twin proved nothing more and took its time)
PROCESS_ONLY = pytest.mark.parametrize("runtime_setup", ["process"], indirect=True)


@dataclass
class Agents:
    """Agent processes (``blocks agent``) for one test, plus the runtime to inspect what they run."""

    system: System
    runtime_name: str
    base: Path
    image: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def runtime(self) -> Runtime:
        if self.runtime_name == "docker":
            from aios_blocks.agent.runtime_docker import DockerRuntime

            return DockerRuntime()
        return ProcessRuntime(scope=process_scope(self.base / "agent"))  # this test's agents' processes only

    async def environment(self, inst: RuntimeInstance) -> dict[str, str]:
        """The environment the instance really runs with (the container's config, the process's)."""
        if self.runtime_name == "docker":
            import docker

            attrs = await asyncio.to_thread(lambda: docker.from_env().containers.get(inst.handle).attrs)
            return dict(e.split("=", 1) for e in attrs["Config"]["Env"])
        import psutil

        return dict(psutil.Process(int(inst.handle.split("-", 1)[0])).environ())

    def component(self, **launch: Any) -> dict[str, Any]:
        comp = dict(COMPONENT, componentURI=f"aios://test/{self.runtime_name}-app")
        comp["resources"] = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 256}
        probe = {"type": "http", "port": "http", "path": "/health", "intervalS": 0.5, "failureThreshold": 2, "startTimeoutS": 20}
        base = {"ports": ["http"], "probe": probe, "stopGraceS": 2}
        if self.runtime_name == "docker":
            comp["image"] = self.image
        else:
            base["command"] = [sys.executable, APP]
        base.update(launch)
        comp["launch"] = base
        return comp

    def start(self, nid: str, cluster: str = "ca", rack: str = "r0", standalone: bool = False) -> subprocess.Popen[bytes]:
        """``standalone``: as one runs `blocks agent` next to `blocks up` (docs/agents.md): no NATS
        setting in its environment, only ``--data-dir`` (it takes its node's user from there)."""
        env = {**os.environ, "AIOS_NATS_URL": self.system.supervisor.nats_url}
        env.pop("AIOS_REDIS_URL", None)  # an agent needs only NATS
        servers = self.system.servers
        extra: list[str] = []
        if standalone:
            assert servers is not None, "a standalone agent needs the embedded servers' data dir"
            for name in ("AIOS_NATS_URL", "AIOS_NATS_CA", "AIOS_EVENT_KEY", "AIOS_SIDECAR_NATS_URL"):
                env.pop(name, None)
            extra = ["--data-dir", str(self.system.data_dir)]
        elif servers is not None:  # as the node's own user agent-<nid>: only its node's rights
            env.update(servers.agent_env(nid))
            assert not servers.auth or url_user(env["AIOS_NATS_URL"]) == f"agent-{nid}"
        log = open(self.base / f"agent-{nid}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", nid, "--cluster", cluster,
             "--runtime", self.runtime_name, "--sim-gpus", "2", "--cpu", "8", "--memory", "16384", "--rack", rack,
             "--heartbeat-s", "0.5", "--agent-dir", str(self.base / "agent"), *extra],
            env=env, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        self.procs[nid] = proc
        return proc

    async def wait_registered(self, nid: str, timeout: float = 90) -> None:
        async with asyncio.timeout(timeout):
            while (await self.system.client.store.node_meta(nid)) is None:
                await asyncio.sleep(0.1)

    def kill(self, nid: str, sig: int = signal.SIGKILL) -> None:
        self.procs[nid].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.procs[nid].wait(10)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


@pytest.fixture(params=RUNTIMES)
def runtime_setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The runtime under test (+ its image); controller settings for fast fault handling. Runs
    before ``system`` so the worker processes inherit the settings."""
    runtime = request.param
    image = request.getfixturevalue("docker_image") if runtime == "docker" else ""
    marker = request.node.get_closest_marker("node_timeout")
    monkeypatch.setenv("AIOS_NODE_TIMEOUT_S", str(marker.args[0] if marker else NODE_TIMEOUT_S))
    monkeypatch.setenv("AIOS_MAX_REPLACEMENTS", "2")
    return runtime, image


@pytest.fixture
async def agents(runtime_setup: tuple[str, str], system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    runtime, image = runtime_setup
    a = Agents(system, runtime, tmp_path, image)
    rt = a.runtime()
    try:
        yield a
    finally:
        a.stop_all()
        for _ in range(2):  # leave nothing behind on the host (a second pass: a start in flight)
            for nid in list(a.procs):
                for inst in await rt.list(nid):
                    await rt.stop(inst.handle, 0)
            await asyncio.sleep(0.5)
        await rt.close()


async def until(fn: Any, timeout: float = 150, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        out = await fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def setup_block(a: Agents, nodes: tuple[str, ...] = ("n1",), **launch: Any) -> tuple[Client, str]:
    c = a.system.client
    for i, nid in enumerate(nodes):
        a.start(nid, rack=f"r{i}")
    for nid in nodes:
        await a.wait_registered(nid)
    await c.add_component(a.component(**launch))
    return c, f"aios://test/{a.runtime_name}-app"


def http_get(port: int, path: str) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read()


async def running_on(a: Agents, nid: str) -> list[RuntimeInstance]:
    return [i for i in await a.runtime().list(nid) if i.running]


# -- the tests -------------------------------------------------------------------------------------
async def test_instance_runs_labelled_is_added_and_delete_removes_it(agents: Agents) -> None:
    c, uri = await setup_block(agents)
    bid, kind, env = await agents.system.submit_and_wait(
        {"blockComponentURI": uri, "minInstances": 1, "maxInstances": 2, "blockInitData": {"model": "tiny"}}, timeout=150
    )
    assert kind == "ready", env
    (iid,) = env["data"]["instances"]
    insts = await running_on(agents, "n1")
    assert [i.instance_id for i in insts] == [iid]
    labels = insts[0].labels
    assert labels["aios.block"] == bid and labels["aios.instance"] == iid and labels["aios.node"] == "n1"
    recorded = (await c.store.instances(bid))[iid]["gpus"]  # which of the node's GPUs: the resourceAllocator's choice
    assert labels["aios.spec-version"] == "1" and labels["aios.gpus"] == ",".join(recorded) and len(recorded) == 1
    port = int(json.loads(labels["aios.ports"])["http"])
    assert http_get(port, "/health").strip() == b"ok"
    # the endpoint the agent reported with instance.added is recorded with the instance, and answers
    endpoint = (await c.store.instances(bid))[iid]["endpoint"]
    assert endpoint == f"http://127.0.0.1:{port}"
    assert (await asyncio.to_thread(urllib.request.urlopen, f"{endpoint}/health", timeout=5)).status == 200
    assert json.loads(http_get(port, "/init.json")) == {"model": "tiny"}
    # the GPU env it really got: UUIDs (simulated GPUs are not attached, so the host's indices)
    gpu_env = await agents.environment(insts[0])
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == gpu_env["NVIDIA_VISIBLE_DEVICES"] == gpu_env["AIOS_GPUS"] == recorded[0]
    assert recorded[0].startswith("GPU-n1-") and gpu_env["AIOS_GPU_INDICES"] == recorded[0].rsplit("-", 1)[1]
    servers = agents.system.servers  # its own token (docs/security.md), not in its stored start command
    if servers is not None and servers.auth:
        from aios_blocks.runtime import instance_key

        assert gpu_env["AIOS_INSTANCE_TOKEN"] == instance_key.token(instance_key.read(servers.data_dir) or "", "n1", iid)
    workdir = Path(labels["aios.workdir"])
    assert (workdir / "blockInitData.json").exists()
    history = [s for s, _, _ in await c.history(bid)]
    assert f"aios.block.{bid}.instance.{iid}.added" in history

    await c.delete(bid)
    await until(lambda: _status(c, bid, "deleted"), what="block deleted")
    assert await running_on(agents, "n1") == []
    assert await agents.runtime().list("n1") == []
    assert not await asyncio.to_thread(workdir.exists)
    with pytest.raises(OSError):
        http_get(port, "/health")
    removed = [s for s, _, _ in await c.history(bid) if s.endswith(".removed")]
    assert removed == [f"aios.block.{bid}.instance.{iid}.removed"]


async def _status(c: Client, bid: str, status: str) -> bool:
    block = await c.store.get_block(bid)
    return bool(block and block["status"] == status)


async def test_setup_failing_late_leaves_no_container_port_or_directory(agents: Agents) -> None:
    # the probe (the stage after gpus, workdir, ports and the container) never passes
    c, uri = await setup_block(agents, probe={"type": "http", "port": "http", "path": "/nope", "startTimeoutS": 2, "intervalS": 0.2})
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 1}, timeout=180)
    assert kind == "failed", env
    assert "instance replacements" in env["data"]["reason"]
    history = await c.history(bid)
    failed = [e["data"] for s, e, _ in history if s.endswith(".failed") and ".instance." in s]
    assert failed and all("stage 'probe' failed" in f["reason"] for f in failed), failed
    assert all("GET /nope" in f["reason"] for f in failed)
    assert await agents.runtime().list("n1") == []  # no container/process, running or not
    instances_dir = agents.base / "agent" / "n1" / "instances"
    assert not instances_dir.exists() or list(instances_dir.iterdir()) == []
    # every reservation is given back (the failed block's instances are removed, then released)
    await until(lambda: _no_reservations(c, "ca"), what="reservations released")
    # ... and their records dropped (the release comes first, then the record: wait for both)
    await until(lambda: _no_instances(c, bid), what="instance records dropped")


async def _no_instances(c: Client, bid: str) -> bool:
    return await c.store.instances(bid) == {}


async def _no_reservations(c: Client, cid: str) -> bool:
    return await c.store.reservations(cid) == []


async def test_setup_failing_at_the_container_stage_cleans_up(agents: Agents) -> None:
    broken = {"command": ["/no/such/binary"]} if agents.runtime_name == "process" else {}
    c, uri = await setup_block(agents, **broken)
    if agents.runtime_name == "docker":
        comp = agents.component()
        comp["image"] = "aios-test/absent:0"
        await c.add_component(comp)
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 1}, timeout=180)
    assert kind == "failed", env
    failed = [e["data"]["reason"] for s, e, _ in await c.history(bid) if s.endswith(".failed") and ".instance." in s]
    assert failed and all(f"stage '{agents.runtime_name}' failed" in r for r in failed), failed
    assert await agents.runtime().list("n1") == []
    instances_dir = agents.base / "agent" / "n1" / "instances"
    assert not instances_dir.exists() or list(instances_dir.iterdir()) == []


@pytest.mark.node_timeout(RESTART_NODE_TIMEOUT_S)  # its node is not declared down while its agent restarts
async def test_sigkilled_agent_readopts_its_instance_and_reports_a_planted_one_dangling(agents: Agents) -> None:
    c, uri = await setup_block(agents)
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 1}, timeout=150)
    assert kind == "ready", env
    (before,) = await running_on(agents, "n1")
    # plant an aios-labelled instance of an id nobody placed
    ghost = LaunchSpec(
        instance_id="ghost-1", block_id="ghost", node_id="n1", gen=1, image=agents.image,
        command=[] if agents.runtime_name == "docker" else [sys.executable, APP], env={"AIOS_PORT": "0"},
    )
    rt = agents.runtime()
    if agents.runtime_name == "docker":
        # not the image's httpd, which as PID 1 ignores SIGTERM: its removal (a dangling one's
        # stop grace is the default 10 s) would wait that out; any labelled container will do
        ghost.command = ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]
    planted = await rt.start(ghost)
    dangling: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_dangling(msg: Any) -> None:
        await dangling.put(json.loads(msg.data))

    await c.bus.subscribe("aios.node.n1.instance.dangling", on_dangling)
    agents.kill("n1", signal.SIGKILL)
    still = await rt.status(before.handle)
    assert still is not None and still.running  # the instance outlives its agent
    agents.start("n1")
    event = await asyncio.wait_for(dangling.get(), 150)
    assert event["data"]["instance_id"] == "ghost-1" and event["data"]["block_id"] == "ghost"
    # the controller's rule removes the unknown one; the known one is the very same, untouched
    await until(lambda: _gone(rt, planted.handle), what="planted instance removed")
    after = await rt.status(before.handle)
    assert after is not None and after.running and after.handle == before.handle
    assert (await c.store.get_block(bid))["status"] == "ready"
    # re-adopted means owned: deleting the block stops it and frees its resources
    await c.delete(bid)
    await until(lambda: _status(c, bid, "deleted"), what="block deleted")
    assert await rt.list("n1") == []


async def _gone(rt: Runtime, handle: str) -> bool:
    st = await rt.status(handle)
    return st is None or not st.running


async def test_exited_instance_is_replaced_through_reassignment(agents: Agents) -> None:
    c, uri = await setup_block(agents)
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 2}, timeout=150)
    assert kind == "ready", env
    (old_iid,) = env["data"]["instances"]
    (inst,) = await running_on(agents, "n1")
    await _kill_instance(agents, inst)
    new = await until(lambda: _replaced(c, bid, old_iid), what="replacement running")
    history = await c.history(bid)
    facts = [s.rsplit(".", 1)[1] for s, _, _ in history if f".instance.{old_iid}." in s]
    assert "failed" in facts and "removed" in facts
    decisions = [d for d in await c.decisions(bid=bid) if d["action"] == "reassignment"]  # inputs rebuilt by replay
    assert decisions and decisions[0]["input_check"] == "rebuilt"
    assert decisions[0]["input"]["payload"]["instance_id"] == old_iid
    running = await running_on(agents, "n1")
    assert [i.instance_id for i in running] == [new]


async def test_a_restart_verdict_restarts_the_instance_in_place_keeping_its_id(agents: Agents) -> None:
    """The health checker's ``restart`` (docs/health.md): the controller sends the node
    ``node.instance.restart``; the agent stops the instance and starts it again under the same id
    (a new process / container), which is reported ``added`` again; nothing is replaced."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import InstanceVerdict

    c, uri = await setup_block(agents, nodes=("hrn1",))  # a node name of its own: processes are found host-wide
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 2}, timeout=150)
    assert kind == "ready", env
    (iid,) = env["data"]["instances"]
    (before,) = await running_on(agents, "hrn1")
    await c.bus.emit(E.instance_verdict, InstanceVerdict(bid, int(env["data"]["gen"]), iid, "hrn1", "restart", "test: restart it",
                                                         policy="test", seq="t1"))

    after = await _restarted_in_place(agents, "hrn1", before, iid)
    assert after.instance_id == iid

    async def added_again() -> list[str]:
        history = await c.history(bid)
        added = [s for s, _, _ in history if s.endswith(f".instance.{iid}.added")]
        assert not [s for s, _, _ in history if s.endswith((".failed", ".removed"))]
        return added if len(added) >= 2 else []

    await until(added_again, what="added reported again after the restart (its probe passed)")
    insts = await c.store.instances(bid)
    assert list(insts) == [iid] and insts[iid]["status"] == "running"  # same record: no replacement


async def _restarted_in_place(agents: Agents, node: str, before: RuntimeInstance, iid: str) -> RuntimeInstance:
    """The one instance on ``node`` running again under ``iid`` as a new process/container."""

    async def restarted() -> RuntimeInstance | None:
        now = await running_on(agents, node)
        return now[0] if len(now) == 1 and now[0].handle != before.handle and now[0].instance_id == iid else None

    return await until(restarted, what=f"{iid} running again under its id on {node}")


RESTARTER = """
class Restarter:
    # a stabilityChecker that restarts, in place, an instance its node agent reported (and
    # leaves the health checker's ticks alone)
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input_data, context):
        return {"verdicts": {i["instance_id"]: {"verdict": "restart", "reason": "agent said " + i["agent"]["report"]}
                             for i in input_data["payload"]["instances"] if i.get("agent")}}
"""


@PROCESS_ONLY  # exit detection, restart and stop on docker: the twin tests above
async def test_an_agent_reported_failure_goes_through_the_stability_checker_which_may_restart_in_place(agents: Agents) -> None:
    """Issue 16: the agent's ``failed`` report is judged by the block's stabilityChecker
    (docs/health.md, "Agent reports"); this one answers ``restart``, so the killed instance is
    started again under its id on its node instead of being replaced. On the process runtime only:
    what it proves is the controller's; an exit seen and a restart in place on docker are proven by
    the docker twins of the exit and restart-verdict tests."""
    c, uri = await setup_block(agents, nodes=("frn1",))  # a node name of its own: processes are found host-wide
    await c.policy_put("restarter", RESTARTER, "python")
    spec = {"blockComponentURI": uri, "minInstances": 1, "maxInstances": 2,
            "policyRulesSpec": [{"values": {"name": "stabilityChecker", "policyRuleURI": "registry:restarter"}}]}
    bid, kind, env = await agents.system.submit_and_wait(spec, timeout=150)
    assert kind == "ready", env
    (iid,) = env["data"]["instances"]
    (before,) = await running_on(agents, "frn1")
    await _kill_instance(agents, before)

    after = await _restarted_in_place(agents, "frn1", before, iid)
    assert after.instance_id == iid

    async def added_again() -> list[str]:
        history = await c.history(bid)
        added = [s for s, _, _ in history if s.endswith(f".instance.{iid}.added")]
        return added if len(added) >= 2 else []

    await until(added_again, what="added reported again after the restart")
    history = await c.history(bid)
    subjects_ = [s for s, _, _ in history]
    assert any(s.endswith(f".instance.{iid}.failed") for s in subjects_), subjects_
    assert not any(s.endswith((".removed", ".reassignment")) for s in subjects_), subjects_
    insts = await c.store.instances(bid)
    assert list(insts) == [iid] and insts[iid]["status"] == "running"  # same record: nothing replaced
    calls = [d for d in await c.decisions(bid=bid) if d["kind"] == "stabilityChecker" and d.get("input")
             and any(i.get("agent") for i in d["input"]["payload"]["instances"])]
    assert calls and calls[0]["output"]["verdicts"][iid]["verdict"] == "restart" and not calls[0].get("error"), calls
    assert calls[0]["input"]["payload"]["instances"][0]["agent"]["report"] == "failed"


RAISER = """
class Raiser:
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input_data, context):
        raise RuntimeError("broken on purpose")
"""


@PROCESS_ONLY  # exit detection, restart and stop on docker: the twin tests above
async def test_a_stability_checker_that_fails_on_an_agent_report_leaves_the_old_rule(agents: Agents) -> None:
    """A broken stabilityChecker never leaves an exited instance dead: the framework replaces it (the
    old rule) and records the failure, from the controller, as ``block.health.failed``. On the
    process runtime only: the fallback is the controller's; a docker exit replaced is proven by the
    exit test's docker twin."""
    c, uri = await setup_block(agents, nodes=("frn2",))
    await c.policy_put("raiser", RAISER, "python")
    spec = {"blockComponentURI": uri, "minInstances": 1, "maxInstances": 2,
            "policyRulesSpec": [{"values": {"name": "stabilityChecker", "policyRuleURI": "registry:raiser"}}]}
    bid, kind, env = await agents.system.submit_and_wait(spec, timeout=150)
    assert kind == "ready", env
    (old_iid,) = env["data"]["instances"]
    (inst,) = await running_on(agents, "frn2")
    await _kill_instance(agents, inst)
    await until(lambda: _replaced(c, bid, old_iid), what="replacement running")

    async def recorded() -> list[dict[str, Any]]:
        return [env["data"] for s, env, _ in await c.history(bid)
                if s.endswith(".health.failed") and env["data"]["step"] == "agent_report"]

    (failed,) = await until(recorded, what="the policy's failure recorded")
    assert "broken on purpose" in failed["reason"] and "old rule: reassign" in failed["reason"]
    assert failed["decisions"] and "broken on purpose" in failed["decisions"][0]["error"]


async def _kill_instance(a: Agents, inst: RuntimeInstance) -> None:
    if a.runtime_name == "docker":
        import docker

        docker.from_env().containers.get(inst.handle).kill()
    else:
        os.kill(int(inst.handle.split("-")[0]), signal.SIGKILL)


async def _replaced(c: Client, bid: str, old: str) -> str | None:
    insts = await c.store.instances(bid)
    fresh = [iid for iid, i in insts.items() if iid != old and i["status"] == "running"]
    return fresh[0] if fresh and old not in insts else None


@PROCESS_ONLY  # the node timeout is the controller's; the old copy's stop on docker: the delete tests
async def test_node_that_stops_heartbeating_has_its_instances_moved(agents: Agents) -> None:
    """A node whose agent is alive but silent (SIGSTOP) has its instance moved to another node; back,
    it is healthy again and its old copy is stopped. On the process runtime only: the node timeout
    and the move are the controller's; stopping a container is proven by the docker delete tests."""
    c, uri = await setup_block(agents, nodes=("n1", "n2"))
    bid, kind, env = await agents.system.submit_and_wait({"blockComponentURI": uri, "minInstances": 1, "maxInstances": 1}, timeout=150)
    assert kind == "ready", env
    (iid,) = env["data"]["instances"]
    node = (await c.store.instances(bid))[iid]["node"]
    other = "n2" if node == "n1" else "n1"
    health: list[dict[str, Any]] = []

    async def on_health(msg: Any) -> None:
        health.append(json.loads(msg.data)["data"])

    await c.bus.subscribe(f"aios.node.{node}.health", on_health)
    agents.kill(node, signal.SIGSTOP)  # alive but silent: no heartbeats, no commands served
    try:
        new = await until(lambda: _replaced(c, bid, iid), what="instance moved off the silent node")
        assert (await c.store.instances(bid))[new]["node"] == other
        meta = await c.store.node_meta(node)
        assert meta is not None and meta["healthy"] is False
        assert health and health[0]["healthy"] is False and health[0]["evicted"] == [iid]
        # its reservation was released at once
        res = {r["iid"] for r in await c.store.reservations("ca")}
        assert res == {new}
    finally:
        agents.kill(node, signal.SIGCONT)
    # back: healthy again, and the old copy is stopped so the instance runs once
    await until(lambda: _healthy(c, node), what="node healthy again")
    assert [h["healthy"] for h in health] == [False, True]
    await until(lambda: _not_running(agents, node, iid), what=f"old copy {iid} stopped on the returning node {node}")
    assert [i.instance_id for i in await running_on(agents, other)] == [new]


async def _healthy(c: Client, nid: str) -> bool:
    meta = await c.store.node_meta(nid)
    return bool(meta and meta["healthy"])


async def _not_running(a: Agents, nid: str, iid: str) -> bool:
    return iid not in [i.instance_id for i in await running_on(a, nid)]


async def test_real_gpus_reach_the_docker_engine_as_a_device_request(docker_image: str, tmp_path: Path) -> None:
    """An agent whose NVML reports GPUs asks the real engine for them by UUID. This engine has no
    NVIDIA runtime, so it refuses the request with its own reason: the request reached it, the
    instance fails at the container stage and leaves no container behind."""
    from aios_blocks.agent.gpus import detect
    from aios_blocks.agent.lifecycle import StageFailed
    from aios_blocks.agent.node_agent import AgentConfig, NodeAgent
    from aios_blocks.agent.runtime_docker import DockerRuntime
    from aios_blocks.schemas.events import InstanceCommand
    from aios_blocks.schemas.spec import Gpu, Node

    from ..unit.test_agent_lifecycle import FakeNvml

    nvml = detect(None, "gpu-n1", FakeNvml(2))
    node = Node(id="gpu-n1", cluster="c", gpus=[Gpu(id=g.id, memory=g.memory) for g in nvml.gpus()])
    rt = DockerRuntime()
    cfg = AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False, workdirs=False, probes=False)
    agent = NodeAgent(None, rt, nvml, cfg)  # type: ignore[arg-type]  # no fact is published here
    cmd = InstanceCommand("b", 1, "c", "b-gpu0", "gpu-n1", ["GPU-0001"], docker_image, {}, launch={"command": ["sleep", "30"]})
    try:
        with pytest.raises(StageFailed) as info:
            await agent._build(cmd).start()
        assert info.value.stage == "docker" and "could not select device driver" in str(info.value.cause), info.value
        assert await rt.list("gpu-n1") == []
    finally:
        for inst in await rt.list("gpu-n1"):
            await rt.stop(inst.handle, 0)
        await rt.close()


async def test_a_docker_instance_that_exits_says_its_last_output(docker_image: str) -> None:
    """The process runtime's exits carry the instance's last lines (its ``failed`` reason, a
    side-car's ``sidecar.exited``); a container said only 'exited with code 3'."""
    from aios_blocks.agent.runtime_docker import DockerRuntime

    rt = DockerRuntime()
    spec = LaunchSpec(instance_id="dies-1", block_id="dies", node_id="dock-n1", gen=1, image=docker_image,
                      command=["sh", "-c", "echo starting; echo 'boom: no model at /models/x'; exit 3"])
    try:
        started = await rt.start(spec)
        async with asyncio.timeout(30):
            while (st := await rt.status(started.handle)) is not None and st.running:
                await asyncio.sleep(0.1)
        assert st is not None and st.exit_code == 3, st
        assert st.detail == "last output 'starting | boom: no model at /models/x'", st
    finally:
        for inst in await rt.list("dock-n1"):
            await rt.stop(inst.handle, 0)
        await rt.close()
