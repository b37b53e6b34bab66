"""The incremental count of nodes that fit a shape equals a full scan, as views are replaced,
added and removed; the gateway's filter uses it and gives the same answers as before."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from aios_blocks.handlers import controller
from aios_blocks.policies import capacity, sampling

from .views import make_ir


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


def test_fit_index_lists_the_fitting_ids_under_changes() -> None:
    rng = random.Random(3)
    nodes = capacity.Nodes({f"n{i}": node(rng, i) for i in range(60)})
    needs, share = {"gpus": 1, "cpu": 1, "memory": 1024}, False
    for step in range(1500):
        if step % 5 == 0:
            idx = capacity.fit_index(nodes, needs, share)
            want = {nid for nid, v in nodes.items() if capacity.node_fits(v, needs, share) is not None}
            assert idx.ids == want and idx.count == len(want), step
            assert all(idx.fits(nid) == (nid in want) for nid in nodes)
        i = rng.randrange(80)
        if rng.random() < 0.8:
            nodes[f"n{i}"] = node(rng, i)
        else:
            nodes.pop(f"n{i}", None)


def test_memos_live_on_the_inventory_view_for_any_number_of_clusters() -> None:
    """No shared cap: 200 clusters each keep their index (a global memo of 64 thrashed)."""
    rng = random.Random(9)
    clusters = [capacity.Nodes({f"c{c}n{i}": node(rng, i) for i in range(5)}) for c in range(200)]
    needs = {"gpus": 1}
    for nodes in clusters:
        capacity.totals(nodes), capacity.fitting(nodes, needs, False)
    for nodes in clusters:
        memo = nodes._totals
        assert memo is not None and memo.seen == nodes.version
        assert capacity.fit_index(nodes, needs, False) is nodes._fits[capacity.shape(needs, False)]
        assert capacity.totals(nodes) == brute_totals(nodes)


def _sample_fields(s: sampling.Sample) -> tuple[Any, ...]:
    return (list(s.nodes), [id(v) for v in s.nodes.values()], s.total, s.visited, s.feasible, s.affinity_pass,
            s.sampled, s.seed, s.limit, s.unsatisfiable)


@pytest.mark.parametrize("density", [0.0, 0.003, 0.02, 0.1, 0.5, 1.0])
def test_the_indexed_sample_equals_the_walk_over_every_node_under_changes(density: float) -> None:
    """A block without affinity on an inventory view is sampled from the capacity index: the same
    nodes, in the same order, with the same counts as the walk over the views (a plain dict),
    whether fitting nodes are absent, rare (ordered by visit position) or dense (walked)."""
    rng = random.Random(int(density * 1000) + 1)
    needs, share = {"gpus": 1, "cpu": 1, "memory": 1024}, False

    def view(i: int) -> dict[str, Any]:
        fits = rng.random() < density
        gpus = [{"id": f"n{i}-g{g}", "memory": 80, "memory_free": 80, "memory_used": 0,
                 "instances": 0 if fits else 1, "exclusive": not fits} for g in range(2)]
        return {"id": f"n{i}", "healthy": True, "cpu_free": 8, "memory_free": 8192, "gpus": gpus}

    nodes = capacity.Nodes({f"n{i}": view(i) for i in range(700)})
    for step in range(60):
        for want in (1, 3, 40):
            seed = f"blk-{step}-{want}"
            got = sampling.sample(nodes, needs, share, seed, threshold=100, want=want)
            ref = sampling.sample(dict(nodes), needs, share, seed, threshold=100, want=want)
            assert _sample_fields(got) == _sample_fields(ref), (step, want)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(760)
            op = rng.random()
            if op < 0.8:
                nodes[f"n{i}"] = view(i)
            elif op < 0.9:
                nodes.pop(f"n{i}", None)
            else:  # a view changed by a tentative placement (replaced by a taken copy)
                nid = rng.choice(nodes.ids())
                taken = capacity.copy_node(nodes[nid])
                capacity.take(taken, [g["id"] for g in taken["gpus"][:1]], needs, share)
                nodes[nid] = taken


def test_payloads_from_an_inventory_view_and_a_plain_dict_encode_the_same() -> None:
    """The policy input is a function of the state: the indexed path gives the bytes the walk does."""
    rng = random.Random(21)
    nodes = capacity.Nodes({f"n{i:04d}": node(rng, i) for i in range(400)})
    for i, v in nodes.items():
        v["labels"] = {"rack": str(int(i[1:]) % 4)}
        for g in v["gpus"]:
            g.setdefault("model", "sim")
    for b in range(30):
        ir = make_ir(bid=f"blk-{b}", max_instances=1 + b % 4, resources={"gpus": 1, "cpu": 1, "memory": 1024})
        a = controller.payload(ir, {"id": "c", "labels": {}}, nodes)
        p = controller.payload(ir, {"id": "c", "labels": {}}, dict(nodes))
        assert a["cluster_metrics"].get("sample") and msgspec.json.encode(a) == msgspec.json.encode(p), b


async def test_a_gang_plans_the_same_on_an_inventory_view_and_a_plain_dict_and_keeps_the_index() -> None:
    """``plan`` forks the view with its capacity index (built on the source, which keeps it for
    the next placement) and chooses what it chooses on a plain dict, instance by instance."""
    from aios_blocks.policies.builtin.resource import BinPackPolicy

    rng = random.Random(4)
    nodes = capacity.Nodes({f"n{i:04d}": node(rng, i) for i in range(300)})
    for i, v in nodes.items():
        v["labels"] = {"rack": str(int(i[1:]) % 4)}
    plain = dict(nodes)

    async def invoke(data: dict[str, Any]) -> Any:
        return BinPackPolicy("p", {}, {}).eval({}, data, {})

    for b in range(6):
        ir = make_ir(bid=f"g{b}", min_instances=3, max_instances=3, resources={"gpus": 1, "cpu": 1, "memory": 1024})
        iids = [controller.instance_id(ir["blockId"], k) for k in range(3)]
        got = await controller.plan(ir, {"id": "c", "labels": {}}, nodes, "allocation", iids, invoke)
        ref = await controller.plan(ir, {"id": "c", "labels": {}}, plain, "allocation", iids, invoke)
        assert got == ref, b
        shape = capacity.shape(ir["resources"], False)
        assert shape in nodes._fits and nodes._fits[shape].seen == nodes.version


def test_the_filter_over_many_clusters_judges_no_node_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each inventory view keeps its own index: with 100 clusters the gateway's filter for the next
    block reads counters (a shared memo of 64 clusters was cleared and rebuilt every block), and
    only a replaced view is judged again (``capacity.any_fits``: a node judged once per view); the
    reasons recorded are the same."""
    from aios_blocks.handlers.gateway import filter_rule

    rng = random.Random(8)
    clusters = {f"c{c:03d}": {"id": f"c{c:03d}"} for c in range(100)}
    nodes = {cid: capacity.Nodes({f"{cid}n{i}": node(rng, i) for i in range(8)}) for cid in clusters}
    ir = {"blockId": "b", "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
          "policies": {"clusterAllocator": {"policyRuleURI": "builtin:cluster-rank", "settings": {}}}}
    first = filter_rule(ir, clusters, nodes)
    judged = []
    real, real_totals = capacity.node_fits, capacity.node_totals
    monkeypatch.setattr(capacity, "node_fits", lambda n, needs, share: judged.append(n["id"]) or real(n, needs, share))
    monkeypatch.setattr(capacity, "node_totals", lambda n: judged.append("totals:" + n["id"]) or real_totals(n))
    assert filter_rule(ir, clusters, nodes) == first and judged == []
    nodes["c007"]["c007n3"] = node(rng, 3)
    again = filter_rule(ir, clusters, nodes)
    # only the replaced view, if at all (the filter asks whether some node fits: another may still)
    assert "totals:n3" in judged and set(judged) <= {"n3", "totals:n3"}
    assert again == filter_rule(ir, clusters, {cid: dict(v) for cid, v in nodes.items()})  # = a full scan


