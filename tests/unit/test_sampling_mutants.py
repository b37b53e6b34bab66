"""Node sampling rules the mutation run (``make mutate``) found unasserted: the default threshold,
the walk on tiny clusters, what a sample says about itself (``cluster_metrics.sample``), the
counts of a small annotated cluster, and the nodes kept to show why nothing fits."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aios_blocks.policies import affinity, capacity, sampling

from .views import busy_gpu, free_gpus, node, nodes_of

NEEDS = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 0}


def cluster(n: int, free: set[int] | None = None, racks: int = 4) -> dict[str, Any]:
    views = []
    for i in range(n):
        gpus = free_gpus(1, prefix=f"n{i}-g") if free is None or i in free else [busy_gpu(f"n{i}-g0")]
        views.append(node(f"n{i:04d}", gpus=gpus, labels={"rack": str(i % racks)}))
    return nodes_of(*views)


def rack(value: str, strength: str = "Required") -> dict[str, Any]:
    return {"category": "Topology", "strength": strength, "anti": False, "target_type": "RackId", "target": value}


@pytest.mark.parametrize("ir", [{}, {"policies": None}, {"policies": {"resourceAllocator": {"settings": None}}},
                                {"policies": {"resourceAllocator": {"settings": {"sampleNodes": None}}}}])
def test_no_sample_nodes_setting_takes_the_default(ir: dict[str, Any]) -> None:
    assert sampling.threshold_of(ir) == sampling.default_threshold()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 9, 12, 30, 97])
def test_the_walk_is_a_start_and_a_stride_coprime_to_the_size(n: int) -> None:
    for seed in ("a", "b", "c", "d"):
        start, stride = sampling.walk(n, seed)
        assert 0 <= start < n and 1 <= stride < max(n, 2) and math.gcd(stride, n) == 1
        assert [(start + i * stride) % n for i in range(n)] == list(sampling.visit_order(n, seed))
    assert list(sampling.visit_order(0, "a")) == []


@pytest.mark.parametrize(("n", "seed", "want"), [
    (3, "a", (1, 1)), (10, "blk-a", (3, 7)), (1000, "blk-a", (231, 911)), (1024, "b-7", (907, 227)),
    (10, "blk-0", (2, 7)), (1000, "blk-0", (654, 153)),  # a first stride not coprime (5, 152): the next one that is
])
def test_the_walk_of_a_seed_is_the_same_in_every_process_and_version(n: int, seed: str, want: tuple[int, int]) -> None:
    """Controllers (any process, any restart) must agree on a block's sample: the walk is fixed
    by the seed (random.Random's string seeding), not by this process."""
    assert sampling.walk(n, seed) == want


def test_strides_spread_over_seeds_even_on_a_tiny_cluster() -> None:
    assert {sampling.walk(3, f"s{i}")[1] for i in range(20)} == {1, 2}
    assert len({sampling.walk(1000, f"s{i}")[1] for i in range(20)}) >= 15


def test_a_sample_says_what_it_did() -> None:
    s = sampling.Sample({}, 10, 7, 3, 9, True, "blk", 4)
    assert s.info() == {"total_nodes": 10, "visited": 7, "feasible": 3, "limit": 4, "seed": "blk"}
    s.unsatisfiable = "RequiredAffinityUnsatisfiable: ..."
    assert s.info()["unsatisfiable"] == "RequiredAffinityUnsatisfiable: ..."


def test_feasible_needs_affinity_room_and_the_required_gpus_free() -> None:
    v = node("n1", gpus=free_gpus(2, prefix="g"))
    assert sampling.feasible(v, NEEDS, False)
    assert not sampling.feasible({**v, "affinity": {"pass": False}}, NEEDS, False)
    assert sampling.feasible({**v, "affinity": {"pass": True, "require_gpus": ["g1"]}}, NEEDS, False)
    assert not sampling.feasible({**v, "affinity": {"pass": True, "require_gpus": ["g1", "g9"]}}, NEEDS, False)
    assert sampling.feasible({**v, "affinity": {"pass": True, "require_gpus": ["g0", "g1"]}}, NEEDS, False)  # all of them
    assert not sampling.feasible(node("n2", gpus=[busy_gpu("g0")]), NEEDS, False)


def test_a_small_cluster_with_affinity_is_annotated_whole_and_counted() -> None:
    nodes = cluster(8, free={0, 1, 2, 5})
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100, entries=[rack("1")])
    assert (s.total, s.visited, s.feasible, s.affinity_pass, s.sampled) == (8, 8, 2, 2, False)  # n1 and n5 on rack 1
    assert set(s.nodes) == set(nodes) and all("affinity" in v for v in s.nodes.values())
    assert all("affinity" not in v for v in nodes.values())  # copies: the snapshot is not annotated
    assert s.unsatisfiable == ""
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100, entries=[rack("9")])
    assert s.affinity_pass == 0 and s.feasible == 0
    assert s.unsatisfiable == "RequiredAffinityUnsatisfiable: entry 0 (Required toward rack 9) eliminated 8 of 8 nodes"
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100)
    assert (s.feasible, s.affinity_pass, s.sampled) == (4, 8, False) and s.nodes is nodes


