"""The FGD-family allocators rank an inventory view's nodes by node state (``capacity.best_fit``'s
``by_state``, ``views.Ranked``): each distinct state scored once per shape, a node ranked by its
state's score and its id's seeded tie. The choices are those of scoring every node (the general
loop every annotated view goes through), over random clusters whose nodes repeat a few states,
as views are replaced, added and removed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.fgd_plus import FgdPlusPolicy
from aios_blocks.policies.builtin.frag import POLICIES, FgdPolicy

#: a workload with whole GPUs, shares and CPU-only tasks (FGD's and fgd-plus's measures use it)
WORKLOAD = [{"cpu": 4, "gpus": 1, "weight": 0.4}, {"cpu": 2, "gpus": 1, "gpuShare": 0.5, "weight": 0.3},
            {"cpu": 8, "gpus": 0, "weight": 0.2}, {"cpu": 4, "gpus": 2, "gpuModels": ["A"], "weight": 0.1}]
RANKED = [uri for uri in POLICIES if uri != "builtin:random"]  # random draws among the fitting nodes: no rank


def _template(rng: random.Random) -> dict[str, Any]:
    model = rng.choice(["A", "B"])
    return {"cpu": rng.choice([8, 16, 32]), "memory": rng.choice([16384, 65536]), "gpus": rng.choice([0, 2, 4, 8]),
            "model": model}


def _view(nid: str, t: dict[str, Any]) -> dict[str, Any]:
    gpus = [{"id": f"{nid}-g{j}", "model": t["model"], "memory": 16384, "memory_free": 16384, "memory_used": 0,
             "instances": 0, "exclusive": False, "share_free": 1000} for j in range(t["gpus"])]
    return {"node_id": nid, "healthy": True, "cpu_free": t["cpu"], "memory_free": t["memory"], "gpus": gpus, "labels": {}}


def _needs(rng: random.Random) -> tuple[dict[str, Any], bool]:
    share = rng.random() < 0.4
    needs: dict[str, Any] = {"gpus": rng.choice([0, 1, 1, 2]), "gpuMemory": 0, "cpu": rng.choice([1, 2, 4]),
                             "memory": rng.choice([512, 2048])}
    if share and needs["gpus"]:
        needs["gpus"], needs["gpuShare"] = 1, rng.choice([0.25, 0.5])
    if rng.random() < 0.2:
        needs["gpuModels"] = ["A"]
    return needs, share


def _annotated(nodes: dict[str, Any]) -> dict[str, Any]:
    return {k: {**v, "affinity": {"pass": True, "score": 0.0}} for k, v in nodes.items()}


@pytest.mark.parametrize("uri", [*RANKED, "builtin:fgd-plus"])
def test_ranking_by_state_picks_what_scoring_every_node_picks(uri: str) -> None:
    cls = FgdPlusPolicy if uri == "builtin:fgd-plus" else POLICIES[uri]
    rng = random.Random(uri)
    picks = 0
    for _ in range(12):
        templates = [_template(rng) for _ in range(3)]  # the nodes repeat a few states
        nodes = capacity.Nodes({f"n{i}": _view(f"n{i}", rng.choice(templates)) for i in range(rng.randint(5, 30))})
        for _step in range(30):
            needs, share = _needs(rng)
            policy = cls("r", {"gpuSharing": share}, {"seed": 3, "workload": WORKLOAD})
            healthy = {k for k, v in nodes.items() if v["healthy"]}
            avoid = {k for k in nodes if rng.random() < 0.1}
            fast = policy._pick(nodes, healthy, needs, avoid, "s")
            assert fast == policy._pick(_annotated(nodes), healthy, needs, avoid, "s")
            if fast is not None:  # place it, as the controller would: the node's view replaced
                picks += 1
                view = capacity.copy_node(nodes[fast[0]])
                capacity.take(view, fast[1], needs, share)
                nodes[fast[0]] = view
            change = rng.random()
            if change < 0.1:
                nid = f"n{rng.randint(0, 40)}"
                nodes[nid] = _view(nid, rng.choice(templates))
            elif change < 0.15 and len(nodes) > 1:
                del nodes[rng.choice(list(nodes))]
            elif change < 0.2:
                nid = rng.choice(list(nodes))
                nodes[nid] = {**nodes[nid], "healthy": not nodes[nid]["healthy"]}
    assert picks > 100  # mostly placed: the comparison is not between two Nones


def test_a_new_shape_scores_each_node_state_once() -> None:
    # 40 nodes in two states (30 of one type, 10 of another, all idle): a shape not seen before is
    # scored twice, not 40 times, then the winner for its GPUs; once a node's view is replaced,
    # its new state alone is scored (then the winner, if another node)
    calls: list[str] = []

    class Counting(FgdPolicy):
        def _score(self, node: Any, usable: Any, needs: Any, units: int, count: int) -> Any:
            calls.append(node["node_id"])
            return super()._score(node, usable, needs, units, count)

    big, small = {"cpu": 32, "memory": 65536, "gpus": 8, "model": "A"}, {"cpu": 8, "memory": 16384, "gpus": 2, "model": "B"}
    nodes = capacity.Nodes({f"n{i}": _view(f"n{i}", big if i < 30 else small) for i in range(40)})
    policy = Counting("r", {"gpuSharing": False}, {"seed": 1, "workload": WORKLOAD})
    needs = {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 1024}
    first = policy._pick(nodes, set(nodes), needs, set(), "s")
    assert first is not None and sorted(calls[:2]) == ["n0", "n30"] and calls[2:] in ([], [first[0]])
    view = capacity.copy_node(nodes[first[0]])
    capacity.take(view, first[1], needs, False)
    nodes[first[0]] = view
    calls.clear()
    second = policy._pick(nodes, set(nodes), needs, set(), "s")
    assert second is not None and calls[0] == first[0] and calls[1:] in ([], [second[0]])
    assert second == policy._pick(_annotated(nodes), set(nodes), needs, set(), "s")


class _Score:
    """A state's score that counts its comparisons (equal scores from different states too)."""

    compared = 0

    def __init__(self, v: float) -> None:
        self.v = v

    def __hash__(self) -> int:
        return hash(self.v)

    def __eq__(self, other: object) -> bool:
        _Score.compared += 1
        return isinstance(other, _Score) and self.v == other.v

    def __lt__(self, other: _Score) -> bool:
        _Score.compared += 1
        return self.v < other.v


