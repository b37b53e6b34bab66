"""``builtin:fgd-plus`` (policies/builtin/fgd_plus.py, docs/trace.md): its choices on tiny
hand-made clusters where it differs from FGD, its look-ahead fragmentation measure against FGD's,
and a replay of the 20-node trace sample."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.fgd_plus import (
    BlendedWorkload,
    FgdPlusPolicy,
    FillWorkload,
    effective_cpu,
    memory_per_cpu,
)
from aios_blocks.policies.builtin.frag import Workload
from aios_blocks.policies.runtime import BUILTINS
from aios_blocks.policies.uris import BUILTIN_KINDS
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import replay, views_of
from aios_blocks.trace.workload import load_tasks

DATA = Path(__file__).parent / "data" / "trace"


def _node(nid: str, gpus: int, cpu: float, memory: int = 262144, model: str = "G2") -> Node:
    return Node(id=nid, cluster="c", cpu=cpu, memory=memory,
                gpus=[Gpu(id=f"{nid}-g{i}", model=model, memory=16384) for i in range(gpus)])


def _pick(views: dict[str, Any], needs: dict[str, Any], share: bool, workload: list[dict[str, Any]], seed: int = 1,
          **params: Any) -> dict[str, Any]:
    policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": share}, {"seed": seed, "workload": workload, **params})
    return policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": "b1", "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})


def _take(views: dict[str, Any], nid: str, gpus: list[str], needs: dict[str, Any], share: bool) -> None:
    node = capacity.copy_node(views[nid])
    capacity.take(node, gpus, needs, share)
    views[nid] = node


#: whole-GPU tasks with 8 CPUs each, and CPU-only tasks
WHOLE_AND_CPU = [{"cpu": 8, "gpus": 1, "weight": 0.5}, {"cpu": 8, "gpus": 0, "weight": 0.5}]
CPU_ONLY = {"gpus": 0, "gpuMemory": 0, "cpu": 8, "memory": 1024}


def test_it_is_a_builtin_resource_allocator() -> None:
    assert BUILTINS["builtin:fgd-plus"] is FgdPlusPolicy
    assert BUILTIN_KINDS["builtin:fgd-plus"] == ("resourceAllocator",)


def test_the_measure_counts_gpus_stranded_by_cpu_which_fgds_does_not() -> None:
    # 4 idle GPUs, CPUs for 3 tasks of 8: one GPU can never be used by this workload
    left = (1000, 1000, 1000, 1000)
    shapes = [{"cpu": 8, "gpus": 1, "weight": 1.0}]
    assert FillWorkload(shapes).frag("G2", 24, left) == 1000
    assert Workload(shapes).frag("G2", 24, left) == 0  # FGD: one task fits, nothing is fragment
    # both agree where no task fits at all, and where the CPUs cover every GPU
    assert FillWorkload(shapes).frag("G2", 7, left) == Workload(shapes).frag("G2", 7, left) == 4000
    assert FillWorkload(shapes).frag("G2", 32, left) == Workload(shapes).frag("G2", 32, left) == 0
    # shares: a GPU with 1000 free holds two 0.47s, 60 thousandths are left over
    assert FillWorkload([{"cpu": 1, "gpus": 1, "gpuShare": 0.47, "weight": 1.0}]).frag("G2", 64, (1000,)) == 60


def test_a_cpu_only_task_goes_where_its_cpus_strand_no_gpu_whatever_the_seed() -> None:
    # n-tight: 4 idle GPUs and 32 CPUs (one 8-CPU task per GPU, exactly); n-roomy: 8 GPUs and
    # 200 CPUs. 8 CPUs taken from n-tight strand a GPU; from n-roomy nothing. (The pack
    # tie-break alone would take n-tight, the node with fewer free GPUs.)
    views = views_of([_node("n-tight", 4, 32), _node("n-roomy", 8, 200)])
    for seed in range(8):
        assert _pick(views, CPU_ONLY, False, WHOLE_AND_CPU, seed=seed)["node_id"] == "n-roomy"
    # FGD's measure sees no difference (one more task still fits on both), so it goes by the seed
    fgd = Workload(WHOLE_AND_CPU)
    left = (1000,) * 4
    assert fgd.frag("G2", 24, left) - fgd.frag("G2", 32, left) == 0
    assert fgd.frag("G2", 192, left * 2) - fgd.frag("G2", 200, left * 2) == 0


def test_memory_strands_gpus_as_cpus_do() -> None:
    # equal CPUs and GPUs; n-lowmem has memory for only ~9 CPUs' worth of tasks (4 GiB per CPU):
    # a task taking 8 GiB there leaves memory for 7 CPUs, below one 8-CPU task: its GPUs strand
    views = views_of([_node("n-lowmem", 4, 64, memory=36864), _node("n-mem", 4, 64)])
    needs = {"gpus": 0, "gpuMemory": 0, "cpu": 1, "memory": 8192}
    for seed in range(8):
        assert _pick(views, needs, False, WHOLE_AND_CPU, seed=seed, memoryPerCpu=4096)["node_id"] == "n-mem"
    assert effective_cpu(64, 36864, 4096) == 9 and effective_cpu(64, 36864, 0) == 64
    assert memory_per_cpu({"memoryPerCpu": 4096}, needs) == 4096
    assert memory_per_cpu({"workload": [{"cpu": 2, "memory": 4096, "weight": 1}]}, needs) == 2048
    assert memory_per_cpu({}, needs) == 8192 and memory_per_cpu({}, {"cpu": 0}) == 0


def test_a_share_fills_the_partly_used_gpu_it_completes() -> None:
    # n-used: one GPU with 530 free (a 0.47 share on it) and an idle one; n-idle: 2 idle GPUs.
    # A 0.47 share completes the 530 GPU (60 left) and keeps two whole GPUs free elsewhere.
    share = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024, "gpuShare": 0.47}
    views = views_of([_node("n-used", 2, 32), _node("n-idle", 2, 32)])
    _take(views, "n-used", ["n-used-g0"], share, True)
    workload = [{"cpu": 1, "gpus": 1, "gpuShare": 0.47, "weight": 0.5}, {"cpu": 1, "gpus": 1, "weight": 0.5}]
    for seed in range(4):
        out = _pick(views, share, True, workload, seed=seed)
        assert (out["node_id"], out["gpus"]) == ("n-used", ["n-used-g0"])


def test_equal_fragmentation_packs_the_fuller_node() -> None:
    # a whole GPU, workload of whole GPUs: every node's measure is unchanged (0 before and
    # after); the node left with the least free GPU compute wins, so the idle one stays whole
    whole = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024}
    views = views_of([_node("n-a", 4, 64), _node("n-b", 4, 64)])
    _take(views, "n-b", ["n-b-g0"], whole, False)
    for seed in range(8):
        assert _pick(views, whole, False, [{"cpu": 1, "gpus": 1, "weight": 1.0}], seed=seed)["node_id"] == "n-b"


def test_replay_of_the_trace_sample_is_deterministic_per_seed() -> None:
    # (a 20-node sample says nothing about quality: the figures are on the whole trace, docs/trace.md)
    nodes, tasks = load_nodes(DATA / "nodes.csv", "s"), load_tasks(DATA / "pods.csv")
    a = asyncio.run(replay(nodes, tasks, "fgd-plus", seed=42)).as_dict()
    b = asyncio.run(replay(nodes, tasks, "fgd-plus", seed=42)).as_dict()
    assert a["policy"] == "builtin:fgd-plus" and a["placed"] > 0 and a["placed"] + a["failed"] == a["blocks"]
    assert a["alloc_curve"] == b["alloc_curve"] and a["failures"] == b["failures"]
    assert a["alloc_at_130"] >= a["alloc_at_100"] > 0


class _NoMemo(dict[Any, float]):
    """A memo that never remembers: every figure computed afresh."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default

    def __setitem__(self, key: Any, value: float) -> None:
        pass


