"""Beyond one machine, tested: the real workers on a 3-server NATS cluster (the ``AIOS`` stream and
its consumers replicated three ways) and a 6-node Redis Cluster (3 primaries, 3 replicas), all on
loopback ports (``cluster_servers``; compose.yaml's ``cluster`` profile is the same layout).

A burst of blocks is submitted; halfway through, the server leading the ``AIOS`` stream is
SIGKILLed. The run must complete on the two survivors: every block ready, nothing lost (Redis
equals the state rebuilt from the replicated stream), nothing double-booked (no GPU over capacity,
no exclusive GPU with two holders, no instance twice). The killed server then comes back and
catches up. Every multi-key script, transaction and pipeline ran against real hash slots: a key
outside its script's slot fails with CROSSSLOT there, not silently as on one server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.cli.client import Client
from aios_blocks.recovery.rebuild import recover
from aios_blocks.runtime.supervisor import Supervisor
from aios_blocks.settings import load as load_settings

from ..chaos.conftest import explain, publish_create, settled_check, spec, wait_terminal
from .cluster_servers import NatsCluster, RedisCluster
from .conftest import COMPONENT, System
from .test_policies import FIRST

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = 48  # 64 one-GPU instances on 96 GPUs: room for all, and contention for the same nodes
CLUSTERS, NODES, GPUS = 3, 4, 8


@dataclass
class ClusterSystem(System):
    nats: NatsCluster
    redis: RedisCluster


@pytest.fixture
def cluster_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Three replicas of the stream and the key bucket, for this process and the workers (the
    supervisor passes its environment on)."""
    monkeypatch.setenv("AIOS_STREAM_REPLICAS", "3")
    load_settings.cache_clear()
    yield
    load_settings.cache_clear()


@pytest.fixture
async def on_cluster(tmp_path: Path, cluster_env: None) -> AsyncIterator[ClusterSystem]:
    data = tmp_path / "data"
    nats = NatsCluster(data / "nats").start()
    try:
        redis = RedisCluster(data / "redis").start()
    except BaseException:
        nats.stop()
        raise
    # two controllers: two processes racing for the same GPUs through the Redis Cluster scripts
    layout = {"parser": 1, "gateway": 1, "controller": 2, "agent-sim": 1}
    sup = Supervisor(nats.url, redis.url, layout=layout, log_dir=str(data / "logs")).start()
    client = None
    try:
        client = await _open_client(nats.url, redis.url)
        await client.add_component(COMPONENT)
        yield ClusterSystem(None, sup, client, data, nats, redis)
    finally:
        if client is not None:
            await client.close()
        sup.stop()
        nats.stop()
        redis.stop()


async def _open_client(nats_url: str, redis_url: str, attempts: int = 60) -> Client:
    """The JetStream meta group elects its leader a moment after the servers start."""
    for n in range(attempts):
        try:
            return await Client.open(nats_url, redis_url)
        except Exception:
            if n == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def _stream_cluster(c: Client) -> tuple[int, str, list[tuple[str, bool, bool]]]:
    info = await c.bus.js.stream_info(subjects.STREAM)
    cl = info.cluster
    assert cl is not None
    return info.config.num_replicas or 1, str(cl.leader), [(p.name, bool(p.current), bool(p.offline)) for p in cl.replicas or []]


