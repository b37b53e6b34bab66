"""Re-placement of a waiting block after capacity frees, end to end (docs/priority.md): the real
workers (``blocks up``'s processes), a 1-node x 1-GPU cluster; a holder block runs, a second block
waits; the holder is deleted and the time from its instance's ``instance.removed`` (stored) to the
waiting block's ``placement`` (stored) is measured, ``ROUNDS`` times.
``python -m bench.queue_replace``. Prints p50 and max."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from datetime import datetime
from pathlib import Path

ROUNDS = 8


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def run() -> None:
    from aios_blocks.cli.client import Client
    from aios_blocks.runtime.embedded import EmbeddedServers
    from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

    sys_dir = Path(tempfile.mkdtemp(prefix="aios-bench-queue-replace-"))
    srv = EmbeddedServers(data_dir=sys_dir).start()
    sup = Supervisor(srv.nats_url, srv.redis_url, log_dir=str(sys_dir / "logs"), role_env=srv.worker_env,
                     groups=DEFAULT_GROUPS).start()
    c = await Client.open(srv.nats_url, srv.redis_url)
    comp = {"componentURI": "aios://bench/model", "image": "aios/bench:1", "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
            "policies": [{"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
                         {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}}]}
    try:
        await c.add_component(comp)
        await c.add_sim_cluster("c1", nodes=1, gpus=1)
        spec = {"blockComponentURI": "aios://bench/model", "minInstances": 1, "maxInstances": 1}
        holder = await c.submit({**spec, "blockId": "h0"})
        kind, _ = await c.wait(holder, 120)
        assert kind == "ready", kind
        gaps = []
        for i in range(ROUNDS):
            waiter = await c.submit({**spec, "blockId": f"w{i}"})
            async for subject, _ in c.follow(waiter):  # until it waits
                if subject.endswith(".pending"):
                    break
            await c.delete(holder)
            kind, _ = await c.wait(waiter, 120)
            assert kind == "ready", kind
            removed = [_t(t) for s, _, _, t in await c.timeline(holder) if s.endswith(".removed")]
            placed = [_t(t) for s, _, _, t in await c.timeline(waiter) if s.endswith(".placement")]
            gaps.append(placed[-1] - removed[-1])
            holder = waiter
        print(f"re-placement after capacity frees (instance.removed -> placement, stored), {ROUNDS} rounds: "
              f"p50 {statistics.median(gaps) * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f} ms "
              f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    finally:
        await c.close()
        sup.stop()
        srv.stop()


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
