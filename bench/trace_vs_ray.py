"""Live placement against Ray placement groups, on the GPU trace, in one run (docs/trace.md "Live
vs Ray"; issue 34's speed target).

Ours: NATS JetStream (fsync on), Redis and the placement path's workers started as ``blocks
trace replay --live`` starts them (``trace.live.own_system``), the trace's node list imported
(each node's CPUs, memory, GPU count and model), and the replay's sampled, shuffled tasks (seed
42, the same protocol as ``--in-process``) created through the client: the first alone (the
workers' start-up), then ``--lat`` one at a time (create -> outcome, unloaded), then ``--tasks``
with ``--window`` creates in flight (placements/s: blocks placed / seconds from the first create
to the last outcome). Beside create -> ready (the issue's figure: our instance added and the block
ready) it prints create -> placement (the reservation committed and announced), the step a Ray
placement group's ready stands for. The simulated fleet's instance start is off (``AIOS_SIM_START_DELAY_S=0``,
``--sim-start-delay`` sets it): a placement group starts nothing either.

Ray: a local Ray with the same inventory as custom resources and the same tasks as one-bundle
placement groups, the same phases (``bench/ray_trace.py`` says how, and why it leans Ray's way).

    .venv/bin/python -m bench.trace_vs_ray [--tasks 2000] [--lat 200] [--window 64] [--json out.json]

``make bench-peer`` installs ray and runs it; without ray the Ray side is skipped, said so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

try:
    from . import common, ray_trace
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import ray_trace  # type: ignore[no-redef]

from aios_blocks.cli.client import Client
from aios_blocks.schemas.spec import Cluster, Node
from aios_blocks.trace import live
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import setup
from aios_blocks.trace.workload import Task, load_tasks

TRACE = common.ROOT / "bench" / "traces" / "openb-2023"
NODES = TRACE / "openb_node_list_gpu_node.csv"
PODS = TRACE / "openb_pod_list_default.csv"
#: our default GPU placement (docs/trace.md)
POLICY = "fgd-plus"


def phases(nodes: list[Node], tasks: list[Task], policy: str, seed: int, lat: int, burst: int) -> tuple[Task, list[Task], list[Task]]:
    """The replay's task list for the seed (``--in-process``'s), cut into the phases: the warm-up
    block, the one-at-a-time ones, the burst."""
    pods = setup(nodes, tasks, policy, seed, 1.3, 0).pods  # the sampling setting does not change the list
    if len(pods) < 1 + lat + burst:
        raise SystemExit(f"the replay samples {len(pods)} tasks; --lat {lat} + --tasks {burst} + 1 do not fit")
    return pods[0], pods[1:1 + lat], pods[1 + lat:1 + lat + burst]


def summary(kind: str, lat: list[float], placed: int, decided: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"side": kind, "p50_ms": 1000 * common.pct(lat, 50), "p99_ms": 1000 * common.pct(lat, 99),
            "timed": len(lat), "burst_placed": placed, "burst_decided": decided, "burst_seconds": seconds,
            "per_s": placed / seconds if seconds else float("nan"), **extra}


async def ours_on(client: Any, nodes: list[Node], tasks: list[Task], policy: str = POLICY, seed: int = 42, lat: int = 200,
                  burst: int = 2000, window: int = 64, timeout: float = 300.0, sample_nodes: int = 0) -> dict[str, Any]:
    """Our side through the system ``client`` is connected to (one with no cluster yet);
    ``sample_nodes``: the resourceAllocator's ``sampleNodes`` (0: every node, as the replay)."""
    warm, one_by_one, many = phases(nodes, tasks, policy, seed, lat, burst)
    st = setup(nodes, tasks, policy, seed, 1.3, sample_nodes)
    for comp in live.components(st):
        await client.add_component(comp)
    await client.import_nodes(Cluster(id=live.CLUSTER), [n.model_copy(update={"cluster": live.CLUSTER}) for n in nodes])
    outcomes = live.Outcomes(steps=("placement",))
    await outcomes.attach(client.bus)
    await live.submit(client, outcomes, [warm], 1, timeout)
    timed = await live.submit(client, outcomes, one_by_one, 1, timeout)
    # create -> placement: the reservation committed and announced (the instance not started yet),
    # what a Ray placement group's ready means; beside create -> ready, the figure
    placed_at = outcomes.seen["placement"]
    reserved = [placed_at[d.bid] - d.created for d in timed if d.bid in placed_at]
    cpu0, t0 = ray_trace.cpu_tree(), time.perf_counter()
    got = await live.submit(client, outcomes, many, window, timeout)
    seconds = max(d.done for d in got) - t0 if got else 0.0
    return summary("ours", [d.seconds for d in timed], sum(d.kind == "ready" for d in got), len(got), seconds,
                   window=window, sample_nodes=sample_nodes, one_by_one_failed=sum(d.kind != "ready" for d in timed),
                   placement_p50_ms=1000 * common.pct(reserved, 50) if reserved else float("nan"),
                   placement_p99_ms=1000 * common.pct(reserved, 99) if reserved else float("nan"),
                   burst_failed=sum(d.kind != "ready" for d in got), burst_cpu_s=ray_trace.cpu_since(cpu0, ray_trace.cpu_tree()))


async def ours(nodes: list[Node], tasks: list[Task], policy: str, seed: int, lat: int, burst: int, window: int,
               sample_nodes: int = 0, log: Any = print) -> dict[str, Any]:
    async with live.own_system(log) as (nats_url, redis_url, _):
        client = await Client.open(nats_url, redis_url)
        try:
            return await ours_on(client, nodes, tasks, policy, seed, lat, burst, window, sample_nodes=sample_nodes)
        finally:
            await client.close()