async def test_burst_survives_sigkill_of_the_stream_leader(on_cluster: ClusterSystem) -> None:
    c = on_cluster.client
    replicas, leader, peers = await _stream_cluster(c)
    assert replicas == 3 and len(peers) == 2, (replicas, leader, peers)
    for i in range(CLUSTERS):
        await c.add_sim_cluster(f"c{i}", nodes=NODES, gpus=GPUS)
    # the capacity keys of one cluster share a slot, and the three clusters do not all share one
    slots = {cid: c.store.r.keyslot(f"aios:{{c:{cid}}}:nodes") for cid in ("c0", "c1", "c2")}
    assert len(set(slots.values())) > 1, slots

    # the registry (head and versions in their own slots, the list of names in another) and the
    # components listing (keys in many slots: no MGET)
    assert await c.policy_put("picker", FIRST, "python") == 1
    assert await c.policy_put("picker", FIRST, "python") == 2
    assert await c.store.policy_names() == ["picker"]
    assert set(await c.store.components()) == {COMPONENT["componentURI"]}

    # every sixth block (one instance) places through the registry policy, which writes its context
    blocks = {f"cl-{i}": _picker(spec(maxInstances=1)) if i % 6 == 1 else spec(minInstances=1 + (i % 3 == 0), maxInstances=3)
              for i in range(BLOCKS)}
    items = list(blocks.items())
    half = len(items) // 2
    await asyncio.gather(*(publish_create(c, bid, body) for bid, body in items[:half]))
    _, leader, _ = await _stream_cluster(c)  # the one whose loss forces an election mid-burst
    on_cluster.nats.kill(leader)
    await asyncio.gather(*(publish_create(c, bid, body) for bid, body in items[half:]))

    status = await wait_terminal(c, set(blocks), timeout=150)
    assert len(status) == BLOCKS, f"{BLOCKS - len(status)} blocks missing: {sorted(set(blocks) - set(status))[:10]}"
    assert {s for s in status.values()} == {"ready"}, {b: s for b, s in status.items() if s != "ready"}

    # nothing lost, nothing double-booked: the invariants over Redis and the replicated stream
    rep = await settled_check(c, set(blocks))
    assert rep.ok, explain(rep)
    assert rep.counts.get("blocks_ready") == BLOCKS, rep.counts

    # and directly: each GPU of each node has at most one reservation (one-GPU, exclusive
    # instances), and every running instance of every block holds one
    holders: dict[tuple[str, str, str], list[str]] = {}
    reserved = 0
    for i in range(CLUSTERS):
        for r in await c.store.reservations(f"c{i}"):
            reserved += 1
            for g in msgspec.json.decode(r["gpus"]):
                holders.setdefault((f"c{i}", r["node"], g), []).append(r["iid"])
    twice = {k: v for k, v in holders.items() if len(v) > 1}
    assert not twice, twice
    instances = sum([len(await c.store.instances(bid)) for bid in blocks])
    assert reserved == instances == sum(1 + (i % 3 == 0) for i in range(BLOCKS)), (reserved, instances)
    for bid in (b for i, b in enumerate(blocks) if i % 6 == 1):
        assert (await c.store.get_block(bid) or {})["ir"]["policies"]["resourceAllocator"]["version"] == 2
        assert (await c.store.context_load(f"{bid}.resourceAllocator")).get("calls", 0) >= 1  # more: a retried step

    # the survivors elected a new leader; the killed server comes back and catches up
    _, new_leader, _ = await _stream_cluster(c)
    assert new_leader != leader
    on_cluster.nats.start_server(leader)
    deadline = asyncio.get_running_loop().time() + 60  # a loaded 2-core box once took more than 30 s
    while True:
        _, _, peers = await _stream_cluster(c)
        if len(peers) == 2 and all(cur and not off for _, cur, off in peers):
            break
        assert asyncio.get_running_loop().time() < deadline, f"the restarted server did not catch up: {peers}"
        await asyncio.sleep(0.5)

    # the command line takes the same URLs: `blocks check` on the list of NATS servers and the cluster
    env = {**os.environ, "AIOS_NATS_URL": on_cluster.nats.url, "AIOS_REDIS_URL": on_cluster.redis.url}
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aios_blocks.cli", "check", "--json"], env=env,
                                capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(r.stdout)["counts"]["blocks_ready"] == BLOCKS

    # `blocks recover --force` rewrites every slot from the stream and ends where it started
    before = rep.redis_digest
    report = await recover(c.bus, c.store, force=True)
    assert report.digest == before
    rep = await settled_check(c, set(blocks))
    assert rep.ok and rep.redis_digest == before, explain(rep)


def _picker(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:picker"}}]}
