"""Cluster-level Preferred affinity (seed 002): the gateway's entries carry ``affinity_score`` (the
best score a node of the cluster could get), and ``builtin:cluster-rank`` ranks on it before free
GPUs, in its selection and in post_dry_run. Entries are built by the gateway's own ``filter_rule``
and ``scoped_entry`` over node views; the policy runs in a real ``PolicyRuntime``."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from aios_blocks.handlers import gateway
from aios_blocks.policies import affinity
from aios_blocks.policies.builtin.cluster_rank import ClusterRankPolicy
from aios_blocks.policies.contract import check
from aios_blocks.schemas.affinity import normalize

from .views import free_gpus, invoker, make_ir, node, nodes_of

CLUSTERS = {"big": {"id": "big", "labels": {}}, "small": {"id": "small", "labels": {}}}


def nodes() -> dict[str, dict[str, dict[str, Any]]]:
    """``big`` has four times the free GPUs of ``small`` and the smaller id: every rank but
    affinity favours it."""
    return {
        "big": nodes_of(node("big-n0", "big", free_gpus(8, "big-n0-g")), node("big-n1", "big", free_gpus(8, "big-n1-g"))),
        "small": nodes_of(node("small-n0", "small", free_gpus(2, "small-n0-g")),
                          node("small-n1", "small", free_gpus(2, "small-n1-g"))),
    }


def block(*entries: dict[str, Any]) -> dict[str, Any]:
    ir = make_ir(bid="pref")
    if entries:
        ir["affinity"] = [msgspec.to_builtins(e) for e in normalize(list(entries))]
    return ir


def toward(nid: str, anti: bool = False) -> dict[str, Any]:
    return {"category": "Topology", "strength": "Preferred", "anti": anti, "target": {"type": "NodeId", "value": nid}}


def rank(input_data: dict[str, Any]) -> Any:
    result = ClusterRankPolicy("pref.clusterAllocator", {}, {"maxCandidates": 0}).eval({}, input_data, {})
    check(input_data["action"], result)
    return result


def scored(e: dict[str, Any], score: float) -> dict[str, Any]:
    return {**e, "score_data": {"score": score, "node_info": {}}}


def entries_of(ir: dict[str, Any]) -> dict[str, dict[str, Any]]:
    passed, filtered = gateway.filter_rule(ir, CLUSTERS, nodes(), affinity.empty_index())
    assert filtered == {}
    return {e["cluster_id"]: e for e in passed}


def test_the_filter_rule_scores_each_cluster_by_its_best_node() -> None:
    e = entries_of(block(toward("small-n1")))
    assert e["small"]["metrics"]["affinity_score"] == 1.0 and e["big"]["metrics"]["affinity_score"] == 0.0
    assert e["big"]["metrics"]["gpus_free"] > e["small"]["metrics"]["gpus_free"]
    # no entries: no score at all (the policy reads 0)
    assert "affinity_score" not in entries_of(block())["big"]["metrics"]


def test_scoped_entry_carries_the_same_score_as_the_filter_rule() -> None:
    """What post_dry_run is given (the gather's entries, rebuilt when it decides) ranks as the
    selection did; without the score, more free GPUs won over the preference."""
    ir = block(toward("small-n1"))
    from_filter = entries_of(ir)
    for cid in CLUSTERS:
        got = gateway.scoped_entry(ir, CLUSTERS[cid], nodes()[cid], affinity.empty_index())
        assert got == from_filter[cid]
    assert "affinity_score" not in gateway.scoped_entry(block(), CLUSTERS["big"], nodes()["big"])["metrics"]


def test_selection_puts_the_preferred_cluster_first_despite_fewer_free_gpus() -> None:
    e = entries_of(block(toward("small-n1")))
    for perm in itertools.permutations(e.values()):
        assert [c["cluster_id"] for c in rank({"action": "selection", "filter_result": list(perm)})["clusters"]] == ["small", "big"]
    # without the preference, free GPUs decide
    plain = entries_of(block())
    assert [c["cluster_id"] for c in rank({"action": "selection", "filter_result": list(plain.values())})["clusters"]] == ["big", "small"]


def test_selection_orders_by_affinity_score_then_free_gpus() -> None:
    e = entries_of(block(toward("small-n1")))
    low = {**e["big"], "cluster_id": "low", "id": "low", "metrics": {**e["big"]["metrics"], "affinity_score": 0.5}}
    out = rank({"action": "selection", "filter_result": [e["big"], low, e["small"]]})
    assert [c["cluster_id"] for c in out["clusters"]] == ["small", "low", "big"]


def test_post_dry_run_tie_on_score_goes_to_the_higher_affinity_score() -> None:
    e = entries_of(block(toward("small-n1")))
    for perm in itertools.permutations([scored(e["big"], 1.0), scored(e["small"], 1.0)]):
        assert rank({"action": "post_dry_run", "clusters": list(perm)})["cluster_id"] == "small"


def test_post_dry_run_feasibility_score_still_comes_before_affinity() -> None:
    e = entries_of(block(toward("small-n1")))
    out = rank({"action": "post_dry_run", "clusters": [scored(e["big"], 1.0), scored(e["small"], 0.5)]})
    assert out["cluster_id"] == "big"


def test_anti_affinity_scores_the_avoided_node_lower() -> None:
    e = entries_of(block(toward("big-n0", anti=True), toward("big-n1", anti=True)))
    assert e["big"]["metrics"]["affinity_score"] < e["small"]["metrics"]["affinity_score"]
    for perm in itertools.permutations([scored(e["big"], 1.0), scored(e["small"], 1.0)]):
        assert rank({"action": "post_dry_run", "clusters": list(perm)})["cluster_id"] == "small"


async def test_the_gateway_chooses_the_preferred_cluster_through_the_builtin_policy() -> None:
    """select -> choose, as the gateway worker runs them (entries rebuilt by ``scoped_entry`` for
    post_dry_run), with builtin:cluster-rank in a real PolicyRuntime."""
    ir = block(toward("small-n1"))
    invoke = invoker(ir, "clusterAllocator")
    sel = await gateway.select(ir, CLUSTERS, nodes(), invoke, affinity.empty_index())
    assert sel.candidates == ["small", "big"]
    entries = {cid: gateway.scoped_entry(ir, CLUSTERS[cid], nodes()[cid], affinity.empty_index()) for cid in sel.candidates}
    results = {cid: {"score": 1.0, "node_info": {}} for cid in sel.candidates}
    decision = await gateway.choose(sel.candidates, results, entries, invoke)
    assert decision.failure == "" and decision.cluster_id == "small"
    # the same round without the preference goes to the cluster with more free GPUs
    plain = block()
    sel = await gateway.select(plain, CLUSTERS, nodes(), invoker(plain, "clusterAllocator"))
    entries = {cid: gateway.scoped_entry(plain, CLUSTERS[cid], nodes()[cid]) for cid in sel.candidates}
    decision = await gateway.choose(sel.candidates, results, entries, invoker(plain, "clusterAllocator"))
    assert decision.cluster_id == "big"
