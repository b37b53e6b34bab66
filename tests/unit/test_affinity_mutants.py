"""Affinity at scheduling time, each rule asserted on its own (the mutation run, ``make mutate``,
found the target matching, the reasons' words and the adapt table's edges unasserted): which
node each target type matches, what the annotation says, why a Required entry cannot be met."""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest

from aios_blocks.policies import affinity as af
from aios_blocks.schemas.affinity import AIOS_NAMESPACE


def e(strength: str, tt: str, target: str, anti: bool = False, category: str = "Topology") -> dict[str, Any]:
    return {"category": category, "strength": strength, "anti": anti, "target_type": tt, "target": target}


def node(nid: str, rack: str | None = None, trust: str | None = None, gpus: tuple[str, ...] = ("g0", "g1")) -> dict[str, Any]:
    labels = {k: v for k, v in (("rack", rack), ("trust-domain", trust)) if v is not None}
    return {"node_id": nid, "labels": labels, "gpus": [{"id": g} for g in gpus]}


def annotated(nodes: list[dict[str, Any]], entries: list[dict[str, Any]], index: af.Index | None = None) -> dict[str, Any]:
    views = {n["node_id"]: n for n in nodes}
    af.annotate(views, entries, index or af.empty_index())
    return {nid: v["affinity"] for nid, v in views.items()}


def test_uid_is_the_uuid5_of_a_name_and_a_uuid_stays_itself() -> None:
    assert af.uid("n1") == str(uuid.uuid5(AIOS_NAMESPACE, "n1"))
    some = "0b4c7e4e-3f8e-4a43-9f35-2a8d2f3c9a10"
    assert af.uid(some) == some
    assert af.uid("x" * 40) == str(uuid.uuid5(AIOS_NAMESPACE, "x" * 40))


def test_each_target_type_matches_its_own_thing() -> None:
    nodes = [node("n1", rack="1", trust="blue"), node("n2", rack="2", trust="red", gpus=("g7",))]
    index = af.add_to_index(af.empty_index(), "other-block", "other-block-0", "n2", "2")
    cases = [
        (e("Preferred", "NodeId", af.uid("n1")), {"n1"}),
        (e("Preferred", "ResourceId", af.uid("g7"), category="Resource"), {"n2"}),
        (e("Preferred", "LeaseId", af.uid("other-block-0")), {"n2"}),
        (e("Preferred", "ServiceId", af.uid("other-block")), {"n2"}),
        (e("Preferred", "RackId", "1"), {"n1"}),
        (e("Preferred", "TrustDomain", "red", category="Trust"), {"n2"}),
        (e("Preferred", "GpuModel", "x"), set()),  # a target type it does not know matches nothing
    ]
    for entry, want in cases:
        got = annotated([dict(n) for n in nodes], [entry], index)
        assert {nid for nid, a in got.items() if a["score"] == af.PREFERRED_WEIGHT} == want, entry["target_type"]
        assert all(a["score"] == 0.0 for nid, a in got.items() if nid not in want)


def test_a_block_is_near_another_on_its_rack_or_on_its_node_when_the_node_has_no_rack() -> None:
    index = af.add_to_index(af.empty_index(), "svc", "svc-0", "n5", "4")
    entry = e("Preferred", "ServiceId", af.uid("svc"))
    got = annotated([node("same-rack", rack="4"), node("n5"), node("other", rack="9"), node("n6")], [entry], index)
    assert {nid: a["score"] for nid, a in got.items()} == {"same-rack": 1.0, "n5": 1.0, "other": 0.0, "n6": 0.0}


