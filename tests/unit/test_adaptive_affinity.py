"""Adaptive affinity (seed 002's reserved strength 0x03, issue 16): the adapt stage's rule (pure),
Adaptive entries scored like Preferred with the adapted weight, the placement it moves, and the
record `blocks explain` shows (base weight, adapted weight, why)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from aios_blocks.handlers import controller
from aios_blocks.policies import affinity
from aios_blocks.projections.explain import explain
from aios_blocks.schemas.affinity import normalize

from .views import free_gpus, invoker, make_ir, node, nodes_of


def entries(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(e) for e in normalize(list(items))]


RACK1 = {"category": "Topology", "strength": "Adaptive", "target": {"type": "RackId", "value": 1}}


def sample(node_id: str, p50: Any = None, dispatch: Any = None) -> dict[str, Any]:
    return {"node": node_id, "state": "ready", "latency_p50_ms": p50, "dispatch_p50_ms": dispatch}


# -- the adapt stage's rule ---------------------------------------------------------------------------
def test_the_multiplier_is_the_block_median_over_the_node_p50_within_bounds() -> None:
    t = affinity.adapt({"i0": sample("slow", 40), "i1": sample("fast", 10), "i2": sample("mid", 25)})
    assert t["figure"] == "latency_p50_ms" and t["block_median_ms"] == 25 and t["bounds"] == [0.5, 2.0]
    assert t["nodes"]["slow"] == {"p50_ms": 40, "instances": 1, "multiplier": 0.625}
    assert t["nodes"]["mid"]["multiplier"] == 1.0
    assert t["nodes"]["fast"]["multiplier"] == 2.0  # 2.5, bounded
    # far slower: bounded below; a node's p50 is the median of its instances
    t = affinity.adapt({"a": sample("n1", 100), "b": sample("n1", 300), "c": sample("n1", 200),
                        "d": sample("n2", 10), "e": sample("n2", 12)})
    assert t["nodes"]["n1"] == {"p50_ms": 200, "instances": 3, "multiplier": 0.5}
    assert t["nodes"]["n2"]["p50_ms"] == 11 and t["block_median_ms"] == 100


def test_no_figures_means_the_base_weight_everywhere() -> None:
    for samples in ({}, {"i0": sample("n1")}, {"i0": {"node": "n1", "latency_p50_ms": math.nan}},
                    {"i0": sample("n1", -1)}, {"i0": sample("n1", True)}, {"i0": sample("", 5)}):
        t = affinity.adapt(samples)
        assert t["figure"] == "" and t["nodes"] == {} and t["block_median_ms"] is None, samples
    # one node only: nothing to compare with
    assert affinity.adapt({"i0": sample("n1", 30)})["nodes"]["n1"]["multiplier"] == 1.0
    # the executors' dispatch time when no instance reports its own latency
    t = affinity.adapt({"i0": sample("n1", dispatch=20), "i1": sample("n2", dispatch=40)})
    assert t["figure"] == "dispatch_p50_ms" and t["nodes"]["n1"]["multiplier"] > 1 > t["nodes"]["n2"]["multiplier"]
    # a block where some instances report latency: that figure only, the others left out
    t = affinity.adapt({"i0": sample("n1", 20, 99), "i1": sample("n2", None, 5)})
    assert t["figure"] == "latency_p50_ms" and set(t["nodes"]) == {"n1"}


# -- scoring -------------------------------------------------------------------------------------
def three_nodes() -> dict[str, dict[str, Any]]:
    return nodes_of(node("a-slow", gpus=free_gpus(2), labels={"rack": "1"}),
                    node("b-fast", gpus=free_gpus(2), labels={"rack": "1"}),
                    node("c-other", gpus=free_gpus(2), labels={"rack": "2"}))


def test_an_adaptive_entry_scores_like_preferred_with_the_adapted_weight() -> None:
    es = entries(RACK1)
    nodes = three_nodes()
    affinity.annotate(nodes, es, affinity.empty_index())  # no metrics: exactly Preferred's weight
    assert {n: v["affinity"]["score"] for n, v in nodes.items()} == {"a-slow": 1.0, "b-fast": 1.0, "c-other": 0.0}
    assert "no live metrics" in nodes["a-slow"]["affinity"]["adaptive"][0]["why"]
    assert nodes["c-other"]["affinity"]["adaptive"][0] == {"entry": 0, "base": 1.0, "multiplier": 0.0, "weight": 0.0,
                                                           "why": "the node does not satisfy the entry"}
    pref = three_nodes()
    affinity.annotate(pref, entries({**RACK1, "strength": "Preferred"}), affinity.empty_index())
    assert {n: v["affinity"]["score"] for n, v in pref.items()} == {n: v["affinity"]["score"] for n, v in nodes.items()}
    assert all("adaptive" not in v["affinity"] for v in pref.values())

    table = affinity.adapt({"s": sample("a-slow", 40), "f": sample("b-fast", 10)})
    nodes = three_nodes()
    affinity.annotate(nodes, es, {**affinity.empty_index(), "adapt": table})
    assert {n: v["affinity"]["score"] for n, v in nodes.items()} == {"a-slow": 0.625, "b-fast": 2.0, "c-other": 0.0}
    fast = nodes["b-fast"]["affinity"]["adaptive"][0]
    assert (fast["base"], fast["multiplier"], fast["weight"]) == (1.0, 2.0, 2.0)
    assert "latency_p50_ms 10 ms here" in fast["why"] and "block median 25 ms" in fast["why"] and "bounded" in fast["why"]
    # an away entry: the nodes off rack 1 satisfy it, at the base weight (no instance there)
    away = three_nodes()
    affinity.annotate(away, entries({**RACK1, "anti": True}), {**affinity.empty_index(), "adapt": table})
    assert away["c-other"]["affinity"]["score"] == 1.0 and away["b-fast"]["affinity"]["score"] == 0.0
    assert "on this node: base weight" in away["c-other"]["affinity"]["adaptive"][0]["why"]


def test_the_index_keeps_the_adapt_table_through_tentative_placements() -> None:
    index = {**affinity.empty_index(), "adapt": {"figure": "x"}}
    assert affinity.add_to_index(index, "b", "b-0", "n1", "1")["adapt"] == {"figure": "x"}


# -- the placement it moves, and the record --------------------------------------------------------
async def test_the_placement_moves_to_the_faster_node_and_records_why() -> None:
    ir = make_ir(bid="ad", min_instances=1, max_instances=3)
    ir["affinity"] = entries(RACK1)
    cluster = {"id": "c1", "labels": {}}
    alloc = invoker(ir, "resourceAllocator")
    # no metrics: binpack's own order (equal nodes: the first id)
    made = await controller.plan(ir, cluster, three_nodes(), "scale", ["ad-x"], alloc, index=affinity.empty_index())
    assert made[0]["node"] == "a-slow" and made[0]["adaptive"][0]["weight"] == 1.0
    # the block's instance on a-slow answers in 40 ms, the one on b-fast in 10 ms
    table = affinity.adapt({"ad-0": sample("a-slow", 40), "ad-1": sample("b-fast", 10)})
    index = {**affinity.empty_index(), "adapt": table}
    made = await controller.plan(ir, cluster, three_nodes(), "scale", ["ad-y"], alloc, index=index)
    assert made[0]["node"] == "b-fast"
    rec = made[0]["adaptive"][0]
    assert (rec["base"], rec["weight"]) == (1.0, 2.0) and made[0]["adapt"] == table
    out = await controller.dry_run(ir, cluster, three_nodes(), alloc, index)
    assert out.node_scores == {"a-slow": 0.625, "b-fast": 2.0} and out.adapt == table

    # blocks explain folds it from the placement event
    placement = {"block_id": "ad", "gen": 1, "cluster_id": "c1", "action": "scale", "adapt": table,
                 "placements": [{"instance_id": "ad-y", "node_id": "b-fast", "gpus": made[0]["gpus"],
                                 "adaptive": made[0]["adaptive"]}]}
    x = explain([("aios.block.ad.placement", {"data": placement})])
    assert x["adapt"]["nodes"]["b-fast"]["multiplier"] == 2.0
    assert x["instances"]["ad-y"]["adaptive"][0]["weight"] == 2.0
    assert "block median 25 ms" in x["instances"]["ad-y"]["adaptive"][0]["why"]


def test_the_cli_renders_the_adapt_table_and_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    from aios_blocks.cli.main import _adapt_line, _render_explain

    table = affinity.adapt({"s": sample("a-slow", 40), "f": sample("b-fast", 10)})
    line = _adapt_line(table)
    assert "block median 25 ms" in line and "a-slow 40 ms x0.625" in line and "b-fast 10 ms x2" in line
    assert "base weight" in _adapt_line(affinity.adapt({}))
    rec = {"entry": 0, "base": 1.0, "multiplier": 2.0, "weight": 2.0, "why": "w"}
    placement = {"block_id": "ad", "gen": 1, "cluster_id": "c1", "action": "scale",  # (the whole payload, as published)
                 "placements": [{"instance_id": "ad-y", "node_id": "b-fast", "gpus": [], "adaptive": [rec]}], "adapt": table}
    capsys.readouterr()
    _render_explain(explain([("aios.block.ad.placement", {"data": placement})]))
    lines = capsys.readouterr().out.splitlines()
    # the adapt stage's table, then each instance's base and adapted weight with the why
    assert "adaptive affinity (adapt stage): " + line in lines
    assert "  ad-y on b-fast: entry 0 base weight 1 -> adapted 2 (w)" in lines
