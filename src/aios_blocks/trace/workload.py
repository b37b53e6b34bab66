"""The GPU trace's tasks (``openb_pod_list_*.csv``) as block requests, and the FGD artifact's
workload protocol: inflate the task list with seeded samples until its GPU requests reach
``inflate`` x the cluster's GPUs (``TunePodsByNodeTotalResource``), then order it by name and
shuffle it with the same seeded generator (``SortClusterPods``). Pure; docs/trace.md "Protocol".

The generator is Python's ``random.Random(seed)``, not Go's ``math/rand``: the same seed draws a
different sample than the artifact's, so single runs differ and means over seeds compare.
"""

from __future__ import annotations

import csv
import io
import random
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..schemas.records import Needs

UNITS = 1000
#: share of the tasks whose shapes make up FGD's target workload (the artifact's
#: ``podPopularityThreshold: 95``, CPU-only tasks included)
TYPICAL_SHARE = 0.95


class WorkloadError(ValueError):
    """A task list that cannot be read; the message says which lines and why, one line each."""


#: the most rows' problems one error lists (then how many more)
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class Task:
    """One task of the trace: ``gpu_milli`` is per GPU (1000 for a whole one, 0 for CPU-only)."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: str = ""
    qos: str = ""

    @property
    def milli_total(self) -> int:
        """GPU compute asked, in thousandths of a GPU."""
        return self.num_gpu * self.gpu_milli

    @property
    def sharing(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < UNITS

    def models(self) -> list[str]:
        return [m for m in self.gpu_spec.split("|") if m] if self.gpu_spec else []

    def resources(self) -> Needs:
        """The block's ``resources``: CPUs, memory, GPUs, and for a GPU-sharing task its
        ``gpuShare``; the allowed models as ``gpuModels``."""
        out: Needs = {"gpus": self.num_gpu, "gpuMemory": 0, "cpu": self.cpu_milli / 1000, "memory": self.memory_mib}
        if self.sharing:
            out["gpuShare"] = self.gpu_milli / UNITS
        if self.models():
            out["gpuModels"] = self.models()
        return out


def _int(row: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = row.get(name)
    if value in (None, ""):
        if default is not None:
            return default
        raise WorkloadError(f"{where}: missing {name}")
    try:
        out = int(float(str(value)))
    except ValueError:
        raise WorkloadError(f"{where}: {name} must be a number, got {value!r}") from None
    if out < 0:
        raise WorkloadError(f"{where}: {name} must be >= 0, got {value!r}")
    return out


def parse_tasks(text: str) -> list[Task]:
    """The tasks of a pod list CSV (``name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,...]``)."""
    reader = csv.DictReader(io.StringIO(text))
    missing = {"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"} - set(reader.fieldnames or [])
    if missing:
        raise WorkloadError(f"CSV header lacks {', '.join(sorted(missing))} (expected name,cpu_milli,memory_mib,num_gpu,gpu_milli,...)")
    out, problems = [], []  # every row's problems, said at once
    for i, row in enumerate(reader, start=2):
        try:
            out.append(_task(row, f"line {i}"))
        except WorkloadError as exc:
            problems.append(str(exc))
    if problems:
        more = f"\n... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise WorkloadError("\n".join(problems[:MAX_PROBLEMS]) + more)
    if not out:
        raise WorkloadError("the task list is empty")
    return out


def _task(row: dict[str, Any], where: str) -> Task:
    num_gpu, gpu_milli = _int(row, "num_gpu", where), _int(row, "gpu_milli", where)
    if gpu_milli > UNITS:
        raise WorkloadError(f"{where}: gpu_milli is per GPU, at most {UNITS}, got {gpu_milli}")
    if num_gpu and not gpu_milli:
        gpu_milli = UNITS
    spec = str(row.get("gpu_spec") or "").strip()
    return Task(str(row["name"]), _int(row, "cpu_milli", where), _int(row, "memory_mib", where), num_gpu,
                gpu_milli if num_gpu else 0, "" if spec.lower() == "nan" else spec, str(row.get("qos") or ""))


def load_tasks(path: Path) -> list[Task]:
    return parse_tasks(path.read_text(encoding="utf-8"))


def inflate(tasks: list[Task], cluster_milli: int, ratio: float, seed: int) -> list[Task]:
    """The artifact's protocol: the trace's tasks, plus seeded samples of them while the GPU
    requests stay within ``ratio`` x the cluster's GPU compute (or seeded removals while above
    it), ordered by name then shuffled by the same generator. Deterministic for a seed."""
    rng = random.Random(seed)
    pods = list(tasks)
    total = sum(t.milli_total for t in pods)
    target = ratio * cluster_milli
    if ratio > 0 and total > target:
        while total > target and pods:
            total -= pods.pop(rng.randrange(len(pods))).milli_total
    elif ratio > 0 and total < target:
        i = 0
        while True:
            t = tasks[rng.randrange(len(tasks))]
            # the artifact stops at the first sample whose per-GPU share would pass the target
            if total + t.gpu_milli > target:
                break
            pods.append(replace(t, name=f"{t.name}-tuned-{i}"))
            total += t.milli_total
            i += 1
    pods.sort(key=lambda t: t.name)
    rng.shuffle(pods)
    return pods


def typical_shapes(tasks: list[Task], share: float = TYPICAL_SHARE) -> list[dict[str, Any]]:
    """FGD's target workload: the most frequent task shapes (CPU, GPUs, share, models) that
    together make up ``share`` of the tasks, each with its frequency (``weight``)."""
    counts = Counter((t.cpu_milli, t.gpu_milli, t.num_gpu, t.gpu_spec) for t in tasks)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out, cum = [], 0
    for (cpu, milli, gpus, spec), n in ranked:
        if cum >= share * len(tasks):
            break
        cum += n
        shape: dict[str, Any] = {"cpu": cpu / 1000, "gpus": gpus, "weight": n / len(tasks)}
        if gpus == 1 and 0 < milli < UNITS:
            shape["gpuShare"] = milli / UNITS
        if spec:
            shape["gpuModels"] = [m for m in spec.split("|") if m]
        out.append(shape)
    return out


def multi_gpu_shapes(tasks: list[Task], typical: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The multi-GPU task shapes (CPU, GPUs, models) that ``typical`` (FGD's target workload)
    leaves out, each with its frequency (``weight``): rare by count (the 95 % cut drops them: on
    the default trace all 75 tasks of 2, 4 and 8 GPUs, 0.9 % of the tasks) but 6 % of the GPU
    requests, and only nodes with that many free GPUs and CPUs take them
    (``builtin:fgd-plus``'s ``parameters.multiGpu``, docs/trace.md "Our policy", 7.)."""
    have = {(round(float(s.get("cpu", 0)) * 1000), int(s.get("gpus", 0)), "|".join(s.get("gpuModels") or ()))
            for s in typical if int(s.get("gpus", 0) or 0) > 1}
    counts = Counter((t.cpu_milli, t.num_gpu, t.gpu_spec) for t in tasks if t.num_gpu > 1)
    out: list[dict[str, Any]] = []
    for (cpu, gpus, spec), n in sorted(counts.items()):
        models = [m for m in spec.split("|") if m] if spec else []
        if (cpu, gpus, "|".join(models)) in have:
            continue
        shape: dict[str, Any] = {"cpu": cpu / 1000, "gpus": gpus, "weight": n / len(tasks)}
        if models:
            shape["gpuModels"] = models
        out.append(shape)
    return out