def test_the_annotation_of_required_preferred_and_anti_entries() -> None:
    entries = [
        e("Required", "RackId", "1"),
        e("Required", "ResourceId", af.uid("g1"), category="Resource"),
        e("Preferred", "ResourceId", af.uid("g0"), anti=True, category="Resource"),
        e("Preferred", "NodeId", af.uid("n2"), anti=True),
    ]
    got = annotated([node("n1", rack="1"), node("n2", rack="2")], entries)
    assert got["n1"] == {"pass": True, "score": 1.0, "reasons": [], "require_gpus": ["g1"], "prefer_gpus": ["g1"],
                         "avoid_gpus": ["g0"]}
    assert got["n2"] == {"pass": False, "score": 0.0, "reasons": ["rejected by entry 0: Required toward rack 1"],
                         "require_gpus": ["g1"], "prefer_gpus": ["g1"], "avoid_gpus": ["g0"]}
    # Required away from a GPU: it is avoided, not required
    got = annotated([node("n1")], [e("Required", "ResourceId", af.uid("g0"), anti=True, category="Resource")])
    assert got["n1"]["pass"] is False and got["n1"]["require_gpus"] == [] and got["n1"]["avoid_gpus"] == ["g0"]
    assert got["n1"]["reasons"] == [f"rejected by entry 0: Required away from ResourceId {af.uid('g0')}"]


def test_describe_says_strength_direction_and_target() -> None:
    assert af.describe(e("Required", "RackId", "3")) == "Required toward rack 3"
    assert af.describe(e("Preferred", "TrustDomain", "blue", anti=True)) == "Preferred away from trust domain blue"
    assert af.describe(e("Adaptive", "NodeId", "u-1")) == "Adaptive toward NodeId u-1"


def test_unsatisfiable_counts_what_each_required_entry_eliminated() -> None:
    nodes = {n["node_id"]: n for n in (node("n1", rack="1"), node("n2", rack="2"), node("n3", rack="2"))}
    index = af.add_to_index(af.empty_index(), "svc", "svc-0", "n1", "1")
    entries = [e("Required", "RackId", "2"), e("Preferred", "RackId", "1"),
               e("Required", "ServiceId", af.uid("svc"), anti=True)]
    assert af.eliminated(nodes, entries, index) == {0: 1, 2: 1}
    assert af.unsatisfiable(nodes, entries, index) == (
        "RequiredAffinityUnsatisfiable: entry 0 (Required toward rack 2) eliminated 1 of 3 nodes; "
        f"entry 2 (Required away from ServiceId {af.uid('svc')}) eliminated 1 of 3 nodes")


def test_referenced_and_has_adaptive() -> None:
    entries = [e("Required", "ServiceId", "s1"), e("Preferred", "LeaseId", "l1"), e("Preferred", "RackId", "1"),
               e("Preferred", "ServiceId", "s2")]
    assert af.referenced(entries) == (["s1", "s2"], ["l1"])
    assert af.has_adaptive(entries) is False
    assert af.has_adaptive([*entries, e("Adaptive", "RackId", "1")]) is True


def test_add_to_index_copies_and_appends() -> None:
    first = af.add_to_index(af.empty_index(), "b", "b-0", "n1", "1")
    second = af.add_to_index(first, "b", "b-1", "n2", "2")
    assert first == {"services": {af.uid("b"): [["n1", "1"]]}, "leases": {af.uid("b-0"): "n1"}}
    assert second == {"services": {af.uid("b"): [["n1", "1"], ["n2", "2"]]},
                      "leases": {af.uid("b-0"): "n1", af.uid("b-1"): "n2"}}


def s(node_id: str, p50: Any = None, dispatch: Any = None) -> dict[str, Any]:
    return {"node": node_id, "latency_p50_ms": p50, "dispatch_p50_ms": dispatch}


