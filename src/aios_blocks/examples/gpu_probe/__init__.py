"""A GPU probe instance, written with the SDK: it reports which GPU it was given and proves it
can compute on it. Used by the real-GPU check (``bench/gpu_check.sh``, docs/gpus.md). Run it as an
instance with ``python -m aios_blocks.examples.gpu_probe``.

``init`` imports torch (when installed) and, with a GPU visible, warms CUDA and cuBLAS up on it; an
instance that shares its GPU (``AIOS_GPU_MEMORY_LIMIT_MIB`` set, docs/gpus.md) keeps to that figure
the way docs/gpus.md tells a program to: ``torch.cuda.set_per_process_memory_fraction``. Each task
(JSON, optional ``{"n": N}``, the matrix size, 1..8192, default 1024, and ``{"alloc_mib": M}``, a
buffer of M MiB to try on GPU 0 and free again, and ``{"tflops": K}``, the bf16 throughput of K x K
matmuls on GPU 0, 0 or 16..16384: how much of the GPU's compute this instance gets) answers::

    {"instance_id", "pid", "env": {CUDA_VISIBLE_DEVICES, AIOS_GPUS, AIOS_GPU_INDICES, NVIDIA_VISIBLE_DEVICES,
                                   and the sharing ones: AIOS_GPU_MEMORY_LIMIT_MIB, AIOS_GPU_SHARE,
                                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT},
     "torch": version or null, "torch_error", "cuda_available", "device_count",
     "device_name", "device_uuid", "device_memory_mib",        # CUDA device 0, when there is one
     "cuda_free_mib",                                           # what CUDA says is free to this process
     "memory_fraction",                                         # set from AIOS_GPU_MEMORY_LIMIT_MIB, or null
     "matmul": {"n", "ms", "max_abs_err", "checksum"},          # an n x n float32 product on GPU 0
     "alloc": {"mib", "ok", "error"},                           # only when alloc_mib was asked
     "throughput": {"n", "tflops", "reps"}}                     # only when tflops was asked

``max_abs_err`` compares the GPU's product with the CPU's (same random inputs, fixed seed).
Without torch or a GPU the probe still answers: the environment, and why the rest is missing.
Imports are absolute so a copy of this package also runs as ``python -m gpu_probe``.
"""

from __future__ import annotations

import os
import time
from typing import Any, NotRequired, TypedDict

from aios_blocks.instance import Context, Task, TaskError
from aios_blocks.schemas.sharing import GPU_MEMORY_LIMIT_ENV, GPU_SHARE_ENV

ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES", "AIOS_GPUS", "AIOS_GPU_INDICES", "NVIDIA_VISIBLE_DEVICES",
    GPU_MEMORY_LIMIT_ENV, GPU_SHARE_ENV, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)
MAX_N = 8192
MAX_ALLOC_MIB = 1 << 20
MAX_TFLOPS_N = 16384


def init(ctx: Context) -> None:
    """Import torch (absent: the probe reports why) and touch CUDA device 0 when there is one."""
    try:
        import torch
    except ImportError as exc:
        ctx.state["torch"], ctx.state["torch_error"] = None, f"{type(exc).__name__}: {exc}"
        return
    ctx.state["torch"], ctx.state["torch_error"] = torch, None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        ctx.state["memory_fraction"] = keep_to_limit(torch, os.environ.get(GPU_MEMORY_LIMIT_ENV))
        warm = torch.ones(64, 64, device="cuda:0")  # CUDA's context and cuBLAS start here, not in a task
        float((warm @ warm).sum())


