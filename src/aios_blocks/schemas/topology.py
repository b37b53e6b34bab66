"""GPU topology of a node: how each pair of its GPUs is connected (docs/topology.md). Pure data.

A node reports ``topology`` (absent: unknown) with one :class:`GpuLink` per GPU pair, by GPU
index (the order of the node's ``gpus``). The tiers, best first, follow NVML's common-ancestor
levels plus NVLink: NVSWITCH (one NVSwitch fabric), NVLINK (direct links, ``nvlinks`` of them),
PCIE_SWITCH (same PCIe switch), HOST_BRIDGE (same host bridge), NUMA (same NUMA node / socket),
SYSTEM (across sockets).

Simulated nodes take a named profile (:data:`PROFILES`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class LinkTier(StrEnum):
    NVSWITCH = "NVSWITCH"
    NVLINK = "NVLINK"
    PCIE_SWITCH = "PCIE_SWITCH"
    HOST_BRIDGE = "HOST_BRIDGE"
    NUMA = "NUMA"
    SYSTEM = "SYSTEM"


#: best first: a lower rank is a faster link
TIER_RANK: dict[LinkTier, int] = {t: i for i, t in enumerate(LinkTier)}
#: the tiers GPUs talk over NVLink (one island / clique when every pair of a set has one)
NVLINK_TIERS = frozenset({LinkTier.NVSWITCH, LinkTier.NVLINK})


class GpuLink(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a: int = Field(ge=0)
    b: int = Field(ge=0)
    tier: LinkTier
    #: direct NVLink links between the two (NVLINK; 0 otherwise)
    nvlinks: int = Field(default=0, ge=0)


class GpuTopology(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: the simulated profile it came from ("" for one read from NVML)
    profile: str = ""
    #: "nvml" or "profile"
    source: str = "profile"
    gpus: int = Field(ge=0)
    #: one per pair a < b; a pair not listed is SYSTEM
    links: list[GpuLink] = Field(default_factory=list)

    def tier(self, a: int, b: int) -> LinkTier:
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link.tier
        return LinkTier.SYSTEM

    def matrix(self) -> list[list[str]]:
        """``nvidia-smi topo -m``-like: row a, column b, the tier (``X`` on the diagonal; NVLINK with its count, ``NV2``)."""
        cell = {(min(x.a, x.b), max(x.a, x.b)): (f"NV{x.nvlinks}" if x.tier == LinkTier.NVLINK else x.tier.value)
                for x in self.links}
        return [["X" if a == b else cell.get((min(a, b), max(a, b)), LinkTier.SYSTEM.value) for b in range(self.gpus)]
                for a in range(self.gpus)]


def _build(name: str, n: int, tier: Callable[[int, int], tuple[LinkTier, int]]) -> GpuTopology:
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            t, k = tier(a, b)
            links.append(GpuLink(a=a, b=b, tier=t, nvlinks=k))
    return GpuTopology(profile=name, source="profile", gpus=n, links=links)


#: DGX-1 (V100) hybrid cube mesh, as ``nvidia-smi topo -m`` shows it: NVLink counts per pair; GPUs
#: 0-3 and 4-7 are two fully linked quads (sockets 0 and 1), joined by one link per GPU (i, i+4).
HYBRID_CUBE_MESH: dict[tuple[int, int], int] = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2, (2, 6): 1,
    (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}


def _socket(a: int, b: int, n: int) -> LinkTier:
    return LinkTier.NUMA if (a < n // 2) == (b < n // 2) else LinkTier.SYSTEM


def _dgx_nvswitch(a: int, b: int) -> tuple[LinkTier, int]:
    return LinkTier.NVSWITCH, 0


def _cube_mesh(a: int, b: int) -> tuple[LinkTier, int]:
    k = HYBRID_CUBE_MESH.get((a, b), 0)
    return (LinkTier.NVLINK, k) if k else (_socket(a, b, 8), 0)


def _nvlink_pairs(a: int, b: int) -> tuple[LinkTier, int]:
    return (LinkTier.NVLINK, 4) if a // 2 == b // 2 else (LinkTier.HOST_BRIDGE, 0)


def _pcie_pairs(a: int, b: int) -> tuple[LinkTier, int]:
    return (LinkTier.PCIE_SWITCH, 0) if a // 2 == b // 2 else (_socket(a, b, 8), 0)


PROFILES: dict[str, GpuTopology] = {
    "dgx-nvswitch-8": _build("dgx-nvswitch-8", 8, _dgx_nvswitch),
    "hybrid-cube-mesh-8": _build("hybrid-cube-mesh-8", 8, _cube_mesh),
    "nvlink-pairs-4": _build("nvlink-pairs-4", 4, _nvlink_pairs),
    "pcie-pairs": _build("pcie-pairs", 8, _pcie_pairs),
}


def profile(name: str) -> GpuTopology:
    """A named profile; ``ValueError`` naming the known ones for any other name."""
    if name not in PROFILES:
        raise ValueError(f"unknown GPU topology profile {name!r} (known: {', '.join(PROFILES)})")
    return PROFILES[name].model_copy(deep=True)