def test_adapt_edges_zero_is_a_figure_rounding_and_instances_without_one() -> None:
    # an instance without the figure does not end the table: the next one still counts
    t = af.adapt({"a": s("n0", dispatch=5), "b": s("n1", 0.5), "c": s("n2", 1.2345678), "d": s("n3", 0)})
    assert t["figure"] == "latency_p50_ms"
    assert set(t["nodes"]) == {"n1", "n2", "n3"}  # n0 reports no latency
    assert t["block_median_ms"] == 0.5 and t["nodes"]["n2"]["p50_ms"] == 1.235
    assert t["nodes"]["n3"] == {"p50_ms": 0.0, "instances": 1, "multiplier": 2.0}  # answers at once: the top weight
    assert t["nodes"]["n2"]["multiplier"] == 0.5  # 0.405, bounded
    t = af.adapt({"a": s("n1", 3), "b": s("n1", 1), "c": s("n2", 0.7)})  # median of an even count
    assert t["block_median_ms"] == 1.0 and t["nodes"]["n1"]["p50_ms"] == 2.0 and t["nodes"]["n2"]["multiplier"] == 1.429
    for junk in (True, -1, math.nan, "5"):
        assert af.adapt({"a": s("n1", junk)}) == {"figure": "", "block_median_ms": None, "bounds": [0.5, 2.0], "nodes": {}}


def test_adapted_weight_says_why() -> None:
    assert af.adapted_weight("n1", None) == (1.0, 1.0, "no live metrics for the block yet: base weight")
    t = af.adapt({"a": s("n1", 10), "b": s("n2", 40), "c": s("n3", 20)})
    assert af.adapted_weight("n9", t) == (1.0, 1.0, "no latency_p50_ms of the block's instances on this node: base weight")
    assert af.adapted_weight("n1", t) == (
        2.0, 2.0, "latency_p50_ms 10 ms here (1 instance(s)) vs block median 20 ms: x2 (bounded)")
    assert af.adapted_weight("n2", t) == (
        0.5, 0.5, "latency_p50_ms 40 ms here (1 instance(s)) vs block median 20 ms: x0.5 (bounded)")
    t = af.adapt({"a": s("n1", 30), "b": s("n2", 20), "c": s("n3", 10)})
    assert af.adapted_weight("n1", t) == (0.667, 0.667, "latency_p50_ms 30 ms here (1 instance(s)) vs block median 20 ms: x0.667")


@pytest.mark.parametrize("anti", [False, True])
def test_an_adaptive_entry_the_node_does_not_satisfy_weighs_nothing(anti: bool) -> None:
    got = annotated([node("n1", rack="1")], [e("Adaptive", "RackId", "2" if not anti else "1", anti=anti)])
    assert got["n1"]["score"] == 0.0
    assert got["n1"]["adaptive"] == [{"entry": 0, "base": 1.0, "multiplier": 0.0, "weight": 0.0,
                                      "why": "the node does not satisfy the entry"}]


def test_entries_add_up() -> None:
    entries = [
        e("Required", "ResourceId", af.uid("g0"), category="Resource"),
        e("Required", "ResourceId", af.uid("g1"), category="Resource"),
        e("Preferred", "RackId", "1"),
        e("Preferred", "NodeId", af.uid("n1")),
        e("Adaptive", "RackId", "1"),
        e("Adaptive", "NodeId", af.uid("n1")),
    ]
    [a] = annotated([node("n1", rack="1")], entries).values()
    assert a["pass"] is True and a["require_gpus"] == ["g0", "g1"] and a["score"] == 4.0  # 2 Preferred + 2 Adaptive x1


def test_a_view_without_labels_and_a_service_nobody_runs_match_nothing() -> None:
    bare = {"node_id": "n1", "gpus": []}
    got = annotated([bare], [e("Preferred", "RackId", "1"), e("Preferred", "TrustDomain", "x", category="Trust"),
                             e("Preferred", "ServiceId", af.uid("nobody"))])
    assert got["n1"]["score"] == 0.0


def test_the_block_median_is_rounded_to_the_microsecond() -> None:
    t = af.adapt({"a": s("n1", 1.23456)})
    assert t["block_median_ms"] == 1.235 and t["nodes"]["n1"]["p50_ms"] == 1.235
