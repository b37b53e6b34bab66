"""The LXD shapes an ``instance_placement`` scriptlet sees (seed 004; LXD's api types, exact field
names): the placement request, the candidate members, and what the helper functions
``get_cluster_member_state`` / ``get_cluster_member_resources`` / ``get_instance_resources``
return. ``policies.starlark_runtime`` builds them from node views; ``blocks policy run --kind lxd``
takes them as given (``LxdArgs``). Plain dicts on the way in and out, typed for mypy.
"""

from __future__ import annotations

from typing import TypedDict

from .records import JSONObject


class InstanceSource(TypedDict):
    type: str
    alias: str


class PlacementRequest(TypedDict):
    """LXD's InstancePlacement (api.InstancesPost + reason + project) for one instance."""

    name: str
    project: str
    #: ``schemas.events.PlacementReason``: new, evacuation, relocation
    reason: str
    type: str
    architecture: str
    profiles: list[str]
    ephemeral: bool
    description: str
    #: the block's initSettings and parameters as strings, and its limits
    config: dict[str, str]
    devices: dict[str, dict[str, str]]
    source: InstanceSource
    instance_type: str


class ClusterMember(TypedDict):
    """LXD's api.ClusterMember for a node (``config``: its labels as strings)."""

    server_name: str
    url: str
    address: str
    database: bool
    status: str
    message: str
    architecture: str
    failure_domain: str
    description: str
    config: dict[str, str]
    groups: list[str]
    roles: list[str]


class SysInfo(TypedDict):
    uptime: int
    load_averages: list[float]
    total_ram: int
    free_ram: int
    shared_ram: int
    buffered_ram: int
    total_swap: int
    free_swap: int
    processes: int
    logical_cpus: int


class MemberState(TypedDict):
    """LXD's api.ClusterMemberState (RAM in bytes; load averages = CPUs in use)."""

    sysinfo: SysInfo
    storage_pools: dict[str, JSONObject]


class GpuMemory(TypedDict):
    total: int
    used: int
    free: int


class GpuCard(TypedDict):
    driver: str
    driver_version: str
    product: str
    product_name: str
    product_id: str
    vendor: str
    vendor_id: str
    pci_address: str
    numa_node: int
    memory: GpuMemory
    #: instances on it (an extension), and whether one holds it alone
    instances: int
    exclusive: bool


class CpuResources(TypedDict):
    architecture: str
    total: int
    sockets: list[JSONObject]


class MemoryResources(TypedDict):
    total: int
    used: int
    free: int
    hugepages_total: int
    hugepages_used: int


class GpuResources(TypedDict):
    cards: list[GpuCard]
    total: int


class DiskResources(TypedDict):
    disks: list[JSONObject]
    total: int


class NetworkResources(TypedDict):
    cards: list[JSONObject]
    total: int


class MemberResources(TypedDict):
    """LXD's api.Resources (cpu, memory, gpu; empty storage and network). Bytes."""

    cpu: CpuResources
    memory: MemoryResources
    gpu: GpuResources
    storage: DiskResources
    network: NetworkResources


class InstanceResources(TypedDict):
    """LXD's api.InstanceResources from the block's resources (plus gpus, gpu_memory in bytes)."""

    cpu_cores: int
    memory_size: int
    root_disk_size: int
    gpus: int
    gpu_memory: int


class LxdGiven(TypedDict):
    """What ``run_lxd``'s caller gives the helper functions (member name -> LXD shape); None:
    not given."""

    member_state: dict[str, MemberState] | None
    member_resources: dict[str, MemberResources] | None
    instance_resources: InstanceResources | None


class LxdArgs(TypedDict, total=False):
    """``blocks policy run --kind lxd``'s input: LXD's own arguments, plus the helpers' answers."""

    request: PlacementRequest
    candidate_members: list[ClusterMember]
    member_state: dict[str, MemberState]
    member_resources: dict[str, MemberResources]
    instance_resources: InstanceResources


class LxdOutcome(TypedDict):
    """``run_lxd``'s answer: the member the scriptlet chose and its log lines."""

    target: str
    logs: list[list[str]]
