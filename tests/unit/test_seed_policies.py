"""Seed-000 policies as users write them (tests/unit/seed_policies/), loaded from source and run by
the real PolicyRuntime and handlers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aios_blocks.handlers import controller, gateway
from aios_blocks.policies.runtime import (
    MAX_PRINT_CHARS,
    MAX_PRINT_LINES,
    PolicyRuntime,
    TrackingDict,
    policy_class_from_source,
)
from aios_blocks.schemas.errors import PlacementFailed, PolicyFailed

from .views import EXAMPLES, busy_gpu, free_gpus, gpu, invoker, make_ir, node, nodes_of

HERE = Path(__file__).parent / "seed_policies"
SELECTOR = HERE / "cluster_selector.py"
RESOURCE = EXAMPLES / "first_fit.py"  # the example a user copies (examples/)
CLUSTER = {"id": "c1", "labels": {"zone": "a"}}


def selector_rule(**kw: Any) -> dict[str, Any]:
    return {"name": "clusterAllocator", "policyRuleURI": str(SELECTOR), "parameters": {}, "settings": {}, **kw}


def resource_rule(**kw: Any) -> dict[str, Any]:
    return {"name": "resourceAllocator", "policyRuleURI": str(RESOURCE), "parameters": {}, "settings": {}, **kw}


def entries(*free: int) -> list[dict[str, Any]]:
    """Filter results (``gateway.cluster_entry``) for clusters c0, c1, ... with the given free GPUs."""
    out = []
    for i, n in enumerate(free):
        cid = f"c{i}"
        out.append(gateway.cluster_entry({"id": cid, "labels": {}}, nodes_of(node(f"{cid}-n", cid, gpus=free_gpus(n)))))
    return out


def with_scores(clusters: list[dict[str, Any]], *scores: float) -> list[dict[str, Any]]:
    return [{**c, "score_data": {"score": s, "node_info": {}}} for c, s in zip(clusters, scores, strict=True)]


async def run(rule: dict[str, Any], input_data: dict[str, Any], context: dict[str, Any] | None = None) -> Any:
    return await PolicyRuntime(allow_files=True).invoke(rule, "b1.rule", input_data, {} if context is None else context)


# -- loading -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "name"), [(SELECTOR, "ClusterSelectorPolicyRule"), (RESOURCE, "AIOSv1PolicyRule")])
def test_seed_sources_load_as_one_policy_class(path: Path, name: str) -> None:
    cls = policy_class_from_source(path.read_text(), str(path))
    assert cls.__name__ == name
    inst = cls("rid", {"s": 1}, {"p": 2})
    assert (inst.settings, inst.parameters) == ({"s": 1}, {"p": 2})


async def test_runtime_loads_the_file_uri_when_files_are_allowed() -> None:
    cls, name, version = await PolicyRuntime(allow_files=True).resolve(str(SELECTOR))
    assert cls.__name__ == "ClusterSelectorPolicyRule" and name == str(SELECTOR) and version is None


async def test_without_file_access_a_py_uri_names_the_registry_entry() -> None:
    async def lookup(name: str, version: int | None) -> dict[str, Any] | None:
        return {"source": SELECTOR.read_text(), "version": 4, "language": "python"} if name == "cluster_selector" else None

    rt = PolicyRuntime(lookup=lookup)
    clusters = entries(1, 2)
    result = await rt.invoke(selector_rule(), "r", {"action": "selection", "filter_result": clusters}, {})
    assert result == {"clusters": clusters}


# -- the seed's ClusterSelectorPolicyRule ------------------------------------------------------------


async def test_selection_returns_the_filter_result_as_is(capsys: pytest.CaptureFixture[str]) -> None:
    clusters = entries(3, 0, 5)
    trace: dict[str, Any] = {}
    rule = selector_rule(parameters={"p": 1})
    input_data = {"action": "selection", "filter_result": clusters}
    result = await PolicyRuntime(allow_files=True).invoke(rule, "b1.rule", input_data, {"k": "v"}, trace)
    assert result == {"clusters": clusters}
    # the example prints its arguments: the call's log lines (its decision record, blocks replay),
    # not the worker's stdout (its JSON log) nor blocks policy run's (the result's JSON)
    ((level, printed),) = trace["logs"]
    assert level == "print" and printed == f"{{'p': 1}} {input_data} {{'k': 'v'}}"
    assert capsys.readouterr().out == ""


async def test_what_a_policy_prints_is_bounded_and_print_keeps_its_arguments() -> None:
    src = (
        "import io\n"
        "class P:\n"
        "    def __init__(self, rule_id, settings, parameters):\n"
        "        pass\n"
        "    def eval(self, parameters, input_data, context):\n"
        "        print('a', 1, sep='-', end='!')\n"
        "        buf = io.StringIO()\n"
        "        print('to a file', file=buf)\n"
        "        print('x' * 5000)\n"
        "        for i in range(300):\n"
        "            print(i)\n"
        "        return {'clusters': [buf.getvalue()]}\n"
    )

    async def lookup(name: str, version: int | None) -> dict[str, Any] | None:
        return {"source": src, "version": 1, "language": "python"}

    trace: dict[str, Any] = {}
    result = await PolicyRuntime(lookup=lookup).invoke(
        {"name": "clusterAllocator", "policyRuleURI": "registry:p"}, "r", {"action": "selection", "filter_result": []}, {}, trace
    )
    assert result == {"clusters": ["to a file\n"]}  # print(file=...) still writes there
    logs = trace["logs"]
    assert logs[0] == ["print", "a-1"] and logs[1] == ["print", "x" * MAX_PRINT_CHARS]
    assert len(logs) == MAX_PRINT_LINES + 1 and logs[-1] == ["warn", "(more printed lines dropped)"]


async def test_selection_with_an_empty_filter_result_fails_the_step() -> None:
    with pytest.raises(PolicyFailed) as info:
        await run(selector_rule(), {"action": "selection", "filter_result": []})
    assert "no results found in the filter" in info.value.reason


@pytest.mark.parametrize(("scores", "winner"), [((0.2, 0.9, 0.5), "c1"), ((1.0, 0.0, 0.99), "c0"), ((0.0, 0.0, 0.3), "c2")])
async def test_post_dry_run_returns_the_entry_with_the_highest_score(scores: tuple[float, ...], winner: str) -> None:
    clusters = with_scores(entries(1, 1, 1), *scores)
    result = await run(selector_rule(), {"action": "post_dry_run", "clusters": clusters})
    assert result["cluster_id"] == winner
    assert result == next(c for c in clusters if c["cluster_id"] == winner)


async def test_post_dry_run_tie_keeps_the_first_listed() -> None:
    clusters = with_scores(entries(1, 1, 1), 0.4, 0.7, 0.7)
    assert (await run(selector_rule(), {"action": "post_dry_run", "clusters": clusters}))["cluster_id"] == "c1"
    assert (await run(selector_rule(), {"action": "post_dry_run", "clusters": clusters[::-1]}))["cluster_id"] == "c2"


async def test_an_action_the_example_does_not_handle_fails_the_step() -> None:
    # the example falls through and returns None: the runtime rejects the shape
    with pytest.raises(PolicyFailed, match="wrong return shape"):
        await run(selector_rule(), {"action": "dry_run", "payload": {}})


async def test_seed_selector_drives_the_gateway_steps() -> None:
    ir = make_ir(selector=str(SELECTOR))
    clusters = {"east": {"id": "east", "labels": {}}, "west": {"id": "west", "labels": {}}, "full": {"id": "full", "labels": {}}}
    nodes = {
        "east": nodes_of(node("e1", "east", gpus=free_gpus(1))),
        "west": nodes_of(node("w1", "west", gpus=free_gpus(4))),
        "full": nodes_of(node("f1", "full", gpus=[busy_gpu("f0")])),
    }
    call = invoker(ir, "clusterAllocator", PolicyRuntime(allow_files=True))
    sel = await gateway.select(ir, clusters, nodes, call)
    assert sel.failure == ""
    assert sel.candidates == ["east", "west"]  # the filter's order, unchanged by the example
    assert set(sel.filtered) == {"full"}
    final = await gateway.choose(sel.candidates, {"east": {"score": 0.25}, "west": {"score": 1.0}}, sel.entries, call)
    assert final.failure == "" and final.cluster_id == "west"


# -- the seed-shaped AIOSv1PolicyRule ------------------------------------------------------------------


def cluster_nodes() -> dict[str, dict[str, Any]]:
    return nodes_of(
        node("n1", gpus=[busy_gpu("a0"), gpu("a1")]),
        node("n2", gpus=free_gpus(3, prefix="b")),
        node("n3", gpus=free_gpus(8, prefix="c"), healthy=False),
    )


async def test_resource_rule_dry_run() -> None:
    ir = make_ir(max_instances=8, resources={"gpus": 1})
    ctx = TrackingDict({})
    result = await run(resource_rule(), {"action": "dry_run", "payload": controller.payload(ir, CLUSTER, cluster_nodes())}, ctx)
    ssd = result["selection_score_data"]
    assert ssd["score"] == pytest.approx(4 / 8)  # a1 + b0..b2; the unhealthy node does not count
    assert ssd["node_info"] == {"node_id": "n1", "gpus": ["a1"]}
    assert ctx.changes() == ({"dry_run": 1}, [])


@pytest.mark.parametrize("action", ["allocation", "scale"])
async def test_resource_rule_allocation_and_scale(action: str) -> None:
    ir = make_ir(resources={"gpus": 2})
    pl = controller.payload(ir, CLUSTER, cluster_nodes(), block_metrics={})
    assert await run(resource_rule(), {"action": action, "payload": pl}) == {"node_id": "n2", "gpus": ["b0", "b1"]}


async def test_resource_rule_reassignment_moves_away() -> None:
    ir = make_ir()
    instances = {"b1-0": {"node": "n1", "gpus": ["a0"]}}
    pl = controller.payload(ir, CLUSTER, cluster_nodes(), instances, instance_id="b1-0", pod_name="b1-0", block_metrics={})
    assert await run(resource_rule(), {"action": "reassignment", "payload": pl}) == {"node_id": "n2", "gpus": ["b0"]}


async def test_resource_rule_without_capacity_fails_the_step() -> None:
    ir = make_ir(resources={"gpus": 4})
    pl = controller.payload(ir, CLUSTER, cluster_nodes())
    with pytest.raises(PolicyFailed, match="no node has 4 free GPUs"):
        await run(resource_rule(), {"action": "allocation", "payload": pl})


async def test_resource_rule_places_a_gang_through_the_controller() -> None:
    ir = make_ir(min_instances=3, max_instances=3, allocator=str(RESOURCE))
    ctx = TrackingDict({"allocation": 10})
    call = invoker(ir, "resourceAllocator", PolicyRuntime(allow_files=True), ctx)
    iids = [controller.instance_id("b1", i) for i in range(3)]
    plan = await controller.plan(ir, CLUSTER, cluster_nodes(), "allocation", iids, call)
    assert [(p["iid"], p["node"], p["gpus"]) for p in plan] == [
        ("b1-0", "n1", ["a1"]),
        ("b1-1", "n2", ["b0"]),
        ("b1-2", "n2", ["b1"]),
    ]
    assert ctx.changes() == ({"allocation": 13}, [])
    outcome = await controller.dry_run(ir, CLUSTER, cluster_nodes(), call)
    assert outcome.score == pytest.approx(1.0) and outcome.node_info == {"node_id": "n1", "gpus": ["a1"]}


async def test_resource_rule_gang_larger_than_the_cluster_fails_with_a_reason() -> None:
    ir = make_ir(min_instances=5, max_instances=5, allocator=str(RESOURCE))
    call = invoker(ir, "resourceAllocator", PolicyRuntime(allow_files=True))
    with pytest.raises(PlacementFailed) as info:
        await controller.plan(ir, CLUSTER, cluster_nodes(), "allocation", [f"b1-{i}" for i in range(5)], call)
    assert "instance 5 of 5" in info.value.reason and "no node has 1 free GPUs" in info.value.reason
