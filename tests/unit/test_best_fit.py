"""The built-in allocators' one-pass choice for views without affinity annotations
(``capacity.best_fit``) picks exactly what their general loop picks (the loop every annotated view
goes through, where each node passes with score 0), over random clusters, shapes and modes."""

from __future__ import annotations

import random
from typing import Any

from aios_blocks.policies.builtin.resource import BinPackPolicy, SpreadPolicy


def _view(i: int, rng: random.Random) -> dict[str, Any]:
    gpus = [
        {"id": f"n{i}-g{j}", "memory": 80, "memory_free": rng.choice([0, 40, 80]), "instances": rng.choice([0, 0, 1]),
         "exclusive": rng.random() < 0.2}
        for j in range(rng.randint(0, 8))
    ]
    return {"node_id": f"n{i}", "healthy": rng.random() < 0.9, "cpu_free": rng.choice([0, 4, 16]),
            "memory_free": rng.choice([0, 1024, 9000]), "gpus": gpus, "labels": {}}


def test_the_one_pass_choice_equals_the_general_loop() -> None:
    rng = random.Random(1)
    placed = 0
    for _ in range(1500):
        nodes = {f"n{i}": _view(i, rng) for i in range(rng.randint(0, 30))}
        healthy = {k for k, v in nodes.items() if v["healthy"] and rng.random() < 0.95} | {"elsewhere"}
        avoid = {k for k in nodes if rng.random() < 0.1}
        needs = {"gpus": rng.randint(0, 3), "gpuMemory": rng.choice([0, 20, 60]), "cpu": rng.choice([0, 1, 8]),
                 "memory": rng.choice([0, 512, 4096])}
        for cls in (BinPackPolicy, SpreadPolicy):
            policy = cls("r", {"gpuSharing": rng.random() < 0.3}, {})
            fast = policy._pick(nodes, healthy, needs, avoid, "seed")
            annotated = {k: {**v, "affinity": {"pass": True, "score": 0.0}} for k, v in nodes.items()}
            assert fast == policy._pick(annotated, healthy, needs, avoid, "seed")
            if fast is not None:
                placed += 1
                assert fast[0] in healthy and fast[0] not in avoid
    assert placed > 1000  # the draws mostly place: the comparison is not between two Nones


def test_an_inventory_view_keeps_its_rank_order_as_views_are_replaced() -> None:
    """On a ``capacity.Nodes`` the choice comes from its rank-ordered index, caught up from the
    change log as views are replaced, added and removed: always what the general loop picks."""
    from aios_blocks.policies import capacity

    rng = random.Random(7)
    for _ in range(60):
        nodes = capacity.Nodes({f"n{i}": _view(i, rng) for i in range(rng.randint(1, 40))})
        policy = (BinPackPolicy if rng.random() < 0.5 else SpreadPolicy)("r", {}, {})
        needs = {"gpus": rng.randint(0, 2), "gpuMemory": 0, "cpu": 1, "memory": 512}
        for _step in range(40):
            healthy = {k for k, v in nodes.items() if v["healthy"]}
            fast = policy._pick(nodes, healthy, needs, set(), "seed")
            annotated = {k: {**v, "affinity": {"pass": True, "score": 0.0}} for k, v in nodes.items()}
            assert fast == policy._pick(annotated, healthy, needs, set(), "seed")
            change = rng.random()
            if change < 0.7 and nodes:  # a view replaced (a reservation, a health change)
                nid = rng.choice(list(nodes))
                nodes[nid] = _view(int(nid[1:]), rng)
            elif change < 0.85:
                nodes[f"n{rng.randint(0, 60)}"] = _view(rng.randint(0, 60), rng)
            elif nodes:
                del nodes[rng.choice(list(nodes))]


def test_healthy_ids_follow_the_view_and_are_a_new_list_each_call() -> None:
    from aios_blocks.policies import capacity

    rng = random.Random(3)
    nodes = capacity.Nodes({f"n{i}": _view(i, rng) for i in range(20)})
    first = capacity.healthy_ids(nodes)
    assert first == sorted(k for k, v in nodes.items() if v["healthy"])
    first.append("mine")  # a policy may change its input: the next call is not affected
    assert "mine" not in capacity.healthy_ids(nodes)
    sick = next(k for k, v in nodes.items() if v["healthy"])
    nodes[sick] = {**nodes[sick], "healthy": False}
    assert sick not in capacity.healthy_ids(nodes)
    assert capacity.healthy_ids(dict(nodes)) == capacity.healthy_ids(nodes)


def test_healthy_ids_and_node_root_caught_up_from_the_change_log_equal_a_rebuild() -> None:
    """Both are kept per inventory view and caught up from its change log (views replaced in
    place, added, removed, marked unhealthy): after every change they equal a plain rebuild (the
    node map's root, ``node_digest.nodes_root``, in its chunked form and in the form before)."""
    import msgspec

    from aios_blocks.policies import capacity, node_digest
    from aios_blocks.schemas import events

    rng = random.Random(11)
    nodes = capacity.Nodes({f"n{i}": _view(i, rng) for i in range(25)})
    for _ in range(400):
        change = rng.random()
        if change < 0.6 and nodes:
            nid = rng.choice(list(nodes))
            nodes[nid] = {**_view(int(nid[1:]), rng), "healthy": rng.random() < 0.8}
        elif change < 0.8:
            nodes[f"n{rng.randint(0, 40)}"] = _view(rng.randint(0, 40), rng)
        elif nodes:
            del nodes[rng.choice(list(nodes))]
        if rng.random() < 0.7:  # not every change is followed by a call: several caught up at once
            plain = dict(nodes)
            assert capacity.healthy_ids(nodes) == capacity.healthy_ids(plain)
            assert node_digest.nodes_root(nodes) == node_digest.nodes_root(plain)
            entries = [events.ref_entry(k, capacity.node_ref(v)) for k, v in plain.items()]
            assert node_digest.nodes_root(nodes) == events.chunked_root_of(entries)
            refs = bytes(events._plain_node_refs(nodes))  # the form before: each view's JSON hashed afresh
            assert msgspec.json.decode(refs) == {k: capacity.node_ref(v) for k, v in plain.items()}
            assert events.nodes_root(refs) == events.nodes_root(b"{" + b",".join(entries) + b"}")
