"""The FGD paper's baselines as built-in resourceAllocators (policies/builtin/frag.py): each one's
choice on a tiny hand-made cluster, in the seed's policy shape, and FGD's fragmentation measure."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.frag import POLICIES, Workload
from aios_blocks.policies.runtime import BUILTINS
from aios_blocks.policies.uris import BUILTIN_KINDS
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import views_of


def _node(nid: str, gpus: int, model: str = "T4", cpu: float = 32) -> Node:
    return Node(id=nid, cluster="c", cpu=cpu, memory=65536, gpus=[Gpu(id=f"{nid}-g{i}", model=model, memory=16384) for i in range(gpus)])


def _take(views: dict[str, Any], nid: str, gpus: list[str], needs: dict[str, Any], share: bool) -> None:
    node = capacity.copy_node(views[nid])
    capacity.take(node, gpus, needs, share)
    views[nid] = node


def _pick(uri: str, views: dict[str, Any], needs: dict[str, Any], share: bool, bid: str = "b1",
          workload: list[dict[str, Any]] | None = None, **params: Any) -> dict[str, Any]:
    policy = POLICIES[uri]("resourceAllocator", {"gpuSharing": share}, {"seed": 1, "workload": workload or [], **params})
    return policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": bid, "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})


SHARE = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024, "gpuShare": 0.5}
WHOLE = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024}
#: FGD's target workload: half and whole GPUs (a half GPU left free is a fragment for the whole ones)
MIX = [{"cpu": 1, "gpus": 1, "gpuShare": 0.5, "weight": 0.5}, {"cpu": 1, "gpus": 1, "weight": 0.5}]


def _cluster() -> capacity.Nodes:
    """n-used: 2 GPUs, one half taken by a sharing task; n-idle: 2 idle GPUs; n-big: 8 idle GPUs."""
    views = views_of([_node("n-used", 2), _node("n-idle", 2), _node("n-big", 8, cpu=96)])
    _take(views, "n-used", ["n-used-g0"], SHARE, True)
    return views


def test_the_baselines_are_builtin_resource_allocators() -> None:
    for uri, cls in POLICIES.items():
        assert BUILTINS[uri] is cls and BUILTIN_KINDS[uri] == ("resourceAllocator",)


@pytest.mark.parametrize(("uri", "needs", "share", "node", "gpus"), [
    # packing policies put half a GPU on the half-used GPU
    ("builtin:fgd", SHARE, True, "n-used", ["n-used-g0"]),
    ("builtin:gpu-packing", SHARE, True, "n-used", ["n-used-g0"]),
    ("builtin:best-fit", SHARE, True, "n-used", ["n-used-g0"]),
    ("builtin:gpu-clustering", SHARE, True, "n-used", ["n-used-g0"]),
    ("builtin:dot-product", SHARE, True, "n-used", ["n-used-g0"]),
    # a whole GPU: best-fit and dot-product take the fullest node (the used one's idle GPU); GPU
    # packing too (a partly used node before an idle one); clustering keeps whole GPUs off a
    # node of shared ones (an idle node)
    ("builtin:best-fit", WHOLE, False, "n-used", ["n-used-g1"]),
    ("builtin:dot-product", WHOLE, False, "n-used", ["n-used-g1"]),
    ("builtin:gpu-packing", WHOLE, False, "n-used", ["n-used-g1"]),
    ("builtin:gpu-clustering", WHOLE, False, "n-idle", None),
])
def test_each_baseline_choice_on_a_tiny_cluster(uri: str, needs: dict[str, Any], share: bool, node: str,
                                                gpus: list[str] | None) -> None:
    # exact scores (dot-product's integer ones, its default, tie here: tests/unit/test_frag_quantize.py)
    out = _pick(uri, _cluster(), needs, share, workload=MIX, quantize=False)
    assert out["node_id"] == node
    if gpus is not None:
        assert out["gpus"] == gpus
    else:
        assert len(out["gpus"]) == 1 and out["gpus"][0].startswith(node)


def test_fgd_places_where_the_workload_loses_least() -> None:
    # a GPU with 600 thousandths free and an idle one; the workload: whole GPUs. 0.4 on the
    # 600 GPU leaves 200 unusable (was 600: less fragment); on the idle GPU 600 unusable (more)
    views = views_of([_node("a", 2)])
    _take(views, "a", ["a-g0"], {**SHARE, "gpuShare": 0.4}, True)
    out = _pick("builtin:fgd", views, {**SHARE, "gpuShare": 0.4}, True, workload=[{"cpu": 1, "gpus": 1, "weight": 1.0}])
    assert out == {"node_id": "a", "gpus": ["a-g0"]}
    wl = Workload([{"cpu": 1, "gpus": 1, "weight": 0.5}, {"cpu": 1, "gpus": 1, "gpuShare": 0.5, "weight": 0.3},
                   {"cpu": 2, "gpus": 0, "weight": 0.2}])
    # free (600, 1000): whole GPUs can't use 600; halves use both; CPU-only tasks none of 1600
    assert wl.frag("T4", 8.0, (600, 1000)) == pytest.approx(0.5 * 600 + 0.3 * 0 + 0.2 * 1600)
    # CPU short for every shape: all of it is fragment
    assert wl.frag("T4", 0.5, (600, 1000)) == pytest.approx(1600)
    # a model the tasks may not use: all of it
    only_v100 = Workload([{"cpu": 1, "gpus": 1, "gpuModels": ["V100M32"], "weight": 1.0}])
    assert only_v100.frag("T4", 8.0, (1000,)) == 1000 and only_v100.frag("V100M32", 8.0, (1000,)) == 0


def test_random_is_seeded_per_block_and_spreads() -> None:
    views = _cluster()
    picks = [_pick("builtin:random", views, WHOLE, False, bid=f"b{i}")["node_id"] for i in range(30)]
    assert picks == [_pick("builtin:random", views, WHOLE, False, bid=f"b{i}")["node_id"] for i in range(30)]
    assert set(picks) == {"n-used", "n-idle", "n-big"}


def test_gpu_models_and_no_fit_for_every_baseline() -> None:
    views = views_of([_node("t4", 2), _node("v100", 2, model="V100M32")])
    for uri in POLICIES:
        out = _pick(uri, views, {**WHOLE, "gpuModels": ["V100M32"]}, False)
        assert out["node_id"] == "v100", uri
        with pytest.raises(RuntimeError, match="no healthy node can host"):
            _pick(uri, views, {**WHOLE, "gpus": 4}, False)


@pytest.mark.parametrize("uri", [u for u in POLICIES if u != "builtin:random"])
def test_views_annotated_with_affinity_choose_as_plain_ones(uri: str) -> None:
    """A block with affinity entries gets per-call annotated copies (the scan path); one without,
    the inventory view's ordered index: the same tasks must land on the same nodes and GPUs."""
    from pathlib import Path

    from aios_blocks.trace.workload import inflate, load_tasks, typical_shapes

    data = Path(__file__).parent / "data" / "trace"
    tasks = load_tasks(data / "pods.csv")
    views = views_of(__import__("aios_blocks.trace.inventory", fromlist=["load_nodes"]).load_nodes(data / "nodes.csv", "s"))
    shapes = typical_shapes(tasks)
    for t in inflate(tasks, 107_000, 1.3, 42)[:120]:
        needs, share = t.resources(), t.sharing
        annotated = {nid: {**v, "affinity": {"pass": True, "score": 0.0}} for nid, v in views.items()}
        got = []
        for vs in (views, annotated):
            try:
                got.append(_pick(uri, vs, needs, share, bid=t.name, workload=shapes))
            except RuntimeError:
                got.append(None)
        assert got[0] == got[1], t
        if got[0]:
            _take(views, got[0]["node_id"], got[0]["gpus"], needs, share)
    # Required affinity still filters on the scan path
    annotated = {nid: {**v, "affinity": {"pass": nid == "openb-node-0000", "score": 0.0}} for nid, v in views.items()}
    out = _pick(uri, annotated, {"gpus": 0, "cpu": 0.1, "memory": 1}, False)
    assert out["node_id"] == "openb-node-0000"
