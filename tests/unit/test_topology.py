"""GPU topology (issue 38, docs/topology.md): the profiles, the pure choice of GPUs, the arrival-
order property over random orders, the controller's use of it, and the NVML reader against a
double with nvidia-ml-py's shape (this machine has no GPU)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from aios_blocks.agent.gpus import NvmlSource, SimulatedSource, detect
from aios_blocks.agent.topology import read_topology
from aios_blocks.handlers import controller
from aios_blocks.policies import topology as tp
from aios_blocks.schemas.spec import Node
from aios_blocks.schemas.topology import HYBRID_CUBE_MESH, PROFILES, LinkTier, profile
from bench.topology import first_fit, measure, ours

from .views import busy_gpu, free_gpus, invoker, make_ir, node, nodes_of


def topo(name: str) -> dict[str, Any]:
    return PROFILES[name].model_dump(mode="json")


def test_hybrid_cube_mesh_is_the_dgx1_one() -> None:
    """Every GPU has 6 NVLinks; GPUs 0-3 and 4-7 are the two fully linked quads, and the only ones."""
    t = profile("hybrid-cube-mesh-8")
    per_gpu = [sum(k for (a, b), k in HYBRID_CUBE_MESH.items() if g in (a, b)) for g in range(8)]
    assert per_gpu == [6] * 8
    quads = [s for s in itertools.combinations(range(8), 4)
             if all(t.tier(a, b) == LinkTier.NVLINK for a, b in itertools.combinations(s, 2))]
    assert quads == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert t.matrix()[0][:5] == ["X", "NV1", "NV1", "NV2", "NV2"] and t.tier(0, 5) == LinkTier.SYSTEM


def test_profiles_have_their_shape() -> None:
    assert {x.tier for x in profile("dgx-nvswitch-8").links} == {LinkTier.NVSWITCH}
    pairs = profile("nvlink-pairs-4")
    assert pairs.tier(0, 1) == pairs.tier(2, 3) == LinkTier.NVLINK and pairs.tier(1, 2) == LinkTier.HOST_BRIDGE
    pcie = profile("pcie-pairs")
    assert pcie.tier(2, 3) == LinkTier.PCIE_SWITCH and pcie.tier(1, 2) == LinkTier.NUMA and pcie.tier(0, 7) == LinkTier.SYSTEM
    with pytest.raises(ValueError, match="known: dgx-nvswitch-8"):
        profile("nope")


def test_a_single_gpu_keeps_the_nvlink_pairs_whole() -> None:
    """On 4 GPUs in NVLink pairs, GPU 0 busy: a 1-GPU instance takes GPU 1 (not 2), so a 2-GPU one still gets a pair."""
    t = topo("nvlink-pairs-4")
    one = tp.choose(t, [1, 2, 3], 1)
    assert one.gpus == (1,)
    two = tp.choose(t, [2, 3], 2)
    assert two.gpus == (2, 3) and two.tier == LinkTier.NVLINK == two.best
    assert tp.first_fit([1, 2, 3], 1) == (1,) and tp.first_fit([2, 3, 1], 2) == (1, 2)


def test_four_gpus_get_a_whole_quad_of_the_cube_mesh() -> None:
    t = topo("hybrid-cube-mesh-8")
    c = tp.choose(t, [1, 2, 3, 4, 5, 6, 7], 4)
    assert c.gpus == (4, 5, 6, 7) and c.tier == LinkTier.NVLINK
    worst = tp.choose(t, [0, 1, 4, 5], 4)  # no quad free: the best there is, and explain says so
    assert worst.tier == worst.best == LinkTier.SYSTEM


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_order_gets_nvlink_whenever_one_is_free(name: str) -> None:
    """The target as a property, over 200 random arrival orders with departures: each 2-GPU
    instance gets an NVLink pair and each 4-GPU one an NVLink island whenever the node still has
    one free, and every instance the best tier the node had free."""
    t = measure(name, 200, ours)
    assert t.misses == []
    for size in (2, 4):
        assert t.nvlink_got_when_free[size] == t.nvlink_free[size]
        assert t.best_got[size] == t.placed[size]
    assert t.placed[2] > 500


def test_first_fit_misses_on_the_same_orders() -> None:
    """The baseline, measured the same way, is not 100 %: the property above is not vacuous."""
    t = measure("hybrid-cube-mesh-8", 200, first_fit)
    assert t.misses and t.nvlink_got_when_free[4] < t.nvlink_free[4]
    assert measure("nvlink-pairs-4", 200, first_fit).misses


def test_large_nodes_are_chosen_greedily_and_well() -> None:
    """16 GPUs in NVLink pairs: C(16, 8) is over the exhaustive limit; the greedy pick is still a clique of pairs' tier."""
    t = {"profile": "", "gpus": 16, "links": [{"a": a, "b": a + 1, "tier": "NVLINK", "nvlinks": 4} for a in range(0, 16, 2)]}
    c = tp.choose(t, list(range(16)), 8)
    assert len(c.gpus) == 8 and tp.choose(t, [3, 4, 5, 9], 2).gpus == (4, 5)


