"""Where a live create's time goes, step by step (docs/trace.md "Live vs Ray"): the placement path's
workers started as ``bench.trace_vs_ray`` starts them (NATS JetStream with fsync, Redis, parser +
gateway, controller, simulated fleet with no start delay), the trace's node list imported, and
the replay's tasks for the seed created one at a time; a core NATS subscription on ``aios.>``
notes when each step's event reached a subscriber, counted from the client's create. Prints,
per event, the median over the blocks (the first block, the workers' start-up, is left out).

    .venv/bin/python -m bench.trace_steps [--lat 100] [--tasks 0 --window 64] [--max-nodes 0] [--policy fgd-plus] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

try:
    from . import common
    from . import trace_vs_ray as tv
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import trace_vs_ray as tv  # type: ignore[no-redef]

from aios_blocks.cli.client import Client
from aios_blocks.schemas.spec import Cluster, Node
from aios_blocks.trace import live
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import block_id, setup
from aios_blocks.trace.workload import Task, load_tasks


def step_of(subject: str, bid: str) -> str:
    """An event's subject without its ids: ``aios.block.<bid>.instance.<iid>.added`` ->
    ``block.instance.added``, ``aios.cluster.<cid>.allocation`` -> ``cluster.allocation``."""
    parts = subject.split(".")[1:]
    if parts and parts[0] in ("block", "cluster", "node", "hint") and len(parts) > 1:
        parts = [parts[0], *parts[2:]]
    return ".".join(p for p in parts if not p.startswith(bid))


async def steps_on(client: Any, nodes: list[Node], tasks: list[Task], policy: str = tv.POLICY, seed: int = 42,
                   lat: int = 100, timeout: float = 120.0, burst: int = 0, window: int = 64) -> dict[str, Any]:
    """Per step, the milliseconds from the create to its event (medians over ``lat`` blocks), and
    the create -> ready (or failed) median; through the system ``client`` is connected to."""
    warm, one_by_one, _ = tv.phases(nodes, tasks, policy, seed, lat, 0)
    st = setup(nodes, tasks, policy, seed, 1.3, 0)
    for comp in live.components(st):
        await client.add_component(comp)
    await client.import_nodes(Cluster(id=live.CLUSTER), [n.model_copy(update={"cluster": live.CLUSTER}) for n in nodes])
    outcomes = live.Outcomes()
    await outcomes.attach(client.bus)
    seen: list[tuple[float, str]] = []
    policy_us: dict[str, list[int]] = {}

    async def note(msg: Any) -> None:
        seen.append((time.perf_counter(), msg.subject))
        for d in _decisions(msg.data):  # the policy calls the step's event carries: how long each took
            policy_us.setdefault(f"{d.get('kind', '?')}/{d.get('action', '?')}", []).append(int(d.get("duration_us", 0)))

    sub = await client.bus.nc.subscribe("aios.>", cb=note)
    await client.bus.nc.flush()
    await live.submit(client, outcomes, [warm], 1, timeout)
    per: dict[str, list[float]] = {}
    totals: list[float] = []
    policy_us.clear()
    for t in one_by_one:
        seen.clear()
        t0 = time.perf_counter()
        (done,) = await live.submit(client, outcomes, [t], 1, timeout)
        await asyncio.sleep(0.005)  # the last events' delivery to this subscription
        totals.append(1000 * done.seconds)
        first: dict[str, float] = {}
        for at, subject in seen:
            first.setdefault(step_of(subject, block_id(t)), 1000 * (at - t0))
        for step, ms in first.items():
            per.setdefault(step, []).append(ms)
    burst_steps: dict[str, Any] = {}
    if burst:
        burst_steps = await _burst(client, outcomes, seen, tasks_after(nodes, tasks, policy, seed, lat, burst), window, timeout)
    await sub.unsubscribe()
    steps = {s: {"median_ms": statistics.median(v), "blocks": len(v)} for s, v in per.items()}
    policies = {k: {"median_ms": statistics.median(v) / 1000, "calls": len(v)} for k, v in sorted(policy_us.items())}
    return {"p50_ms": statistics.median(totals), "timed": len(totals),
            "steps": dict(sorted(steps.items(), key=lambda kv: kv[1]["median_ms"])), "policies": policies,
            "burst": burst_steps}


def tasks_after(nodes: list[Node], tasks: list[Task], policy: str, seed: int, lat: int, burst: int) -> list[Task]:
    """The burst's tasks: those after the one-at-a-time ones (``trace_vs_ray``'s phases)."""
    return tv.phases(nodes, tasks, policy, seed, lat, burst)[2]


async def _burst(client: Any, outcomes: live.Outcomes, seen: list[tuple[float, str]], many: list[Task], window: int,
                 timeout: float) -> dict[str, Any]:
    """``many`` created with ``window`` in flight: per step, the median and p90 of each block's
    time from its create to that step's event, and the placements/s."""
    seen.clear()
    bids = {block_id(t) for t in many}
    t0 = time.perf_counter()
    done = await live.submit(client, outcomes, many, window, timeout)
    seconds = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    firsts: dict[str, dict[str, float]] = {}
    for at, subject in seen:
        bid = next((p for p in subject.split(".")[2:3] if p in bids), None)
        if bid is not None:
            firsts.setdefault(bid, {}).setdefault(step_of(subject, bid), at)
    per: dict[str, list[float]] = {}
    for steps in firsts.values():
        start = steps.get("block.create")
        if start is None:
            continue
        for step, at in steps.items():
            per.setdefault(step, []).append(1000 * (at - start))
    out = {s: {"median_ms": statistics.median(v), "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))], "blocks": len(v)}
           for s, v in per.items()}
    return {"per_s": sum(d.kind == "ready" for d in done) / seconds, "seconds": seconds, "window": window,
            "steps": dict(sorted(out.items(), key=lambda kv: kv[1]["median_ms"]))}


def _decisions(raw: bytes) -> list[dict[str, Any]]:
    """The decision records an event's data carries (``decisions``, ``trace``), else ``[]``."""
    try:
        data = json.loads(raw).get("data")
    except Exception:
        return []
    if not isinstance(data, dict):
        return []
    out = [d for k in ("decisions", "trace") for d in (data.get(k) or []) if isinstance(d, dict)]
    if "duration_us" in data and "action" in data:  # a decision event of its own
        out.append(data)
    return out


async def run(nodes: list[Node], tasks: list[Task], policy: str, seed: int, lat: int, burst: int = 0,
              window: int = 64) -> dict[str, Any]:
    async with live.own_system(print) as (nats_url, redis_url, _):
        client = await Client.open(nats_url, redis_url)
        try:
            return await steps_on(client, nodes, tasks, policy, seed, lat, burst=burst, window=window)
        finally:
            await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=Path, default=tv.NODES)
    ap.add_argument("--pods", type=Path, default=tv.PODS)
    ap.add_argument("--max-nodes", type=int, default=0, help="the first N nodes of the list only (0: all)")
    ap.add_argument("--policy", default=tv.POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--lat", type=int, default=100, help="blocks created one at a time")
    ap.add_argument("--tasks", type=int, default=0, help="then this many blocks with --window in flight (a burst)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    nodes = load_nodes(a.nodes, live.CLUSTER)
    if a.max_nodes:
        nodes = nodes[:a.max_nodes]
    with common.env_set("AIOS_SIM_START_DELAY_S", "0"):
        got = common.run(run(nodes, load_tasks(a.pods), a.policy, a.seed, a.lat, a.tasks, a.window))
    print(f"{len(nodes)} nodes, policy {a.policy}, {got['timed']} blocks one at a time: create -> outcome p50 "
          f"{got['p50_ms']:.1f} ms; each step's event, median ms after the create:")
    prev = 0.0
    for step, s in got["steps"].items():
        print(f"  {step:36} {s['median_ms']:7.1f}  (+{s['median_ms'] - prev:5.1f})  {s['blocks']} blocks")
        prev = s["median_ms"]
    print("policy calls carried by those events, median ms each:")
    for name, p in got["policies"].items():
        print(f"  {name:36} {p['median_ms']:7.2f}  {p['calls']} calls")
    if got["burst"]:
        b = got["burst"]
        print(f"burst: {a.tasks} blocks, {b['window']} in flight, {b['per_s']:.1f} placements/s; per step, ms after "
              "each block's create (median / p90):")
        for step, s in b["steps"].items():
            print(f"  {step:36} {s['median_ms']:7.1f} / {s['p90_ms']:7.1f}  {s['blocks']} blocks")
    if a.json:
        a.json.write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
