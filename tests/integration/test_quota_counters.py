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
from .test_pending_queue import events, spec
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
    assert await counted(store) == {}
    await recover(c.bus, c.store, force=True)
    assert await counted(store) == await recounted(store) == a
