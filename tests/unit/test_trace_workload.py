"""The GPU trace's tasks and the FGD artifact's protocol (docs/trace.md "Protocol"): the task CSV,
inflation by seeded samples up to a share of the cluster's GPUs, the seeded shuffle, and FGD's
target workload (the most frequent shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aios_blocks.trace.workload import Task, WorkloadError, inflate, load_tasks, parse_tasks, typical_shapes

DATA = Path(__file__).parent / "data" / "trace"


def test_task_csv_with_and_without_the_optional_columns() -> None:
    full = parse_tasks("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n"
                       "p1,6000,12288,1,460,,LS\np2,16000,32768,1,1000,V100M16|V100M32,BE\np3,8000,1024,0,0,nan,LS\n")
    assert full[0].resources() == {"gpus": 1, "gpuMemory": 0, "cpu": 6.0, "memory": 12288, "gpuShare": 0.46}
    assert full[0].sharing and full[0].milli_total == 460 and full[0].qos == "LS"
    assert full[1].resources()["gpuModels"] == ["V100M16", "V100M32"] and not full[1].sharing
    assert full[2].resources() == {"gpus": 0, "gpuMemory": 0, "cpu": 8.0, "memory": 1024} and full[2].gpu_spec == ""
    (bare,) = parse_tasks("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,12000,16384,8,1000\n")  # the multigpu files
    assert bare.milli_total == 8000 and bare.gpu_spec == "" and bare.resources()["gpus"] == 8


@pytest.mark.parametrize(("text", "message"), [
    ("name,cpu_milli,num_gpu,gpu_milli\np,1,0,0\n", "CSV header lacks memory_mib"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1500\n", "line 2: gpu_milli is per GPU, at most 1000"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,x,1,1,1\n", "line 2: cpu_milli must be a number"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "the task list is empty"),
])
def test_bad_task_lists_are_refused(text: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        parse_tasks(text)


def test_inflation_is_deterministic_for_a_seed_and_reaches_the_target() -> None:
    tasks = load_tasks(DATA / "pods.csv")
    cluster = sum(t.milli_total for t in tasks)  # the trace asks as much as the cluster has: 1.3 x adds samples
    a, b, c = inflate(tasks, cluster, 1.3, 42), inflate(tasks, cluster, 1.3, 42), inflate(tasks, cluster, 1.3, 43)
    assert [t.name for t in a] == [t.name for t in b]
    assert [t.name for t in a] != [t.name for t in c]
    total = sum(t.milli_total for t in a)
    assert total <= 1.3 * cluster and total > 1.3 * cluster - 8000  # stops within one task of the target
    # the trace's own tasks are all there (the list is below the target), the rest are named samples
    names = {t.name for t in a}
    assert {t.name for t in tasks} <= names and all("-tuned-" in n for n in names - {t.name for t in tasks})
    assert [t.name for t in a] != sorted(t.name for t in a)  # shuffled
    # above the target: seeded removals
    down = inflate(tasks, cluster, 0.5, 7)
    assert cluster * 0.5 - 8000 < sum(t.milli_total for t in down) <= cluster * 0.5
    assert [t.name for t in down] == [t.name for t in inflate(tasks, cluster, 0.5, 7)]
    assert {t.name for t in down} < {t.name for t in tasks}


def test_typical_shapes_cover_95_percent_of_the_tasks_most_frequent_first() -> None:
    tasks = [Task(f"a{i}", 6000, 1, 1, 460) for i in range(60)] + [Task(f"b{i}", 8000, 1, 0, 0) for i in range(33)] \
        + [Task(f"c{i}", 4000, 1, 2, 1000, "T4") for i in range(5)] + [Task(f"d{i}", 1000, 1, 8, 1000) for i in range(2)]
    shapes = typical_shapes(tasks)  # 60 + 33 < 95 tasks: the third shape is in, the fourth is not
    assert shapes == [{"cpu": 6.0, "gpus": 1, "weight": 0.6, "gpuShare": 0.46}, {"cpu": 8.0, "gpus": 0, "weight": 0.33},
                      {"cpu": 4.0, "gpus": 2, "weight": 0.05, "gpuModels": ["T4"]}]


def test_every_bad_task_row_is_named_at_once() -> None:
    """Only the first bad row was said."""
    text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,-1,100,1,1000\np2,100,abc,1,1000\np3,100,100,1,1000\np4,100,100,1,5000\n"
    with pytest.raises(WorkloadError) as exc:
        parse_tasks(text)
    assert str(exc.value).splitlines() == ["line 2: cpu_milli must be >= 0, got '-1'", "line 3: memory_mib must be a number, got 'abc'",
                                           "line 5: gpu_milli is per GPU, at most 1000, got 5000"]
