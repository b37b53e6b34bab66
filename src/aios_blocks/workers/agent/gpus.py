"""GPU inventory of a node: NVML (``nvidia-ml-py``) when a driver is present, else a configured
simulated list, else none (with a log line saying why).

Every source has the same interface (:class:`GpuSource`); the NVML one reads through a small
``Nvml`` facade so unit tests can hand it a double — the only place a double is used, because the
hardware is absent here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

log = structlog.get_logger("aios.agent.gpus")


@dataclass(frozen=True)
class GpuInfo:
    id: str  # the GPU UUID (NVML) or a simulated id
    model: str
    memory: int  # MiB
    index: int


class GpuSource(Protocol):
    kind: str

    def gpus(self) -> list[GpuInfo]: ...

    def utilization(self) -> dict[str, float]:
        """GPU id -> utilisation 0..1 (empty when unknown)."""
        ...


class Nvml(Protocol):
    """The handful of pynvml calls used (pynvml itself satisfies it)."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class NvmlSource:
    nvml: Nvml
    kind: str = "nvml"
    _handles: list[tuple[str, Any]] = field(default_factory=list)

    def gpus(self) -> list[GpuInfo]:
        out, self._handles = [], []
        for i in range(self.nvml.nvmlDeviceGetCount()):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(self.nvml.nvmlDeviceGetUUID(h))
            mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuInfo(uuid, _text(self.nvml.nvmlDeviceGetName(h)), int(mem.total) // (1024 * 1024), i))
            self._handles.append((uuid, h))
        return out

    def utilization(self) -> dict[str, float]:
        out = {}
        for uuid, h in self._handles:
            try:
                out[uuid] = self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            except Exception:  # a GPU fell off the bus: report the others
                continue
        return out


@dataclass
class SimulatedSource:
    count: int
    prefix: str
    model: str = "sim-gpu"
    memory: int = 81920
    kind: str = "simulated"

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(f"{self.prefix}-g{i}", self.model, self.memory, i) for i in range(self.count)]

    def utilization(self) -> dict[str, float]:
        return {}


@dataclass
class NoGpus:
    kind: str = "none"

    def gpus(self) -> list[GpuInfo]:
        return []

    def utilization(self) -> dict[str, float]:
        return {}


def detect(simulated: int | None, node_id: str, nvml: Nvml | None = None) -> GpuSource:
    """``simulated`` GPUs when asked for (``--sim-gpus N``), else NVML, else none."""
    if simulated is not None:
        return SimulatedSource(simulated, node_id)
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
        source = NvmlSource(nvml)
        n = len(source.gpus())
        log.info("gpus.nvml", count=n)
        return source
    except Exception as exc:  # no driver, no library, no device
        log.info("gpus.none", reason=f"NVML unavailable ({type(exc).__name__}: {exc}); this node reports 0 GPUs")
        return NoGpus()