def topo_node(nid: str, name: str, busy: set[int] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    t = topo(name)
    gpus = [busy_gpu(f"{nid}-g{i}") if i in busy else free_gpus(1, f"{nid}-g{i}")[0] | {"id": f"{nid}-g{i}"}
            for i in range(t["gpus"])]
    return node(nid, gpus=gpus) | {"topology": t}


async def test_the_controller_gives_an_nvlink_pair_and_records_the_tier() -> None:
    """GPU 3 busy: binpack alone picks GPUs 1,2 for this block (across the pairs); with the
    node's topology the instance gets the free NVLink pair 0,1 and the record says so (explain shows it)."""
    ir = make_ir(resources={"gpus": 2, "gpuMemory": 0, "cpu": 1, "memory": 1024})
    plain = nodes_of({k: v for k, v in topo_node("n1", "nvlink-pairs-4", busy={3}).items() if k != "topology"})
    made = await controller.plan(ir, {"id": "c1", "labels": {}}, plain, "allocation", ["b1-0"], invoker(ir, "resourceAllocator"))
    assert made[0]["gpus"] == ["n1-g1", "n1-g2"] and "topology" not in made[0]
    nodes = nodes_of(topo_node("n1", "nvlink-pairs-4", busy={3}))
    made = await controller.plan(ir, {"id": "c1", "labels": {}}, nodes, "allocation", ["b1-0"], invoker(ir, "resourceAllocator"))
    assert made[0]["gpus"] == ["n1-g0", "n1-g1"]
    assert made[0]["topology"] == {"tier": "NVLINK", "best": "NVLINK"}


def test_refine_leaves_shared_gpus_and_pinned_gpus_to_the_policy() -> None:
    n = topo_node("n1", "nvlink-pairs-4")
    ids = [g["id"] for g in n["gpus"]]
    assert tp.refine(n, ids[1:3], ids, share=True) == (ids[1:3], {"tier": "HOST_BRIDGE", "best": "NVLINK"})
    pinned = [{"category": "Resource", "strength": "Required", "anti": False, "target_type": "ResourceId", "target": "x"}]
    assert tp.refine(n, ids[1:3], ids, share=False, entries=pinned)[0] == ids[1:3]
    assert tp.refine(n, ids[1:3], ids, share=False)[0] == ids[0:2]


# -- NVML -----------------------------------------------------------------------------------------
class FakeNvml:
    """nvidia-ml-py's shape: handles by index, PCI info structs (domain/bus/device), per-link
    NVLink state raising past the last link, remote PCI info / device type per link, common ancestor levels."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, n: int, nvlinks: dict[tuple[int, int], int], ancestor: dict[tuple[int, int], int],
                 switch: bool = False, links_per_gpu: int = 6):
        self.n, self.nvlinks, self.ancestor, self.switch, self.per = n, nvlinks, ancestor, switch, links_per_gpu
        self.ends: dict[int, list[int | None]] = {g: [] for g in range(n)}
        for (a, b), k in nvlinks.items():
            self.ends[a] += [b] * k
            self.ends[b] += [a] * k

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h}".encode()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Tesla V100-SXM2-16GB"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=16 * 1024**3)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=0)

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(domain=0, bus=0x06 + h, device=0, busId=f"00000000:{0x06 + h:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.per:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1 if (self.switch or link < len(self.ends[h])) else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return 2 if self.switch else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        peer = self.ends[h][link]
        assert peer is not None
        return self.nvmlDeviceGetPciInfo(peer)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.ancestor.get((min(a, b), max(a, b)), 50)


def test_nvml_topology_of_a_cube_mesh() -> None:
    """The DGX-1's links and PCIe levels read back as the hybrid-cube-mesh-8 profile."""
    nvml = FakeNvml(8, HYBRID_CUBE_MESH, {(a, b): 40 for a in range(8) for b in range(8) if (a < 4) == (b < 4)})
    got = read_topology(nvml, list(range(8)))
    assert got is not None and got.source == "nvml"
    assert got.matrix() == profile("hybrid-cube-mesh-8").matrix()


def test_nvml_topology_nvswitch_and_pcie_levels() -> None:
    sw = read_topology(FakeNvml(4, {}, {}, switch=True), list(range(4)))
    assert sw is not None and {x.tier for x in sw.links} == {LinkTier.NVSWITCH}
    pcie = read_topology(FakeNvml(4, {}, {(0, 1): 10, (2, 3): 20, (0, 2): 30, (1, 2): 40}), list(range(4)))
    assert pcie is not None
    assert [pcie.tier(*p) for p in [(0, 1), (2, 3), (0, 2), (1, 2), (0, 3)]] == [
        LinkTier.PCIE_SWITCH, LinkTier.PCIE_SWITCH, LinkTier.HOST_BRIDGE, LinkTier.NUMA, LinkTier.SYSTEM]


def test_the_agent_reports_the_topology_in_its_node() -> None:
    from aios_blocks.agent.main import AgentOptions, describe_node

    src = detect(None, "n1", nvml=FakeNvml(2, {(0, 1): 4}, {}))
    assert isinstance(src, NvmlSource)
    node = describe_node(AgentOptions("n1", "c1", cpu=1, memory=1), src)
    assert node.topology is not None and node.topology.tier(0, 1) == LinkTier.NVLINK and node.topology.links[0].nvlinks == 4
    sim = detect(None, "n2", profile="nvlink-pairs-4")
    assert isinstance(sim, SimulatedSource) and len(sim.gpus()) == 4
    assert describe_node(AgentOptions("n2", "c1", cpu=1, memory=1), sim).topology == profile("nvlink-pairs-4")
    with pytest.raises(ValueError, match="has 4 GPUs, not 8"):
        detect(8, "n3", profile="nvlink-pairs-4")


def test_a_single_gpu_without_nvlink_reports_its_topology_read_from_nvml() -> None:
    """As an H200 in a VM answered (bench/gpu_check.sh, docs/topology.md): NvLinkState refuses link 0
    (NotSupported). The node still reports a topology read from NVML, of one GPU and no pairs, so
    `blocks node get` says so instead of "unknown"; placement is the same (no pair to choose)."""
    from aios_blocks.agent.main import AgentOptions, describe_node

    src = detect(None, "h200", nvml=FakeNvml(1, {}, {}, links_per_gpu=0))
    topo = describe_node(AgentOptions("h200", "c1", cpu=1, memory=1), src).topology
    assert topo is not None and (topo.source, topo.gpus, topo.links) == ("nvml", 1, []) and topo.matrix() == [["X"]]
    assert detect(None, "none", nvml=FakeNvml(0, {}, {})).topology() is None  # no GPU: nothing to say


def test_a_node_without_topology_is_unknown_and_old_specs_still_load() -> None:
    old = {"id": "n1", "cluster": "c1", "gpus": [{"id": "g0"}]}
    assert Node.model_validate(old).topology is None
    assert SimulatedSource(2, "n1").topology() is None


# -- seed 002's Topology category: a link tier, Required (filter) or Preferred (score) -----------
def tier_entry(strength: str, tier: str) -> list[dict[str, Any]]:
    from aios_blocks.schemas.affinity import normalize

    raw = [{"category": "Topology", "strength": strength, "target": {"type": "LinkTier", "value": tier}}]
    return [msgspec_to_dict(e) for e in normalize(raw)]


def msgspec_to_dict(e: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(e)


def test_link_tier_entries_parse_encode_and_reject_anti() -> None:
    import base64

    from aios_blocks.schemas.affinity import decode_tlv, encode_tlv, normalize
    from aios_blocks.schemas.errors import SpecInvalid

    [e] = normalize([{"category": "Topology", "strength": "Required", "target": {"type": "LinkTier", "value": "nvlink"}}])
    assert e.target == "NVLINK" and decode_tlv(encode_tlv([e])) == [e]
    assert encode_tlv([e])[-1] == 2
    assert normalize(affinity_tlv=base64.b64encode(encode_tlv([e])).decode()) == [e]
    with pytest.raises(SpecInvalid, match="toward only"):
        normalize([{"category": "Topology", "strength": "Required", "anti": True, "target": {"type": "LinkTier", "value": "NVLINK"}}])
    with pytest.raises(SpecInvalid, match="LinkTier must be one of"):
        normalize([{"category": "Topology", "strength": "Required", "target": {"type": "LinkTier", "value": "FAST"}}])
    with pytest.raises(SpecInvalid, match="not allowed for category Trust"):
        normalize([{"category": "Trust", "strength": "Required", "target": {"type": "LinkTier", "value": "NVLINK"}}])


def test_required_link_tier_filters_nodes_with_the_reason_and_preferred_scores() -> None:
    from aios_blocks.policies import affinity

    nodes = nodes_of(topo_node("pairs", "nvlink-pairs-4", busy={0, 2}), topo_node("cube", "hybrid-cube-mesh-8", busy={0}),
                     topo_node("pcie", "pcie-pairs"), node("plain", gpus=free_gpus(8)))
    index = {**affinity.empty_index(), "gpus": 2}
    affinity.annotate(nodes, tier_entry("Required", "NVLINK"), index)
    assert {n: v["affinity"]["pass"] for n, v in nodes.items()} == {"pairs": False, "cube": True, "pcie": False, "plain": False}
    assert "best tier of 2 free GPUs here: HOST_BRIDGE" in nodes["pairs"]["affinity"]["reasons"][0]
    assert "reports no GPU topology" in nodes["plain"]["affinity"]["reasons"][0]
    affinity.annotate(nodes, tier_entry("Required", "PCIE_SWITCH"), index)
    assert nodes["pcie"]["affinity"]["pass"] and not nodes["pairs"]["affinity"]["pass"]
    four = {**index, "gpus": 4}
    affinity.annotate(nodes, tier_entry("Required", "NVLINK"), four)
    assert nodes["cube"]["affinity"]["pass"]  # 4-7 is still a whole quad
    affinity.annotate(nodes, tier_entry("Preferred", "NVLINK"), index)
    assert {n: v["affinity"]["score"] for n, v in nodes.items()} == {"pairs": 0.0, "cube": 1.0, "pcie": 0.0, "plain": 0.0}
    assert all(v["affinity"]["pass"] for v in nodes.values())


async def test_a_required_tier_lands_on_the_node_that_has_it() -> None:
    """binpack prefers the fuller node (pairs, one NVLink pair broken); Required NVLINK sends the
    2-GPU instance to the node that still has a free pair; no such node: the reason says why."""
    ir = make_ir(resources={"gpus": 2, "gpuMemory": 0, "cpu": 1, "memory": 1024})
    nodes = nodes_of(topo_node("full", "nvlink-pairs-4", busy={0, 2}), topo_node("free", "nvlink-pairs-4"))
    made = await controller.plan(ir, {"id": "c1", "labels": {}}, nodes, "allocation", ["b1-0"], invoker(ir, "resourceAllocator"))
    assert made[0]["node"] == "full" and made[0]["topology"] == {"tier": "HOST_BRIDGE", "best": "HOST_BRIDGE"}
    ir["affinity"] = tier_entry("Required", "NVLINK")
    index = {**controller.affinity.empty_index(), "gpus": 2}
    made = await controller.plan(ir, {"id": "c1", "labels": {}}, nodes, "allocation", ["b1-0"], invoker(ir, "resourceAllocator"), None, index)
    assert made[0]["node"] == "free" and made[0]["topology"] == {"tier": "NVLINK", "best": "NVLINK"}
    from aios_blocks.schemas.errors import PlacementFailed

    with pytest.raises(PlacementFailed, match=r"RequiredAffinityUnsatisfiable.*GPU link tier NVLINK"):
        await controller.plan(ir, {"id": "c1", "labels": {}}, nodes_of(topo_node("full", "nvlink-pairs-4", busy={0, 2})),
                              "allocation", ["b1-0"], invoker(ir, "resourceAllocator"), None, index)


def test_cluster_import_applies_a_profile_by_option_or_label() -> None:
    from aios_blocks.cli.trace import with_topology
    from aios_blocks.schemas.spec import Gpu

    def n(nid: str, k: int, **labels: str) -> Node:
        return Node(id=nid, cluster="c1", labels=labels, gpus=[Gpu(id=f"{nid}-g{i}") for i in range(k)])

    out = with_topology([n("a", 8), n("b", 4), n("c", 4, **{"gpu-topology": "nvlink-pairs-4"}), n("d", 2)], "dgx-nvswitch-8")
    assert [x.topology.profile if x.topology else None for x in out] == ["dgx-nvswitch-8", None, "nvlink-pairs-4", None]
    with pytest.raises(ValueError, match="has 8 GPUs, the node 4"):
        with_topology([n("e", 4, **{"gpu-topology": "pcie-pairs"})], None)


def test_a_topology_that_does_not_cover_the_nodes_gpus_is_ignored() -> None:
    """A node view whose topology is of another GPU count (a stale spec): the policy's choice, no record, no crash."""
    from aios_blocks.policies import affinity

    n = topo_node("n1", "nvlink-pairs-4") | {"gpus": free_gpus(6, "n1-g")}
    ids = [g["id"] for g in n["gpus"]]
    assert tp.refine(n, ids[4:6], ids, share=False) == (ids[4:6], {})
    assert tp.refine(n, ids[4:6], ids, share=True) == (ids[4:6], {})
    affinity.annotate({"n1": n}, tier_entry("Required", "NVLINK"), {**affinity.empty_index(), "gpus": 2})
    assert not n["affinity"]["pass"] and "reports no GPU topology" in n["affinity"]["reasons"][0]
