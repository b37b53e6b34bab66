"""A GPU probe instance, written with the SDK: it reports which GPU it was given and proves it
can compute on it. Used by the real-GPU check (``bench/gpu_check.sh``, docs/gpus.md). Run it as an
instance with ``python -m aios_blocks.examples.gpu_probe``.

``init`` imports torch (when installed) and, with a GPU visible, warms CUDA and cuBLAS up on it. Each task
(JSON, optional ``{"n": N}``, the matrix size, 1..8192, default 1024) answers::

    {"instance_id", "pid", "env": {CUDA_VISIBLE_DEVICES, AIOS_GPUS, AIOS_GPU_INDICES, NVIDIA_VISIBLE_DEVICES},
     "torch": version or null, "torch_error", "cuda_available", "device_count",
     "device_name", "device_uuid", "device_memory_mib",        # CUDA device 0, when there is one
     "matmul": {"n", "ms", "max_abs_err", "checksum"}}          # an n x n float32 product on GPU 0

``max_abs_err`` compares the GPU's product with the CPU's (same random inputs, fixed seed).
Without torch or a GPU the probe still answers: the environment, and why the rest is missing.
Imports are absolute so a copy of this package also runs as ``python -m gpu_probe``.
"""

from __future__ import annotations

import os
import time
from typing import Any, NotRequired, TypedDict

from aios_blocks.instance import Context, Task, TaskError

ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "AIOS_GPUS", "AIOS_GPU_INDICES", "NVIDIA_VISIBLE_DEVICES")
MAX_N = 8192


def init(ctx: Context) -> None:
    """Import torch (absent: the probe reports why) and touch CUDA device 0 when there is one."""
    try:
        import torch
    except ImportError as exc:
        ctx.state["torch"], ctx.state["torch_error"] = None, f"{type(exc).__name__}: {exc}"
        return
    ctx.state["torch"], ctx.state["torch_error"] = torch, None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        warm = torch.ones(64, 64, device="cuda:0")  # CUDA's context and cuBLAS start here, not in a task
        float((warm @ warm).sum())


class Matmul(TypedDict):
    """An n x n matmul on GPU 0: how long it took and how far it is from the CPU's."""

    n: int
    device: str
    ms: float
    max_abs_err: float
    checksum: float


class Probe(TypedDict):
    """What ``probe`` reports (the task's answer, with ``instance_id``); the device fields and
    ``matmul`` only when torch sees a GPU."""

    pid: int
    env: dict[str, str | None]
    torch: str | None
    torch_error: str | None
    cuda_available: bool
    device_count: int
    device_name: NotRequired[str]
    device_uuid: NotRequired[str]
    device_memory_mib: NotRequired[int]
    matmul: NotRequired[Matmul]


class Answer(Probe):
    instance_id: str


def probe(torch: Any, n: int = 1024, torch_error: str | None = None) -> Probe:
    """What this process sees: its GPU environment, torch's view of CUDA and a matmul on GPU 0."""
    out: Probe = {
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "torch": None,
        "torch_error": torch_error,
        "cuda_available": False,
        "device_count": 0,
    }
    if torch is None:
        return out
    out["torch"] = str(torch.__version__)
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = int(torch.cuda.device_count()) if out["cuda_available"] else 0
    if out["device_count"] == 0:
        return out
    props = torch.cuda.get_device_properties(0)
    out["device_name"] = str(torch.cuda.get_device_name(0))
    out["device_uuid"] = str(props.uuid)
    out["device_memory_mib"] = int(props.total_memory) // (1024 * 1024)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32)
    ga, gb = a.to("cuda:0"), b.to("cuda:0")
    torch.cuda.synchronize(0)
    started = time.perf_counter()
    gc = ga @ gb
    torch.cuda.synchronize(0)
    ms = (time.perf_counter() - started) * 1000
    c = gc.cpu()
    out["matmul"] = {
        "n": n,
        "device": str(gc.device),
        "ms": round(ms, 3),
        "max_abs_err": float((c - a @ b).abs().max()),
        "checksum": float(c.double().sum()),
    }
    return out


def handle(task: Task, ctx: Context) -> Answer:
    data = task.json()
    n = data.get("n", 1024) if isinstance(data, dict) else 1024
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise TaskError(422, f"n must be an integer 1..{MAX_N}")
    answer = probe(ctx.state.get("torch"), n, ctx.state.get("torch_error"))
    return {"instance_id": ctx.instance_id, **answer}
