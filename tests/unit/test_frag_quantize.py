"""``parameters.quantize`` of ``builtin:fgd`` and ``builtin:dot-product`` (policies/builtin/frag.py):
the FGD artifact's integer node scores (0-100), equal ones in the seeded order of the node ids, and
``drawTies``: kube-scheduler's draw among the nodes with the top one, per block and seed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.frag import POLICIES, DotProductPolicy, FgdPolicy, fgd_integer
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import views_of


def _node(nid: str, gpus: int, cpu: float = 32) -> Node:
    return Node(id=nid, cluster="c", cpu=cpu, memory=65536,
                gpus=[Gpu(id=f"{nid}-g{i}", model="T4", memory=16384) for i in range(gpus)])


def _pick(uri: str, views: dict[str, Any], needs: dict[str, Any], share: bool, bid: str,
          params: dict[str, Any]) -> str:
    policy = POLICIES[uri]("resourceAllocator", {"gpuSharing": share}, {"seed": 1, **params})
    assert policy.quantize is (params.get("quantize", True) is not False)  # type: ignore[attr-defined]
    out: Any = policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": bid, "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})
    return str(out["node_id"])


def _artifact_fgd(before: float, after: float) -> int:
    """fgd_score.go: int64(sigmoid((before - after) / 1000) * MaxNodeScore)."""
    return int(1 / (1 + math.exp(-(before - after) / 1000)) * 100)


@pytest.mark.parametrize("growth", [0.0, -3.0, 5.0, -400.0, 400.0, -1000.0, 1000.0, -7999.5, 7999.5, 123.456])
def test_fgd_integer_is_the_artifacts(growth: float) -> None:
    assert fgd_integer(growth) == _artifact_fgd(0.0, growth)
    assert FgdPolicy("r", {}, {})._integer(growth) == fgd_integer(growth)


@pytest.mark.parametrize("dot", [0.0, 0.001, 0.5, 0.999, 1.0, 1.37, 2.0])
def test_dot_product_integer_is_the_artifacts(dot: float) -> None:
    # dot_product_score.go: int64(MaxNodeScore * (1 - dot / len(vec))), two dimensions
    assert DotProductPolicy("r", {}, {})._integer(dot) == int(100 * (1 - dot / 2))


def _fgd_cluster() -> capacity.Nodes:
    """a: GPU 0 with 300 thousandths free; b: GPU 0 with 500 free. A 0.3 share there makes FGD's
    fragmentation grow by -3 on a and -0.5 on b (a mixed workload weighted 0.01): a wins exactly,
    both score 50 as integers."""
    views = views_of([_node("a", 2), _node("b", 2)])
    for nid, taken in (("a", 0.7), ("b", 0.5)):
        node = capacity.copy_node(views[nid])
        capacity.take(node, [f"{nid}-g0"], {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024,
                                            "gpuShare": taken}, True)
        views[nid] = node
    return views


FGD_WORKLOAD = [{"cpu": 1, "gpus": 1, "gpuShare": 0.5, "weight": 0.005}, {"cpu": 1, "gpus": 1, "weight": 0.005}]
SHARE3: Any = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024, "gpuShare": 0.3}
WHOLE: Any = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024}


CASES = [
    ("builtin:fgd", _fgd_cluster, SHARE3, True, "a", {"workload": FGD_WORKLOAD}),
    # idle nodes with 32 and 33 CPUs: dot products 32/16384 + 1/8 against 33/16384 + 1/8, both 93
    ("builtin:dot-product", lambda: views_of([_node("a", 2, cpu=32), _node("b", 2, cpu=33)]), WHOLE, False, "a", {}),
]


@pytest.mark.parametrize(("uri", "views", "needs", "share", "exact", "params"), CASES)
def test_equal_integer_scores_go_in_the_seeded_order(uri: str, views: Any, needs: dict[str, Any], share: bool,
                                                     exact: str, params: dict[str, Any]) -> None:
    """The default: integer scores, equal ones in the seed's order of the node ids (the per-shape
    index's): one node for every block of a seed, either over seeds; exact scores: always ``exact``."""
    v = views()
    by_seed = {}
    for s in range(12):
        assert {_pick(uri, v, needs, share, f"blk{i}", {**params, "seed": s, "quantize": False})
                for i in range(5)} == {exact}
        picks = {_pick(uri, v, needs, share, f"blk{i}", {**params, "seed": s}) for i in range(5)}
        assert len(picks) == 1
        by_seed[s] = picks.pop()
    assert set(by_seed.values()) == {"a", "b"}


@pytest.mark.parametrize(("uri", "views", "needs", "share", "exact", "params"), CASES)
def test_draw_ties_draws_per_block(uri: str, views: Any, needs: dict[str, Any], share: bool,
                                   exact: str, params: dict[str, Any]) -> None:
    v = views()
    bids = [f"blk{i}" for i in range(40)]
    picks = [_pick(uri, v, needs, share, b, {**params, "drawTies": True}) for b in bids]
    assert set(picks) == {"a", "b"}
    # deterministic per block and seed
    assert picks == [_pick(uri, v, needs, share, b, {**params, "drawTies": True}) for b in bids]


def test_quantize_keeps_a_better_integer_score_first() -> None:
    # a: a GPU with 300 thousandths free, which the 0.3 share fills (growth -300: 57); b: idle (a
    # 700 fragment left: +700, 33). Different integers: the higher one wins for every block
    views = views_of([_node("a", 2), _node("b", 2)])
    node = capacity.copy_node(views["a"])
    capacity.take(node, ["a-g0"], {**SHARE3, "gpuShare": 0.7}, True)
    views["a"] = node
    wl = [{"cpu": 1, "gpus": 1, "weight": 1.0}]
    for extra in ({}, {"drawTies": True}):
        picks = {_pick("builtin:fgd", views, SHARE3, True, f"blk{i}", {"workload": wl, "seed": s, **extra})
                 for i in range(5) for s in range(8)}
        assert picks == {"a"}
