"""The Ray side of ``bench/trace_vs_ray.py``: the GPU trace's inventory as custom resources of a
local Ray instance, its tasks as one-bundle placement groups of the same shapes. Imports nothing
of aios_blocks (plain tuples and dicts in), so it runs in a venv that has only ray.

The inventory is summed into pools (Ray's placement-group scheduler places a bundle on one Ray
node; 1,213 raylets do not fit a 2-core machine, so there is one, holding every pool):

* ``t_cpu`` (thousandths of a CPU), ``t_mem`` (MiB), ``t_gpu`` (GPUs of any model) and
  ``t_model_<MODEL>`` (GPUs of that model);
* a task asks ``t_cpu``/``t_mem`` as the trace does, ``t_gpu`` its GPU count (a GPU-sharing task
  its share, a fraction: Ray's fractional resources), and a task limited to GPU models also
  ``t_model_<first allowed model>`` as much (a bundle cannot say "this model or that one").

So Ray decides against totals: no node, no GPU to fit a task into, no fragmentation; its work per
group is a lower bound of ours (which fits each task on one node and its GPUs, with FGD-like
scoring over every node), and the comparison leans Ray's way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

#: a trace node: (cpu_milli, memory_mib, gpus, model)
NodeRow = tuple[int, int, int, str]
#: a trace task: (cpu_milli, memory_mib, num_gpu, gpu_milli, allowed models)
TaskRow = tuple[int, int, int, int, tuple[str, ...]]


def pools(nodes: Iterable[NodeRow]) -> dict[str, float]:
    """The Ray node's custom resources: the inventory summed per pool."""
    out: dict[str, float] = {"t_cpu": 0, "t_mem": 0, "t_gpu": 0}
    for cpu, mem, gpus, model in nodes:
        out["t_cpu"] += cpu
        out["t_mem"] += mem
        if gpus:
            out["t_gpu"] += gpus
            out[f"t_model_{model}"] = out.get(f"t_model_{model}", 0) + gpus
    return {k: v for k, v in out.items() if v}


def bundle(task: TaskRow) -> dict[str, float]:
    """The one bundle of a task's placement group (zero amounts left out: Ray refuses them)."""
    cpu, mem, num_gpu, gpu_milli, models = task
    gpu = num_gpu * gpu_milli / 1000 if num_gpu == 1 and 0 < gpu_milli < 1000 else float(num_gpu if gpu_milli else 0)
    out: dict[str, float] = {"t_cpu": cpu, "t_mem": mem, "t_gpu": gpu}
    if gpu and models:
        out[f"t_model_{models[0]}"] = gpu
    return {k: v for k, v in out.items() if v}


def cpu_tree(root: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``root`` (this process by default) and every
    process under it, by program name (the workers by their kinds); Linux ``/proc``, empty
    elsewhere. Two snapshots around a phase give its CPU per process, free of the machine's load."""
    import os

    root = root or os.getpid()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    procs: dict[int, tuple[int, str, float]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()
        name = os.path.basename(args[0].split()[0]) if args else stat.split("(", 1)[1].rsplit(")", 1)[0]
        if "-m" in args and args.index("-m") + 2 < len(args) and args[args.index("-m") + 1] == "aios_blocks.runtime.main":
            name = args[args.index("-m") + 2]
        procs[pid] = (int(rest[1]), name, (int(rest[11]) + int(rest[12])) / tick)
    out: dict[str, float] = {}
    for pid, (_ppid, name, secs) in procs.items():
        p, seen = pid, 0
        while p and p != root and p in procs and seen < 64:
            p, seen = procs[p][0], seen + 1
        if p == root:
            key = "driver" if pid == root else name
            out[key] = out.get(key, 0.0) + secs
    return out


def cpu_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per process name between two ``cpu_tree`` snapshots (processes that ended
    in between are not counted)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def _wait_all(refs: list[Any], settle_s: float) -> tuple[int, float]:
    """Wait for the groups' ``ready()`` refs: (how many got ready, perf_counter of the last one).
    A group that fits nowhere stays pending in Ray for good: the wait ends ``settle_s`` after the
    last progress."""
    import ray

    pending, ready, last = list(refs), 0, time.perf_counter()
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.01)
        if done:
            ready += len(done)
            last = time.perf_counter()
        elif time.perf_counter() - last > settle_s:
            break
    return ready, last


def _windowed(bundles: list[dict[str, float]], window: int, settle_s: float) -> tuple[int, float]:
    """Create the groups in order with at most ``window`` not ready yet (our client's pattern):
    (how many got ready, perf_counter of the last one). Stops ``settle_s`` after the last
    progress (groups that fit nowhere stay pending)."""
    import ray
    from ray.util.placement_group import placement_group

    todo, ready, last = list(reversed(bundles)), 0, time.perf_counter()
    flying: list[Any] = []
    while todo or flying:
        while todo and len(flying) < window:
            flying.append(placement_group([todo.pop()], strategy="PACK").ready())
        done, flying = ray.wait(flying, num_returns=1, timeout=settle_s)
        if not done:
            break
        ready, last = ready + len(done), time.perf_counter()
    return ready, last


def figures(nodes: list[NodeRow], warm: list[TaskRow], one_by_one: list[TaskRow], burst: list[TaskRow],
            settle_s: float = 20.0, window: int = 64) -> dict[str, Any]:
    """On a fresh local Ray with ``pools(nodes)``: the ``warm`` groups, then create->ready of each
    ``one_by_one`` group alone (groups that never get ready are counted, not timed), then the
    ``burst`` groups with ``window`` not ready at most (0: all created at once, where Ray 2.x's
    scheduler slows to a few groups/s on 2 cores); groups are never removed (as our blocks).
    Returns the latencies (s), the burst's ready count and seconds (its first create to its last
    ready)."""
    import ray
    from ray.util.placement_group import placement_group

    ray.init(num_cpus=1, resources=pools(nodes), include_dashboard=False, object_store_memory=80 * 1024**2,
             log_to_driver=False, logging_level=logging.ERROR)
    try:
        _wait_all([placement_group([bundle(t)], strategy="PACK").ready() for t in warm], settle_s)
        lat, unplaced = [], 0
        for t in one_by_one:
            t0 = time.perf_counter()
            ref = placement_group([bundle(t)], strategy="PACK").ready()
            done, _ = ray.wait([ref], timeout=settle_s)
            if done:
                lat.append(time.perf_counter() - t0)
            else:
                unplaced += 1
        cpu0, t0 = cpu_tree(), time.perf_counter()
        if window:
            ready, last = _windowed([bundle(t) for t in burst], window, settle_s)
        else:
            ready, last = _wait_all([placement_group([bundle(t)], strategy="PACK").ready() for t in burst], settle_s)
        return {"latencies": lat, "one_by_one_unplaced": unplaced, "burst": len(burst), "burst_ready": ready,
                "burst_seconds": last - t0, "burst_cpu_s": cpu_since(cpu0, cpu_tree())}
    finally:
        ray.shutdown()