@pytest.mark.parametrize("inventory", [False, True])
def test_a_big_cluster_with_nothing_that_fits_keeps_a_few_nodes_to_show_why(inventory: bool) -> None:
    nodes: dict[str, Any] = cluster(300, free=set())
    if inventory:
        nodes = capacity.Nodes(nodes)
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100)
    assert s.sampled and s.visited == 300 and s.feasible == 0 and len(s.nodes) == sampling.KEEP_INFEASIBLE
    assert s.limit == sampling.limit(300) and s.seed == "blk"
    start, stride = sampling.walk(300, "blk")
    ids = list(nodes)
    assert list(s.nodes) == [ids[(start + j * stride) % 300] for j in range(sampling.KEEP_INFEASIBLE)]


@pytest.mark.parametrize("inventory", [False, True])
@pytest.mark.parametrize(("free", "want"), [(None, 1), (set(range(0, 300, 3)), 1), ({7, 150}, 1), (None, 50), (None, 500),
                                           (set(range(0, 90, 10)), 1)])  # exactly as many fit as are enough
def test_a_big_cluster_sample_stops_at_enough_fitting_nodes(inventory: bool, free: set[int] | None, want: int) -> None:
    nodes: dict[str, Any] = cluster(300, free=free)
    if inventory:
        nodes = capacity.Nodes(nodes)
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100, want=want)
    fitting = 300 if free is None else len(free)
    k = max(sampling.limit(300), min(want, 100))  # want is capped at the threshold
    assert s.limit == k and s.sampled and s.total == 300
    assert s.feasible == len(s.nodes) == min(k, fitting)
    # the nodes are the first fitting ones in the block's visit order, and the walk stopped there
    order = [list(nodes)[i] for i in sampling.visit_order(300, "blk")]
    fits = [nid for nid in order if capacity.node_fits(nodes[nid], NEEDS, False) is not None]
    assert list(s.nodes) == fits[:k]
    assert s.visited == (300 if fitting < k else order.index(fits[k - 1]) + 1)


def test_a_big_cluster_with_required_affinity_counts_what_passes() -> None:
    nodes = cluster(300, racks=4)
    entries = [rack("2")]
    s = sampling.sample(nodes, NEEDS, False, "blk", threshold=100, entries=entries, index=affinity.empty_index())
    assert s.feasible == len(s.nodes) == sampling.limit(300)
    assert all(v["affinity"]["pass"] and v["labels"]["rack"] == "2" for v in s.nodes.values())
    assert s.affinity_pass == s.feasible and s.unsatisfiable == ""
