"""Quota usage kept incrementally (issue 36, docs/priority.md "Quota gating"): the capacity
scripts count each reservation taken or given back in the cluster's usage counters
(``state.keys.quota_usage_key``), so the gate reads one hash per cluster, not every placed block.
After seeded random creates, deletes and preemptions on real servers the counters equal a recount
of the placed blocks (``policies.quota.holdings_of``, what the gate read before), and ``blocks
recover`` rebuilds them from the stream."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from aios_blocks.policies import quota as qp
from aios_blocks.recovery.rebuild import recover
from aios_blocks.state.keys import quota_res_key, quota_usage_key
from aios_blocks.state.priority import PriorityStore

from .conftest import System
from .test_pending_queue import events, spec, status_of
from .test_priority_cli import _ok

pytestmark = pytest.mark.integration


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "0.5")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


def norm(u: dict[str, qp.Usage]) -> dict[str, dict[str, dict[str, float]]]:
    return {t: {m: {r: round(v, 6) for r, v in a.items() if round(v, 6)} for m, a in mu.items()}
            for t, mu in sorted(u.items())} if u else {}


def clean(u: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    return {t: {m: a for m, a in mu.items() if a} for t, mu in u.items() if any(mu.values())}


async def counted(store: PriorityStore) -> dict[str, Any]:
    return clean(norm(qp.from_fields(await store.usage_counters())))


async def recounted(store: PriorityStore) -> dict[str, Any]:
    placed, models = await store.placed()
    return clean(norm(qp.usage_by_tenant(qp.holdings_of(placed, models))))


async def settled(system: System, store: PriorityStore, timeout: float = 60) -> tuple[dict[str, Any], dict[str, Any]]:
    """The counters and the recount once no block is on its way (placing, deleting, draining)."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    async with asyncio.timeout(timeout):
        while True:
            bids = await system.client.store.list_blocks()
            blocks = [await system.client.store.get_block(x) for x in bids]
            moving = [x for x in blocks if x and x["status"] not in ("ready", "pending", "deleted", "failed")]
            a, b = await counted(store), await recounted(store)
            if not moving and a == b:
                return a, b
            await asyncio.sleep(0.2)


async def test_usage_counters_equal_a_recount_and_recover_rebuilds_them(quick: None, system: System) -> None:
    c = system.client
    store = PriorityStore(c.store.r)
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=3, gpus=2)
    rng = random.Random(36)
    live: list[str] = []
    for i in range(24):
        if live and rng.random() < 0.3:
            bid = live.pop(rng.randrange(len(live)))
            await c.delete(bid)
            continue
        bid = f"q{i}"
        extra: dict[str, Any] = {"labels": {"tenant": rng.choice(("t-a", "t-b", "t-c"))}}
        if rng.random() < 0.35:
            extra["priorityClass"] = "high"
        await c.submit(spec(bid, 1, resources={"gpus": rng.choice((1, 1, 2)), "cpu": 1, "memory": 512}, **extra))
        live.append(bid)
        async with asyncio.timeout(30):  # placed, or waiting (a preemption may be under way)
            while ((await c.store.get_block(bid)) or {}).get("status") not in ("ready", "pending"):
                await asyncio.sleep(0.05)
    a, b = await settled(system, store)
    assert a == b and a, (a, b)
    preempted = [x for x in live if await events(system, x, "preempted")]
    assert preempted, "the random run made no preemption"
    # recover rebuilds them from the stream (the counters dropped first: nothing left over)
    await c.store.r.delete(quota_usage_key("c1"), quota_res_key("c1"))
    await recover(c.bus, c.store, force=True)
    assert (await c.store.r.hget(quota_usage_key("c1"), qp.VERSION_FIELD)) == qp.COUNTERS_VERSION  # not migrated again
    assert not await store.migrate("c1")
    # equal to what the reservations (rebuilt too) add up to; not compared with ``a``: a block
    # waiting behind a preemption's drain may be placed after ``settled`` returned (a t-c block
    # was, once at load 5: the counters had moved on with it, rightly)
    after = await counted(store)
    assert after == await recounted(store) and after, after


