"""Node sampling for large clusters (``policies.sampling``): deterministic, whole for small
clusters, never loses the only feasible node, Required affinity still fails closed with its reason;
and the totals memo (``capacity.totals``) that keeps payloads cheap on big clusters."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from aios_blocks.handlers import controller, gateway
from aios_blocks.policies import capacity, sampling
from aios_blocks.policies.builtin.resource import BinPackPolicy
from aios_blocks.policies.contract import check
from aios_blocks.schemas.affinity import normalize

from .views import busy_gpu, free_gpus, invoker, make_ir, node, nodes_of

CLUSTER = {"id": "c1", "labels": {}}


def big(n: int, free: set[int] | None = None, labels: dict[int, dict[str, str]] | None = None) -> dict[str, Any]:
    """n nodes with 2 GPUs each; only the nodes in ``free`` have free GPUs (all when None)."""
    views = []
    for i in range(n):
        has_room = free is None or i in free
        gpus = free_gpus(2, prefix=f"n{i}-g") if has_room else [busy_gpu(f"n{i}-g0"), busy_gpu(f"n{i}-g1")]
        views.append(node(f"n{i:05d}", gpus=gpus, labels=(labels or {}).get(i, {"rack": str(i % 8)})))
    return nodes_of(*views)


def with_affinity(ir: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {**ir, "affinity": msgspec.to_builtins(normalize(entries))}


# -- visiting order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 1024])
def test_visit_order_is_a_permutation(n: int) -> None:
    order = list(sampling.visit_order(n, "blk-1"))
    assert sorted(order) == list(range(n))


def test_visit_order_is_deterministic_per_seed_and_differs_between_seeds() -> None:
    a = list(sampling.visit_order(1000, "blk-a"))
    assert a == list(sampling.visit_order(1000, "blk-a"))
    others = {tuple(sampling.visit_order(1000, f"blk-{i}"))[:10] for i in range(20)}
    assert len(others) > 15  # different blocks start in different places


@pytest.mark.parametrize(("n", "k"), [(1, 1), (2, 2), (4, 2), (5, 3), (100, 7), (1000, 10), (10000, 14)])
def test_limit_is_nomads_log2(n: int, k: int) -> None:
    assert sampling.limit(n) == k


# -- small clusters are seen whole ------------------------------------------------------------------


def test_small_cluster_is_never_sampled() -> None:
    nodes = big(100)
    pl = controller.payload(make_ir(), CLUSTER, nodes)
    assert set(pl["cluster_metrics"]["nodes"]) == set(nodes)
    assert pl["healthy_nodes"] == sorted(nodes)
    assert "sample" not in pl["cluster_metrics"]


def test_sample_nodes_zero_turns_sampling_off() -> None:
    nodes = big(300)
    pl = controller.payload(make_ir(allocator_settings={"sampleNodes": 0}), CLUSTER, nodes)
    assert len(pl["cluster_metrics"]["nodes"]) == 300 and "sample" not in pl["cluster_metrics"]


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (50, 50), ("20", 20), ("x", sampling.default_threshold()), (-3, 0)])
def test_threshold_comes_from_the_allocator_settings(value: Any, expected: int) -> None:
    assert sampling.threshold_of(make_ir(allocator_settings={"sampleNodes": value})) == expected


# -- large clusters ---------------------------------------------------------------------------------


def test_large_cluster_payload_keeps_the_contract_with_a_sample_and_full_totals() -> None:
    nodes = big(1000)
    pl = controller.payload(make_ir(), CLUSTER, nodes)
    metrics = pl["cluster_metrics"]
    assert set(pl) >= {"block", "cluster", "cluster_metrics", "healthy_nodes"}
    assert len(metrics["nodes"]) == sampling.limit(1000)
    assert set(pl["healthy_nodes"]) == set(metrics["nodes"]) and set(metrics["nodes"]) <= set(nodes)
    assert metrics["node_count"] == 1000 and metrics["gpus"] == 2000 and metrics["gpus_free"] == 2000
    assert metrics["sample"]["total_nodes"] == 1000 and metrics["sample"]["feasible"] == sampling.limit(1000)
    check("allocation", BinPackPolicy("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {}))


def test_same_block_same_sample_other_block_other_sample() -> None:
    nodes = big(1000)
    a1 = controller.payload(make_ir(bid="a"), CLUSTER, nodes)["healthy_nodes"]
    a2 = controller.payload(make_ir(bid="a"), CLUSTER, nodes)["healthy_nodes"]
    b = controller.payload(make_ir(bid="b"), CLUSTER, nodes)["healthy_nodes"]
    assert a1 == a2 and a1 != b


def test_dry_run_sample_holds_enough_feasible_nodes_for_max_instances() -> None:
    nodes = big(500)
    pl = controller.payload(make_ir(max_instances=40), CLUSTER, nodes)
    assert len(pl["cluster_metrics"]["nodes"]) == 40
    result = BinPackPolicy("r", {}, {}).eval({}, {"action": "dry_run", "payload": pl}, {})
    assert result["selection_score_data"]["score"] == 1.0


@pytest.mark.parametrize("where", [0, 1, 777, 1999])
def test_the_only_feasible_node_of_a_big_cluster_is_found(where: int) -> None:
    nodes = big(2000, free={where})
    target = f"n{where:05d}"
    for bid in ("x", "y", "z"):
        pl = controller.payload(make_ir(bid=bid), CLUSTER, nodes)
        assert list(pl["cluster_metrics"]["nodes"]) == [target]
        assert pl["cluster_metrics"]["sample"]["visited"] <= 2000
        assert BinPackPolicy("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {})["node_id"] == target


def test_a_full_big_cluster_fails_with_the_reason_after_a_full_scan() -> None:
    nodes = big(500, free=set())
    pl = controller.payload(make_ir(), CLUSTER, nodes)
    sample = pl["cluster_metrics"]["sample"]
    assert sample["visited"] == 500 and sample["feasible"] == 0
    assert 0 < len(pl["cluster_metrics"]["nodes"]) <= sampling.KEEP_INFEASIBLE  # some, to show why
    with pytest.raises(RuntimeError, match=r"visited 500 of 500 nodes"):
        BinPackPolicy("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {})
    passed, filtered = gateway.filter_rule(make_ir(), {"c1": CLUSTER}, {"c1": nodes})
    assert passed == [] and "no healthy node with capacity" in filtered["c1"]


def test_required_affinity_fails_closed_on_a_big_cluster_with_the_reason_over_all_nodes() -> None:
    nodes = big(400)
    ir = with_affinity(make_ir(), [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "nobody"}}])
    pl = controller.payload(ir, CLUSTER, nodes)
    reason = pl["cluster_metrics"]["sample"]["unsatisfiable"]
    assert "RequiredAffinityUnsatisfiable" in reason and "eliminated 400 of 400 nodes" in reason
    with pytest.raises(RuntimeError, match="eliminated 400 of 400 nodes"):
        BinPackPolicy("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {})
    passed, filtered = gateway.filter_rule(ir, {"c1": CLUSTER}, {"c1": nodes})
    assert passed == [] and "eliminated 400 of 400 nodes" in filtered["c1"]


def test_required_affinity_on_a_big_cluster_finds_the_one_matching_node() -> None:
    labels = {i: {"rack": str(i % 8)} for i in range(3000)}
    labels[2345] = {"rack": "1", "trust-domain": "attested"}
    nodes = big(3000, labels=labels)
    ir = with_affinity(make_ir(), [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "attested"}}])
    pl = controller.payload(ir, CLUSTER, nodes)
    assert [n for n, v in pl["cluster_metrics"]["nodes"].items() if v["affinity"]["pass"]] == ["n02345"]
    assert BinPackPolicy("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {})["node_id"] == "n02345"
    assert "affinity" not in nodes["n02345"]  # the shared snapshot is not annotated


async def test_plan_places_a_gang_on_a_big_cluster_without_touching_the_snapshot() -> None:
    nodes = big(1500, free={3, 900, 1400})
    before = copy.deepcopy(nodes)
    ir = make_ir(min_instances=6, max_instances=6)
    placements = await controller.plan(ir, CLUSTER, nodes, "allocation", [f"b1-{i}" for i in range(6)], invoker(ir, "resourceAllocator"))
    assert sorted(p["node"] for p in placements) == ["n00003"] * 2 + ["n00900"] * 2 + ["n01400"] * 2
    assert len({g for p in placements for g in p["gpus"]}) == 6
    assert nodes == before


# -- totals memo ------------------------------------------------------------------------------------


def fresh_totals(nodes: dict[str, Any]) -> dict[str, Any]:
    healthy = [n for n in nodes.values() if n["healthy"]]
    return {
        "gpus": sum(len(n["gpus"]) for n in nodes.values()),
        "gpus_free": sum(capacity.free_gpus(n) for n in healthy),
        "gpu_memory_free": sum(g["memory_free"] for n in healthy for g in n["gpus"]),
        "cpu_free": round(sum(n["cpu_free"] for n in healthy), 3),
        "memory_free": sum(n["memory_free"] for n in healthy),
        "healthy_node_count": len(healthy),
    }


def test_totals_follow_replaced_added_and_removed_views() -> None:
    nodes = big(50)
    assert capacity.totals(nodes) == fresh_totals(nodes)
    nodes["n00007"] = node("n00007", gpus=[busy_gpu("x0"), *free_gpus(1, prefix="x")], cpu_used=3.5)
    nodes["n00008"] = node("n00008", gpus=free_gpus(2, prefix="y"), healthy=False)
    nodes["extra"] = node("extra", gpus=free_gpus(4, prefix="z"))
    del nodes["n00009"]
    assert capacity.totals(nodes) == fresh_totals(nodes)


def test_fork_shares_the_memo_and_diverges_on_take() -> None:
    nodes = big(60)
    work = capacity.fork(nodes)
    work["n00001"] = capacity.copy_node(work["n00001"])
    capacity.take(work["n00001"], ["n1-g0"], {"gpus": 1, "cpu": 2, "memory": 10}, False)
    assert capacity.totals(work) == fresh_totals(work)
    assert capacity.totals(nodes) == fresh_totals(nodes)
    assert capacity.totals(work)["gpus_free"] == capacity.totals(nodes)["gpus_free"] - 1
