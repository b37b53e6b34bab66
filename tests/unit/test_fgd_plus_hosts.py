"""``builtin:fgd-plus`` rule 8, opt-in (``parameters.hostPressure``, ``hostShare``; docs/rebalance.md
"Keeping the few large nodes"): a shape only a few nodes can hold (8 GPUs and 120 CPUs: only the
128-CPU node) puts a pressure on their class, and work that fits elsewhere keeps off them."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.fgd_plus import FgdPlusPolicy, host_pressure
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import views_of


def _node(nid: str, model: str, cpu: float, gpus: int = 8) -> Node:
    return Node(id=nid, cluster="c", cpu=cpu, memory=1 << 20,
                gpus=[Gpu(id=f"{nid}-g{i}", model=model, memory=16384) for i in range(gpus)])


#: the 1-GPU tasks of 12 CPUs, and the rare 8-GPU tasks of 120 CPUs only a 128-CPU node holds
WORKLOAD = [{"cpu": 12, "gpus": 1, "weight": 0.99}, {"cpu": 120, "gpus": 8, "weight": 0.01}]


def _cluster() -> dict[str, Any]:
    """big: the one 128-CPU node (G3), one GPU and 12 CPUs already taken (it no longer holds an
    8-GPU task now); g2-0..g2-8: nine idle 96-CPU nodes (G2), which never hold one."""
    views = views_of([_node("big", "G3", 128)] + [_node(f"g2-{i}", "G2", 96) for i in range(9)])
    node = capacity.copy_node(views["big"])
    capacity.take(node, ["big-g0"], {"gpus": 1, "cpu": 12, "memory": 1024}, False)
    views["big"] = node
    return views


def _pick(views: dict[str, Any], needs: dict[str, Any], seed: int, **params: Any) -> str:
    policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": False}, {"seed": seed, "workload": WORKLOAD, **params})
    out: Any = policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": "b1", "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})
    return str(out["node_id"])


def test_the_host_pressure_of_a_shape_only_one_class_holds() -> None:
    views = _cluster()
    # the 8-GPU 120-CPU shape: 0.08 of the 0.99 + 0.08 GPU demand, on 8 of the 80 GPUs
    press = host_pressure(WORKLOAD, list(views.values()), 0.1)
    assert list(press) == [("G3", 8)]
    assert press[("G3", 8)] == pytest.approx(((0.08 / 1.07) / (8 / 80), 16.0))
    # the nodes that hold it have more than hostShare of the GPUs: not scarce, no pressure
    assert host_pressure(WORKLOAD, list(views.values()), 0.05) == {}
    # a shape every node holds puts no pressure anywhere
    assert host_pressure([{"cpu": 12, "gpus": 1, "weight": 1.0}], list(views.values()), 0.1) == {}


ONE = {"gpus": 1, "gpuMemory": 0, "cpu": 12, "memory": 1024}


@pytest.mark.parametrize("seed", range(4))
def test_a_task_that_fits_elsewhere_keeps_off_the_node_only_the_large_shape_fits(seed: int) -> None:
    # the fragmentation change is alike on every node (none holds an 8-GPU 120-CPU task, before or
    # after); best fit then packs the partly used big node (6 GPUs left against 7). With the host
    # pressure the task goes to a G2 node and big drains toward the shape only it holds.
    views = _cluster()
    assert _pick(views, ONE, seed) == "big"
    assert _pick(views, ONE, seed, hostPressure=1).startswith("g2-")
    assert _pick(views, ONE, seed, hostPressure=1, hostShare=0.05) == "big"  # not scarce: off
    # a CPU-only task too (its CPUs counted in GPUs at the class's 16 CPUs per GPU)
    cpu_only = {"gpus": 0, "gpuMemory": 0, "cpu": 16, "memory": 1024}
    assert _pick(views, cpu_only, seed, hostPressure=1).startswith("g2-")
