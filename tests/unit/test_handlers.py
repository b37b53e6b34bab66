"""Pure handler steps (gateway filter/select/choose, controller plan/dry_run/check_choice) with the
real built-in policies run by a real PolicyRuntime, plus the capacity arithmetic they share."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from aios_blocks.handlers import controller, gateway
from aios_blocks.policies import capacity
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.schemas.spec import ID_RE

from .views import busy_gpu, free_gpus, gpu, invoker, make_ir, node, nodes_of

CLUSTER = {"id": "c1", "labels": {}}


def runtime_with(**sources: str) -> PolicyRuntime:
    """A runtime whose registry holds the given policy sources (``registry:NAME``)."""

    async def lookup(name: str, version: int | None) -> dict[str, Any] | None:
        return {"source": sources[name], "version": 1, "language": "python"} if name in sources else None

    return PolicyRuntime(lookup=lookup)


def returning(expr: str) -> str:
    return (
        "class Fixed:\n"
        "    def __init__(self, rule_id, settings, parameters):\n"
        "        pass\n"
        "    def eval(self, parameters, input_data, context):\n"
        f"        return {expr}\n"
    )


RAISING = returning("1 // 0")


def inventory() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, dict[str, Any]]]]:
    clusters = {
        "eu1": {"id": "eu1", "labels": {"region": "eu", "tier": "gold"}},
        "eu2": {"id": "eu2", "labels": {"region": "eu", "tier": "silver"}},
        "us1": {"id": "us1", "labels": {"region": "us", "tier": "gold"}},
        "full": {"id": "full", "labels": {"region": "eu", "tier": "gold"}},
        "empty": {"id": "empty", "labels": {"region": "eu", "tier": "gold"}},
    }
    nodes = {
        "eu1": nodes_of(node("eu1-a", "eu1", gpus=free_gpus(2)), node("eu1-b", "eu1", gpus=[busy_gpu("x")])),
        "eu2": nodes_of(node("eu2-a", "eu2", gpus=free_gpus(4))),
        "us1": nodes_of(node("us1-a", "us1", gpus=free_gpus(8))),
        "full": nodes_of(
            node("full-a", "full", gpus=[busy_gpu("f0")]),
            node("full-b", "full", gpus=free_gpus(4), healthy=False),
        ),
    }
    return clusters, nodes


# -- filter_rule ------------------------------------------------------------------------------------


def test_filter_rule_match_labels() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector_settings={"filter": {"matchLabels": {"region": "eu", "tier": "gold"}}})
    passed, filtered = gateway.filter_rule(ir, clusters, nodes)
    assert [e["cluster_id"] for e in passed] == ["eu1"]
    assert filtered["eu2"] == "labels do not match tier=gold"
    assert filtered["us1"] == "labels do not match region=eu"
    assert set(filtered) == {"eu2", "us1", "full", "empty"}


def test_filter_rule_capacity_check_and_reasons() -> None:
    clusters, nodes = inventory()
    passed, filtered = gateway.filter_rule(make_ir(), clusters, nodes)
    assert [e["cluster_id"] for e in passed] == ["eu1", "eu2", "us1"]
    assert filtered == {
        "empty": "no healthy node with capacity for one instance (0 nodes)",
        "full": "no healthy node with capacity for one instance (2 nodes)",
    }


def test_filter_rule_capacity_uses_the_block_needs() -> None:
    clusters, nodes = inventory()
    passed, filtered = gateway.filter_rule(make_ir(resources={"gpus": 3}), clusters, nodes)
    assert [e["cluster_id"] for e in passed] == ["eu2", "us1"]
    assert "eu1" in filtered


def test_filter_rule_capacity_check_can_be_switched_off() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector_settings={"filter": {"capacity": False}})
    passed, filtered = gateway.filter_rule(ir, clusters, nodes)
    assert [e["cluster_id"] for e in passed] == ["empty", "eu1", "eu2", "full", "us1"]
    assert filtered == {}


def test_filter_rule_capacity_honours_gpu_sharing() -> None:
    clusters = {"c": {"id": "c", "labels": {}}}
    nodes = {"c": nodes_of(node("n", "c", gpus=[gpu("g", 80_000, used=40_000, instances=1)]))}
    plain = make_ir(resources={"gpus": 1, "gpuMemory": 20_000})
    shared = make_ir(resources={"gpus": 1, "gpuMemory": 20_000}, allocator_settings={"gpuSharing": True})
    assert gateway.filter_rule(plain, clusters, nodes)[0] == []
    assert [e["cluster_id"] for e in gateway.filter_rule(shared, clusters, nodes)[0]] == ["c"]


def test_filter_rule_entries_carry_labels_and_metrics() -> None:
    clusters, nodes = inventory()
    passed, _ = gateway.filter_rule(make_ir(resources={"gpus": 1, "cpu": 1, "memory": 1}), clusters, nodes)
    eu1 = next(e for e in passed if e["cluster_id"] == "eu1")
    assert eu1["id"] == "eu1" and eu1["labels"] == {"region": "eu", "tier": "gold"}
    m = eu1["metrics"]
    assert m["node_count"] == 2 and m["healthy_node_count"] == 2
    assert m["gpus"] == 3 and m["gpus_free"] == 2
    assert "nodes" not in m  # the summary only; node views stay in the controller's payload


# -- select -----------------------------------------------------------------------------------------


async def test_select_ranks_candidates_with_the_builtin_policy() -> None:
    clusters, nodes = inventory()
    ir = make_ir()
    sel = await gateway.select(ir, clusters, nodes, invoker(ir, "clusterAllocator"))
    assert sel.failure == ""
    assert sel.candidates == ["us1", "eu2", "eu1"]  # most free GPUs first
    assert set(sel.entries) == {"us1", "eu2", "eu1"}
    assert set(sel.filtered) == {"full", "empty"}


async def test_select_records_clusters_dropped_by_the_policy() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector_parameters={"maxCandidates": 1})
    sel = await gateway.select(ir, clusters, nodes, invoker(ir, "clusterAllocator"))
    assert sel.candidates == ["us1"]
    assert sel.filtered["eu1"] == sel.filtered["eu2"] == "dropped by the clusterAllocator's selection"


async def test_select_fails_naming_every_cluster_when_nothing_passes() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector_settings={"filter": {"matchLabels": {"region": "mars"}}})
    sel = await gateway.select(ir, clusters, nodes, invoker(ir, "clusterAllocator"))
    assert sel.candidates == []
    assert sel.failure.startswith("no cluster passed the filter rule")
    for cid in clusters:
        assert f"{cid}: labels do not match region=mars" in sel.failure


async def test_select_with_no_clusters_at_all() -> None:
    ir = make_ir()
    sel = await gateway.select(ir, {}, {}, invoker(ir, "clusterAllocator"))
    assert sel.failure == "no cluster passed the filter rule (no clusters registered)"


async def test_select_when_the_policy_raises() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector="registry:boom")
    sel = await gateway.select(ir, clusters, nodes, invoker(ir, "clusterAllocator", runtime_with(boom=RAISING)))
    assert sel.candidates == []
    assert "clusterAllocator" in sel.failure and "ZeroDivisionError" in sel.failure


async def test_select_when_the_policy_names_an_unknown_cluster() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector="registry:odd")
    call = invoker(ir, "clusterAllocator", runtime_with(odd=returning("{'clusters': ['eu1', 'nowhere']}")))
    sel = await gateway.select(ir, clusters, nodes, call)
    assert sel.candidates == []
    assert "unknown cluster" in sel.failure and "nowhere" in sel.failure


async def test_select_rejects_a_filtered_cluster_chosen_by_the_policy() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector="registry:odd")
    call = invoker(ir, "clusterAllocator", runtime_with(odd=returning("{'clusters': ['full']}")))
    sel = await gateway.select(ir, clusters, nodes, call)
    # the reason says why that cluster is no candidate (the filter rule's reason), not "unknown"
    assert sel.candidates == [] and sel.failure == (
        f"clusterAllocator selected cluster(s) that are not candidates (full: {sel.filtered['full']}); "
        f"candidates: {[c for c in ('eu1', 'eu2', 'us1') if c not in sel.filtered]}"
    ), sel.failure
    assert "unknown" not in sel.failure


async def test_select_when_the_policy_selects_nothing() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector="registry:none")
    call = invoker(ir, "clusterAllocator", runtime_with(none=returning("{'clusters': []}")))
    sel = await gateway.select(ir, clusters, nodes, call)
    assert sel.failure == "clusterAllocator selected no cluster"
    assert all(sel.filtered[c] == "dropped by the clusterAllocator's selection" for c in ("eu1", "eu2", "us1"))


async def test_select_accepts_ids_and_removes_duplicates() -> None:
    clusters, nodes = inventory()
    ir = make_ir(selector="registry:ids")
    call = invoker(ir, "clusterAllocator", runtime_with(ids=returning("{'clusters': ['eu2', 'eu1', 'eu2']}")))
    sel = await gateway.select(ir, clusters, nodes, call)
    assert sel.failure == "" and sel.candidates == ["eu2", "eu1"]
    assert sel.filtered["us1"] == "dropped by the clusterAllocator's selection"


# -- choose -----------------------------------------------------------------------------------------


def selection_entries() -> dict[str, dict[str, Any]]:
    clusters, nodes = inventory()
    passed, _ = gateway.filter_rule(make_ir(), clusters, nodes)
    return {e["cluster_id"]: e for e in passed}


async def test_choose_picks_the_best_score() -> None:
    ir = make_ir()
    results = {"eu1": {"score": 0.5, "node_info": {"node_id": "eu1-a"}}, "eu2": {"score": 0.75}, "us1": {"score": 0.25}}
    final = await gateway.choose(["eu1", "eu2", "us1"], results, selection_entries(), invoker(ir, "clusterAllocator"))
    assert final.failure == "" and final.cluster_id == "eu2"
    assert final.scores == {"eu1": 0.5, "eu2": 0.75, "us1": 0.25}
    assert final.missing == [] and final.errors == {}


async def test_choose_counts_missing_clusters_as_zero_and_lists_them() -> None:
    ir = make_ir()
    final = await gateway.choose(["eu1", "eu2", "us1"], {"eu1": {"score": 0.5}}, selection_entries(), invoker(ir, "clusterAllocator"))
    assert final.cluster_id == "eu1"
    assert final.missing == ["eu2", "us1"]
    assert final.scores == {"eu1": 0.5, "eu2": 0.0, "us1": 0.0}


async def test_choose_passes_score_data_to_the_policy() -> None:
    ir = make_ir(selector="registry:echo")
    echo = (
        "class Echo:\n"
        "    def __init__(self, r, s, p):\n        pass\n"
        "    def eval(self, parameters, input_data, context):\n"
        "        context['clusters'] = input_data['clusters']\n"
        "        return input_data['clusters'][0]\n"
    )
    ctx: dict[str, Any] = {}
    call = invoker(ir, "clusterAllocator", runtime_with(echo=echo), ctx)
    results = {"eu1": {"score": 0.5, "node_info": {"node_id": "eu1-a", "gpus": ["g0"]}}}
    await gateway.choose(["eu1", "gone"], results, selection_entries(), call)
    seen = {c["cluster_id"]: c for c in ctx["clusters"]}
    assert seen["eu1"]["score_data"] == {"score": 0.5, "node_info": {"node_id": "eu1-a", "gpus": ["g0"]}}
    assert seen["eu1"]["metrics"]["gpus_free"] == 2 and "missing" not in seen["eu1"]
    assert seen["gone"]["score_data"] == {"score": 0.0, "node_info": {}} and seen["gone"]["missing"] is True


async def test_choose_fails_naming_each_cluster_when_all_scores_are_zero() -> None:
    ir = make_ir()
    results = {"eu1": {"score": 0.0}, "eu2": {"score": 0.0, "error": "policy 'resourceAllocator' (dry_run) failed: boom"}}
    final = await gateway.choose(["eu1", "eu2", "us1"], results, selection_entries(), invoker(ir, "clusterAllocator"))
    assert final.cluster_id == ""
    assert final.failure.startswith("no candidate cluster can place an instance")
    assert "eu1: score 0" in final.failure
    assert "eu2: policy 'resourceAllocator' (dry_run) failed: boom" in final.failure
    assert "us1: no answer in time" in final.failure
    assert final.errors == {"eu2": "policy 'resourceAllocator' (dry_run) failed: boom"}


async def test_choose_fails_when_the_policy_picks_an_unknown_cluster() -> None:
    ir = make_ir(selector="registry:odd")
    call = invoker(ir, "clusterAllocator", runtime_with(odd=returning("'elsewhere'")))
    final = await gateway.choose(["eu1"], {"eu1": {"score": 1.0}}, selection_entries(), call)
    assert final.cluster_id == ""
    assert final.failure == "clusterAllocator chose 'elsewhere', which was not a candidate"


async def test_choose_fails_when_the_policy_raises() -> None:
    ir = make_ir(selector="registry:boom")
    call = invoker(ir, "clusterAllocator", runtime_with(boom=RAISING))
    final = await gateway.choose(["eu1"], {"eu1": {"score": 1.0}}, selection_entries(), call)
    assert final.cluster_id == "" and "ZeroDivisionError" in final.failure


# -- controller.plan --------------------------------------------------------------------------------


def two_by_two() -> dict[str, dict[str, Any]]:
    return nodes_of(node("n1", gpus=free_gpus(2, prefix="a")), node("n2", gpus=free_gpus(2, prefix="b")))


def assert_no_gpu_twice(plan: list[dict[str, Any]]) -> None:
    taken = [(p["node"], g) for p in plan for g in p["gpus"]]
    assert len(taken) == len(set(taken)), taken


@pytest.mark.parametrize("allocator", ["builtin:binpack", "builtin:spread"])
async def test_plan_gang_of_three_never_reuses_a_gpu(allocator: str) -> None:
    ir = make_ir(min_instances=3, max_instances=3, allocator=allocator, resources={"gpus": 1, "cpu": 2, "memory": 100})
    nodes = two_by_two()
    before = copy.deepcopy(nodes)
    iids = [controller.instance_id("b1", i) for i in range(3)]
    plan = await controller.plan(ir, CLUSTER, nodes, "allocation", iids, invoker(ir, "resourceAllocator"))
    assert [p["iid"] for p in plan] == ["b1-0", "b1-1", "b1-2"]
    assert_no_gpu_twice(plan)
    for p in plan:
        assert len(p["gpus"]) == 1 and set(p["gpus"]) <= {g["id"] for g in nodes[p["node"]]["gpus"]}
        assert p | {"iid": 0, "node": 0, "gpus": 0} == {
            "iid": 0, "node": 0, "gpus": 0, "block": "b1", "cpu": 2.0, "mem": 100, "gpu_mem": 0,
            "exclusive": True, "share": False, "vc": "",  # the primary's unassigned nodes (seed 003)
        }
    assert nodes == before  # the plan works on a copy of the snapshot
    per_node = sorted(sum(1 for p in plan if p["node"] == n) for n in nodes)
    assert per_node == [1, 2]


async def test_plan_binpack_fills_one_node_first_spread_alternates() -> None:
    iids = ["b1-0", "b1-1"]
    packed = make_ir(min_instances=2, max_instances=2, allocator="builtin:binpack")
    spread = make_ir(min_instances=2, max_instances=2, allocator="builtin:spread")
    p1 = await controller.plan(packed, CLUSTER, two_by_two(), "allocation", iids, invoker(packed, "resourceAllocator"))
    p2 = await controller.plan(spread, CLUSTER, two_by_two(), "allocation", iids, invoker(spread, "resourceAllocator"))
    assert len({p["node"] for p in p1}) == 1
    assert len({p["node"] for p in p2}) == 2


async def test_plan_gang_with_gpu_sharing_stacks_on_one_gpu_while_memory_lasts() -> None:
    ir = make_ir(min_instances=3, max_instances=3, resources={"gpus": 1, "gpuMemory": 25_000},
                 allocator_settings={"gpuSharing": True})
    nodes = nodes_of(node("n1", gpus=[gpu("g0", 80_000)]))
    plan = await controller.plan(ir, CLUSTER, nodes, "allocation", ["a", "b", "c"], invoker(ir, "resourceAllocator"))
    assert [p["gpus"] for p in plan] == [["g0"], ["g0"], ["g0"]]
    assert all(p["share"] and not p["exclusive"] and p["gpu_mem"] == 25_000 for p in plan)
    with pytest.raises(PlacementFailed, match="instance 4 of 4"):
        await controller.plan(ir, CLUSTER, nodes, "allocation", ["a", "b", "c", "d"], invoker(ir, "resourceAllocator"))


async def test_plan_fails_with_a_reason_when_capacity_runs_out() -> None:
    ir = make_ir(min_instances=5, max_instances=5)
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, two_by_two(), "allocation", [f"b1-{i}" for i in range(5)],
                              invoker(ir, "resourceAllocator"))
    reason = info.value.reason
    assert "instance 5 of 5" in reason and "no healthy node can host" in reason


async def test_plan_fails_when_the_policy_picks_a_node_outside_the_cluster() -> None:
    ir = make_ir(allocator="registry:ghost")
    call = invoker(ir, "resourceAllocator", runtime_with(ghost=returning("{'node_id': 'ghost', 'gpus': ['g0']}")))
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, two_by_two(), "allocation", ["b1-0"], call)
    assert info.value.reason == "resourceAllocator allocation chose an impossible placement: node 'ghost' is not in this cluster"
    assert info.value.policy  # the policy's answer refused: the block fails at once (allocation.after_failure)


@pytest.mark.parametrize(("gpus", "problems"), [
    ("['a0']", []),  # a choice that works, but on a node Required affinity rejects
    ("['zz', 'a0']", ["2 GPUs chosen, block needs 1", "GPU(s) ['zz'] are not GPUs of n1"]),
])
async def test_a_refused_choice_names_every_problem_and_is_the_policy_s(gpus: str, problems: list[str]) -> None:
    """Refused on the very snapshot the policy was given: no other round can help (``policy``,
    ``allocation.after_failure``: the block fails at once, not re-selected)."""
    import msgspec

    from aios_blocks.schemas.affinity import normalize

    ir = make_ir(allocator="registry:odd")
    ir["affinity"] = msgspec.to_builtins(normalize([{"category": "Trust", "strength": "Required",
                                                     "target": {"type": "TrustDomain", "value": "attested"}}]))
    call = invoker(ir, "resourceAllocator", runtime_with(odd=returning(f"{{'node_id': 'n1', 'gpus': {gpus}}}")))
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, two_by_two(), "allocation", ["b1-0"], call)
    reason, rejects = info.value.reason, "Required affinity rejects n1: "
    assert info.value.policy, reason
    if problems:
        assert reason.startswith("resourceAllocator allocation chose an impossible placement: " + "; ".join(problems) + "; " + rejects)
    else:
        assert reason.startswith("resourceAllocator allocation chose n1, which Required affinity rejects: ")
    assert "attested" in reason, reason


async def test_plan_fails_when_a_naive_policy_reuses_a_gpu_across_the_gang() -> None:
    ir = make_ir(min_instances=2, max_instances=2, allocator="registry:naive")
    call = invoker(ir, "resourceAllocator", runtime_with(naive=returning("{'node_id': 'n1', 'gpus': ['a0']}")))
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, two_by_two(), "allocation", ["b1-0", "b1-1"], call)
    assert "impossible placement" in info.value.reason and "a0" in info.value.reason


async def test_plan_fails_when_the_policy_fails() -> None:
    ir = make_ir(allocator="registry:boom")
    call = invoker(ir, "resourceAllocator", runtime_with(boom=RAISING))
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, two_by_two(), "scale", ["b1-x"], call, block_metrics={})
    assert "ZeroDivisionError" in info.value.reason and "instance 1 of 1" in info.value.reason


async def test_plan_reassignment_moves_the_instance_off_its_node() -> None:
    ir = make_ir(allocator="builtin:binpack")
    nodes = nodes_of(node("n1", gpus=[busy_gpu("a0"), gpu("a1")]), node("n2", gpus=free_gpus(2, prefix="b")))
    instances = {"b1-0": {"node": "n1", "gpus": ["a0"], "status": "running"}}
    plan = await controller.plan(ir, CLUSTER, nodes, "reassignment", ["b1-r"], invoker(ir, "resourceAllocator"),
                                 instances, instance_id="b1-0", pod_name="b1-0", block_metrics={})
    assert plan[0]["node"] == "n2"


# -- controller.dry_run -----------------------------------------------------------------------------


async def test_dry_run_outcome() -> None:
    ir = make_ir(max_instances=8)
    out = await controller.dry_run(ir, CLUSTER, two_by_two(), invoker(ir, "resourceAllocator"))
    assert out.score == pytest.approx(0.5) and out.error == ""
    assert out.node_info["node_id"] in {"n1", "n2"} and len(out.node_info["gpus"]) == 1


async def test_dry_run_outcome_when_the_policy_fails() -> None:
    ir = make_ir(allocator="registry:boom")
    out = await controller.dry_run(ir, CLUSTER, two_by_two(), invoker(ir, "resourceAllocator", runtime_with(boom=RAISING)))
    assert out.score == 0.0 and out.node_info == {}
    assert "ZeroDivisionError" in out.error


# -- check_choice -----------------------------------------------------------------------------------

NEEDS = {"gpus": 2, "gpuMemory": 0, "cpu": 1, "memory": 10}


def choice_nodes() -> dict[str, dict[str, Any]]:
    return nodes_of(
        node("n1", gpus=[gpu("a0"), gpu("a1"), busy_gpu("a2")]),
        node("n2", gpus=free_gpus(4, prefix="b"), cpu=0.5),
        node("n3", gpus=free_gpus(2, prefix="c"), healthy=False),
    )


@pytest.mark.parametrize(
    ("node_id", "gpus", "why"),
    [
        ("n1", ["a0", "a1"], ""),
        ("n9", ["a0", "a1"], "node 'n9' is not in this cluster"),
        ("n1", ["a0"], "1 GPUs chosen, block needs 2"),
        ("n1", ["a0", "a1", "a2"], "3 GPUs chosen, block needs 2; GPU(s) ['a2'] on n1 are not free for this instance"),
        ("n1", ["a0", "a2"], "GPU(s) ['a2'] on n1 are not free for this instance"),
        ("n1", ["a0", "zz"], "GPU(s) ['zz'] are not GPUs of n1"),
        ("n1", ["a0", "a0"], "the same GPU was chosen twice"),
        # every problem of the choice, not the first only
        ("n9", ["a0"], "node 'n9' is not in this cluster; 1 GPUs chosen, block needs 2"),
        ("n1", ["a2", "a2", "zz"], "3 GPUs chosen, block needs 2; GPU(s) ['zz'] are not GPUs of n1; "
                                   "GPU(s) ['a2'] on n1 are not free for this instance; the same GPU was chosen twice"),
        ("n2", ["b0"], "1 GPUs chosen, block needs 2; node n2 cannot host the instance: cpu 0.5 free < 1"),
        ("n2", ["b0", "b1"], "node n2 cannot host the instance: cpu 0.5 free < 1"),
        ("n3", ["c0", "c1"], "node n3 cannot host the instance: unhealthy"),
    ],
)
def test_check_choice(node_id: str, gpus: list[str], why: str) -> None:
    assert controller.check_choice(node_id, gpus, choice_nodes(), NEEDS, False) == why


def test_check_choice_with_sharing() -> None:
    nodes = nodes_of(node("n1", gpus=[gpu("g0", 80_000, used=70_000, instances=2), gpu("g1", 80_000, used=10_000, instances=1)]))
    needs = {"gpus": 1, "gpuMemory": 20_000}
    assert controller.check_choice("n1", ["g1"], nodes, needs, True) == ""
    assert "not free" in controller.check_choice("n1", ["g0"], nodes, needs, True)
    assert controller.check_choice("n1", ["g1"], nodes, needs, False) == "node n1 cannot host the instance: 0 usable GPUs < 1"


# -- instance ids -----------------------------------------------------------------------------------


def test_instance_id_for_gang_members_is_the_index() -> None:
    assert [controller.instance_id("blk", i) for i in range(3)] == ["blk-0", "blk-1", "blk-2"]


def test_instance_id_for_requests_is_a_stable_digest() -> None:
    a = controller.instance_id("blk", "req-1")
    assert a == controller.instance_id("blk", "req-1")
    assert a != controller.instance_id("blk", "req-2")
    assert a != controller.instance_id("other", "req-1")
    assert re.fullmatch(r"blk-[0-9a-f]{8}", a)
    assert ID_RE.match(a)


def test_instance_ids_of_a_block_do_not_collide() -> None:
    ids = {controller.instance_id("b", i) for i in range(50)} | {controller.instance_id("b", f"r{i}") for i in range(500)}
    assert len(ids) == 550


# -- capacity ---------------------------------------------------------------------------------------


def test_node_fits_returns_the_usable_gpus() -> None:
    n = node("n1", gpus=[gpu("a"), busy_gpu("b"), gpu("c", 10_000)])
    usable = capacity.node_fits(n, {"gpus": 1, "gpuMemory": 20_000}, False)
    assert [g["id"] for g in usable] == ["a"]  # b is taken, c is too small
    assert capacity.node_fits(n, {"gpus": 2, "gpuMemory": 20_000}, False) is None
    assert [g["id"] for g in capacity.node_fits(n, {"gpus": 2}, False)] == ["a", "c"]


@pytest.mark.parametrize(
    ("view", "needs"),
    [
        (node("n", gpus=free_gpus(2), healthy=False), {"gpus": 1}),
        (node("n", gpus=free_gpus(2), cpu=4, cpu_used=3.5), {"gpus": 1, "cpu": 1}),
        (node("n", gpus=free_gpus(2), memory=1000, mem_used=900), {"gpus": 1, "memory": 101}),
        (node("n", gpus=[busy_gpu("a"), gpu("b")]), {"gpus": 2}),
    ],
)
def test_node_fits_refuses(view: dict[str, Any], needs: dict[str, Any]) -> None:
    assert capacity.node_fits(view, needs, False) is None
    assert capacity.why_not(view, needs, False)


def test_node_fits_exact_fit() -> None:
    n = node("n", gpus=free_gpus(1), cpu=4, cpu_used=3, memory=1000, mem_used=900)
    assert capacity.node_fits(n, {"gpus": 1, "cpu": 1, "memory": 100}, False) is not None


def test_node_fits_with_sharing() -> None:
    n = node("n", gpus=[gpu("a", 80_000, used=60_000, instances=2), busy_gpu("b")])
    assert [g["id"] for g in capacity.node_fits(n, {"gpus": 1, "gpuMemory": 20_000}, True)] == ["a"]
    assert capacity.node_fits(n, {"gpus": 1, "gpuMemory": 20_001}, True) is None
    assert capacity.node_fits(n, {"gpus": 1, "gpuMemory": 20_000}, False) is None


def test_take_exclusive() -> None:
    n = node("n", gpus=free_gpus(3), cpu=8, memory=1000)
    capacity.take(n, ["g0", "g2"], {"gpus": 2, "cpu": 1.5, "memory": 300}, False)
    assert n["cpu_free"] == 6.5 and n["memory_free"] == 700
    g = {x["id"]: x for x in n["gpus"]}
    for gid in ("g0", "g2"):
        assert g[gid]["instances"] == 1 and g[gid]["exclusive"]
        assert g[gid]["memory_free"] == 0 and g[gid]["memory_used"] == g[gid]["memory"]
    assert g["g1"]["instances"] == 0 and not g["g1"]["exclusive"] and g["g1"]["memory_free"] == g["g1"]["memory"]
    assert capacity.free_gpus(n) == 1
    assert capacity.node_fits(n, {"gpus": 2}, False) is None


def test_take_shared() -> None:
    n = node("n", gpus=[gpu("g0", 80_000)])
    needs = {"gpus": 1, "gpuMemory": 30_000}
    capacity.take(n, ["g0"], needs, True)
    capacity.take(n, ["g0"], needs, True)
    g0 = n["gpus"][0]
    assert (g0["instances"], g0["memory_used"], g0["memory_free"], g0["exclusive"]) == (2, 60_000, 20_000, False)
    assert capacity.node_fits(n, needs, True) is None  # 20 GB left < 30 GB
    assert capacity.free_gpus(n) == 0


def test_take_then_node_fits_agree_with_a_fresh_view() -> None:
    # the optimistic twin of RESERVE_GANG: taking on a copy equals the view the store would return
    taken = node("n", gpus=free_gpus(2), cpu=8, memory=1000)
    capacity.take(taken, ["g1"], {"gpus": 1, "cpu": 2, "memory": 100}, False)
    fresh = node("n", gpus=[gpu("g0"), busy_gpu("g1")], cpu=8, cpu_used=2, memory=1000, mem_used=100)
    assert taken == fresh


def test_copy_nodes_is_deep_enough_for_take() -> None:
    nodes = nodes_of(node("n", gpus=free_gpus(1)))
    work = capacity.copy_nodes(nodes)
    capacity.take(work["n"], ["g0"], {"gpus": 1, "cpu": 1}, False)
    assert nodes["n"]["gpus"][0]["instances"] == 0 and nodes["n"]["cpu_free"] == 64.0
    assert work["n"]["gpus"][0]["instances"] == 1


def test_gather_waits_for_the_deadline_then_decides_with_a_usable_answer() -> None:
    expected = ["eu1", "eu2"]
    usable = {"eu1": {"score": 0.5, "node_info": {}}}
    assert gateway.gather_wait(expected, usable, now=100.0, deadline=105.0, patience_s=60) == 5.0
    assert gateway.gather_wait(expected, usable, now=105.0, deadline=105.0, patience_s=60) == 0.0


def test_gather_past_deadline_without_a_usable_answer_keeps_waiting_within_patience() -> None:
    expected = ["eu1", "eu2"]
    nothing: dict[str, dict[str, Any]] = {}
    unusable = {"eu1": {"score": 0.0}, "eu2": {"score": 1.0, "error": "policy failed"}}
    assert gateway.gather_wait(expected, nothing, now=110.0, deadline=105.0, patience_s=60) == 55.0
    assert gateway.gather_wait(["eu1", "eu2", "us1"], unusable, now=110.0, deadline=105.0, patience_s=60) == 55.0
    # patience spent: decide (the decision then names the clusters that never answered)
    assert gateway.gather_wait(expected, nothing, now=165.0, deadline=105.0, patience_s=60) == 0.0


def test_gather_with_every_answer_in_decides_even_if_none_is_usable() -> None:
    answered = {"eu1": {"score": 0.0}, "eu2": {"score": 0.0, "error": "no node fits"}}
    assert gateway.gather_wait(["eu1", "eu2"], answered, now=106.0, deadline=105.0, patience_s=60) == 0.0
    assert not gateway.usable(answered["eu1"]) and not gateway.usable(answered["eu2"])
    assert gateway.usable({"score": 0.25})


# -- a gang no cluster can hold fails at post_dry_run, not after rounds of allocation -----------------
def test_gang_shortfall_needs_every_candidate_to_have_counted() -> None:
    from aios_blocks.handlers.gateway import gang_shortfall

    res = {"c1": {"score": 0.5, "placeable": 1}, "c2": {"score": 0.0, "placeable": 0}}
    assert gang_shortfall(["c1", "c2", "c3"], res, 2) == "no cluster can hold minInstances (2) at once: c1 fits 1; c2: none; c3: no answer in time"
    assert gang_shortfall(["c1", "c2"], res, 1) == ""  # c1 holds one
    assert gang_shortfall(["c1"], {"c1": {"score": 0.5}}, 2) == ""  # a policy that did not count: allocation decides
    assert gang_shortfall(["c1"], {"c1": {"score": 0.5, "placeable": -1}}, 2) == ""
    assert gang_shortfall(["c1"], {"c1": {"score": 0.0, "placeable": 0}}, 2) == ""  # nothing usable: decided elsewhere


async def test_choose_fails_the_block_without_asking_the_policy_when_no_cluster_holds_the_gang() -> None:
    from aios_blocks.handlers.gateway import choose

    calls: list[Any] = []

    async def invoke(data: dict[str, Any]) -> Any:
        calls.append(data)
        return {"cluster_id": "c1"}

    results = {"c1": {"score": 1 / 3, "placeable": 1, "node_info": {}}, "c2": {"score": 2 / 3, "placeable": 2, "node_info": {}}}
    d = await choose(["c1", "c2"], results, {}, invoke, min_instances=3)
    assert d.failure == "no cluster can hold minInstances (3) at once: c1 fits 1, c2 fits 2" and not d.cluster_id
    assert d.scores == {"c1": pytest.approx(1 / 3), "c2": pytest.approx(2 / 3)} and calls == []
    d = await choose(["c1", "c2"], results, {}, invoke, min_instances=2)
    assert d.cluster_id == "c1" and not d.failure and len(calls) == 1


async def test_dry_run_reports_the_shortfall_of_a_cluster_too_small_for_the_gang() -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(2)))
    ir = make_ir(min_instances=3, max_instances=4)
    out = await controller.dry_run(ir, {"id": "c1", "labels": {}}, nodes, invoker(ir, "resourceAllocator"))
    assert (out.score, out.placeable, out.shortfall) == (0.5, 2, 1)
    ir = make_ir(min_instances=2, max_instances=4)
    out = await controller.dry_run(ir, {"id": "c1", "labels": {}}, nodes, invoker(ir, "resourceAllocator"))
    assert (out.placeable, out.shortfall) == (2, 0)


def test_a_short_answer_does_not_end_the_gather_at_its_deadline() -> None:
    """c1 holds 2 of a gang of 3 and answered; c2 (room for all, but busy) has not answered yet.
    Deciding at the deadline would fail the block although c2 may hold it: wait for c2 (patience),
    decide at once when every cluster answered."""
    short = {"score": 0.5, "placeable": 2, "shortfall": 1}
    assert not gateway.usable(short) and gateway.usable({"score": 0.5, "placeable": 3, "shortfall": 0})
    assert gateway.gather_wait(["c1", "c2"], {"c1": short}, now=106.0, deadline=105.0, patience_s=60) == 59.0
    answered = {"c1": short, "c2": {"score": 0.0, "placeable": 0, "shortfall": 3}}
    assert gateway.gather_wait(["c1", "c2"], answered, now=106.0, deadline=105.0, patience_s=60) == 0.0
