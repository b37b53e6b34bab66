"""The chunked root of a placement input's node map (``schemas.events.chunked_root``), kept per
inventory view by ``policies.node_digest``: equal to the root of the whole map computed afresh
after any change, and the digest forms a recorded input may carry still match."""

from __future__ import annotations

import hashlib
import random

import msgspec

from aios_blocks.policies import capacity, node_digest
from aios_blocks.schemas import events as ev


def _node(nid: str, cpu: float = 8.0) -> dict:
    return {"id": nid, "healthy": True, "cpu_free": cpu, "memory_free": 1024, "labels": {},
            "gpus": [{"id": f"{nid}-g{i}", "memory": 16, "memory_free": 16, "memory_used": 0, "instances": 0,
                      "exclusive": False} for i in range(2)]}


def _fresh(nodes: dict) -> str:
    """The root by hand: each view's reference, the map's entries in order, chunks of 64."""
    entries = [msgspec.json.encode(nid) + b":" + msgspec.json.encode("sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest())
               for nid, v in nodes.items()]
    digests = [hashlib.sha256(b",".join(entries[i:i + 64])).digest() for i in range(0, len(entries), 64)]
    return "sha256c64:" + hashlib.sha256(str(len(entries)).encode() + b":" + b"".join(digests)).hexdigest()


def test_the_kept_root_follows_every_change_of_an_inventory_view() -> None:
    """Views replaced (in every chunk, the last short one included), added, removed, and an
    annotated copy: the kept root always equals the whole map's; a root not caught up (the entry or
    chunk of a replaced view left as it was) fails at the first replacement."""
    rng = random.Random(7)
    nodes = capacity.Nodes({f"n{i:04d}": _node(f"n{i:04d}") for i in range(200)})
    root = node_digest.nodes_root(nodes)
    assert root == _fresh(dict(nodes)) == ev.chunked_root_of(list(node_digest._entries(dict(nodes))))
    seen = {root}
    for step in range(300):
        nid = rng.choice(nodes.ids())
        if step % 50 == 17:
            del nodes[nid]
        elif step % 50 == 33:
            nodes[f"x{step}"] = _node(f"x{step}")
        else:
            nodes[nid] = _node(nid, cpu=rng.uniform(0, 8))
        got = node_digest.nodes_root(nodes)
        assert got == _fresh(dict(nodes)), step
        seen.add(got)
        assert node_digest.nodes_root(nodes) == got  # the same version: the kept root
    assert len(seen) > 250  # each change changed it
    # only the changed chunk is hashed again
    kept = node_digest._KEPT[id(nodes)]
    before = list(kept.digests)
    nid = nodes.ids()[70]
    nodes[nid] = _node(nid, cpu=0.25)
    assert node_digest.nodes_root(nodes) == _fresh(dict(nodes))
    assert [i for i, (a, b) in enumerate(zip(before, kept.digests, strict=True)) if a != b] == [70 // 64]
    # an annotated view (a per-call copy, changed in place) is hashed whole, never kept
    annotated = capacity.Nodes({**nodes, nid: {**nodes[nid], "affinity": {"pass": True, "score": 0.0, "reasons": []}}})
    assert node_digest.nodes_root(annotated) == _fresh(dict(annotated)) and id(annotated) not in node_digest._KEPT
    # a plain map: the same form
    assert node_digest.nodes_root(dict(nodes)) == _fresh(dict(nodes))


def test_the_digest_forms_a_record_may_carry_all_match() -> None:
    """``input_digest_of`` with the kept root equals the digest of the input rebuilt from its JSON
    (``recovery.inputs``), and a record made with any earlier form (the root of the whole reference
    map, the map inline, the flat JSON) still matches the rebuilt input."""
    nodes = capacity.Nodes({f"n{i}": _node(f"n{i}") for i in range(130)})
    data = {"action": "allocation", "payload": {"block": {"blockId": "b"}, "cluster_metrics": {"nodes": nodes, "gpus": 4},
                                                 "healthy_nodes": list(nodes)}}
    nodes["n5"] = _node("n5", cpu=1.0)
    now = ev.input_digest_of(data, node_digest.nodes_root)
    raw = msgspec.json.encode(data)
    assert now == ev.input_digest_of(msgspec.json.decode(raw))
    refs = {nid: "sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest() for nid, v in nodes.items()}

    def replaced(value: object) -> str:
        return ev.input_digest(msgspec.json.encode(
            {**data, "payload": {**data["payload"], "cluster_metrics": {**data["payload"]["cluster_metrics"], "nodes": value}}}))

    assert now == replaced(_fresh(dict(nodes)))
    whole_root = replaced("sha256:" + hashlib.sha256(msgspec.json.encode(refs)).hexdigest())
    assert whole_root == ev.input_digest_of(data, lambda n: ev.nodes_root(bytes(ev._plain_node_refs(n))))  # the form before
    forms = [now, whole_root, replaced(refs), ev.input_digest(raw)]
    assert list(ev.input_digests(raw)) == forms and len(set(forms)) == 4
    assert all(ev.input_matches(raw, d) for d in forms)
    nodes["n9"] = _node("n9", cpu=2.0)  # another state: none of the old forms match it
    raw2 = msgspec.json.encode(data)
    assert not any(ev.input_matches(raw2, d) for d in forms)


def test_node_map_is_a_map_of_dicts_only() -> None:
    """``node_map``: the node views when every value is a dict (an inventory view's too), else None."""
    views = capacity.Nodes({"a": _node("a"), "b": _node("b")})
    assert ev.node_map({"payload": {"cluster_metrics": {"nodes": views}}}) is views
    for nodes in ({}, {"a": _node("a"), "b": "sha256:x"}, {"a": capacity.Nodes()}, ["a"], "sha256c64:x"):
        assert ev.node_map({"payload": {"cluster_metrics": {"nodes": nodes}}}) is None


def test_node_map_of_an_inventory_view_reads_only_the_views_changed_since() -> None:
    """An inventory view answers ``node_map``'s check from its change log: after the first
    answer, no pass over every view (the old check read each view's type at every record), and a
    view replaced by a non-dict (or back) changes the answer."""
    reads: list[int] = []

    class Counted(capacity.Nodes):
        def values(self):  # type: ignore[no-untyped-def,override]
            reads.append(len(self))
            return super().values()

    views = Counted({f"n{i}": _node(f"n{i}") for i in range(50)})
    inp = {"payload": {"cluster_metrics": {"nodes": views}}}
    assert ev.node_map(inp) is views
    reads.clear()
    for i in range(10):
        views[f"n{i}"] = _node(f"n{i}", cpu=i)
        assert ev.node_map(inp) is views
    assert reads == []
    views["n3"] = "sha256:x"  # type: ignore[assignment]
    assert ev.node_map(inp) is None
    views["n3"] = _node("n3")
    assert ev.node_map(inp) is views
    del views["n4"]
    views["n9"] = {**_node("n9"), "cpu_free": 1.0}
    assert ev.node_map(inp) is views


def test_a_digest_reuses_the_healthy_list_s_encoding_while_it_does_not_change() -> None:
    """A placement input's ``healthy_nodes`` from an inventory view (``capacity.healthy_ids``) is
    encoded once while the list stays the same (``Nodes.healthy_json``), and the digest is the one
    of the plain input (the list encoded with the rest) after every change: views replaced,
    nodes turned unhealthy and back, added and removed; a list that is not the view's is encoded
    as given."""
    rng = random.Random(3)
    nodes = capacity.Nodes({f"n{i:03d}": _node(f"n{i:03d}") for i in range(150)})

    def digests() -> tuple[str, str]:
        ids = capacity.healthy_ids(nodes)
        inp = {"action": "allocation", "payload": {"block": {"blockId": "b"}, "cluster_metrics": {"nodes": nodes},
                                                    "healthy_nodes": ids}}
        plain = {"action": "allocation", "payload": {"block": {"blockId": "b"}, "cluster_metrics": {"nodes": dict(nodes)},
                                                      "healthy_nodes": list(ids)}}
        return ev.input_digest_of(inp, node_digest.nodes_root), ev.input_digest_of(plain)

    got, want = digests()
    assert got == want
    raw = nodes.healthy_json(capacity.healthy_ids(nodes))
    assert raw == msgspec.json.encode(capacity.healthy_ids(nodes))
    nodes["n000"] = _node("n000", cpu=4.0)  # a view replaced, the healthy list the same: not encoded again
    assert nodes.healthy_json(capacity.healthy_ids(nodes)) is raw
    for _step in range(200):
        nid = f"n{rng.randint(0, 170):03d}"
        change = rng.random()
        if change < 0.5 and nid in nodes:
            nodes[nid] = {**nodes[nid], "healthy": not nodes[nid]["healthy"]}
        elif change < 0.8:
            nodes[nid] = _node(nid, cpu=rng.choice([2.0, 8.0]))
        elif nid in nodes:
            del nodes[nid]
        got, want = digests()
        assert got == want, _step
    ids = capacity.healthy_ids(nodes)
    assert nodes.healthy_json(ids[:-1]) is None  # not the view's list: None, encoded with the rest
