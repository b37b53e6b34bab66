"""A short ready block preempts (docs/priority.md "A short block preempts"), on real NATS
JetStream, Redis and the worker processes.

``hi`` (priority 1000) and ``lo`` each hold one of the two one-GPU nodes of ``c1``; ``hi``'s node
dies (as the health monitor's heartbeat sweep marks it: unhealthy, and a reassignment of its
instance off it). The replacement fits nowhere (``lo`` holds the other GPU), the instance is
evicted and ``hi`` is ``ready`` and short of it; the reconciler's asks place nothing. Before, a
short block never preempted: ``hi`` stayed short for good under a block 1000 points lower. Now its
missing instance is a pending placement of its priority: ``lo`` is preempted for it (``Priority``,
waits again), and ``hi`` is whole on the GPU ``lo`` held. A peer of equal priority is never a
victim: ``hi`` stays short."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.recovery.invariants import check
from aios_blocks.schemas.events import ReassignRequest

from .conftest import System
from .test_pending_queue import events, spec, status_of
from .test_priority_cli import _ok
from .test_vcluster import kill

pytestmark = pytest.mark.integration


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inherited by the worker processes: the walker's and the reconciler's passes come often."""
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "0.5")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")
    monkeypatch.setenv("AIOS_RECONCILE_RESYNC_S", "1")
    # marked short at the pass after its first ask; its next ask is 30 s away: the missing instance
    # is placed by the walker's ask, once the victim is gone (a reconciler's ask in between would
    # place it too, and the test could not tell)
    monkeypatch.setenv("AIOS_RECONCILE_BACKOFF_S", "30")


async def running(system: System, bid: str) -> dict[str, str]:
    """iid -> node of the block's running instances."""
    return {i: r["node"] for i, r in (await system.client.store.instances(bid)).items() if r["status"] == "running"}


async def until(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        out = await fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.2)


async def two_holders(system: System, other: dict[str, Any]) -> tuple[str, str]:
    """``hi`` and ``other`` each on one of c1's two one-GPU nodes, both running; (hi's iid, its node)."""
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=2, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("hi", priorityClass="high"))
    assert kind == "ready"
    _, kind, _ = await system.submit_and_wait(other)
    assert kind == "ready"
    await until(lambda: running(system, other["blockId"]), 30, "the other block running")
    ((iid, node),) = (await until(lambda: running(system, "hi"), 30, "hi running")).items()
    return iid, node


async def node_dies(system: System, node: str, iid: str) -> None:
    """What the health monitor's sweep does for a node whose heartbeats stopped: unhealthy, and a
    reassignment of each of its instances off it."""
    c = system.client
    await kill(c, "c1", node)
    hi = await c.store.get_block("hi") or {}
    await c.bus.emit(E.cluster_reassignment, ReassignRequest(
        "hi", "c1", f"{iid}:evicted:{int(time.time())}", iid, f"node {node} unhealthy: no heartbeat (test)",
        gen=int(hi["gen"]), avoid_node=node, at=round(time.time(), 3)))


async def short(system: System) -> bool:
    return bool((await system.client.store.get_block("hi") or {}).get("short"))


async def test_a_short_ready_block_preempts_a_lower_one_for_its_missing_instance(quick: None, system: System) -> None:
    c = system.client
    iid, dead = await two_holders(system, spec("lo"))
    (lo_iid, lo_node), = (await running(system, "lo")).items()
    await node_dies(system, dead, iid)
    # hi is whole again, on the GPU lo held; lo waits, preempted by hi
    async def replaced() -> dict[str, str]:
        now = await running(system, "hi")
        return now if now and iid not in now else {}

    now = await until(replaced, 60, "hi running again")
    assert list(now.values()) == [lo_node] and iid not in now, now
    lo = await status_of(system, "lo", "pending")
    assert lo["preempted_by"] == "hi" and lo["reason"] == "preempted by hi", lo
    (preempted,) = await events(system, "lo", "preempted")
    assert preempted["preemptor"] == "hi" and preempted["reason"] == "Priority", preempted
    assert preempted["instances"] == {lo_iid: lo_node}, preempted
    (preempting,) = await events(system, "hi", "preempting")
    assert preempting["victims"] == {"lo": [lo_iid]} and preempting["short"] == 1, preempting
    asks = [e for e in await events(system, "hi", "target") if e["source"] == "queue"]
    assert asks and asks[0]["target"] == 1, asks
    hi = await c.store.get_block("hi") or {}
    assert hi["status"] == "ready", hi
    await until(lambda: _not(short(system)), 30, "hi's short mark cleared")
    # it stays so: the victim waits (the walker's passes see hi whole; no second preemption)
    await asyncio.sleep(2)
    assert (await c.store.get_block("lo") or {})["status"] == "pending" and not await running(system, "lo")
    assert len(await events(system, "hi", "preempting")) == 1
    # the state the stream folds to is the live one (the preemptor stayed ready throughout)
    rep = await check(c.bus, c.store, settled=False)
    assert rep.redis_digest == rep.stream_digest and not rep.violations, (rep.diff, rep.violations)


async def _not(x: Any) -> bool:
    return not await x


async def test_a_short_block_never_preempts_a_peer_of_its_priority(quick: None, system: System) -> None:
    c = system.client
    iid, dead = await two_holders(system, spec("peer", priorityClass="high"))
    await node_dies(system, dead, iid)
    await until(lambda: short(system), 60, "hi marked short")
    await asyncio.sleep(4)  # walker passes every 0.5 s, the reconciler's every second
    assert not await events(system, "peer", "preempted") and not await events(system, "hi", "preempting")
    assert list((await running(system, "peer")).keys()) and (await c.store.get_block("peer") or {})["status"] == "ready"
    assert not await running(system, "hi") and await short(system)