def test_a_full_pass_orders_the_nodes_by_state_score_then_tie_without_sorting_every_node() -> None:
    # a shape's first pass over 600 nodes in 6 states (two pairs of them scoring alike): the nodes
    # in the view's tie order (Nodes.tie_order, made once, kept for every shape) bucketed by
    # score, the few scores sorted; the same order as sorting ((score, *tie), id), which compares
    # scores ~n log n times (thousands) where the buckets compare them a few dozen times
    from aios_blocks.policies.views import Ranked, state_id

    rng = random.Random(7)
    templates = [{"cpu": c, "memory": 65536, "gpus": 2, "model": "A"} for c in (4, 8, 12, 16, 20, 24)]
    nodes = capacity.Nodes({f"n{i:03d}": _view(f"n{i:03d}", rng.choice(templates)) for i in range(600)})
    values = {8: 0.5, 12: 0.5, 16: 0.25, 20: 0.75, 24: 0.75}  # cpu 4: does not fit
    by_sid = {state_id(v): values.get(v["cpu_free"]) for v in nodes.values()}

    def fits(v: dict[str, Any]) -> Any:
        return v["gpus"] if v["cpu_free"] > 4 else None

    def score(v: dict[str, Any]) -> _Score:
        return _Score(values[v["cpu_free"]])

    def tie(nid: str) -> tuple[int, str]:
        return (hash(("seed", nid)) % 97, nid)

    index = Ranked(nodes, "fits-t", fits, "rank-t", None, by_state=(score, tie))
    _Score.compared = 0
    index.update()
    assert _Score.compared < 60
    want = sorted(((by_sid[state_id(v)], *tie(nid)), nid) for nid, v in nodes.items() if v["cpu_free"] > 4)
    assert [(r[0].v, *r[1:], nid) for r, nid in index.order] == [(*r, nid) for r, nid in want]
    assert nodes.tie_order(tie) is nodes.tie_order(tie)  # kept while no id is added or removed
    # changes caught up one by one, then a node added: its index and a new one agree with a sort
    nodes["n000"] = _view("n000", templates[3])
    nodes["n600"] = _view("n600", templates[5])
    index.update()
    fresh = Ranked(nodes, "fits-t", fits, "rank-t", None, by_state=(score, tie))
    fresh.update()
    by_sid = {state_id(v): values.get(v["cpu_free"]) for v in nodes.values()}
    want = sorted(((by_sid[state_id(v)], *tie(nid)), nid) for nid, v in nodes.items() if v["cpu_free"] > 4)
    for got in (index, fresh):
        assert [(r[0].v, *r[1:], nid) for r, nid in got.order] == [(*r, nid) for r, nid in want]


