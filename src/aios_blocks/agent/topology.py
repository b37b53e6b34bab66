"""A node's GPU topology read from NVML (docs/topology.md).

For each GPU pair: the NVLink links between them (``nvmlDeviceGetNvLinkState`` on every link,
whose far end ``nvmlDeviceGetNvLinkRemotePciInfo`` names), NVSWITCH when both GPUs have active
links to an NVSwitch (``nvmlDeviceGetNvLinkRemoteDeviceType``), else the PCIe level of their
common ancestor (``nvmlDeviceGetTopologyCommonAncestor``). Written against nvidia-ml-py's API and
checked with a double of its shape; no real GPU was at hand to check it (docs/topology.md).
"""

from __future__ import annotations

from typing import Any

import structlog

from ..schemas.topology import GpuLink, GpuTopology, LinkTier

log = structlog.get_logger("aios.agent.topology")

# NVML's values (nvml.h; pynvml exports them by these names)
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
#: nvmlGpuTopologyLevel_t -> tier: INTERNAL (same board) and SINGLE / MULTIPLE (behind PCIe
#: switches) share a switch; HOSTBRIDGE; NODE (same NUMA node); SYSTEM (across sockets)
ANCESTOR_TIER: dict[int, LinkTier] = {
    0: LinkTier.PCIE_SWITCH, 10: LinkTier.PCIE_SWITCH, 20: LinkTier.PCIE_SWITCH,
    30: LinkTier.HOST_BRIDGE, 40: LinkTier.NUMA, 50: LinkTier.SYSTEM,
}
#: links tried per GPU when the library does not say (NVML_NVLINK_MAX_LINKS of recent drivers)
MAX_LINKS = 18


def _pci_key(pci: Any) -> tuple[int, int, int]:
    return int(pci.domain), int(pci.bus), int(pci.device)


def _nvlinks(nvml: Any, handle: Any, max_links: int) -> tuple[list[tuple[int, int, int]], bool]:
    """The PCI address of each active link's far end, and whether any ends at an NVSwitch."""
    peers: list[tuple[int, int, int]] = []
    switch = False
    for link in range(max_links):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != NVML_FEATURE_ENABLED:
                continue
        except Exception:  # NOT_SUPPORTED / INVALID_ARGUMENT past the GPU's last link, or no NVLink at all
            break
        kind = None
        get_type = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        if get_type is not None:
            try:
                kind = get_type(handle, link)
            except Exception:
                kind = None
        if kind == NVML_NVLINK_DEVICE_TYPE_SWITCH:
            switch = True
            continue
        try:
            peers.append(_pci_key(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
        except Exception:
            continue
    return peers, switch


def read_topology(nvml: Any, handles: list[Any]) -> GpuTopology | None:
    """The topology of the GPUs behind ``handles`` (NVML index order); None when NVML cannot say."""
    n = len(handles)
    try:
        addr = {_pci_key(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", MAX_LINKS))
        found = [_nvlinks(nvml, h, max_links) for h in handles]
        links: list[GpuLink] = []
        for a in range(n):
            for b in range(a + 1, n):
                count = sum(1 for p in found[a][0] if addr.get(p) == b)
                if found[a][1] and found[b][1]:
                    tier, count = LinkTier.NVSWITCH, 0
                elif count:
                    tier = LinkTier.NVLINK
                else:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                    tier = ANCESTOR_TIER.get(level, LinkTier.SYSTEM)
                links.append(GpuLink(a=a, b=b, tier=tier, nvlinks=count))
    except Exception as exc:
        log.info("topology.unknown", reason=f"{type(exc).__name__}: {exc}")
        return None
    return GpuTopology(profile="", source="nvml", gpus=n, links=links)
