"""Placement benchmark: raw stack limits, warm create->ready latency, burst throughput.

Prints figures (never pass/fail) and writes bench/results/latest.json. Every loop is bounded in
count and time; all traffic goes to 127.0.0.1 (embedded servers).

    .venv/bin/python bench/placement.py [--blocks 150] [--latency-samples 30] [--nodes 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from aios_blocks.bus.nats_bus import Bus
from aios_blocks.cli.client import TERMINAL, Client, event_kind
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import Store
from aios_blocks.workers.embedded import EmbeddedServers
from aios_blocks.workers.supervisor import Supervisor

COMPONENT = {
    "componentURI": "aios://bench/model",
    "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"},
    ],
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def raw_limits(nats_url: str, redis_url: str, n: int = 2000) -> dict[str, float]:
    """One-process ceilings of the parts: JetStream publish+ack, Redis atomic reservation."""
    bus = await Bus.open(nats_url, "bench")
    await bus.ensure_stream()
    t = time.perf_counter()
    for i in range(n):
        await bus.publish_raw(f"aios.bench.raw.{i % 10}", b"{}", msg_id=f"raw-{i}")
    js_rate = n / (time.perf_counter() - t)
    await bus.close()
    store = Store.open(redis_url)
    node = Node(id="raw-n", cluster="rawc", cpu=1e9, memory=10**12, gpus=[Gpu(id="raw-g", memory=10**9)])
    await store.put_node(node)
    t = time.perf_counter()
    for i in range(n):
        p = {"iid": f"raw-{i}", "block": "raw", "node": "raw-n", "gpus": ["raw-g"], "cpu": 1, "mem": 1,
             "gpu_mem": 1, "exclusive": False, "share": True}
        await store.reserve_gang("rawc", [p])
    redis_rate = n / (time.perf_counter() - t)
    await store.close()
    return {"jetstream_publish_ack_per_s": js_rate, "redis_reserve_per_s": redis_rate}


async def run(args: argparse.Namespace) -> dict[str, object]:
    data = Path(tempfile.mkdtemp(prefix="aios-bench-"))
    servers = EmbeddedServers(data_dir=data).start()
    sup = Supervisor(servers.nats_url, servers.redis_url, log_dir=str(data / "logs")).start()
    client = await Client.open(servers.nats_url, servers.redis_url)
    try:
        limits = await raw_limits(servers.nats_url, servers.redis_url)
        await client.add_component(COMPONENT)
        for i in range(args.clusters):
            await client.add_sim_cluster(f"b{i}", nodes=args.nodes, gpus=8)
        spec = {"blockComponentURI": "aios://bench/model", "minInstances": 1, "maxInstances": 1}
        # warm-up, then sequential create -> ready latency (unloaded)
        await client.wait(await client.submit(dict(spec)), 60)
        lat = []
        deadline = time.time() + 120
        for _ in range(args.latency_samples):
            if time.time() > deadline:
                break
            t = time.perf_counter()
            kind, _ = await client.wait(await client.submit(dict(spec)), 60)
            lat.append(time.perf_counter() - t)
            assert kind == "ready", kind
        # burst: N blocks at once
        t = time.perf_counter()
        bids = set(await asyncio.gather(*(client.submit(dict(spec)) for _ in range(args.blocks))))
        done: dict[str, str] = {}
        async with asyncio.timeout(300):
            async for subject, _env in client.follow("*", from_start=False):
                bid, kind = subject.split(".")[2], event_kind(subject)
                if bid in bids and kind in TERMINAL:
                    done[bid] = kind
                    if len(done) == len(bids):
                        break
        burst_s = time.perf_counter() - t
        ready = sum(1 for k in done.values() if k == "ready")
    finally:
        await client.close()
        sup.stop()
        servers.stop()
    steps_per_block = 14  # messages through the stream per 1-instance block on 3 clusters
    blocks_per_s = args.blocks / burst_s
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": vars(args),
        "raw": limits,
        "latency_ms": {"p50": pct(lat, 50) * 1000, "p99": pct(lat, 99) * 1000, "max": max(lat) * 1000, "n": len(lat)},
        "burst": {"blocks": args.blocks, "ready": ready, "seconds": burst_s, "blocks_per_s": blocks_per_s},
        "fraction_of_raw_publish_limit": blocks_per_s * steps_per_block / limits["jetstream_publish_ack_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=150)
    ap.add_argument("--latency-samples", type=int, default=30)
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    t = Table(title="aios-blocks placement benchmark")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("JetStream publish+ack (1 process, raw)", f"{res['raw']['jetstream_publish_ack_per_s']:.0f}/s")
    t.add_row("Redis atomic reservation (1 process, raw)", f"{res['raw']['redis_reserve_per_s']:.0f}/s")
    lat = res["latency_ms"]
    t.add_row(f"create->ready p50 / p99 / max (n={lat['n']}, unloaded)", f"{lat['p50']:.1f} / {lat['p99']:.1f} / {lat['max']:.1f} ms")
    b = res["burst"]
    t.add_row(f"burst of {b['blocks']} blocks ({b['ready']} ready)", f"{b['blocks_per_s']:.1f} blocks/s")
    t.add_row("burst stream traffic as fraction of raw publish limit", f"{res['fraction_of_raw_publish_limit']:.2f}")
    Console().print(t)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
