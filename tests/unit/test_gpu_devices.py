"""Reserved GPUs reach an instance: the Docker runtime attaches them by UUID (exact docker SDK
arguments), every runtime's env names them in the view the instance has, and an instance that
shares a GPU gets its memory cap. The Docker engine is a recording double behind the SDK's
``DockerClient`` interface and NVML the double of ``test_agent_lifecycle`` (no GPU, no dockerd
needed here; the real-engine tests are in tests/integration/test_agent.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from docker.errors import NotFound
from docker.types import DeviceRequest

from aios_blocks.agent.gpus import GpuSource, HeldGpu, SimulatedSource, detect, gpu_env
from aios_blocks.agent.node_agent import AgentConfig, NodeAgent
from aios_blocks.agent.runtime import Runtime
from aios_blocks.agent.runtime_docker import DockerRuntime, container_name
from aios_blocks.agent.runtime_process import ProcessRuntime, process_scope
from aios_blocks.handlers.controller import env_for
from aios_blocks.schemas.events import InstanceCommand
from aios_blocks.schemas.spec import Gpu, Node

from .test_agent_lifecycle import FakeNvml
from .views import make_ir


# -- a Docker engine double, shaped like docker.DockerClient --------------------------------------
class FakeContainer:
    def __init__(self, name: str, labels: dict[str, str]):
        self.id, self.name, self.labels, self.status = f"cid-{name}", name, labels, "running"
        self.attrs: dict[str, Any] = {"State": {"Status": "running"}}

    def reload(self) -> None:
        pass

    def stop(self, timeout: int = 10) -> None:
        self.status = "exited"

    def remove(self, force: bool = False) -> None:
        self.status = "removed"


class FakeContainers:
    def __init__(self) -> None:
        self.runs: list[tuple[str, dict[str, Any]]] = []
        self.by_name: dict[str, FakeContainer] = {}

    def get(self, name: str) -> FakeContainer:
        if name not in self.by_name:
            raise NotFound(f"no container {name}")
        return self.by_name[name]

    def run(self, image: str, **kwargs: Any) -> FakeContainer:
        self.runs.append((image, kwargs))
        c = self.by_name[kwargs["name"]] = FakeContainer(kwargs["name"], kwargs["labels"])
        return c

    def list(self, all: bool = False, filters: dict[str, Any] | None = None) -> list[FakeContainer]:
        return list(self.by_name.values())


class FakeDockerClient:
    def __init__(self) -> None:
        self.containers = FakeContainers()

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        pass


def agent(runtime: Runtime, source: GpuSource, tmp_path: Path) -> NodeAgent:
    node = Node(id="n1", cluster="c1", gpus=[Gpu(id=g.id, model=g.model, memory=g.memory) for g in source.gpus()])
    cfg = AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False, workdirs=False, probes=False)
    return NodeAgent(None, runtime, source, cfg)  # type: ignore[arg-type]  # no fact is published here


def command(gpus: list[str], env: dict[str, Any] | None = None, launch: dict[str, Any] | None = None) -> InstanceCommand:
    base = {"AIOS_BLOCK_ID": "b1", "AIOS_INSTANCE_ID": "b1-i0", "AIOS_GPUS": ",".join(gpus)}
    return InstanceCommand("b1", 1, "c1", "b1-i0", "n1", gpus, "aios/test:1", {**base, **(env or {})}, launch=launch or {})


async def start_in_docker(gpus: list[str], source: GpuSource, tmp_path: Path, env: dict[str, Any] | None = None) -> dict[str, Any]:
    client = FakeDockerClient()
    a = agent(DockerRuntime(_client=client), source, tmp_path)
    runner = a._build(command(gpus, env))
    await runner.start()
    [(image, kwargs)] = client.containers.runs
    assert image == "aios/test:1"
    await runner.close()
    return kwargs


# -- Docker: device requests and the container's view ---------------------------------------------
async def test_docker_attaches_the_reserved_gpus_by_uuid_and_the_env_is_the_containers_view(tmp_path: Path) -> None:
    nvml = detect(None, "n1", FakeNvml(4))  # host GPUs GPU-0000..GPU-0003 at NVML indices 0..3
    kwargs = await start_in_docker(["GPU-0003", "GPU-0001"], nvml, tmp_path)
    assert kwargs["device_requests"] == [DeviceRequest(device_ids=["GPU-0003", "GPU-0001"], capabilities=[["gpu"]])]
    assert kwargs["device_requests"][0] == {
        "Driver": "", "Count": 0, "DeviceIDs": ["GPU-0003", "GPU-0001"], "Capabilities": [["gpu"]], "Options": {},
    }
    env = kwargs["environment"]
    # inside the container the two attached GPUs are devices 0 and 1, whatever their host indices
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0003,GPU-0001" and env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0003,GPU-0001"
    assert env["AIOS_GPUS"] == "GPU-0003,GPU-0001" and env["AIOS_GPU_INDICES"] == "0,1"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env and "AIOS_GPU_MEMORY_LIMIT_MIB" not in env  # held whole
    assert kwargs["name"] == container_name("b1-i0") and kwargs["labels"]["aios.gpus"] == "GPU-0003,GPU-0001"
    assert kwargs["network_mode"] == "host" and kwargs["detach"] is True and kwargs["stop_signal"] == "SIGTERM"


async def test_docker_without_gpus_and_with_simulated_gpus_sets_no_device_request(tmp_path: Path) -> None:
    kwargs = await start_in_docker([], detect(None, "n1", FakeNvml(2)), tmp_path / "a")
    assert "device_requests" not in kwargs
    assert kwargs["environment"]["CUDA_VISIBLE_DEVICES"] == "" and kwargs["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    sim = SimulatedSource(2, "n1")  # fake UUIDs are no devices: docker would refuse them
    kwargs = await start_in_docker(["GPU-n1-1"], sim, tmp_path / "b")
    assert "device_requests" not in kwargs and kwargs["environment"]["AIOS_GPUS"] == "GPU-n1-1"


async def test_a_sharing_instance_gets_its_gpu_memory_cap_in_docker(tmp_path: Path) -> None:
    nvml = detect(None, "n1", FakeNvml(2))  # 81920 MiB each
    kwargs = await start_in_docker(["GPU-0001"], nvml, tmp_path, env={"AIOS_GPU_MEMORY_LIMIT_MIB": "40000"})
    env = kwargs["environment"]
    assert kwargs["device_requests"] == [DeviceRequest(device_ids=["GPU-0001"], capabilities=[["gpu"]])]
    assert env["AIOS_GPU_MEMORY_LIMIT_MIB"] == "40000"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40000M"  # CUDA ordinal 0: the one visible device
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.488"  # 40000 / 81920, rounded down


# -- the process runtime: the host's view ---------------------------------------------------------
async def test_process_instance_sees_the_host_view_of_its_gpus(tmp_path: Path) -> None:
    rt = ProcessRuntime(scope=process_scope(tmp_path))  # processes are host-wide: this test's only
    a = agent(rt, detect(None, "n1", FakeNvml(4)), tmp_path)
    launch = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "probe": {"type": "running"}}
    runner = a._build(command(["GPU-0002"], {"AIOS_GPU_MEMORY_LIMIT_MIB": "20000"}, launch))
    await runner.start()
    try:
        [inst] = await rt.list("n1")
        env = psutil.Process(int(inst.handle.split("-")[0])).environ()  # what the process really got
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0002" and env["AIOS_GPU_INDICES"] == "2"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20000M" and env["AIOS_GPU_MEMORY_LIMIT_MIB"] == "20000"
    finally:
        await runner.close()
    assert await rt.list("n1") == []


# -- the pieces -------------------------------------------------------------------------------------
def test_gpu_env_views() -> None:
    held = [HeldGpu("GPU-a", 5, 81920), HeldGpu("GPU-b", 2, 40960)]
    host, box = gpu_env(held, attached=False), gpu_env(held, attached=True)
    assert host["AIOS_GPU_INDICES"] == "5,2" and box["AIOS_GPU_INDICES"] == "0,1"
    assert host["CUDA_VISIBLE_DEVICES"] == box["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    capped = gpu_env(held, attached=True, memory_limit_mib=20480)
    assert capped["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M,1=20480M"
    assert capped["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.500"  # of the smaller GPU
    assert gpu_env([], attached=True) == {"AIOS_GPUS": "", "AIOS_GPU_INDICES": "", "CUDA_VISIBLE_DEVICES": "",
                                          "NVIDIA_VISIBLE_DEVICES": "void"}


def test_simulated_gpus_have_stable_fake_uuids() -> None:
    assert [g.id for g in SimulatedSource(2, "rack1-n7").gpus()] == ["GPU-rack1-n7-0", "GPU-rack1-n7-1"]
    assert [g.index for g in SimulatedSource(2, "x").gpus()] == [0, 1]


@pytest.mark.parametrize(("share", "expected"), [(True, "40000"), (False, None)])
def test_controller_gives_a_sharing_instance_its_memory_figure(share: bool, expected: str | None) -> None:
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 40000}, allocator_settings={"gpuSharing": share})
    assert env_for(ir, "i0", ["g0"]).get("AIOS_GPU_MEMORY_LIMIT_MIB") == expected
    assert "AIOS_GPU_MEMORY_LIMIT_MIB" not in env_for(ir, "i0", [])