@pytest.mark.parametrize("seed", range(6))
def test_any_fits_answers_as_the_full_index_without_building_it(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's capacity check (``capacity.any_fits``) equals ``fitting(...) > 0`` on seeded
    random clusters of every density (full ones included) as views are replaced and removed; for a
    shape not indexed yet it judges nodes only until one fits, and a cluster where none fits
    keeps the index so the next ask reads its count."""
    rng = random.Random(seed)
    density = [0.0, 0.02, 0.3, 1.0][seed % 4]

    def view(i: int) -> dict[str, Any]:
        v = node(rng, i)
        return v if rng.random() < density else {**v, "healthy": False}

    nodes = capacity.Nodes({f"n{i}": view(i) for i in range(200)})
    shapes = [({"gpus": 1, "cpu": 1, "memory": 1024}, False), ({"gpus": 2, "gpuMemory": 40}, True), ({"cpu": 4}, False),
              ({"gpus": 1, "gpuMemory": 40, "gpuShare": 0.3}, True)]
    judged: list[str] = []
    real = capacity.node_fits
    monkeypatch.setattr(capacity, "node_fits", lambda n, needs, share: judged.append(n["id"]) or real(n, needs, share))
    for step in range(300):
        needs, share = shapes[step % len(shapes)]
        indexed = capacity.shape(needs, share) in nodes._fits
        judged.clear()
        got = capacity.any_fits(nodes, needs, share)
        seen = list(judged)
        assert got == (brute(nodes, needs, share) > 0), step
        assert len(set(seen)) == len(seen)  # no node judged twice in one ask
        if got and not indexed:  # judged up to the first fitting node after the witness, never more
            assert [nid for nid in seen if real(nodes[nid], needs, share) is not None] in ([], seen[-1:]), step
            assert capacity.shape(needs, share) not in nodes._fits
        if not got:  # none fits: the shape is indexed now, and its count is right
            assert capacity.fit_index(nodes, needs, share).count == 0
        i = rng.randrange(220)
        if rng.random() < 0.9:
            nodes[f"n{i}"] = view(i)
        else:
            nodes.pop(f"n{i}", None)
    assert capacity.any_fits(capacity.Nodes(), {"cpu": 1}, False) is False


def test_any_fits_on_a_new_shape_stops_at_the_first_fitting_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large cluster where every node fits: a new shape judges one node, not all of them, and
    the next ask judges none (the witness's verdict is memoised with its view)."""
    roomy = {"healthy": True, "cpu_free": 8, "memory_free": 8192,
             "gpus": [{"id": "g", "memory": 80, "memory_free": 80, "memory_used": 0, "instances": 0, "exclusive": False}]}
    nodes = capacity.Nodes({f"n{i}": {**roomy, "id": f"n{i}"} for i in range(1000)})
    judged: list[str] = []
    real = capacity.node_fits
    monkeypatch.setattr(capacity, "node_fits", lambda n, needs, share: judged.append(n["id"]) or real(n, needs, share))
    needs = {"gpus": 1, "cpu": 1, "memory": 1024}
    assert capacity.any_fits(nodes, needs, False) and judged == ["n0"]
    assert capacity.any_fits(nodes, needs, False) and judged == ["n0"]
    nodes["n0"] = {**roomy, "id": "n0", "cpu_free": 0}  # the witness is full now: the scan goes on from it
    assert capacity.any_fits(nodes, needs, False) and judged == ["n0", "n0", "n1"]


_SCAN = capacity._usable  # (the real one: the tests below count calls of the module's)


def _fresh_fits(node: dict[str, Any], needs: dict[str, Any], share: bool) -> list[dict[str, Any]] | None:
    """``node_fits`` computed afresh (no memo): the same checks, GPUs scanned every call."""
    if not node.get("healthy", True) or node["cpu_free"] + 1e-9 < needs.get("cpu", 0) or node["memory_free"] < needs.get("memory", 0):
        return None
    models = needs.get("gpuModels")
    units = capacity.share_units(needs) if share else 0
    usable = _SCAN(node, needs.get("gpuMemory", 0), share, units, models)
    return None if len(usable) < needs.get("gpus", 0) else usable


@pytest.mark.parametrize("seed", range(4))
def test_usable_gpus_are_kept_per_view_and_equal_a_fresh_scan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new task shape that differs from a known one in CPUs, memory or GPU count reads each
    view's usable GPUs from the memo (no GPU scanned again); the answers equal a fresh scan on
    seeded random views, also after ``take`` changed a view in place."""
    rng = random.Random(seed)
    views = [{**node(rng, i), "gpus": [{**g, "model": rng.choice(["A", "B"]), "share_free": rng.choice([0, 300, 1000])}
                                        for g in node(rng, i)["gpus"]]} for i in range(80)]
    scans: list[str] = []
    real = capacity._usable
    monkeypatch.setattr(capacity, "_usable", lambda n, *a: scans.append(n["id"]) or real(n, *a))
    base = [({"gpuMemory": 40}, True), ({"gpuMemory": 40, "gpuShare": 0.3}, True), ({}, False),
            ({"gpuModels": ["B"]}, False)]
    for gpu_needs, share in base:
        for v in views:
            capacity.node_fits(v, {"gpus": 1, **gpu_needs}, share)
        scans.clear()
        for cpu, memory, gpus in [(0, 0, 1), (1, 1024, 2), (2, 0, 0), (0, 8192, 3)]:
            needs = {"gpus": gpus, "cpu": cpu, "memory": memory, **gpu_needs}
            for v in views:
                assert capacity.node_fits(v, needs, share) == _fresh_fits(v, needs, share)
        assert scans == []  # the GPUs of no view scanned again for these shapes
    for v in views[:20]:  # changed in place: the memo of the view is dropped, the answer follows
        usable = capacity.node_fits(v, {"gpus": 1}, False)
        if usable:
            capacity.take(v, [usable[0]["id"]], {"gpus": 1}, False)
        for gpu_needs, share in base:
            needs = {"gpus": 1, **gpu_needs}
            assert capacity.node_fits(v, needs, share) == _fresh_fits(v, needs, share)


@pytest.mark.parametrize("policy", ["fgd-plus", "fgd"])
def test_the_trace_sample_is_placed_the_same_without_the_usable_gpus_memo(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of the trace sample goes to the same node and GPUs when each node's usable
    GPUs are scanned afresh for every shape (``usable_gpus`` not memoised)."""
    import asyncio
    from pathlib import Path

    from aios_blocks.trace.inventory import load_nodes
    from aios_blocks.trace.replay import replay
    from aios_blocks.trace.workload import load_tasks

    data = Path(__file__).parent / "data" / "trace"
    nodes, tasks = load_nodes(data / "nodes.csv", "s"), load_tasks(data / "pods.csv")
    fast = asyncio.run(replay(nodes, tasks, policy, seed=42))
    monkeypatch.setattr(capacity, "usable_gpus", lambda n, needs, share: capacity._usable(
        n, needs.get("gpuMemory", 0), share, capacity.share_units(needs) if share else 0, needs.get("gpuModels")))
    slow = asyncio.run(replay(nodes, tasks, policy, seed=42))
    assert len(fast.placements) > 50 and fast.placements == slow.placements
