"""Capacity rules the mutation run (``make mutate``) found unasserted: which GPU an instance may
use (exclusive, shared, by model, by compute share), the reason a node is refused in `blocks
explain`, what a tentative placement takes, and the node-reference digests of annotated views."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from aios_blocks.policies import capacity as cap
from aios_blocks.policies import node_digest
from aios_blocks.schemas import events as ev


def gpu(gid: str = "g0", memory: int = 100, used: int = 0, n: int = 0, x: bool = False, model: str = "H100",
        share_free: int | None = None) -> dict[str, Any]:
    g = {"id": gid, "model": model, "memory": memory, "memory_used": used, "memory_free": memory - used,
         "instances": n, "exclusive": x}
    if share_free is not None:
        g["share_free"] = share_free
    return g


def view(nid: str = "n1", gpus: list[dict[str, Any]] | None = None, cpu_free: float = 8.0, memory_free: int = 1000,
         healthy: bool = True) -> dict[str, Any]:
    return {"node_id": nid, "healthy": healthy, "cpu": 8.0, "cpu_free": cpu_free, "memory": 1000,
            "memory_free": memory_free, "gpus": gpus if gpus is not None else [gpu()]}


def test_share_units_are_thousandths_of_a_gpu() -> None:
    assert cap.share_units({"gpuShare": 0.25}) == 250
    assert cap.share_units({"gpuShare": 0.3333}) == 333
    assert cap.share_units({}) == 0 and cap.share_units({"gpuShare": None}) == 0


@pytest.mark.parametrize(("g", "needs", "share", "want"), [
    (gpu(), {"gpuMemory": 100}, False, True),  # a whole idle GPU big enough
    (gpu(), {"gpuMemory": 101}, False, False),  # too small
    (gpu(n=1, used=10), {"gpuMemory": 10}, False, False),  # in use: not to hold whole
    (gpu(x=True), {}, True, False),  # held exclusively: never
    (gpu(n=1, used=60), {"gpuMemory": 40}, True, True),  # shared, exactly the free memory
    (gpu(n=1, used=61), {"gpuMemory": 40}, True, False),
    (gpu(memory=30), {"gpuMemory": 40}, True, False),  # smaller than asked even when free
    (gpu(), {}, True, True),  # sharing, nothing asked
    (gpu(), {"gpuMemory": -5}, True, True),  # a negative ask is none
    (gpu(share_free=250), {"gpuShare": 0.25}, True, True),
    (gpu(share_free=249), {"gpuShare": 0.25}, True, False),  # not enough compute left
    (gpu(), {"gpuShare": 1.0}, True, True),  # no share taken yet: all of it
    (gpu(model="A10"), {"gpuModels": ["H100"]}, False, False),
    (gpu(model="A10"), {"gpuModels": ["H100", "A10"]}, True, True),
    (gpu(model="A10"), {"gpuModels": []}, False, True),  # no model asked: any
])
def test_gpu_usable(g: dict[str, Any], needs: dict[str, Any], share: bool, want: bool) -> None:
    assert cap.gpu_usable(g, needs, share) is want
    # node_fits applies the same rule to each GPU
    fits = cap.node_fits(view(gpus=[g]), {**needs, "gpus": 1}, share)
    assert (fits is not None) is want


@pytest.mark.parametrize(("node", "needs", "share", "want"), [
    (view(healthy=False), {}, False, "unhealthy"),
    (view(cpu_free=1.5), {"cpu": 2}, False, "cpu 1.5 free < 2"),
    (view(memory_free=100), {"memory": 512}, False, "memory 100 MiB free < 512"),
    (view(gpus=[gpu(model="A10"), gpu("g1", model="L4")]), {"gpus": 1, "gpuModels": ["H100", "B200"]}, False,
     "no GPU of model H100|B200 (gpuModels)"),
    (view(gpus=[gpu(n=1), gpu("g1"), gpu("g2", x=True)]), {"gpus": 2}, False, "1 usable GPUs < 2"),
    (view(gpus=[gpu(model="A10")]), {"gpuModels": ["H100"]}, False, "0 usable GPUs < 0"),  # none asked: not the model
    (view(gpus=[gpu(n=1, used=90)]), {"gpus": 1, "gpuMemory": 20}, True, "0 usable GPUs < 1"),
])
def test_why_not_says_the_first_reason_a_node_cannot_take_one_instance(
        node: dict[str, Any], needs: dict[str, Any], share: bool, want: str) -> None:
    assert cap.why_not(node, needs, share) == want


def test_why_not_counts_cpu_within_the_rounding_margin() -> None:
    # 0.1 + 0.2 style leftovers: 1.9999999999 free is 2
    assert cap.why_not(view(cpu_free=1.9999999999, gpus=[]), {"cpu": 2, "gpus": 1}, False) == "0 usable GPUs < 1"


def test_take_applies_one_placement_like_the_reservation_script() -> None:
    node = view(gpus=[gpu("g0", share_free=1000), gpu("g1"), gpu("g2")], cpu_free=1.0, memory_free=1000)
    cap.take(node, ["g0", "g1"], {"cpu": 0.7, "memory": 300, "gpuMemory": 40, "gpuShare": 0.25}, True)
    assert node["cpu_free"] == 0.3 and node["memory_free"] == 700
    g0, g1, g2 = node["gpus"]
    assert (g0["memory_used"], g0["memory_free"], g0["instances"], g0["exclusive"], g0["share_free"]) == (40, 60, 1, False, 750)
    assert (g1["memory_used"], g1["memory_free"], g1["instances"], g1["share_free"]) == (40, 60, 1, 750)
    assert g2 == gpu("g2")
    # a whole GPU: all of its memory, marked exclusive, its compute share left as it was
    node = view(gpus=[gpu("g0", share_free=1000)])
    cap.take(node, ["g0"], {"gpuMemory": 10, "gpuShare": 0.5}, False)
    assert node["gpus"][0] == {**gpu("g0", used=100, n=1, x=True), "share_free": 1000}
    assert cap.free_gpus(node) == 0 and cap.free_gpus(view(gpus=[gpu(), gpu("g1", n=1), gpu("g2", x=True)])) == 1


def test_take_forgets_what_was_derived_from_the_view() -> None:
    node = view(gpus=[gpu()])
    needs = {"gpus": 1}
    assert cap.node_fits_cached(node, needs, False) is not None
    before = cap.node_ref(node)
    cap.take(node, ["g0"], needs, False)
    assert cap.node_fits_cached(node, needs, False) is None
    assert cap.node_ref(node) != before


def test_node_ref_is_the_sha256_of_the_views_json_annotated_or_not() -> None:
    node = view()
    assert cap.node_ref(node) == "sha256:" + hashlib.sha256(msgspec.json.encode(node)).hexdigest()
    assert bytes(cap.encoded(node)) == msgspec.json.encode(node)
    annotated = {**view(), "affinity": {"pass": True, "score": 1.0}}
    first = cap.node_ref(annotated)
    assert first == "sha256:" + hashlib.sha256(msgspec.json.encode(annotated)).hexdigest()
    annotated["affinity"]["score"] = 2.0  # annotated in place per call: never kept
    assert cap.node_ref(annotated) != first


def refs_of(nodes: dict[str, dict[str, Any]]) -> bytes:
    return msgspec.json.encode({nid: cap.node_ref(v) for nid, v in nodes.items()})


def root_of(nodes: dict[str, dict[str, Any]]) -> str:
    """The chunked root of a node map, from scratch (each view's ``node_ref``)."""
    return ev.chunked_root_of([ev.ref_entry(nid, cap.node_ref(v)) for nid, v in nodes.items()])


def older_root(nodes: dict[str, dict[str, Any]]) -> str:
    """The root in the form before the chunked one, as ``input_digests`` computes it."""
    return ev.nodes_root(bytes(ev._plain_node_refs(nodes)))


def test_node_references_and_roots_of_an_inventory_view_follow_its_changes_and_its_annotated_copies() -> None:
    plain = {"a": view("a"), "b": view("b")}
    nodes = cap.Nodes(plain)
    assert bytes(ev._plain_node_refs(nodes)) == bytes(ev._plain_node_refs(plain)) == refs_of(plain)
    root = node_digest.nodes_root(nodes)
    assert root == node_digest.nodes_root(plain) == root_of(plain)
    old = older_root(nodes)
    assert old == older_root(plain) == "sha256:" + hashlib.sha256(refs_of(plain)).hexdigest()
    nodes["b"] = view("b", cpu_free=1.0)  # replaced in place: same ids
    assert bytes(ev._plain_node_refs(nodes)) == refs_of(dict(nodes))
    assert node_digest.nodes_root(nodes) != root and node_digest.nodes_root(nodes) == root_of(dict(nodes))
    assert older_root(nodes) != old and older_root(nodes) == "sha256:" + hashlib.sha256(refs_of(dict(nodes))).hexdigest()
    # annotated views replacing some (a block with affinity, per call): the map follows them
    for nid in ("a", "b"):
        nodes[nid] = {**nodes[nid], "affinity": {"pass": True, "score": 0.0}}
    assert bytes(ev._plain_node_refs(nodes)) == refs_of(dict(nodes))
    assert node_digest.nodes_root(nodes) == root_of(dict(nodes))
    nodes["a"]["affinity"]["score"] = 5.0  # changed in place: nothing of it was kept
    assert bytes(ev._plain_node_refs(nodes)) == refs_of(dict(nodes))
    assert node_digest.nodes_root(nodes) == root_of(dict(nodes)) == node_digest.nodes_root(dict(nodes))
    assert older_root(nodes) == "sha256:" + hashlib.sha256(refs_of(dict(nodes))).hexdigest()
    # then plain views again
    nodes["a"], nodes["b"] = view("a"), view("b", memory_free=5)
    assert bytes(ev._plain_node_refs(nodes)) == refs_of(dict(nodes))
    assert node_digest.nodes_root(nodes) == root_of(dict(nodes))


def test_healthy_ids_follow_an_inventory_view_as_nodes_come_go_and_flip() -> None:
    nodes = cap.Nodes({"c": view("c"), "a": view("a", healthy=False), "b": view("b")})
    assert cap.healthy_ids(nodes) == ["b", "c"]
    nodes["a"] = view("a")
    nodes["d"] = view("d", healthy=False)
    del nodes["c"]
    assert cap.healthy_ids(nodes) == ["a", "b"]
    nodes["b"] = view("b", healthy=False)
    assert cap.healthy_ids(nodes) == ["a"] == cap.healthy_ids(dict(nodes))
    got = cap.healthy_ids(nodes)
    got.append("x")  # a new list each call
    assert cap.healthy_ids(nodes) == ["a"]
    nodes.clear()
    assert cap.healthy_ids(nodes) == []


def test_a_fork_shares_the_totals_and_the_capacity_index_of_a_shape() -> None:
    needs = {"gpus": 1}
    nodes = cap.Nodes({"a": view("a"), "b": view("b", gpus=[gpu(n=1)])})
    work = cap.fork(nodes, needs, True)
    assert cap.fitting(work, needs, True) == 2 and cap.fitting(work, needs, False) == 1
    node = cap.copy_node(work["a"])
    cap.take(node, ["g0"], needs, False)
    work["a"] = node
    assert cap.fitting(work, needs, False) == 0 and cap.fitting(nodes, needs, False) == 1
    assert cap.totals(work)["gpus_free"] == 0 and cap.totals(nodes)["gpus_free"] == 1


@pytest.mark.parametrize(("node", "needs", "share", "want"), [
    ({k: v for k, v in view(gpus=[]).items() if k != "healthy"}, {}, False, "0 usable GPUs < 0"),  # no flag: healthy
    (view(cpu_free=2.0, memory_free=512, gpus=[]), {"cpu": 2, "memory": 512, "gpus": 1}, False, "0 usable GPUs < 1"),
    (view(cpu_free=0.5, memory_free=0, gpus=[]), {}, False, "0 usable GPUs < 0"),  # nothing asked: nothing missing
    (view(cpu_free=-1.0), {}, False, "cpu -1 free < 0"),  # overcommitted
    (view(memory_free=-5), {}, False, "memory -5 MiB free < 0"),
    (view(gpus=[gpu(n=1, used=10), gpu("g1", n=1, used=10)]), {"gpus": 3}, True, "2 usable GPUs < 3"),  # shared in use
    (view(gpus=[gpu(model="A10", n=1)]), {"gpus": 1, "gpuModels": ["A10"]}, False, "0 usable GPUs < 1"),  # the model, busy
])
def test_why_not_edges(node: dict[str, Any], needs: dict[str, Any], share: bool, want: str) -> None:
    assert cap.why_not(node, needs, share) == want


@pytest.mark.parametrize(("g", "needs", "share", "want"), [
    (gpu(used=100, n=1), {}, True, True),  # full, but nothing asked
    (gpu(memory=40), {"gpuMemory": 40}, True, True),  # exactly its size
    (gpu(memory=0), {}, False, True),  # a GPU without memory figure, nothing asked
])
def test_gpu_usable_edges(g: dict[str, Any], needs: dict[str, Any], share: bool, want: bool) -> None:
    assert cap.gpu_usable(g, needs, share) is want


@pytest.mark.parametrize("inventory", [False, True])
def test_best_fit_passes_over_skipped_nodes_to_the_next_in_rank(inventory: bool) -> None:
    views = {f"n{i}": view(f"n{i}", gpus=[gpu(f"g{j}") for j in range(i + 1)]) for i in range(4)}
    nodes: dict[str, Any] = cap.Nodes(views) if inventory else views
    needs = {"gpus": 1}

    def fits(v: dict[str, Any]) -> list[dict[str, Any]] | None:
        return cap.node_fits(v, needs, False)

    def rank(v: dict[str, Any]) -> Any:
        return cap.free_gpus(v)  # fewest free first

    def best(skip: set[str], count: int = 1) -> Any:
        found = cap.best_fit(nodes, skip, ("fits", "t"), fits, ("rank", "t"), rank, count)
        return found and found[0]

    assert best(set()) == "n0"
    assert best({"n0"}) == "n1"
    assert best({"n0", "n1"}) == "n2"
    assert best(set(), count=3) == "n2"
    assert best({"n0", "n1", "n2", "n3"}) is None


def test_what_is_not_asked_is_not_needed_and_not_taken() -> None:
    bare = {k: v for k, v in view(cpu_free=0.5, memory_free=0, gpus=[gpu(memory=0)]).items() if k != "healthy"}
    assert cap.node_fits(bare, {}, False) == [gpu(memory=0)]  # no health flag: healthy; nothing asked: it fits
    node = view(cpu_free=0.5, memory_free=10, gpus=[gpu()])
    cap.take(node, ["g0"], {"gpuShare": 0.25}, True)
    assert node["cpu_free"] == 0.5 and node["memory_free"] == 10
    assert node["gpus"][0]["memory_used"] == 0 and node["gpus"][0]["share_free"] == 750  # no figure yet: all of it


def test_totals_round_the_free_cpu_to_the_thousandth() -> None:
    assert cap.totals({"a": view(cpu_free=1.23456)})["cpu_free"] == 1.235