def keep_to_limit(torch: Any, limit_mib: str | None) -> float | None:
    """A sharing instance's memory figure as torch's cap on GPU 0 (None: no figure, nothing set)."""
    try:
        limit = int(limit_mib or 0)
    except ValueError:
        return None
    if limit <= 0:
        return None
    total = torch.cuda.get_device_properties(0).total_memory / (1024 * 1024)
    fraction = min(1.0, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return round(fraction, 4)


class Matmul(TypedDict):
    """An n x n matmul on GPU 0: how long it took and how far it is from the CPU's."""

    n: int
    device: str
    ms: float
    max_abs_err: float
    checksum: float


class Alloc(TypedDict):
    """A try to hold ``mib`` MiB on GPU 0: whether it succeeded, and the error when not."""

    mib: int
    ok: bool
    error: str | None


class Throughput(TypedDict):
    """bf16 ``n`` x ``n`` matmuls on GPU 0: TFLOP/s over ``reps`` timed products (after 3 warm-ups)."""

    n: int
    tflops: float
    reps: int


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
    cuda_free_mib: NotRequired[int]
    memory_fraction: NotRequired[float | None]
    matmul: NotRequired[Matmul]
    alloc: NotRequired[Alloc]
    throughput: NotRequired[Throughput]


class Answer(Probe):
    instance_id: str


def probe(
    torch: Any, n: int = 1024, torch_error: str | None = None, alloc_mib: int = 0, memory_fraction: float | None = None,
    tflops_n: int = 0,
) -> Probe:
    """What this process sees: its GPU environment, torch's view of CUDA and a matmul on GPU 0
    (and, with ``alloc_mib``, whether a buffer that large fits)."""
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
    # under CUDA MPS with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT this is at most the limit: the proof it is enforced
    out["cuda_free_mib"] = int(torch.cuda.mem_get_info(0)[0]) // (1024 * 1024)
    out["memory_fraction"] = memory_fraction
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
    if alloc_mib:
        out["alloc"] = try_alloc(torch, alloc_mib)
    if tflops_n:
        out["throughput"] = throughput(torch, tflops_n)
    return out


def throughput(torch: Any, n: int, reps: int = 10) -> Throughput:
    """TFLOP/s of bf16 ``n`` x ``n`` products on GPU 0 (under CUDA MPS, capped by the instance's
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: its ``gpuShare`` of the SMs)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda:0")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda:0")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(0)
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(0)
    seconds = max(time.perf_counter() - started, 1e-9)
    return {"n": n, "tflops": round(2 * n**3 * reps / seconds / 1e12, 1), "reps": reps}


def try_alloc(torch: Any, mib: int) -> Alloc:
    """Hold ``mib`` MiB on GPU 0, then free it (torch's cap or MPS's limit refuses what is over)."""
    try:
        buf = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
    except Exception as exc:  # torch.OutOfMemoryError, or a CUDA error under MPS
        return {"mib": mib, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    del buf
    torch.cuda.empty_cache()
    return {"mib": mib, "ok": True, "error": None}


def handle(task: Task, ctx: Context) -> Answer:
    data = task.json()
    n = data.get("n", 1024) if isinstance(data, dict) else 1024
    alloc = data.get("alloc_mib", 0) if isinstance(data, dict) else 0
    tflops = data.get("tflops", 0) if isinstance(data, dict) else 0
    problems = []
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        problems.append(f"n must be an integer 1..{MAX_N}")
    if not isinstance(alloc, int) or isinstance(alloc, bool) or not 0 <= alloc <= MAX_ALLOC_MIB:
        problems.append(f"alloc_mib must be an integer 0..{MAX_ALLOC_MIB}")
    if not isinstance(tflops, int) or isinstance(tflops, bool) or not (tflops == 0 or 16 <= tflops <= MAX_TFLOPS_N):
        problems.append(f"tflops must be 0 or an integer 16..{MAX_TFLOPS_N}")
    if problems:
        raise TaskError(422, "; ".join(problems))
    answer = probe(ctx.state.get("torch"), n, ctx.state.get("torch_error"), alloc, ctx.state.get("memory_fraction"),
                   tflops)
    return {"instance_id": ctx.instance_id, **answer}