async def test_counters_of_reservations_made_before_them_are_migrated_on_first_use(quick: None, system: System) -> None:
    """Reservations made before the counters existed (no amounts kept, no usage hash) are counted
    on first use (the version marker absent: ``PriorityStore.migrate``), together with those the
    scripts counted since, and a release of an old one (nothing to take back) is not subtracted."""
    c = system.client
    store = PriorityStore(c.store.r)
    await c.add_sim_cluster("c1", nodes=2, gpus=2)
    for bid, tenant in (("o1", "t-a"), ("o2", "t-a"), ("o3", "t-b")):
        await c.submit(spec(bid, 1, resources={"gpus": 1, "cpu": 1, "memory": 512}, labels={"tenant": tenant}))
        await status_of(system, bid, "ready")
    # what a system before the counters left: reservations, no amounts, no usage hash
    await c.store.r.delete(quota_usage_key("c1"), quota_res_key("c1"))
    await c.submit(spec("n1", 1, resources={"gpus": 1, "cpu": 1, "memory": 512}, labels={"tenant": "t-b"}))
    await status_of(system, "n1", "ready")  # counted by RESERVE_GANG (a hash without the version)
    assert set(await c.store.r.hkeys(quota_res_key("c1"))) == {i for i in await c.store.instances("n1")}
    await c.delete("o1")  # an old reservation given back: nothing to take back
    await status_of(system, "o1", "deleted")
    a, b = await settled(system, store)
    assert a == b, (a, b)
    assert a["t-a"]["*"]["gpus"] == 1 and a["t-b"]["*"]["gpus"] == 2, a
    assert not await store.migrate("c1")  # at the version now: nothing to do
    # and it keeps counting: the last old one released subtracts what the migration recorded
    await c.delete("o2")
    await status_of(system, "o2", "deleted")
    a, b = await settled(system, store)
    assert a == b and "t-a" not in a, (a, b)


async def test_counters_after_a_node_is_drained_and_removed(quick: None, system: System) -> None:
    """A tenant's instance evacuated from a drained node (a reassignment) and the node removed:
    the counters still equal a recount (the move counts the new reservation and gives back the old)."""
    from aios_blocks.cli import nodes as ncli

    c = system.client
    store = PriorityStore(c.store.r)
    await c.add_sim_cluster("c1", nodes=3, gpus=2)
    await c.submit(spec("m", 2, resources={"gpus": 1, "cpu": 1, "memory": 512}, labels={"tenant": "t-a"}))
    await status_of(system, "m", "ready")
    node = sorted(i["node"] for i in (await c.store.instances("m")).values())[0]
    await ncli.drain(c, node)
    assert await ncli.wait_empty(c, node, 60) == 0
    async with asyncio.timeout(60):
        while len([i for i in (await c.store.instances("m")).values() if i["status"] == "running"]) != 2:
            await asyncio.sleep(0.2)
    await ncli.remove_node(c, node)
    a, b = await settled(system, store)
    assert a == b and a["t-a"]["*"]["gpus"] == 2, (a, b)


async def test_quota_list_reads_the_counters_and_recount_compares(quick: None, system: System) -> None:
    """``blocks quota list`` shows the counters the gate reads (not a recount of the blocks);
    ``--recount`` lists where a recount differs, exit 1 (agreeing: exit 0)."""
    import json

    from .test_priority_cli import run

    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    await _ok(system, "quota", "set", "t-a", "--nominal", "*:gpus=2")
    await c.submit(spec("k", 1, resources={"gpus": 1, "cpu": 1, "memory": 512}, labels={"tenant": "t-a"}))
    await status_of(system, "k", "ready")
    await settled(system, store := PriorityStore(c.store.r))
    assert "equal a recount" in await _ok(system, "quota", "list", "--recount")
    # a counter made wrong by hand: the listing shows it, the recount names the difference
    await store.r.hincrbyfloat(quota_usage_key("c1"), qp.SEP.join(("t-a", "*", "gpus")), 3)
    (row,) = json.loads(await _ok(system, "quota", "list", "--json"))
    assert row["usage"]["gpus"] == 4.0 and row["borrowed"] == {"gpus": 2.0}, row
    r = await run(system, "quota", "list", "--recount", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert json.loads(r.stdout)["differences"] == [
        {"tenant": "t-a", "model": "*", "resource": "gpus", "counters": 4.0, "recount": 1.0}]
    r = await run(system, "quota", "list", "--recount")
    assert r.returncode == 1 and "differ from a recount" in r.stdout, r.stdout
