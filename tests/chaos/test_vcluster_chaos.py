"""Virtual clusters under failover (seed 003, "GCS Server Failover" and "Raylet Failover"):
Redis rebuilt from the stream gives the same state digest, and controllers SIGKILLed in the middle
of updates leave every node in exactly one place, none lost."""

from __future__ import annotations

import asyncio
import os
import random
import signal

from aios_blocks.recovery.rebuild import drop_project_keys, recover, state_digest
from aios_blocks.state.vcluster import VClusterStore

from ..integration.conftest import System
from ..integration.test_vcluster import (
    create,
    kill,
    partitioned,
    places,
    remove,
    typed_cluster,
    until,
    update,
)
from ..integration.test_vcluster import vcli as vcli_
from .conftest import explain, settled_check, spec


async def test_virtual_clusters_survive_flush_and_recover_with_the_same_digest(chaos: System) -> None:
    c = chaos.client
    await typed_cluster(c, "c1", a100=6, h100=2)
    await c.add_sim_cluster("c2", nodes=2, gpus=2, node_labels={"nodeType": "A100"})
    vs = VClusterStore(c.store)
    assert (await create(c, "I", "c1", {"A100": 2}))[0]
    assert (await create(c, "D", "c1", {"A100": 2, "H100": 1}, divisible=True))[0]
    assert (await create(c, "tmp", "c1", {"H100": 1}))[0]
    assert (await update(c, "I", 1, {"A100": 1}))[0]
    assert (await remove(c, "tmp"))[0]
    blocks = {
        "in-i": spec(virtualClusterId="I"),
        "plain": spec(),
        "job": spec(virtualClusterId="D", jobCluster={"replicaSets": {"A100": 1}}),
        "job-gone": spec(virtualClusterId="D", jobCluster={"replicaSets": {"H100": 1}}),
    }
    for bid, s in blocks.items():
        _, kind, _ = await chaos.submit_and_wait({**s, "blockId": bid})
        assert kind == "ready", bid
    await c.delete("job-gone")

    async def job_gone() -> bool:
        return await vs.get("job-job-gone") is None

    await until(job_gone)
    # a dead undivided node of D is replaced from the primary
    undivided = sorted(n for n, p in (await places(c, "c1")).items() if p == "D")[0]
    await kill(c, "c1", undivided)

    async def replaced() -> bool:
        d = await vs.get("D")
        return d is not None and undivided not in d.nodes

    await until(replaced)
    await partitioned(c, "c1")
    rep = await settled_check(c, set(blocks))
    assert rep.ok, explain(rep)
    assert rep.counts["vclusters"] == 3  # I, D and the job cluster of "job"
    before = await state_digest(c.store)
    assert before == rep.redis_digest == rep.stream_digest

    assert await drop_project_keys(c.store.r) > 10
    report = await recover(c.bus, c.store)
    assert report.digest == before and await state_digest(c.store) == before
    assert report.anomalies == []
    await partitioned(c, "c1")
    # the rebuilt state is live: a request with the latest revision is applied
    d = await vs.get("D")
    assert d is not None and (await update(c, "D", d.revision, {"A100": 2, "H100": 0}))[0]


async def test_controllers_killed_mid_update_lose_no_node_and_put_none_in_two_places(chaos: System) -> None:
    c = chaos.client
    await typed_cluster(c, "c1", a100=12)
    for vid in ("A", "B", "C"):
        assert (await create(c, vid, "c1", {"A100": 1}))[0]
    rng = random.Random(7)
    reqs = []
    killer_stop = asyncio.Event()

    async def killer() -> None:
        while not killer_stop.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            pids = chaos.supervisor.pids("controller")
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)

    task = asyncio.create_task(killer())
    try:
        for _ in range(30):
            vid = rng.choice(("A", "B", "C"))
            rec = await VClusterStore(c.store).get(vid)
            assert rec is not None
            reqs.append(await vcli_.update(c, vid, rec.revision, {"A100": rng.randint(0, 5)}))
            await asyncio.sleep(rng.uniform(0, 0.1))
    finally:
        killer_stop.set()
        await task
    assert chaos.supervisor.restarts > 0  # controllers did die under the requests
    # every request ends in one outcome (a redelivered one publishes what its first run did)
    outcomes = await asyncio.gather(*(vcli_.outcome(c, r, timeout=120) for r in reqs))
    assert all(out.get("reason") or out.get("record") for _, out in outcomes)
    await partitioned(c, "c1")
    where = await places(c, "c1")
    recs = await VClusterStore(c.store).records("c1")
    assert len(where) == 12 and sum(len(r.nodes) for r in recs.values()) == sum(1 for p in where.values() if p)
    rep = await settled_check(c, set())
    assert rep.ok, explain(rep)
