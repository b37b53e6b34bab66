"""The controller's placement input (``handlers.controller.payload``) for a cluster the block's
``sampleNodes`` covers: every node as it is, the same input as through ``sampling.sample``, and no
per-shape fit index built on the inventory view for a count the input does not carry (docs/trace.md
"Live vs Ray": 19 % of the plan's time with the trace's shapes)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aios_blocks.handlers import controller, gateway
from aios_blocks.policies import affinity, capacity

from .test_sampling import CLUSTER, big, with_affinity
from .views import make_ir


def through_sample(ir: dict[str, Any], nodes: dict[str, Any]) -> dict[str, Any]:
    """The input as built before: the nodes through ``sampling.sample`` (``gateway.sample_for``)."""
    smp = gateway.sample_for(ir, nodes, None, 1)  # type: ignore[arg-type]
    metrics = gateway.cluster_metrics(nodes, smp.nodes)
    if smp.sampled:
        metrics["sample"] = smp.info()
    if ir.get("affinity"):
        metrics["affinity_index"] = affinity.empty_index()
    block = dict(ir)
    block["instances"] = {}
    return {"block": block, "cluster": CLUSTER, "cluster_metrics": metrics,
            "healthy_nodes": capacity.healthy_ids(smp.nodes)}


@pytest.mark.parametrize(("n", "settings"), [(300, {"sampleNodes": 0}), (60, {}), (120, {"sampleNodes": 500})])
def test_an_unsampled_cluster_gives_the_same_input_without_a_fit_index(n: int, settings: dict[str, Any]) -> None:
    ir = make_ir(allocator_settings=settings) if settings else make_ir()
    view = capacity.Nodes(big(n, free=set(range(0, n, 3))))
    got = controller.payload(ir, CLUSTER, view)  # type: ignore[arg-type]
    assert not view._fits  # no per-shape index of every node's fit was built
    assert "sample" not in got["cluster_metrics"] and len(got["cluster_metrics"]["nodes"]) == n
    assert msgspec.json.encode(got) == msgspec.json.encode(through_sample(ir, capacity.Nodes(big(n, free=set(range(0, n, 3))))))


def test_a_sampled_cluster_and_a_block_with_affinity_still_go_through_the_sample() -> None:
    view = capacity.Nodes(big(300))
    got = controller.payload(make_ir(allocator_settings={"sampleNodes": 50}), CLUSTER, view)  # type: ignore[arg-type]
    assert got["cluster_metrics"]["sample"]["total_nodes"] == 300
    assert len(got["cluster_metrics"]["nodes"]) < 300
    ir = with_affinity(make_ir(allocator_settings={"sampleNodes": 0}), [
        {"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "nobody"}}])
    got = controller.payload(ir, CLUSTER, capacity.Nodes(big(40)))  # type: ignore[arg-type]
    assert msgspec.json.encode(got) == msgspec.json.encode(through_sample(ir, capacity.Nodes(big(40))))
