"""The node agent's pure parts: seed-001 lifecycle (Provisioner / Stage / Runner), the reconcile
and fault rules, the instance environment, the GPU sources (NVML through a double: no GPU here)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from aios_blocks.agent.adoption import reconcile
from aios_blocks.agent.gpus import NoGpus, NvmlSource, SimulatedSource, detect
from aios_blocks.agent.lifecycle import (
    DerivedSpec,
    FixedSpec,
    Provisioner,
    ProvisionStage,
    Runner,
    StageFailed,
)
from aios_blocks.agent.node_agent import instance_env
from aios_blocks.agent.runtime import LaunchSpec, labels_to_resources
from aios_blocks.handlers import faults


@dataclass
class Recording(Provisioner[Any, Any]):
    """A provisioner that records setup/teardown order in a shared journal; fails when told."""

    label: str
    journal: list[str]
    fail: bool = False
    live: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.label

    async def setup(self, spec: Any) -> Any:
        if self.fail:
            raise OSError(f"{self.label} cannot be set up")
        self.journal.append(f"setup {self.label}:{spec}")
        self.live.add(self.label)
        return f"{self.label}-resource({spec})"

    async def teardown(self, resource: Any) -> None:
        self.journal.append(f"teardown {self.label}")
        self.live.discard(self.label)


def chain(journal: list[str], fail_at: int | None = None, n: int = 5) -> tuple[Runner, list[Recording]]:
    provs = [Recording(f"s{i}", journal, fail=(i == fail_at)) for i in range(1, n + 1)]
    stages: list[Any] = []
    prev: ProvisionStage[Any, Any] | None = None
    for p in provs:
        st = ProvisionStage(p)
        spec = FixedSpec("x") if prev is None else DerivedSpec(lambda r: f"from[{r}]", prev)
        stages.append((st, spec))
        prev = st
    return Runner("i-1", stages), provs


async def test_runner_sets_up_in_order_and_tears_down_in_reverse() -> None:
    journal: list[str] = []
    runner, provs = chain(journal, n=3)
    await runner.start()
    assert journal == ["setup s1:x", "setup s2:from[s1-resource(x)]", "setup s3:from[s2-resource(from[s1-resource(x)])]"]
    await runner.close()
    assert journal[3:] == ["teardown s3", "teardown s2", "teardown s1"]
    assert all(not p.live for p in provs)


async def test_a_failed_third_stage_tears_down_the_first_two_and_names_itself() -> None:
    journal: list[str] = []
    runner, provs = chain(journal, fail_at=3)
    with pytest.raises(StageFailed) as info:
        await runner.start()
    assert info.value.stage == "s3" and "s3 cannot be set up" in str(info.value)
    assert journal == ["setup s1:x", "setup s2:from[s1-resource(x)]", "teardown s2", "teardown s1"]
    assert all(not p.live for p in provs)  # nothing left behind; s4 and s5 never started


async def test_cancel_on_agent_shutdown_does_not_reclaim() -> None:
    journal: list[str] = []
    runner, provs = chain(journal, n=2)
    await runner.start()
    runner.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not any(j.startswith("teardown") for j in journal)
    assert {p.label for p in provs if p.live} == {"s1", "s2"}


async def test_adopted_runner_owns_existing_resources_and_tears_them_down() -> None:
    journal: list[str] = []
    provs = [Recording(f"s{i}", journal) for i in (1, 2)]
    runner = Runner.adopted("i-9", [ProvisionStage.adopted(p, f"r{p.label}") for p in provs])
    assert journal == []  # nothing set up again
    await runner.close()
    assert journal == ["teardown s2", "teardown s1"]


async def test_teardown_error_does_not_stop_the_others() -> None:
    journal: list[str] = []

    class Sticky(Recording):
        async def teardown(self, resource: Any) -> None:
            raise OSError("busy")

    provs = [Recording("a", journal), Sticky("b", journal), Recording("c", journal)]
    runner = Runner("i", [(ProvisionStage(p), FixedSpec(1)) for p in provs])
    await runner.start()
    await runner.close()
    assert "teardown a" in journal and "teardown c" in journal
    assert runner.teardown_errors == ["b: OSError: busy"]


async def test_stage_exposes_the_failure() -> None:
    stage = ProvisionStage(Recording("gpu", [], fail=True))
    await stage.setup(FixedSpec(None))
    with pytest.raises(StageFailed, match="gpu cannot be set up"):
        await stage.wait_for_resource()
    assert not stage.is_set_up


# -- rules ---------------------------------------------------------------------------------------
BLOCK = {"gen": 7, "status": "ready"}
INST = {"node": "n1", "status": "running", "cluster": "c"}


@pytest.mark.parametrize(
    ("block", "inst", "node", "gen", "n", "action"),
    [
        (BLOCK, INST, "n1", 7, 0, "reassign"),
        (BLOCK, INST, "n2", 7, 0, "ignore"),  # a node speaking for an instance it does not hold
        (BLOCK, INST, "n1", 6, 0, "ignore"),  # an older generation
        (None, INST, "n1", 7, 0, "ignore"),
        ({**BLOCK, "status": "deleting"}, INST, "n1", 7, 0, "ignore"),
        (BLOCK, {**INST, "status": "removing"}, "n1", 7, 0, "ignore"),
        (BLOCK, None, "n1", 7, 0, "ignore"),
        (BLOCK, INST, "n1", 7, 3, "give_up"),
        ({**BLOCK, "status": "placing"}, INST, "n1", 7, 3, "fail_block"),
    ],
)
def test_fault_rule(block: Any, inst: Any, node: str, gen: int, n: int, action: str) -> None:
    assert faults.on_fault(block, inst, node, gen, n, 3).action == action


@pytest.mark.parametrize(
    ("block", "inst", "node", "gen", "action", "why"),
    [
        (BLOCK, INST, "n1", 7, "adopt", "recorded"),
        (None, None, "n1", 1, "remove", "unknown block"),
        (BLOCK, INST, "n1", 3, "remove", "older generation"),
        (BLOCK, None, "n1", 7, "remove", "not recorded"),
        (BLOCK, INST, "n2", 7, "remove", "duplicate"),
        ({**BLOCK, "status": "failed"}, INST, "n1", 7, "remove", "failed"),
    ],
)
def test_dangling_rule(block: Any, inst: Any, node: str, gen: int, action: str, why: str) -> None:
    v = faults.on_dangling(block, inst, node, gen)
    assert v.action == action and why in v.why


def test_reconcile_sorts_found_and_expected() -> None:
    found = {"a": {"gen": 1}, "b": {"gen": 2}, "ghost": {"gen": 1}}
    expected = {
        "a": {"gen": 1, "status": "running"},
        "b": {"gen": 1, "status": "running"},  # same id, other generation: not ours to adopt
        "gone": {"gen": 1, "status": "running"},
        "pending": {"gen": 1, "status": "starting"},  # its create waits in the mailbox
    }
    assert reconcile(found, expected) == {"adopt": ["a"], "dangling": ["b", "ghost"], "lost": ["gone"]}


# -- environment and labels -----------------------------------------------------------------------
def test_instance_env_carries_ids_gpus_ports_and_seed_fields_as_json() -> None:
    env = instance_env(
        {"AIOS_BLOCK_ID": "b", "blockInitData": {"model": "m"}, "parameters": {"t": 0.5}},
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"http": 8080, "grpc-api": 9090},
    )
    assert env["AIOS_BLOCK_ID"] == "b" and env["blockInitData"] == '{"model": "m"}' and env["parameters"] == '{"t": 0.5}'
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["AIOS_PORT"] == "8080" and env["AIOS_PORT_HTTP"] == "8080" and env["AIOS_PORT_GRPC_API"] == "9090"
    assert "AIOS_HOST" not in env


def test_instances_bind_loopback_only_when_their_endpoints_advertise_loopback_and_get_the_input_protocol() -> None:
    from aios_blocks.agent.node_agent import bind_host
    from aios_blocks.handlers.controller import env_for

    assert bind_host("127.0.0.1") == "127.0.0.1" and bind_host("10.0.0.7") == "0.0.0.0"
    cmd_env = env_for({"blockId": "b", "inputProtocol": {"path": "/v1/x"}}, "b-0", [])
    env = instance_env(cmd_env, {}, {"http": 8080}, bind_host("10.0.0.7"))
    assert env["AIOS_HOST"] == "0.0.0.0" and env["inputProtocol"] == '{"path": "/v1/x"}'


def test_labels_round_trip_to_resources() -> None:
    spec = LaunchSpec("i", "b", "n", 3, workdir=None, ports={"http": 81}, gpus=["g0", "g1"], resources={"cpu": 2})
    labels = spec.labels()
    assert labels["aios.block"] == "b" and labels["aios.instance"] == "i" and labels["aios.node"] == "n"
    assert labels_to_resources(labels) == {"workdir": "", "ports": {"http": 81}, "gpus": ["g0", "g1"], "resources": {"cpu": 2},
                                           "stop_grace_s": 10.0}
    assert labels_to_resources({"aios.ports": "{broken"})["ports"] == {}
    assert labels_to_resources({"aios.stop-grace": "x"})["stop_grace_s"] == 10.0  # unreadable: the default


async def test_a_readopted_instance_is_stopped_with_its_own_stop_grace(tmp_path: Any) -> None:
    """An instance found running after its agent restarted is re-adopted from its labels; its
    stop (a delete, a dangling one's removal) waits its spec's stopGraceS, not the default 10 s
    (a spec's 60 s was cut to 10, its 2 s stretched to 10). The runtime records the stop asked
    of it (tests/integration/test_agent.py's re-adoption test runs the real runtimes)."""
    from aios_blocks.agent.node_agent import AgentConfig, NodeAgent
    from aios_blocks.agent.runtime import RuntimeInstance
    from aios_blocks.schemas.spec import Gpu, Node

    stops: list[tuple[str, float]] = []

    class StopRecorder:
        name, gpu_devices = "process", False

        async def stop(self, handle: str, grace_s: float) -> None:
            stops.append((handle, grace_s))

    gpus = detect(1, "n")
    node = Node(id="n", cluster="c", gpus=[Gpu(id=g.id) for g in gpus.gpus()])
    cfg = AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False, workdirs=False, probes=False)
    agent = NodeAgent(None, StopRecorder(), gpus, cfg)  # type: ignore[arg-type]  # no fact is published here
    for grace in (2.0, 60.0):
        spec = LaunchSpec(f"i-{grace:g}", "b", "n", 1, gpus=[node.gpus[0].id], ports={"http": 81}, stop_grace_s=grace)
        await agent._adopt(RuntimeInstance(f"h-{grace:g}", spec.labels(), running=True), watch=False).close()
    assert stops == [("h-2", 2.0), ("h-60", 60.0)]


# -- GPU sources ----------------------------------------------------------------------------------
class FakeNvml:
    """Stands in for pynvml: this machine has no GPU (the only double in the agent's tests)."""

    def __init__(self, n: int, fail_init: bool = False):
        self.n, self.fail_init = n, fail_init

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h:04d}".encode()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=80 * 1024**3)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if h == 1:
            raise OSError("fell off the bus")
        return SimpleNamespace(gpu=40 + h)


def test_nvml_source_reads_uuids_models_memory_and_utilisation() -> None:
    src = detect(None, "n1", FakeNvml(3))
    assert isinstance(src, NvmlSource)
    gpus = src.gpus()
    assert [g.id for g in gpus] == ["GPU-0000", "GPU-0001", "GPU-0002"]
    assert gpus[0].model == "NVIDIA H100 80GB HBM3" and gpus[0].memory == 81920 and gpus[2].index == 2
    assert src.utilization() == {"GPU-0000": 0.40, "GPU-0002": 0.42}  # the broken one is skipped


def test_no_nvml_means_zero_gpus_and_simulated_on_request() -> None:
    assert isinstance(detect(None, "n1", FakeNvml(2, fail_init=True)), NoGpus)
    assert NoGpus().gpus() == []
    sim = detect(4, "n1", FakeNvml(2))
    assert isinstance(sim, SimulatedSource) and [g.id for g in sim.gpus()] == ["GPU-n1-0", "GPU-n1-1", "GPU-n1-2", "GPU-n1-3"]


async def test_a_probe_watcher_that_ignores_its_cancel_does_not_hold_the_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The remove of an instance tears its probe down first; a watcher that does not end when
    cancelled is given PROBE_STOP_S, then left, so the remove goes on."""
    from aios_blocks.agent import provisioners as pv

    monkeypatch.setattr(pv, "PROBE_STOP_S", 0.2)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

    spec = pv.ProbeSpec("h1", "http", 1, "/health", 1.0, 1.0, 3, 1.0)
    probe = pv.Probe(spec, asyncio.get_running_loop().create_task(stubborn()))
    await asyncio.sleep(0)
    prov = pv.ProbeProvisioner(None, None)  # type: ignore[arg-type]
    await asyncio.wait_for(prov.teardown(probe), 5)  # returns: the watcher did not hold it
    assert probe.task is not None and not probe.task.done()
    release.set()
    probe.task.cancel()
    await asyncio.wait({probe.task}, timeout=1)
