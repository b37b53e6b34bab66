"""GPU inventory of a node: NVML (``nvidia-ml-py``) when a driver is present, else a configured
simulated list, else none (with a log line saying why); and the environment an instance gets for
the GPUs it was reserved (:func:`gpu_env`).

Every GPU is named by its UUID (NVML's ``GPU-…``, or ``MIG-…``); simulated GPUs get stable fake
UUIDs ``GPU-<node>-<index>``. Only NVML GPUs are real devices a runtime can attach.

Every source has the same interface (:class:`GpuSource`); the NVML one reads through a small
``Nvml`` facade so unit tests can hand it a double — the only place a double is used, because the
hardware is absent here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import structlog

from ..schemas.sharing import GPU_MEMORY_LIMIT_ENV
from ..schemas.topology import GpuTopology
from ..schemas.topology import profile as topology_profile
from .topology import read_topology

log = structlog.get_logger("aios.agent.gpus")


@dataclass(frozen=True)
class GpuInfo:
    id: str  # the GPU UUID (NVML) or a simulated id
    model: str
    memory: int  # MiB
    index: int


class GpuSourceKind(StrEnum):
    NVML = "nvml"
    SIMULATED = "simulated"
    NONE = "none"


class GpuSource(Protocol):
    kind: GpuSourceKind

    def gpus(self) -> list[GpuInfo]: ...

    def utilization(self) -> dict[str, float]:
        """GPU id -> utilisation 0..1 (empty when unknown)."""
        ...

    def topology(self) -> GpuTopology | None:
        """How the GPUs are connected, pair by pair (None: unknown; docs/topology.md)."""
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
    # the topology (agent/topology.py): nvmlDeviceGetPciInfo, nvmlDeviceGetNvLinkState,
    # nvmlDeviceGetNvLinkRemotePciInfo, nvmlDeviceGetNvLinkRemoteDeviceType (optional) and
    # nvmlDeviceGetTopologyCommonAncestor; a library without them reports the topology unknown


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class NvmlSource:
    nvml: Nvml
    kind: GpuSourceKind = GpuSourceKind.NVML
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

    def topology(self) -> GpuTopology | None:
        if not self._handles:
            self.gpus()
        # one GPU has no pairs, but the node still says where its topology came from (docs/topology.md)
        return read_topology(self.nvml, [h for _, h in self._handles]) if self._handles else None


def sim_uuid(node_id: str, index: int) -> str:
    """A simulated GPU's stable fake UUID (the same after every agent restart)."""
    return f"GPU-{node_id}-{index}"


@dataclass
class SimulatedSource:
    count: int
    prefix: str
    model: str = "sim-gpu"
    memory: int = 81920
    kind: GpuSourceKind = GpuSourceKind.SIMULATED
    #: a named GPU topology profile (schemas.topology.PROFILES; "": none reported)
    profile: str = ""

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(sim_uuid(self.prefix, i), self.model, self.memory, i) for i in range(self.count)]

    def utilization(self) -> dict[str, float]:
        return {}

    def topology(self) -> GpuTopology | None:
        return topology_profile(self.profile) if self.profile else None


@dataclass
class NoGpus:
    kind: GpuSourceKind = GpuSourceKind.NONE

    def gpus(self) -> list[GpuInfo]:
        return []

    def utilization(self) -> dict[str, float]:
        return {}

    def topology(self) -> GpuTopology | None:
        return None


def detect(simulated: int | None, node_id: str, nvml: Nvml | None = None, profile: str = "") -> GpuSource:
    """``simulated`` GPUs when asked for (``--sim-gpus N``; ``profile``: their topology,
    ``--gpu-topology``, whose GPU count is used when ``simulated`` is 0), else NVML, else none."""
    if profile and not simulated:
        simulated = topology_profile(profile).gpus
    if simulated is not None:
        if profile and topology_profile(profile).gpus != simulated:
            raise ValueError(f"GPU topology {profile!r} has {topology_profile(profile).gpus} GPUs, not {simulated}")
        return SimulatedSource(simulated, node_id, profile=profile)
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


# -- what an instance sees --------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldGpu:
    """One reserved GPU as the agent knows it: UUID, host (NVML) index, memory (MiB)."""

    id: str
    host_index: int
    memory: int


def gpu_env(gpus: Sequence[HeldGpu], attached: bool, memory_limit_mib: int = 0) -> dict[str, str]:
    """The GPU environment of an instance, in the view it will have.

    * ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` name the GPUs by UUID: right in a
      container (where attached GPUs are renumbered from 0) and on the host (where CUDA's default
      FASTEST_FIRST order need not match NVML's indices) alike.
    * ``AIOS_GPUS``: the same UUIDs; ``AIOS_GPU_INDICES``: the GPUs' indices as the instance sees
      them - ``0..n-1`` when ``attached`` (a container given only these devices), the host's
      indices otherwise (process runtime).
    * ``memory_limit_mib`` > 0 (the instance shares its GPUs): ``AIOS_GPU_MEMORY_LIMIT_MIB``, the
      CUDA MPS client limit ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (per CUDA ordinal, i.e. relative
      to ``CUDA_VISIBLE_DEVICES``; enforced when the node runs an MPS daemon the instance can
      reach) and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (JAX would otherwise take 75% of each GPU).
    """
    ids = ",".join(g.id for g in gpus)
    indices = range(len(gpus)) if attached else [g.host_index for g in gpus]
    env = {
        "AIOS_GPUS": ids,
        "AIOS_GPU_INDICES": ",".join(str(i) for i in indices),
        "CUDA_VISIBLE_DEVICES": ids,
        "NVIDIA_VISIBLE_DEVICES": ids or "void",
    }
    if memory_limit_mib > 0 and gpus:
        env[GPU_MEMORY_LIMIT_ENV] = str(memory_limit_mib)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{k}={memory_limit_mib}M" for k in range(len(gpus)))
        smallest = min(g.memory for g in gpus)
        if smallest > 0:
            fraction = math.floor(min(memory_limit_mib / smallest, 1.0) * 1000) / 1000  # never rounded up
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.3f}"
    return env