class _Uncached(FgdPlusPolicy):
    """fgd-plus without its memos: the slow path (each node scored, every figure afresh)."""

    memoise = False
    rank_by_state = False

    def measure(self, shapes: list[dict[str, Any]]) -> BlendedWorkload:
        wl = super().measure(shapes)
        wl._memo = wl.fgd._memo = wl.fill._memo = _NoMemo()
        return wl


@pytest.mark.parametrize("seed", [42, 7])
def test_the_memoised_measure_makes_the_decisions_of_the_slow_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # memos keyed by the node state (per view, per (model, CPU, free compute per GPU)) change no
    # decision: every block of the sample goes to the same node and GPUs as measured afresh
    nodes, tasks = load_nodes(DATA / "nodes.csv", "s"), load_tasks(DATA / "pods.csv")
    fast = asyncio.run(replay(nodes, tasks, "fgd-plus", seed=seed))
    monkeypatch.setitem(BUILTINS, "builtin:fgd-plus", _Uncached)
    slow = asyncio.run(replay(nodes, tasks, "fgd-plus", seed=seed))
    assert len(fast.placements) > 50 and fast.placements == slow.placements
    assert fast.as_dict()["frag_curve"] == slow.as_dict()["frag_curve"]


def test_the_look_ahead_measure_does_not_depend_on_what_was_measured_before() -> None:
    # two CPU figures 0.05 apart fit a different number of 12-CPU tasks: a memo keyed by a
    # rounded CPU would give the second the first's figure
    shapes = [{"cpu": 12, "gpus": 1, "weight": 1.0}]
    left = (1000,) * 4
    a = FillWorkload(shapes)
    assert (a.frag("G2", 23.97, left), a.frag("G2", 24.0, left)) == (3000, 2000)
    b = FillWorkload(shapes)
    assert (b.frag("G2", 24.0, left), b.frag("G2", 23.97, left)) == (2000, 3000)
