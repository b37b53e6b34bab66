"""The built-in policies in the seed-000 class shape: ``ClusterRankPolicy``, ``BinPackPolicy``,
``SpreadPolicy``, fed payloads built by ``handlers.controller.payload`` over node views in the
``state.store.node_view`` shape."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from aios_blocks.handlers.controller import payload
from aios_blocks.handlers.gateway import cluster_entry
from aios_blocks.policies.builtin.cluster_rank import ClusterRankPolicy
from aios_blocks.policies.builtin.resource import BinPackPolicy, SpreadPolicy
from aios_blocks.policies.contract import check

from .views import busy_gpu, free_gpus, gpu, make_ir, node, nodes_of

CLUSTER = {"id": "c1", "labels": {}}
ALLOCATORS = [BinPackPolicy, SpreadPolicy]


def run(cls: type, action: str, ir: dict[str, Any], nodes: dict[str, Any], settings: dict[str, Any] | None = None,
        instances: dict[str, Any] | None = None, **extra: Any) -> Any:
    policy = cls("b1.resourceAllocator", settings or {}, {})
    result = policy.eval({}, {"action": action, "payload": payload(ir, CLUSTER, nodes, instances, **extra)}, {})
    check(action, result)  # every answer honours the seed contract
    return result


def gpu_ids(view: dict[str, Any]) -> set[str]:
    return {g["id"] for g in view["gpus"]}


# -- dry_run ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_dry_run_score_is_the_fraction_of_max_instances_placeable(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(1)), node("n2", gpus=free_gpus(1)))
    result = run(cls, "dry_run", make_ir(max_instances=4), nodes)
    ssd = result["selection_score_data"]
    assert ssd["score"] == pytest.approx(0.5)
    info = ssd["node_info"]
    assert info["node_id"] in nodes
    assert len(info["gpus"]) == 1 and set(info["gpus"]) <= gpu_ids(nodes[info["node_id"]])


@pytest.mark.parametrize(("free", "max_instances", "score"), [(4, 4, 1.0), (6, 4, 1.0), (3, 4, 0.75), (1, 3, 1 / 3)])
def test_dry_run_score_values(free: int, max_instances: int, score: float) -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(free)))
    result = run(BinPackPolicy, "dry_run", make_ir(max_instances=max_instances), nodes)
    assert result["selection_score_data"]["score"] == pytest.approx(score)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_dry_run_with_no_capacity_scores_zero_without_node_info(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[busy_gpu("g0")]), node("n2", gpus=[]))
    ssd = run(cls, "dry_run", make_ir(max_instances=2), nodes)["selection_score_data"]
    assert ssd["score"] == 0.0
    assert not ssd["node_info"]


def test_dry_run_counts_multi_gpu_instances() -> None:
    # 5 free GPUs, 2 per instance: 2 instances fit on n1 (4 GPUs), none on n2 (1 GPU)
    nodes = nodes_of(node("n1", gpus=free_gpus(4)), node("n2", gpus=free_gpus(1, prefix="h")))
    ir = make_ir(max_instances=4, resources={"gpus": 2})
    ssd = run(BinPackPolicy, "dry_run", ir, nodes)["selection_score_data"]
    assert ssd["score"] == pytest.approx(0.5)
    assert ssd["node_info"]["node_id"] == "n1" and len(set(ssd["node_info"]["gpus"])) == 2


def test_dry_run_respects_cpu_and_memory() -> None:
    nodes = nodes_of(
        node("n1", gpus=free_gpus(4), cpu=8, cpu_used=5),  # 3 CPUs left: one 2-CPU instance
        node("n2", gpus=free_gpus(4, prefix="h"), memory=10_000, mem_used=9_000),  # 1000 MiB left: none
    )
    ir = make_ir(max_instances=4, resources={"gpus": 1, "cpu": 2, "memory": 500})
    ssd = run(SpreadPolicy, "dry_run", ir, nodes)["selection_score_data"]
    assert ssd["score"] == pytest.approx(3 / 4)  # n1: 1 (cpu bound), n2: 2 (memory bound)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_dry_run_ignores_unhealthy_nodes(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(1)), node("sick", gpus=free_gpus(8, prefix="s"), healthy=False))
    ssd = run(cls, "dry_run", make_ir(max_instances=2), nodes)["selection_score_data"]
    assert ssd["score"] == pytest.approx(0.5)
    assert ssd["node_info"]["node_id"] == "n1"


def test_dry_run_does_not_touch_the_snapshot() -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(2)), node("n2", gpus=free_gpus(2, prefix="h")))
    before = copy.deepcopy(nodes)
    run(BinPackPolicy, "dry_run", make_ir(max_instances=4), nodes)
    assert nodes == before


# -- allocation: bin-pack vs spread -----------------------------------------------------------------


@pytest.mark.parametrize(("fuller", "emptier"), [("n1", "n2"), ("n2", "n1")])
def test_binpack_puts_the_next_instance_on_the_fuller_node(fuller: str, emptier: str) -> None:
    nodes = nodes_of(
        node(fuller, gpus=[busy_gpu(f"{fuller}-g0"), gpu(f"{fuller}-g1")]),
        node(emptier, gpus=[gpu(f"{emptier}-g0"), gpu(f"{emptier}-g1")]),
    )
    result = run(BinPackPolicy, "allocation", make_ir(), nodes)
    assert result == {"node_id": fuller, "gpus": [f"{fuller}-g1"]}


@pytest.mark.parametrize(("fuller", "emptier"), [("n1", "n2"), ("n2", "n1")])
def test_spread_puts_the_next_instance_on_the_emptier_node(fuller: str, emptier: str) -> None:
    nodes = nodes_of(
        node(fuller, gpus=[busy_gpu(f"{fuller}-g0"), gpu(f"{fuller}-g1")]),
        node(emptier, gpus=[gpu(f"{emptier}-g0"), gpu(f"{emptier}-g1")]),
    )
    result = run(SpreadPolicy, "allocation", make_ir(), nodes)
    assert result["node_id"] == emptier
    assert len(result["gpus"]) == 1 and set(result["gpus"]) <= gpu_ids(nodes[emptier])


@pytest.mark.parametrize("cls", ALLOCATORS)
@pytest.mark.parametrize("action", ["allocation", "scale"])
def test_allocation_returns_distinct_free_gpus_of_the_chosen_node(cls: type, action: str) -> None:
    nodes = nodes_of(node("n1", gpus=[busy_gpu("g0"), gpu("g1"), gpu("g2"), busy_gpu("g3"), gpu("g4")]))
    result = run(cls, action, make_ir(resources={"gpus": 3}), nodes)
    assert result["node_id"] == "n1"
    assert sorted(result["gpus"]) == ["g1", "g2", "g4"]


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_a_node_without_enough_free_gpus_is_skipped(cls: type) -> None:
    nodes = nodes_of(node("a", gpus=[gpu("a0"), busy_gpu("a1")]), node("b", gpus=free_gpus(2, prefix="b")))
    result = run(cls, "allocation", make_ir(resources={"gpus": 2}), nodes)
    assert result["node_id"] == "b" and sorted(result["gpus"]) == ["b0", "b1"]


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_cpu_only_blocks_get_no_gpus(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[], cpu=4), node("n2", gpus=[], cpu=1))
    result = run(cls, "allocation", make_ir(resources={"gpus": 0, "cpu": 2}), nodes)
    assert result == {"node_id": "n1", "gpus": []}


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_unhealthy_nodes_are_never_chosen(cls: type) -> None:
    # the unhealthy node is the most attractive one for both modes (empty, and 1 busy + 1 free)
    nodes = nodes_of(
        node("ok", gpus=[busy_gpu("o0"), gpu("o1"), busy_gpu("o2")]),
        node("sick1", gpus=free_gpus(4, prefix="s"), healthy=False),
        node("sick2", gpus=[busy_gpu("t0"), busy_gpu("t1"), busy_gpu("t2"), gpu("t3")], healthy=False),
    )
    assert run(cls, "allocation", make_ir(), nodes)["node_id"] == "ok"
    assert run(cls, "scale", make_ir(), nodes, block_metrics={})["node_id"] == "ok"


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_a_node_marked_unhealthy_in_its_view_is_skipped_even_if_listed(cls: type) -> None:
    nodes = nodes_of(node("ok", gpus=free_gpus(1)), node("sick", gpus=free_gpus(4, prefix="s"), healthy=False))
    pl = payload(make_ir(), CLUSTER, nodes)
    pl["healthy_nodes"] = ["ok", "sick"]  # a stale list must not override the node's own view
    result = cls("r", {}, {}).eval({}, {"action": "allocation", "payload": pl}, {})
    assert result["node_id"] == "ok"


@pytest.mark.parametrize("cls", ALLOCATORS)
@pytest.mark.parametrize("action", ["allocation", "scale", "reassignment"])
def test_no_capacity_raises(cls: type, action: str) -> None:
    nodes = nodes_of(node("n1", gpus=[busy_gpu("g0")]), node("n2", gpus=free_gpus(4, prefix="h"), healthy=False))
    extra = {"instance_id": "b1-0", "pod_name": "b1-0", "block_metrics": {}} if action == "reassignment" else {}
    policy = cls("r", {}, {})
    pl = payload(make_ir(), CLUSTER, nodes, {"b1-0": {"node": "n1", "gpus": ["g0"]}}, **extra)
    with pytest.raises(Exception, match="no healthy node can host"):
        policy.eval({}, {"action": action, "payload": pl}, {})


# -- reassignment -----------------------------------------------------------------------------------


ROOMY = [busy_gpu("r0"), gpu("r1"), gpu("r2"), gpu("r3")]  # 3 free GPUs
TIGHT = [busy_gpu("t0"), busy_gpu("t1"), gpu("t2")]  # 1 free GPU


@pytest.mark.parametrize(
    ("cls", "current_gpus", "other_gpus"),
    # the current node is the one the mode would pick again: the fuller for bin-pack, the emptier for spread
    [(BinPackPolicy, TIGHT, ROOMY), (SpreadPolicy, ROOMY, TIGHT)],
)
@pytest.mark.parametrize("current", ["n1", "n2"])
def test_reassignment_avoids_the_current_node(
    cls: type, current_gpus: list[dict[str, Any]], other_gpus: list[dict[str, Any]], current: str
) -> None:
    other = "n2" if current == "n1" else "n1"
    nodes = nodes_of(node(current, gpus=current_gpus), node(other, gpus=other_gpus))
    instances = {"b1-0": {"node": current, "gpus": [current_gpus[0]["id"]], "status": "running"}}
    baseline = run(cls, "allocation", make_ir(), nodes, instances=instances)
    assert baseline["node_id"] == current  # the test is meaningful: without avoidance it would stay
    result = run(cls, "reassignment", make_ir(), nodes, instances=instances, instance_id="b1-0", pod_name="b1-0",
                 block_metrics={})
    assert result["node_id"] == other
    assert len(result["gpus"]) == 1 and set(result["gpus"]) <= gpu_ids(nodes[other]) - {"r0", "t0", "t1"}


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_reassignment_falls_back_to_the_current_node_when_it_is_the_only_fit(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[busy_gpu("g0"), gpu("g1")]), node("n2", gpus=[busy_gpu("h0")]))
    instances = {"b1-0": {"node": "n1", "gpus": ["g0"]}}
    result = run(cls, "reassignment", make_ir(), nodes, instances=instances, instance_id="b1-0", pod_name="b1-0",
                 block_metrics={})
    assert result == {"node_id": "n1", "gpus": ["g1"]}


# -- GPU sharing ------------------------------------------------------------------------------------


def shared_gpu(gid: str, memory: int, used: int, instances: int = 1) -> dict[str, Any]:
    return gpu(gid, memory, used=used, instances=instances, exclusive=False)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_without_sharing_a_gpu_in_use_is_not_offered(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[shared_gpu("g0", 80_000, 10_000)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 10_000})
    with pytest.raises(RuntimeError):
        run(cls, "allocation", ir, nodes)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_with_sharing_a_gpu_in_use_is_offered_when_memory_fits(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[shared_gpu("g0", 80_000, 50_000)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 30_000}, allocator_settings={"gpuSharing": True})
    assert run(cls, "allocation", ir, nodes, settings={"gpuSharing": True}) == {"node_id": "n1", "gpus": ["g0"]}


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_with_sharing_a_gpu_without_enough_free_memory_is_not_offered(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[shared_gpu("g0", 80_000, 50_001)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 30_000})
    with pytest.raises(RuntimeError):
        run(cls, "allocation", ir, nodes, settings={"gpuSharing": True})


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_with_sharing_an_exclusively_held_gpu_is_never_offered(cls: type) -> None:
    # exclusive with (inconsistently) free memory: exclusivity alone must keep it out
    nodes = nodes_of(node("n1", gpus=[gpu("g0", 80_000, used=0, instances=1, exclusive=True)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 1_000})
    with pytest.raises(RuntimeError):
        run(cls, "allocation", ir, nodes, settings={"gpuSharing": True})


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_with_sharing_a_gpu_smaller_than_gpu_memory_is_never_offered(cls: type) -> None:
    nodes = nodes_of(node("n1", gpus=[gpu("small", 16_000)]), node("n2", gpus=[gpu("big", 80_000)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 40_000})
    for settings in ({}, {"gpuSharing": True}):
        assert run(cls, "allocation", ir, nodes, settings=settings)["gpus"] == ["big"]


@pytest.mark.parametrize(("settings", "score"), [({}, 1 / 3), ({"gpuSharing": False}, 1 / 3), ({"gpuSharing": True}, 2 / 3)])
def test_dry_run_shares_gpus_only_when_the_settings_say_so(settings: dict[str, Any], score: float) -> None:
    nodes = nodes_of(node("n1", gpus=[gpu("g0", 80_000)]))
    ir = make_ir(max_instances=3, resources={"gpus": 1, "gpuMemory": 30_000})  # two fit in 80 GB, not three
    ssd = run(BinPackPolicy, "dry_run", ir, nodes, settings=settings)["selection_score_data"]
    assert ssd["score"] == pytest.approx(score)


def test_binpack_shares_the_fullest_gpu_spread_the_emptiest() -> None:
    nodes = nodes_of(node("n1", gpus=[shared_gpu("a", 80_000, 40_000), shared_gpu("b", 80_000, 10_000), gpu("c", 80_000)]))
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 20_000})
    share = {"gpuSharing": True}
    assert run(BinPackPolicy, "allocation", ir, nodes, settings=share)["gpus"] == ["a"]
    assert run(SpreadPolicy, "allocation", ir, nodes, settings=share)["gpus"] == ["c"]


# -- cluster rank -----------------------------------------------------------------------------------


def entry(cid: str, free: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    nodes = nodes_of(node(f"{cid}-n", cid, gpus=[*free_gpus(free), busy_gpu("x")]))
    return cluster_entry({"id": cid, "labels": labels or {}}, nodes)


def rank(parameters: dict[str, Any] | None = None, call_parameters: dict[str, Any] | None = None) -> Any:
    policy = ClusterRankPolicy("b1.clusterAllocator", {}, parameters or {})
    return lambda input_data: policy.eval(call_parameters or {}, input_data, {})


def test_selection_sorts_by_free_gpus_descending() -> None:
    entries = [entry("a", 1), entry("b", 5), entry("c", 3), entry("d", 0)]
    result = rank({"maxCandidates": 0})({"action": "selection", "filter_result": entries})
    check("selection", result)
    assert [e["cluster_id"] for e in result["clusters"]] == ["b", "c", "a", "d"]
    assert result["clusters"][0] is entries[1]  # the entries themselves, not copies or ids


def test_selection_ties_are_ordered_by_id() -> None:
    entries = [entry("z", 2), entry("m", 2), entry("a", 2)]
    for perm in itertools.permutations(entries):
        result = rank()({"action": "selection", "filter_result": list(perm)})
        assert [e["cluster_id"] for e in result["clusters"]] == ["a", "m", "z"]


@pytest.mark.parametrize(("limit", "expected"), [(1, ["b"]), (2, ["b", "c"]), (10, ["b", "c", "a"])])
def test_selection_honours_max_candidates(limit: int, expected: list[str]) -> None:
    entries = [entry("a", 1), entry("b", 5), entry("c", 3)]
    from_rule = rank({"maxCandidates": limit})({"action": "selection", "filter_result": entries})
    from_call = rank(call_parameters={"maxCandidates": limit})({"action": "selection", "filter_result": entries})
    assert [e["cluster_id"] for e in from_rule["clusters"]] == expected
    assert [e["cluster_id"] for e in from_call["clusters"]] == expected


def test_selection_keeps_the_top_three_by_default() -> None:
    entries = [entry("a", 1), entry("b", 5), entry("c", 3), entry("d", 0), entry("e", 4)]
    result = rank()({"action": "selection", "filter_result": entries})
    assert [e["cluster_id"] for e in result["clusters"]] == ["b", "e", "c"]


def test_call_parameters_override_rule_parameters() -> None:
    entries = [entry("a", 1), entry("b", 5), entry("c", 3)]
    result = rank({"maxCandidates": 1}, {"maxCandidates": 2})({"action": "selection", "filter_result": entries})
    assert [e["cluster_id"] for e in result["clusters"]] == ["b", "c"]


def scored(e: dict[str, Any], score: float) -> dict[str, Any]:
    return {**e, "score_data": {"score": score, "node_info": {}}}


def test_post_dry_run_picks_the_highest_score_in_any_order() -> None:
    clusters = [scored(entry("a", 9), 0.2), scored(entry("b", 0), 0.9), scored(entry("c", 4), 0.5)]
    for perm in itertools.permutations(clusters):
        result = rank()({"action": "post_dry_run", "clusters": list(perm)})
        check("post_dry_run", result)
        assert result["cluster_id"] == "b"


def test_post_dry_run_tie_goes_to_more_free_gpus() -> None:
    clusters = [scored(entry("a", 1), 0.7), scored(entry("b", 6), 0.7), scored(entry("c", 3), 0.7)]
    for perm in itertools.permutations(clusters):
        assert rank()({"action": "post_dry_run", "clusters": list(perm)})["cluster_id"] == "b"


def test_post_dry_run_full_tie_is_deterministic_and_picks_the_smallest_id() -> None:
    clusters = [scored(entry(c, 2), 0.5) for c in ("east", "north", "west")]
    picks = {rank()({"action": "post_dry_run", "clusters": list(p)})["cluster_id"] for p in itertools.permutations(clusters)}
    assert picks == {"east"}


def test_post_dry_run_full_tie_picks_the_smallest_id_even_for_prefix_ids() -> None:
    clusters = [scored(entry(c, 2), 0.5) for c in ("c10", "c1", "c2")]
    for perm in itertools.permutations(clusters):
        assert rank()({"action": "post_dry_run", "clusters": list(perm)})["cluster_id"] == "c1"


def test_post_dry_run_handles_entries_without_metrics() -> None:
    # choose() sends clusters that never answered as bare entries with empty metrics
    clusters = [{"cluster_id": "gone", "id": "gone", "labels": {}, "metrics": {}, "score_data": {"score": 0.0}},
                scored(entry("a", 1), 0.4)]
    assert rank()({"action": "post_dry_run", "clusters": clusters})["cluster_id"] == "a"


def test_unknown_action_raises() -> None:
    with pytest.raises(ValueError, match="unsupported action"):
        rank()({"action": "dry_run", "payload": {}})


def test_equal_gpus_are_taken_in_a_per_block_order_so_concurrent_plans_rarely_collide() -> None:
    """Two controllers planning different blocks on the same empty node used to pick the same
    first GPU and race; a per-request hash order spreads them over the node's equal GPUs."""
    nodes = nodes_of(node("n1", gpus=[gpu(f"n1-g{i}") for i in range(8)]))
    firsts = {run(BinPackPolicy, "allocation", {**make_ir(), "blockId": f"blk-{i}"}, nodes)["gpus"][0] for i in range(32)}
    assert len(firsts) >= 4  # 32 blocks over 8 equal GPUs: not all on n1-g0
    again = {run(BinPackPolicy, "allocation", {**make_ir(), "blockId": f"blk-{i}"}, nodes)["gpus"][0] for i in range(32)}
    assert again == firsts  # deterministic per request (a redelivered plan chooses the same)


def test_tie_break_hash_is_starlarks_string_hash() -> None:
    import starlark as sl

    from aios_blocks.policies.builtin.resource import string_hash

    words = ["", "a", "abc", "blk-1:0:c1-n0-g7", "x" * 40, "Zz-_.9"]
    module = sl.Module()
    sl.eval(module, sl.parse("h.star", f"out = [hash(w) for w in {words!r}]"), sl.Globals.standard())
    assert module["out"] == [string_hash(w) for w in words]
    assert string_hash("abc") == 96354  # Java's "abc".hashCode()
