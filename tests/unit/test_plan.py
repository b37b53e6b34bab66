"""The plan of ``blocks submit --dry-run`` (``handlers.plan``): the workers' own steps chained on one
snapshot, with the real built-in policies; plus the pure pieces it shares with the parser."""

from __future__ import annotations

import copy
import json
from typing import Any

from aios_blocks.cli.client import StateChanged
from aios_blocks.handlers import parse
from aios_blocks.handlers.plan import make_plan

from .test_handlers import inventory, runtime_with
from .views import invoker, make_ir


async def _plan(ir: dict[str, Any], runtime: Any = None) -> Any:
    clusters, nodes = inventory()
    before = copy.deepcopy(nodes)
    plan = await make_plan(ir, clusters, nodes, invoker(ir, "clusterAllocator", runtime),
                           invoker(ir, "resourceAllocator", runtime))
    assert nodes == before  # planning never touches the snapshot it was given
    json.dumps(plan.as_dict())  # --json prints it as is
    return plan


async def test_a_gang_that_fits_gets_a_cluster_nodes_and_distinct_gpus() -> None:
    plan = await _plan(make_ir(bid="p1", min_instances=2, max_instances=2))
    assert plan.places and plan.failure == "" and plan.stage == ""
    assert plan.candidates == ["us1", "eu2", "eu1"]  # builtin:cluster-rank: most free GPUs first, top 3
    assert plan.filtered == {
        "empty": "no healthy node with capacity for one instance (0 nodes)",
        "full": "no healthy node with capacity for one instance (2 nodes)",
    }
    assert {c: d.score for c, d in plan.dry_runs.items()} == {"us1": 1.0, "eu2": 1.0, "eu1": 1.0}
    assert plan.cluster_id == "us1"  # equal scores: more free GPUs wins
    assert [p["iid"] for p in plan.placements] == ["p1-0", "p1-1"]
    assert {p["node"] for p in plan.placements} == {"us1-a"}
    gpus = [g for p in plan.placements for g in p["gpus"]]
    assert len(gpus) == 2 and len(set(gpus)) == 2
    assert plan.as_dict()["places"] is True


async def test_nothing_passes_the_filter_rule() -> None:
    plan = await _plan(make_ir(resources={"gpus": 16, "cpu": 1, "memory": 1}))
    assert not plan.places and plan.stage == "selection"
    assert plan.failure.startswith("no cluster passed the filter rule (")
    assert set(plan.filtered) == {"empty", "eu1", "eu2", "full", "us1"} and plan.dry_runs == {}


async def test_no_cluster_holds_the_gang_at_once() -> None:
    plan = await _plan(make_ir(min_instances=3, max_instances=3, resources={"gpus": 4, "cpu": 1, "memory": 1}))
    assert not plan.places and plan.stage == "post_dry_run"
    assert plan.failure == "no cluster can hold minInstances (3) at once: eu2 fits 1, us1 fits 2"
    assert {c: d.placeable for c, d in plan.dry_runs.items()} == {"us1": 2, "eu2": 1}
    assert plan.cluster_id == "" and plan.placements == []


ODD = (
    "class Odd:\n"
    "    def __init__(self, rule_id, settings, parameters):\n"
    "        pass\n"
    "    def eval(self, parameters, input_data, context):\n"
    "        context['calls'] = context.get('calls', 0) + 1\n"
    "        if input_data['action'] == 'dry_run':\n"
    "            return {'selection_score_data': {'score': 1.0, 'node_info': {}}}\n"
    "        return {'node_id': 'nowhere', 'gpus': ['g0']}\n"
)


async def test_an_allocation_that_cannot_work_is_reported_with_the_cluster() -> None:
    ir = make_ir(allocator="registry:odd")
    plan = await _plan(ir, runtime_with(odd=ODD))
    assert not plan.places and plan.stage == "allocation" and plan.cluster_id == "us1"
    assert plan.failure == "us1: resourceAllocator allocation chose an impossible placement: node 'nowhere' is not in this cluster"


async def test_a_policy_error_in_one_dry_run_is_kept_per_cluster() -> None:
    ir = make_ir(allocator="registry:boom")
    plan = await _plan(ir, runtime_with(boom="class B:\n    def __init__(self, r, s, p):\n        pass\n"
                                             "    def eval(self, p, i, c):\n        raise RuntimeError('no')\n"))
    assert not plan.places and plan.stage == "post_dry_run"
    assert all("RuntimeError: no" in d.error for d in plan.dry_runs.values())
    assert plan.failure.startswith("no candidate cluster can place an instance (us1: policy 'resourceAllocator'")


async def test_pinned_versions_take_the_registry_head_of_every_unpinned_registry_rule() -> None:
    asked: list[tuple[str, int | None]] = []

    async def lookup(name: str, version: int | None) -> dict[str, Any] | None:
        asked.append((name, version))
        return {"version": 7} if name != "gone" else None

    component = {"policies": [{"name": "resourceAllocator", "policyRuleURI": "registry:packer"},
                              {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"}]}
    doc = {"policyRulesSpec": [{"name": "autoscaler", "policyRuleURI": "registry:scaler@2"},
                               {"values": {"name": "loadBalancer", "policyRuleURI": "gone.py"}}]}
    assert await parse.pinned_versions(lookup, doc, component) == {"resourceAllocator": 7}
    assert asked == [("packer", None), ("gone", None)]  # pinned (@2) and built-ins are not looked up


def test_a_stale_index_says_what_changed_and_what_to_do() -> None:
    exc = StateChanged(12, 15)
    assert str(exc) == "state changed since index 12 (now 15): run --dry-run again"
    assert isinstance(exc, LookupError)  # the CLI's "refused": exit 1
