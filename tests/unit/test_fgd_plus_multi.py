"""``builtin:fgd-plus`` sees the multi-GPU shapes FGD's 95 % cut leaves out (``parameters.multiGpu``,
``multiGpuWeight``; docs/trace.md "Our policy", 7.): a small task keeps off the node that alone
still holds an 8-GPU task, and the replays (offline, online in-process and live) pass those shapes."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.policies.builtin.fgd_plus import MULTI_GPU_WEIGHT, FgdPlusPolicy
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import setup, views_of
from aios_blocks.trace.workload import Task, multi_gpu_shapes, typical_shapes


def _node(nid: str, gpus: int, cpu: float) -> Node:
    return Node(id=nid, cluster="c", cpu=cpu, memory=1 << 20,
                gpus=[Gpu(id=f"{nid}-g{i}", model="G2", memory=16384) for i in range(gpus)])


def _pick(views: dict[str, Any], seed: int, **params: Any) -> str:
    policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": False},
                           {"seed": seed, "workload": [{"cpu": 12, "gpus": 1, "weight": 1.0}], **params})
    needs = {"gpus": 1, "gpuMemory": 0, "cpu": 12, "memory": 1024}
    out: Any = policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": "b1", "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})
    return str(out["node_id"])


#: the rare 8-GPU tasks of the default trace's shape (64.2 CPUs), at their frequency there
EIGHT = [{"cpu": 64.2, "gpus": 8, "weight": 0.0022}]


@pytest.mark.parametrize("seed", range(6))
def test_a_one_gpu_task_keeps_off_the_node_an_8_gpu_task_still_fits(seed: int) -> None:
    # n-whole: 8 idle GPUs and 96 CPUs (an 8-GPU task of 64.2 CPUs fits); n-wide: 10 idle GPUs
    # and 50 CPUs (no 8-GPU task fits; 1-GPU tasks of 12 CPUs strand 6 of its GPUs before and
    # after). For the 1-GPU workload alone both changes are 0 and the tie packs n-whole (7 left
    # against 9); with the 8-GPU shapes n-whole would lose the only place an 8-GPU task fits.
    views = views_of([_node("n-whole", 8, 96), _node("n-wide", 10, 50)])
    assert _pick(views, seed) == "n-whole"
    assert _pick(views, seed, multiGpu=EIGHT) == "n-wide"
    assert _pick(views, seed, multiGpu=EIGHT, multiGpuWeight=0) == "n-whole"


def test_the_weight_scales_the_rare_shapes_and_keys_the_memos() -> None:
    params = {"seed": 1, "workload": [{"cpu": 12, "gpus": 1, "weight": 1.0}], "multiGpu": EIGHT}
    policy = FgdPlusPolicy("resourceAllocator", {}, params)
    assert MULTI_GPU_WEIGHT == 0.5
    assert policy.multi == [{"cpu": 64.2, "gpus": 8, "weight": 0.0022 * MULTI_GPU_WEIGHT}]
    off = FgdPlusPolicy("resourceAllocator", {}, {**params, "multiGpuWeight": 0})
    assert off.multi == [] and off.key != policy.key
    # a 1-GPU shape given as multi-GPU is not one: ignored
    assert FgdPlusPolicy("resourceAllocator", {}, {**params, "multiGpu": [{"cpu": 1, "gpus": 1}]}).multi == []


def _task(name: str, gpus: int, cpu: int, milli: int = 1000, spec: str = "") -> Task:
    return Task(name=name, cpu_milli=cpu, memory_mib=1024, num_gpu=gpus, gpu_milli=milli, gpu_spec=spec)


def test_the_replay_passes_the_multi_gpu_shapes_the_95_percent_cut_drops() -> None:
    # 60 one-GPU tasks, then an 8-GPU task and two 2-GPU V100 tasks (4.8 %: past the 95 % the cut keeps)
    tasks = [_task(f"t{i:02}", 1, 4000) for i in range(60)]
    tasks += [_task("big", 8, 64000), _task("v1", 2, 8000, spec="V100M16|V100M32"), _task("v2", 2, 8000, spec="V100M16|V100M32")]
    typical = typical_shapes(tasks)
    assert [s["gpus"] for s in typical] == [1]
    multi = multi_gpu_shapes(tasks, typical)
    assert multi == [{"cpu": 8.0, "gpus": 2, "weight": 2 / 63, "gpuModels": ["V100M16", "V100M32"]},
                     {"cpu": 64.0, "gpus": 8, "weight": 1 / 63}]
    # a multi-GPU shape the cut keeps is not repeated
    assert multi_gpu_shapes(tasks, [*typical, {"cpu": 64.0, "gpus": 8, "weight": 1 / 63}]) == multi[:1]
    st = setup([_node("n", 8, 96)], tasks, "fgd-plus", 7, 1.0, 0)
    assert st.rule(False)["parameters"]["multiGpu"] == multi
    assert st.rule(False)["parameters"]["workload"] == typical


def _online_tasks() -> list[Task]:
    # 60 one-GPU tasks, then 2-, 4- and 8-GPU tasks (4.8 %: past the 95 % the cut keeps)
    return [_task(f"t{i:02}", 1, 4000) for i in range(60)] + [_task("two", 2, 8000), _task("four", 4, 16000),
                                                              _task("eight", 8, 64000)]


def test_the_online_replays_pass_the_multi_gpu_shapes_too() -> None:
    """``trace.online.Sim`` (``--online --in-process``, the rebalance window's too) builds its
    rules with the replay's setup: ``parameters.multiGpu`` holds the 2/4/8-GPU shapes."""
    from aios_blocks.trace import online, online_rebalance

    tasks = _online_tasks()
    multi = multi_gpu_shapes(tasks, typical_shapes(tasks))
    assert [s["gpus"] for s in multi] == [2, 4, 8]
    timed = [online.Timed(t, float(i), 10.0) for i, t in enumerate(tasks)]
    for cls in (online.Sim, online_rebalance.RebalanceSim):
        sim = cls([_node("n", 8, 96)], timed, online.Mode.PREEMPTION, "fgd-plus", 7, 0, online.HEAD, online.MIN_DELTA, "hand")
        for share in (False, True):
            assert sim.rules[share]["parameters"]["multiGpu"] == multi
            assert sim.rules[share]["parameters"]["workload"] == typical_shapes(tasks)


def test_the_online_live_replay_registers_the_multi_gpu_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace.online_live`` (``--online --live``) registers components whose resourceAllocator
    rules hold ``parameters.multiGpu``, as the offline live replay's do."""
    import asyncio

    from aios_blocks.state import priority
    from aios_blocks.trace import online, online_live

    class Store:
        r = None

        async def clusters(self) -> list[Any]:
            return []

    class Classes:
        def __init__(self, r: Any) -> None:
            pass

        async def put_class(self, record: dict[str, Any]) -> None:
            pass

    class Bus:
        async def emit(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Client:
        def __init__(self) -> None:
            self.store, self.bus = Store(), Bus()
            self.components: list[dict[str, Any]] = []

        async def add_component(self, comp: dict[str, Any]) -> None:
            self.components.append(comp)

        async def import_nodes(self, cluster: Any, nodes: list[Node]) -> None:
            pass

    monkeypatch.setattr(priority, "PriorityStore", Classes)
    tasks = _online_tasks()
    client = Client()
    asyncio.run(online_live._register(client, [_node("n", 8, 96)], [online.Timed(t, 0.0, 1.0) for t in tasks], "fgd-plus", 7))
    rules = [p for c in client.components for p in c["policies"] if p["name"] == "resourceAllocator"]
    assert len(rules) == 2
    assert all(r["parameters"]["multiGpu"] == multi_gpu_shapes(tasks, typical_shapes(tasks)) for r in rules)
