"""The pending queue's cost per capacity event (docs/priority.md): one walk of a scope's queue head
(``QueueWalker.walk``: the head's ``AIOS_QUEUE_WINDOW`` blocks read from Redis, each checked for a
fit on the node views) with 100 and with 10,000 blocks waiting, on a 64-node x 8-GPU cluster where
none fits (16 GPUs each, priority 0: no retry, no preemption). Real Redis (the embedded server):
``python -m bench.queue``. Prints the median wall and controller CPU (``time.process_time``) per walk."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import types
from pathlib import Path
from typing import Any, cast

import msgspec

WALKS = 200


async def run() -> None:
    from aios_blocks.cli.client import Client
    from aios_blocks.runtime import embedded
    from aios_blocks.settings import load as load_settings
    from aios_blocks.state.inventory import Inventory
    from aios_blocks.state.keys import block_key
    from aios_blocks.state.queue import PendingQueue
    from aios_blocks.workers.queue import QueueWalker

    srv = embedded.EmbeddedServers(data_dir=Path(tempfile.mkdtemp(prefix="aios-bench-queue-"))).start()
    client = await Client.open(srv.nats_url, srv.redis_url)
    try:
        await client.add_sim_cluster("c1", nodes=64, gpus=8)
        ir = {"minInstances": 1, "maxInstances": 1, "priority": 0,
              "resources": {"gpus": 16, "cpu": 1, "memory": 1024, "gpuMemory": 0},
              "policies": {"clusterAllocator": {"policyRuleURI": "builtin:cluster-rank", "settings": {}},
                           "resourceAllocator": {"policyRuleURI": "builtin:binpack", "settings": {}}}}
        w = types.SimpleNamespace(store=client.store, inventory=Inventory(client.store), settings=load_settings(), bus=None)
        walker = QueueWalker(cast(Any, w))  # the parts of a Worker a walk uses
        q, r = PendingQueue(client.store.r), client.store.r
        have = 0
        for total in (100, 10_000):
            pipe = r.pipeline(transaction=False)
            for i in range(have, total):
                bid = f"p{i}"
                pipe.hset(block_key(bid), mapping={"status": "pending", "gen": "1", "version": "1", "attempt": "0",
                                                   "ir": msgspec.json.encode({**ir, "blockId": bid}).decode()})
            await pipe.execute()
            for i in range(have, total):
                await q.add(f"p{i}", "_", 0, 1_000_000.0 + i, 0.0)
            have = total
            await walker.walk("_")  # warm: the inventory's views are read once
            walls, cpus = [], []
            for _ in range(WALKS):
                t, c = time.perf_counter(), time.process_time()
                out = await walker.walk("_")
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
            assert not out.retry and not out.preempt
            print(f"{total:>6} pending, window {w.settings.queue_window}: walk wall p50 {statistics.median(walls) * 1e3:.2f} ms, "
                  f"controller CPU p50 {statistics.median(cpus) * 1e3:.2f} ms (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    finally:
        await client.close()
        srv.stop()


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