def rows_of(nodes: list[Node]) -> list[ray_trace.NodeRow]:
    return [(round(n.cpu * 1000), n.memory, len(n.gpus), n.gpus[0].model if n.gpus else "") for n in nodes]


def row_of(t: Task) -> ray_trace.TaskRow:
    return (t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli, tuple(t.models()))


def ray_side(nodes: list[Node], tasks: list[Task], policy: str, seed: int, lat: int, burst: int, window: int = 64) -> dict[str, Any]:
    warm, one_by_one, many = phases(nodes, tasks, policy, seed, lat, burst)
    got = ray_trace.figures(rows_of(nodes), [row_of(warm)], [row_of(t) for t in one_by_one], [row_of(t) for t in many],
                            window=window)
    return summary("ray", got["latencies"], got["burst_ready"], got["burst"], got["burst_seconds"],
                   one_by_one_failed=got["one_by_one_unplaced"], burst_failed=got["burst"] - got["burst_ready"],
                   window=window, burst_cpu_s=got["burst_cpu_s"])


def table(o: dict[str, Any], r: dict[str, Any] | None) -> str:
    lines = [f"{'':34} {'ours':>12} {'Ray':>12} {'ours/Ray':>10}"]

    def line(name: str, key: str, unit: str) -> None:
        a, b = o[key], (r or {}).get(key, float("nan"))
        lines.append(f"{name:34} {a:>10.1f}{unit:>2} {b:>10.1f}{unit:>2} {a / b if b == b and b else float('nan'):>9.2f}x")

    line("placements/s (burst, placed)", "per_s", "/s")
    line("create->ready p50 (one at a time)", "p50_ms", "ms")
    line("create->ready p99 (one at a time)", "p99_ms", "ms")
    if "placement_p50_ms" in o:  # ours reserved (placement event) against Ray's group ready: the same step
        a, b = o["placement_p50_ms"], (r or {}).get("p50_ms", float("nan"))
        lines.append(f"{'create->placement p50 (reserved)':34} {a:>10.1f}ms {b:>10.1f}ms "
                     f"{a / b if b == b and b else float('nan'):>9.2f}x")
    lines.append(f"burst: ours {o['burst_placed']} placed of {o['burst_decided']} in {o['burst_seconds']:.2f} s "
                 f"({o['window']} in flight)" + (f"; Ray {r['burst_placed']} of {r['burst_decided']} in "
                                                 f"{r['burst_seconds']:.2f} s ({r['window'] or 'all'} in flight)" if r else ""))
    for side in (o, r):
        if side and side.get("burst_cpu_s") and side["burst_placed"]:
            per = {k: 1000 * v / side["burst_placed"] for k, v in side["burst_cpu_s"].items()}
            lines.append(f"{side['side']}: CPU ms per placement in the burst, {sum(per.values()):.1f} in all: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05))
    if r:
        lines.append(f"target (issue 34): placements/s >= Ray's: {'met' if o['per_s'] >= r['per_s'] else 'NOT met'}; "
                     f"p50 <= 4 x Ray's: {'met' if o['p50_ms'] <= 4 * r['p50_ms'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace_vs_ray", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=Path, default=NODES)
    ap.add_argument("--pods", type=Path, default=PODS)
    ap.add_argument("--max-nodes", type=int, default=0, help="the first N nodes of the list only (0: all)")
    ap.add_argument("--policy", default=POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--lat", type=int, default=200, help="tasks created one at a time (p50/p99)")
    ap.add_argument("--tasks", type=int, default=2000, help="tasks of the burst (placements/s)")
    ap.add_argument("--window", type=int, default=64, help="our creates in flight in the burst")
    ap.add_argument("--ray-window", type=int, default=64, help="Ray's groups not ready yet in the burst (0: all at once)")
    ap.add_argument("--sample-nodes", type=int, default=0,
                    help="our resourceAllocator's sampleNodes (0: every node, as `blocks trace replay`; 100: a block's default)")
    ap.add_argument("--sim-start-delay", default="0", help="AIOS_SIM_START_DELAY_S of our simulated fleet")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    nodes = load_nodes(a.nodes, live.CLUSTER)
    if a.max_nodes:
        nodes = nodes[:a.max_nodes]
    tasks = load_tasks(a.pods)
    print(f"{len(nodes)} nodes, {sum(len(n.gpus) for n in nodes)} GPUs; policy {a.policy}, seed {a.seed}; "
          f"{a.lat} one at a time, {a.tasks} in the burst; sampleNodes {a.sample_nodes}", flush=True)
    with common.env_set("AIOS_SIM_START_DELAY_S", a.sim_start_delay):
        o = common.run(ours(nodes, tasks, a.policy, a.seed, a.lat, a.tasks, a.window, a.sample_nodes))
    print(f"ours: {json.dumps(o)}", flush=True)
    r = None
    if a.skip_ray:
        print("Ray: skipped (--skip-ray)")
    elif importlib.util.find_spec("ray") is None:
        print("Ray: skipped, ray is not installed (`make bench-peer` installs it: .venv/bin/pip install 'ray>=2.9')")
    else:
        r = ray_side(nodes, tasks, a.policy, a.seed, a.lat, a.tasks, a.ray_window)
        print(f"ray: {json.dumps(r)}", flush=True)
    print(table(o, r))
    if a.json:
        with contextlib.suppress(OSError):
            a.json.write_text(json.dumps({"ours": o, "ray": r, "nodes": len(nodes), "policy": a.policy, "seed": a.seed,
                                          "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
