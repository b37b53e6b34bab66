"""The GPU probe instance (examples/gpu_probe, run by bench/gpu_check.sh): it answers without
torch or a GPU (its environment and why the rest is missing), and with a CUDA device it reports
device 0 and a checked matmul on it (here through a small pure-Python stand-in for torch)."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from aios_blocks.examples import gpu_probe
from aios_blocks.instance import InstanceApp

UUID = "GPU-9d3c7d2e-54a1-4b43-a8a0-5e8e0c1f3b6a"


class FakeTensor:
    def __init__(self, rows: list[list[float]], device: str = "cpu"):
        self.rows, self.device = rows, device

    def to(self, device: str) -> FakeTensor:
        return FakeTensor(self.rows, device)

    def cpu(self) -> FakeTensor:
        return FakeTensor(self.rows)

    def double(self) -> FakeTensor:
        return self

    def __matmul__(self, o: FakeTensor) -> FakeTensor:
        assert self.device == o.device
        cols = list(zip(*o.rows, strict=True))
        return FakeTensor([[sum(a * b for a, b in zip(r, c, strict=True)) for c in cols] for r in self.rows], self.device)

    def __sub__(self, o: FakeTensor) -> FakeTensor:
        return FakeTensor([[a - b for a, b in zip(r, s, strict=True)] for r, s in zip(self.rows, o.rows, strict=True)])

    def abs(self) -> FakeTensor:
        return FakeTensor([[abs(a) for a in r] for r in self.rows])

    def max(self) -> float:
        return max(max(r) for r in self.rows)

    def sum(self) -> float:
        return sum(sum(r) for r in self.rows)


def fake_torch(gpus: int) -> Any:
    class Generator:
        def manual_seed(self, seed: int) -> random.Random:
            return random.Random(seed)

    def randn(n: int, m: int, generator: random.Random | None = None, dtype: Any = None, device: str = "cpu") -> FakeTensor:
        g = generator or random.Random(1)
        return FakeTensor([[g.gauss(0, 1) for _ in range(m)] for _ in range(n)], device)

    cuda = SimpleNamespace(
        is_available=lambda: gpus > 0,
        device_count=lambda: gpus,
        get_device_name=lambda i: "NVIDIA H100 80GB HBM3",
        get_device_properties=lambda i: SimpleNamespace(uuid=UUID[4:], total_memory=81559 * 2**20),
        synchronize=lambda i=None: None,
        empty_cache=lambda: None,
        mem_get_info=lambda i=0: (80000 * 2**20, 81559 * 2**20),
    )
    cap: dict[int, float] = {}  # device -> fraction of its memory (torch's per-process cap)

    def set_per_process_memory_fraction(fraction: float, device: int = 0) -> None:
        cap[device] = fraction

    def empty(size: int, dtype: Any = None, device: str = "cpu") -> object:
        if size > cap.get(int(device.rsplit(":", 1)[-1]), 1.0) * 81559 * 2**20:
            raise MemoryError(f"CUDA out of memory. Tried to allocate {size // 2**20} MiB\nmore")
        return object()

    cuda.set_per_process_memory_fraction = set_per_process_memory_fraction
    return SimpleNamespace(__version__="2.11.0+fake", cuda=cuda, Generator=Generator, randn=randn,
                           float32="float32", uint8="uint8", bfloat16="bfloat16", empty=empty, cap=cap)


@pytest.fixture
def gpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUID)
    monkeypatch.setenv("AIOS_GPUS", UUID)
    monkeypatch.setenv("AIOS_GPU_INDICES", "3")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    for key in gpu_probe.ENV_KEYS[4:]:  # the sharing ones: set only for an instance that shares
        monkeypatch.delenv(key, raising=False)


async def test_answers_its_gpu_environment_without_torch(monkeypatch: pytest.MonkeyPatch, gpu_env: None) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    app = InstanceApp(gpu_probe.handle, gpu_probe.init)
    await app.start()
    r = await app.call({})
    assert r.status == 200
    a = r.json()
    assert a["env"] == {"CUDA_VISIBLE_DEVICES": UUID, "AIOS_GPUS": UUID, "AIOS_GPU_INDICES": "3", "NVIDIA_VISIBLE_DEVICES": None,
                        "AIOS_GPU_MEMORY_LIMIT_MIB": None, "AIOS_GPU_SHARE": None,
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": None}
    assert a["torch"] is None and "torch" in a["torch_error"]
    assert (a["cuda_available"], a["device_count"]) == (False, 0) and "matmul" not in a
    assert (await app.call(b"")).status == 200  # an empty task is fine
    for bad in ({"n": 0}, {"n": "8"}, {"n": True}, {"n": gpu_probe.MAX_N + 1}):
        r = await app.call(bad)
        assert r.status == 422 and "n must be" in r.json()["error"]
    r = await app.call({"n": 0, "alloc_mib": -1, "tflops": 8})  # every problem at once
    assert r.status == 422 and all(f"{k} must be" in r.json()["error"] for k in ("n", "alloc_mib", "tflops"))


def test_torch_without_a_gpu_reports_no_device() -> None:
    a = gpu_probe.probe(fake_torch(0))
    assert a["torch"] == "2.11.0+fake" and (a["cuda_available"], a["device_count"]) == (False, 0)
    assert "device_uuid" not in a


def test_with_a_gpu_reports_device_0_and_a_checked_matmul(gpu_env: None) -> None:
    a = gpu_probe.probe(fake_torch(1), n=4, alloc_mib=1000, tflops_n=16)
    assert a["device_count"] == 1 and a["device_name"] == "NVIDIA H100 80GB HBM3"
    assert a["device_uuid"] == UUID[4:] and a["device_memory_mib"] == 81559  # torch's UUID: no GPU- prefix
    assert a["cuda_free_mib"] == 80000
    m = a["matmul"]
    assert (m["n"], m["device"], m["max_abs_err"]) == (4, "cuda:0", 0.0) and m["ms"] >= 0
    # every field the probe reports is named by its record (gpu_probe.Probe, Matmul)
    assert set(a) == set(gpu_probe.Probe.__annotations__) and set(m) == set(gpu_probe.Matmul.__annotations__)
    assert a["alloc"] == {"mib": 1000, "ok": True, "error": None} and a["memory_fraction"] is None
    t = a["throughput"]
    assert (t["n"], t["reps"]) == (16, 10) and t["tflops"] >= 0 and set(t) == set(gpu_probe.Throughput.__annotations__)


def test_a_sharing_instance_keeps_to_its_memory_figure(gpu_env: None) -> None:
    torch = fake_torch(1)
    assert gpu_probe.keep_to_limit(torch, None) is None and gpu_probe.keep_to_limit(torch, "x") is None
    assert torch.cap == {}  # no figure: no cap
    fraction = gpu_probe.keep_to_limit(torch, "20000")
    assert fraction == round(20000 / 81559, 4) and torch.cap == {0: 20000 / 81559}
    a = gpu_probe.probe(torch, n=2, alloc_mib=25000, memory_fraction=fraction)
    assert a["memory_fraction"] == fraction
    assert a["alloc"]["ok"] is False and a["alloc"]["error"] == "MemoryError: CUDA out of memory. Tried to allocate 25000 MiB"
    assert gpu_probe.try_alloc(torch, 19000)["ok"] is True
