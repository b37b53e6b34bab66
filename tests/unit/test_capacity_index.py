"""The incremental count of nodes that fit a shape equals a full scan, as views are replaced,
added and removed; the gateway's filter uses it and gives the same answers as before."""

from __future__ import annotations

import random
from typing import Any

import pytest

from aios_blocks.policies import capacity


def node(rng: random.Random, i: int) -> dict[str, Any]:
    gpus = [
        {"id": f"n{i}-g{g}", "memory": 80, "memory_free": rng.choice([0, 40, 80]), "memory_used": 0,
         "instances": rng.choice([0, 0, 1]), "exclusive": rng.random() < 0.2}
        for g in range(rng.randint(0, 4))
    ]
    return {"id": f"n{i}", "healthy": rng.random() > 0.1, "cpu_free": rng.choice([0, 2, 8]), "memory_free": rng.choice([0, 1024, 8192]),
            "gpus": gpus}


def brute(nodes: dict[str, dict[str, Any]], needs: dict[str, Any], share: bool) -> int:
    return sum(1 for v in nodes.values() if capacity.node_fits(v, needs, share) is not None)


@pytest.mark.parametrize("kind", [dict, capacity.Nodes])
def test_the_incremental_count_and_totals_equal_a_full_scan_under_changes(kind: type) -> None:
    """Plain dicts are caught up by an identity scan; ``Nodes`` (the inventory's) by its change log,
    compactions included."""
    rng = random.Random(7)
    nodes = kind({f"n{i}": node(rng, i) for i in range(60)})
    shapes = [({"gpus": 1, "cpu": 1, "memory": 1024}, False), ({"gpus": 2, "gpuMemory": 40}, True), ({"cpu": 4}, False)]
    for step in range(3000):
        if step % 7 == 0:
            for needs, share in shapes:
                assert capacity.fitting(nodes, needs, share) == brute(nodes, needs, share), step
            assert capacity.totals(nodes) == brute_totals(nodes), step
        i = rng.randrange(80)
        op = rng.random()
        if op < 0.7:
            nodes[f"n{i}"] = node(rng, i)  # a refreshed view (replaced, never edited)
        elif op < 0.85:
            nodes.pop(f"n{i}", None)
        elif f"n{i}" in nodes:
            del nodes[f"n{i}"]
    if kind is capacity.Nodes:
        assert nodes.version > 2000 and nodes.changed_since(0) is None  # compacted along the way


def test_a_fork_shares_the_totals_and_keeps_them_right_as_it_changes() -> None:
    rng = random.Random(11)
    nodes = capacity.Nodes({f"n{i}": node(rng, i) for i in range(40)})
    capacity.totals(nodes)
    work = capacity.fork(nodes)
    for i in range(10):
        work[f"n{i}"] = node(rng, i)
    assert capacity.totals(work) == brute_totals(work) and capacity.totals(nodes) == brute_totals(nodes)


def brute_totals(nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return capacity.totals(dict(nodes))  # a fresh plain dict: a full scan


def test_the_filter_judges_capacity_without_a_node_scan_and_with_the_same_answer() -> None:
    from aios_blocks.handlers.gateway import filter_rule

    rng = random.Random(3)
    full = {f"n{i}": {**node(rng, i), "gpus": [{"id": "g", "memory": 80, "memory_free": 0, "memory_used": 80, "instances": 1,
                                                  "exclusive": True}]} for i in range(5)}
    roomy = {"m0": {"id": "m0", "healthy": True, "cpu_free": 8, "memory_free": 8192,
                    "gpus": [{"id": "g", "memory": 80, "memory_free": 80, "memory_used": 0, "instances": 0, "exclusive": False}]}}
    ir = {"blockId": "b", "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
          "policies": {"clusterAllocator": {"policyRuleURI": "builtin:cluster-rank", "settings": {}}}}
    passed, filtered = filter_rule(ir, {"full": {"id": "full"}, "roomy": {"id": "roomy"}}, {"full": full, "roomy": roomy})
    assert [e["id"] for e in passed] == ["roomy"]
    assert filtered == {"full": "no healthy node with capacity for one instance (5 nodes)"}


def test_node_views_pickle_and_copy_as_their_items() -> None:
    """A sandboxed policy's input is pickled; a small cluster's input holds the inventory's views."""
    import copy
    import pickle

    import msgspec

    nodes = capacity.Nodes({"n1": {"id": "n1"}})
    nodes["n2"] = {"id": "n2"}
    for other in (pickle.loads(pickle.dumps(nodes)), copy.deepcopy(nodes), copy.copy(nodes)):
        assert isinstance(other, capacity.Nodes) and other == nodes
        other["n3"] = {"id": "n3"}  # usable: its own log
        assert "n3" not in nodes
    assert msgspec.json.decode(msgspec.json.encode(nodes)) == {"n1": {"id": "n1"}, "n2": {"id": "n2"}}


def test_the_cached_id_order_equals_the_dicts_under_changes() -> None:
    """``Nodes.ids()``/``positions()`` (what sampling walks instead of copying every id) stay
    ``list(nodes)`` as views are replaced (same place), added, removed, popped and merged."""
    rng = random.Random(5)
    nodes = capacity.Nodes({f"n{i}": node(rng, i) for i in range(50)})
    for step in range(2000):
        if step % 5 == 0:
            assert nodes.ids() == list(nodes), step
            assert nodes.positions() == {nid: i for i, nid in enumerate(nodes)}, step
            assert capacity.node_ids(nodes) == list(nodes)
        i = rng.randrange(70)
        op = rng.random()
        if op < 0.6:
            nodes[f"n{i}"] = node(rng, i)
        elif op < 0.75:
            nodes.pop(f"n{i}", None)
        elif op < 0.85:
            if f"n{i}" in nodes:
                del nodes[f"n{i}"]
        elif op < 0.9:
            nodes |= {f"n{i}": node(rng, i)}
        elif op < 0.95:
            nodes.setdefault(f"n{i}", node(rng, i))
        elif nodes:
            nodes.popitem()
    nodes.clear()
    assert nodes.ids() == [] and capacity.node_ids({"a": {}}) == ["a"]
