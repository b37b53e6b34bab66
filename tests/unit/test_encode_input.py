"""``Worker.record``'s input encoding: byte for byte what ``msgspec.json.encode`` gives (the digest
``recovery.inputs`` checks a rebuilt input against), with node views encoded once per view."""

from __future__ import annotations

import copy

import msgspec

from aios_blocks.policies import capacity
from aios_blocks.workers.base import encode_input


def _node(nid: str, gpus: int = 4) -> dict:
    return {
        "id": nid, "cluster": "c1", "healthy": True, "labels": {"rack": "r1"}, "cpu_free": 32.5, "memory_free": 1 << 20,
        "gpus": [{"id": f"{nid}-g{i}", "memory": 81920, "memory_free": 81920, "memory_used": 0, "instances": 0,
                  "exclusive": False, "model": "A100"} for i in range(gpus)],
    }


def _input(nodes: dict) -> dict:
    return {"action": "dry_run", "payload": {"block": {"blockId": "b1", "instances": {}}, "cluster": {"id": "c1"},
            "cluster_metrics": {"nodes": nodes, "gpus": 8, "node_count": len(nodes)}, "healthy_nodes": sorted(nodes)}}


def test_the_same_bytes_as_a_plain_encode() -> None:
    nodes = capacity.Nodes({f"n{i}": _node(f"n{i}") for i in range(20)})
    data = _input(nodes)
    assert encode_input(data) == msgspec.json.encode(data)
    assert encode_input(data) == msgspec.json.encode(data)  # the second time from the per-view cache


def test_a_view_changed_by_take_is_encoded_afresh() -> None:
    nodes = {f"n{i}": _node(f"n{i}") for i in range(3)}
    data = _input(nodes)
    first = encode_input(data)
    capacity.take(nodes["n1"], ["n1-g0"], {"gpus": 1, "cpu": 1, "memory": 10}, False)
    assert encode_input(data) == msgspec.json.encode(data) != first


def test_annotated_views_and_other_inputs_are_encoded_whole() -> None:
    nodes = {"n0": {**_node("n0"), "affinity": {"pass": True, "score": 0.0}}}
    data = _input(nodes)
    assert encode_input(data) == msgspec.json.encode(data)
    nodes["n0"]["affinity"]["score"] = 1.0  # an annotation changed in place: never a stale encoding
    assert encode_input(data) == msgspec.json.encode(data)
    for other in ({"action": "selection", "payload": {"clusters": []}}, {"action": "autoscale"}, _input({})):
        assert encode_input(other) == msgspec.json.encode(other)


def test_a_copy_is_not_its_original() -> None:
    nodes = {"n0": _node("n0")}
    encode_input(_input(nodes))
    twin = copy.deepcopy(nodes)
    twin["n0"]["cpu_free"] = 1.0
    assert encode_input(_input(twin)) == msgspec.json.encode(_input(twin))


def test_the_tree_digest_covers_every_node_and_matches_a_plain_rebuild() -> None:
    """``input_digest_of`` with the per-version root memo (the worker) equals it computed from the
    input decoded from its JSON (``recovery.inputs``), and any byte of any node changes it; the
    older forms a record may hold (the root of the whole reference map, the reference map inline,
    the flat JSON) still match."""
    import hashlib

    from aios_blocks.policies import node_digest
    from aios_blocks.schemas.events import (
        _plain_node_refs,
        input_digest,
        input_digest_of,
        input_digests,
        input_matches,
        nodes_root,
    )

    nodes = capacity.Nodes({f"n{i}": _node(f"n{i}") for i in range(10)})
    data = _input(nodes)
    tree = input_digest_of(data, node_digest.nodes_root)
    assert tree == input_digest_of(msgspec.json.decode(msgspec.json.encode(data)))
    # the map's place holds its root: the SHA-256 of the count and of the reference map's chunks
    # of 64 entries (each view's SHA-256); 10 nodes: one chunk
    entries = [msgspec.json.encode(nid) + b":" + msgspec.json.encode("sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest())
               for nid, v in nodes.items()]
    root = "sha256c64:" + hashlib.sha256(b"10:" + hashlib.sha256(b",".join(entries)).digest()).hexdigest()
    by_hand = {**data, "payload": {**data["payload"], "cluster_metrics": {**data["payload"]["cluster_metrics"], "nodes": root}}}
    assert tree == input_digest(msgspec.json.encode(by_hand))
    # kept per inventory version: a replaced view changes it, and it still equals a plain rebuild
    assert input_digest_of(data, node_digest.nodes_root) == tree and node_digest._KEPT[id(nodes)].ref is nodes
    nodes["n3"] = {**nodes["n3"], "cpu_free": 0.5}
    changed = input_digest_of(data, node_digest.nodes_root)
    assert changed != tree and changed == input_digest_of(msgspec.json.decode(msgspec.json.encode(data)))
    raw = msgspec.json.encode(data)
    assert tree != input_digest(raw)  # not the flat form
    twin = msgspec.json.decode(msgspec.json.encode(data))
    twin["payload"]["cluster_metrics"]["nodes"]["n7"]["gpus"][3]["memory_free"] -= 1
    assert input_digest_of(twin) != changed
    # a record made before the chunked root (the whole map's root), before the root (the reference
    # map inline) or before the tree (flat) matches
    whole = input_digest_of(data, lambda n: nodes_root(bytes(_plain_node_refs(n))))
    refs_now = {nid: "sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest() for nid, v in nodes.items()}
    whole_root = "sha256:" + hashlib.sha256(msgspec.json.encode(refs_now)).hexdigest()
    assert whole == input_digest(msgspec.json.encode(
        {**data, "payload": {**data["payload"], "cluster_metrics": {**data["payload"]["cluster_metrics"], "nodes": whole_root}}}))
    inline = {**data, "payload": {**data["payload"], "cluster_metrics": {**data["payload"]["cluster_metrics"], "nodes": refs_now}}}
    older = input_digest(msgspec.json.encode(inline))
    assert list(input_digests(raw)) == [changed, whole, older, input_digest(raw)]
    assert all(input_matches(raw, d) for d in (changed, whole, older, input_digest(raw))) and not input_matches(raw, tree)
    other = {"action": "autoscale", "payload": {"x": 1}}  # no node map: the flat form
    assert input_digest_of(other) == input_digest(msgspec.json.encode(other))
