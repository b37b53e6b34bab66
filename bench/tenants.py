"""Tenants' cost (docs/security.md "Tenants"): the time ``auth.add_tenant`` takes (config rewrite
and two reloads of the embedded nats-server), and sequential task round trips to one block through
a tenant's account (service import -> the gateway's tenant desk -> the executors) against the
``upstream`` user's direct request. ``python -m bench.tenants [N]`` (default 200 of each)."""

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
COMPONENT = {
    "componentURI": "aios://test/model", "image": "aios/test:1", "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}},
    ],
}


async def main() -> None:
    data = Path(tempfile.mkdtemp()) / "d"
    s = EmbeddedServers(data_dir=data).start()
    sup = Supervisor(s.nats_url, s.redis_url, log_dir=str(data / "logs"), role_env=s.worker_env, groups=DEFAULT_GROUPS).start()
    c = await Client.open(s.nats_url, s.redis_url)
    try:
        await c.add_component(COMPONENT)
        await c.add_sim_cluster("c", nodes=1, gpus=2)
        adds = []
        for i in range(5):
            t0 = time.perf_counter()
            auth.add_tenant(data, f"t{i}")
            adds.append(time.perf_counter() - t0)
        creds = json.loads(auth.credentials_path(data, "t0", "main").read_text())
        a = await nats.connect(creds["url"], user=creds["user"], password=creds["password"])
        ev = {"specversion": "1.0", "id": "x", "source": "urn:b", "type": "io.aios.block.create",
              "data": {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}}
        await a.jetstream(timeout=10).publish("aios.block.tb.create", json.dumps(ev).encode())
        kind, env = await c.wait("tb", 60)
        assert kind == "ready", env
        up = await nats.connect(s.endpoints.nats_url("upstream"), inbox_prefix="_INBOX.upstream")
        for _ in range(20):  # warm
            await a.request("aios.block.tb.task", b"{}", timeout=30)
            await up.request("aios.block.tb.task", b"{}", timeout=30)
        rt = {"tenant": [], "upstream": []}
        for _ in range(N):
            for name, nc in (("tenant", a), ("upstream", up)):
                t0 = time.perf_counter()
                m = await nc.request("aios.block.tb.task", b"{}", timeout=30)
                rt[name].append((time.perf_counter() - t0) * 1000)
                assert (m.headers or {}).get("Aios-Status", "200") == "200", m.headers
        print(f"add_tenant: median {statistics.median(adds)*1000:.0f} ms, max {max(adds)*1000:.0f} ms over {len(adds)}")
        for name, xs in rt.items():
            xs.sort()
            print(f"task round trip via {name}: median {statistics.median(xs):.2f} ms, p95 {xs[int(len(xs)*0.95)]:.2f} ms (n={len(xs)})")
        await a.close()
        await up.close()
    finally:
        await c.close()
        sup.stop()
        s.stop()


if __name__ == "__main__":
    asyncio.run(main())