def test_a_full_pass_with_scores_no_bucket_can_key_sorts_as_before() -> None:
    # unhashable scores (a list) and a NaN: the plain sort of every node, as before the buckets
    from aios_blocks.policies.views import Ranked

    nodes = capacity.Nodes({f"n{i}": _view(f"n{i}", {"cpu": 8 + i % 3, "memory": 65536, "gpus": 1, "model": "A"})
                            for i in range(30)})
    for make in (lambda c: [c % 2, c], lambda c: float("nan") if c == 9 else float(c)):
        index = Ranked(nodes, ("fits-u", id(make)), lambda v: v["gpus"], "rank-u", None,
                       by_state=(lambda v, make=make: make(v["cpu_free"]), lambda nid: (len(nid), nid)))
        index.update()
        # the old pass: each state's nodes in turn (a NaN's place depends on that order), one sort
        plain = [((make(nodes[nid]["cpu_free"]), len(nid), nid), nid) for members in nodes.states().values()
                 for nid in members]
        plain.sort()
        assert [nid for _r, nid in index.order] == [nid for _r, nid in plain]


def test_a_new_shape_ranks_its_nodes_in_buckets_without_a_tie_per_node() -> None:
    # a shape's full pass puts each state's nodes in its score's bucket (a C-level extend per
    # state), and a pick puts in tie order only the buckets it reads (Nodes.tie_positions, made
    # once per view): no tie computed, no rank tuple built, per node. The old pass built
    # ((score, *tie(id)), id) for every fitting node of every new shape (~450 tie calls each here)
    rng = random.Random(11)
    templates = [{"cpu": c, "memory": 65536, "gpus": 2, "model": "A"} for c in (4, 8, 12, 16)]
    nodes = capacity.Nodes({f"n{i:03d}": _view(f"n{i:03d}", rng.choice(templates)) for i in range(600)})
    ties: list[str] = []

    def tie(nid: str) -> tuple[int, str]:
        ties.append(nid)
        return (hash(("seed", nid)) % 97, nid)

    def fits(v: dict[str, Any]) -> Any:
        return v["gpus"] if v["cpu_free"] > 4 else None

    nodes.tie_order(tie)  # the view's tie order: once, whatever the shape
    ties.clear()
    for shape in range(3):
        got = capacity.best_fit(nodes, set(), ("fits-b", shape), fits, "rank-b", None, 1,
                                by_state=(lambda v, shape=shape: (v["cpu_free"] * (shape + 1)) % 7, tie))
        assert got is not None and ties == [], len(ties)
        want = min((((nodes[n]["cpu_free"] * (shape + 1)) % 7, *tie(n)), n) for n in nodes if nodes[n]["cpu_free"] > 4)[1]
        ties.clear()
        assert got[0] == want


def test_the_buckets_follow_changes_as_a_sort_of_every_node() -> None:
    # views replaced (new states, new scores), added and removed between picks; some buckets
    # walked (in tie order), others not yet: the order and each pick (with nodes skipped and
    # GPU counts) equal a plain sort of every fitting node's ((score, *tie), id)
    rng = random.Random(5)
    buckets: Any = None
    templates = [{"cpu": c, "memory": 65536, "gpus": g, "model": "A"} for c in (4, 8, 12, 16, 20) for g in (1, 2, 4)]
    nodes = capacity.Nodes({f"n{i:03d}": _view(f"n{i:03d}", rng.choice(templates)) for i in range(150)})

    def fits(v: dict[str, Any]) -> Any:
        return v["gpus"] if v["cpu_free"] > 4 else None

    def score(v: dict[str, Any]) -> tuple[int, int]:
        return (v["cpu_free"] % 12, -len(v["gpus"]) // 3)

    def tie(nid: str) -> tuple[int, str]:
        return (hash(("t", nid)) % 13, nid)

    for step in range(200):
        want = sorted(((score(v), *tie(nid)), nid) for nid, v in nodes.items() if fits(v) is not None)
        skip = {nid for nid in nodes if rng.random() < 0.3}
        count = rng.choice([1, 2, 4])
        first = next((nid for _r, nid in want if nid not in skip and len(fits(nodes[nid])) >= count), None)
        got = capacity.best_fit(nodes, skip, "fits-c", fits, "rank-c", None, count, by_state=(score, tie))
        assert (got[0] if got else None) == first, step
        index = nodes._ranked["fits-c", "rank-c"]
        buckets = buckets if step else index.buckets  # the first pass's
        if step % 7 == 0:
            assert index.order == want, step
        for _ in range(rng.randint(1, 6)):
            change = rng.random()
            nid = f"n{rng.randint(0, 170):03d}"
            if change < 0.8:
                nodes[nid] = _view(nid, rng.choice(templates))
            elif nid in nodes:
                del nodes[nid]
    assert buckets is not None and index.buckets is buckets  # caught up change by change: no full pass since
