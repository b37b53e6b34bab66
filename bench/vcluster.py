"""Virtual clusters (seed 003) on a 1,000-node cluster: what a create / update costs, and how long
until a placing worker's inventory sees it.

Setup: embedded servers in a temp dir, one controller process (it takes the vcluster requests),
a 1,000-node simulated cluster (500 A100 + 500 H100 nodes, 8 GPUs each), and in this process a
*placing worker* (a ``Worker`` with a warmed inventory, as the gateway and the controllers keep
one) that watches the inventory hints.

Figures (p50 / p95 over the repetitions):

* ``decide``: the pure decision (``handlers.vcluster.plan_create``) over the 1,000 node views;
* ``commit``: plan + the one Lua commit + hint + event, in process (``workers.vcluster.apply``);
* ``request -> changed``: publish the request, the controller decides and commits, the stored
  ``vcluster.changed`` event arrives (a core subscription);
* ``request -> visible``: publish the request until the placing worker's view of the block's
  nodes (``handlers.vcluster.part`` of its inventory) holds the new membership (polled every
  0.5 ms); ``changed -> visible`` is the part after the event.

Run: ``.venv/bin/python bench/vcluster.py [--quick]`` (prints the rows; not part of run_all yet).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from bench import common

NODES, GPUS = 1000, 8


async def _measure(quick: bool) -> list[common.Row]:
    from aios_blocks.cli import vcluster as vcli
    from aios_blocks.cli.client import Client
    from aios_blocks.handlers import vcluster as h
    from aios_blocks.runtime.supervisor import Supervisor
    from aios_blocks.schemas.vcluster import VClusterCreate, VClusterRemove
    from aios_blocks.workers import vcluster as vw
    from aios_blocks.workers.base import Worker

    reps = 5 if quick else 15
    rows: list[common.Row] = []
    async with common.servers("vcluster") as (nats_url, redis_url, data):
        sup = Supervisor(nats_url, redis_url, layout={"controller": 1}, log_dir=str(data / "logs")).start()
        client = await Client.open(nats_url, redis_url)
        placer = await Worker.open(nats_url, redis_url, "bench-placer")
        try:
            half = NODES // 2
            await client.add_sim_cluster("big", nodes=half, gpus=GPUS, node_labels={"nodeType": "A100"})
            await client.add_sim_cluster("big", nodes=half, gpus=GPUS, node_labels={"nodeType": "H100"}, first=half)
            placer.inventory.prefetch = True
            await placer.inventory.warm()
            nodes = await placer.inventory.nodes("big")
            assert len(nodes) == NODES, len(nodes)

            # 1. the pure decision over 1,000 views
            clusters = await placer.inventory.clusters()
            times = []
            for _ in range(reps * 4):
                t = time.perf_counter()
                h.plan_create(VClusterCreate("x", "big", {"A100": 100, "H100": 100}, "r"), 1, clusters, nodes, {}, None)
                times.append(time.perf_counter() - t)
            rows.append(common.row("vcluster 1000 nodes", "decide create (200 of 1,000 nodes) p50",
                                   common.pct(times, 50) * 1e3, "ms"))

            # 2. plan + Lua commit + hint + event, in process (a scratch id, removed each time)
            commits: dict[str, list[float]] = {"create": [], "remove": []}
            for i in range(reps):
                vid = f"inproc{i}"
                await placer.store.r.hsetnx("aios:vcindex", vid, "big")
                t = time.perf_counter()
                req = VClusterCreate(vid, "big", {"A100": 100}, f"c{i}")
                out = await vw.apply(placer, "big", lambda n, r, req=req: h.plan_create(req, 1, clusters, n, r, "big"))
                commits["create"].append(time.perf_counter() - t)
                assert isinstance(out, h.Plan), out
                t = time.perf_counter()
                rm = VClusterRemove(vid, f"d{i}")
                out = await vw.apply(placer, "big", lambda n, r, rm=rm: h.plan_remove(rm, n, r), drop_claim=vid)
                commits["remove"].append(time.perf_counter() - t)
                assert isinstance(out, h.Plan), out
            for op, xs in commits.items():
                rows.append(common.row("vcluster 1000 nodes", f"{op} 100 nodes in process (plan+Lua+hint+event) p50",
                                       common.pct(xs, 50) * 1e3, "ms"))

            # 3. through the controller, and until the placing worker sees it
            changed: dict[str, float] = {}
            news = asyncio.Event()

            async def on_changed(msg: Any) -> None:
                d = msgspec.json.decode(msg.data).get("data") or {}
                changed[d.get("request_id", "")] = time.perf_counter()
                news.set()

            async def arrived(rid: str) -> float:
                while rid not in changed:
                    news.clear()
                    await news.wait()
                return changed[rid]

            sub = await client.bus.nc.subscribe("aios.vcluster.*.changed", cb=on_changed)
            e2e: dict[str, list[float]] = {}
            vis: dict[str, list[float]] = {}
            after: dict[str, list[float]] = {}

            async def one(label: str, make: Any, vid: str, want: int) -> None:
                t0 = time.perf_counter()
                req = await make()
                while True:  # the placing worker's view of the virtual cluster
                    if len(h.part(await placer.inventory.nodes("big"), vid)) == want:
                        seen = time.perf_counter()
                        break
                    await asyncio.sleep(0.0005)
                async with asyncio.timeout(30):
                    got = await arrived(req.request_id)
                e2e.setdefault(label, []).append(got - t0)
                vis.setdefault(label, []).append(seen - t0)
                after.setdefault(label, []).append(max(0.0, seen - got))

            for i in range(reps):
                vid = f"v{i}-{uuid.uuid4().hex[:4]}"
                await one("create 100", lambda vid=vid: vcli.create(client, vid, "big", {"A100": 100}), vid, 100)
                await one("update +100", lambda vid=vid: vcli.update(client, vid, 1, {"A100": 200}), vid, 200)
                await one("update -100", lambda vid=vid: vcli.update(client, vid, 2, {"A100": 100}), vid, 100)
                await one("update +1", lambda vid=vid: vcli.update(client, vid, 3, {"A100": 101}), vid, 101)
                await one("remove", lambda vid=vid: vcli.remove(client, vid), vid, 0)
            await sub.unsubscribe()
            for label in e2e:
                rows.append(common.row("vcluster 1000 nodes", f"{label}: request -> changed p50", common.pct(e2e[label], 50) * 1e3, "ms"))
                rows.append(common.row("vcluster 1000 nodes", f"{label}: request -> changed p95", common.pct(e2e[label], 95) * 1e3, "ms"))
                rows.append(common.row("vcluster 1000 nodes", f"{label}: request -> placing worker sees it p50",
                                       common.pct(vis[label], 50) * 1e3, "ms"))
                rows.append(common.row("vcluster 1000 nodes", f"{label}: changed event -> placing worker sees it p95",
                                       common.pct(after[label], 95) * 1e3, "ms", note="0: seen before the event arrived"))
        finally:
            await placer.close()
            await client.close()
            sup.stop()
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    return list(common.run(_measure(quick)))


def main() -> None:
    quick = "--quick" in sys.argv
    for r in figures(quick):
        print(f"{r['group']:<22} {r['figure']:<62} {r['value']:>9.2f} {r['unit']}")


if __name__ == "__main__":
    main()
