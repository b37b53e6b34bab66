"""The pending queue on real servers (issue 36, docs/priority.md): a block that fits nowhere waits
(``pending``, with the reason per cluster) and is placed when capacity frees, without being
submitted again; priority order; maxPendingS; ``queue: false`` (``submit --no-queue``) fails as
before; preemption sends the victim back to pending, and it returns when capacity does; a block
that is not preemptible is never a victim; ``blocks recover`` rebuilds the queue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from aios_blocks.recovery.invariants import check
from aios_blocks.recovery.rebuild import recover
from aios_blocks.state.queue import PendingQueue

from .conftest import System
from .test_priority_cli import _ok, run

pytestmark = pytest.mark.integration


@pytest.fixture
def quick_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "0.5")  # inherited by the worker processes
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


def spec(bid: str, n: int = 1, **extra: Any) -> dict[str, Any]:
    return {"blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": n, "maxInstances": n, **extra}


async def status_of(system: System, bid: str, want: str, timeout: float = 40) -> dict[str, Any]:
    block = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                block = await system.client.store.get_block(bid)
                if block is not None and block["status"] == want:
                    return block
                await asyncio.sleep(0.1)
    except TimeoutError:
        kinds = [s.split(".", 3)[3] for s, _, _ in await system.client.history(bid, idle=0.2)]
        raise AssertionError(f"{bid} is not {want}: {block and {k: v for k, v in block.items() if k != 'ir'}}; {kinds}") from None


async def events(system: System, bid: str, tail: str) -> list[dict[str, Any]]:
    return [e["data"] for s, e, _ in await system.client.history(bid, idle=0.2) if s.endswith(f".{tail}")]


async def test_a_block_that_fits_nowhere_waits_and_is_placed_when_another_is_deleted(quick_queue: None, system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait(spec("a", 2))
    assert kind == "ready"
    await c.submit(spec("b"))
    block = await status_of(system, "b", "pending")
    assert "no healthy node with capacity" in block["reason"]
    (pending,) = await events(system, "b", "pending")
    assert pending["reasons"] == {"c1": "no healthy node with capacity for one instance (1 nodes)"}, pending
    assert await PendingQueue(c.store.r).position("b") == ("_", 1, 1)
    out = json.loads(await _ok(system, "list", "--pending", "--json"))
    assert [(r["id"], r["position"]) for r in out] == [("b", 1)] and "no healthy node" in out[0]["reason"]
    said = await _ok(system, "explain", "b")
    assert "block b: pending - no cluster passed the filter rule" in said and "waits in the pending queue at position 1 of 1" in said, said
    await c.delete("a")
    await status_of(system, "b", "ready")  # placed, never submitted again
    assert await PendingQueue(c.store.r).position("b") is None


async def test_priority_order_among_waiting_blocks_and_not_preemptible(quick_queue: None, system: System) -> None:
    """lo waits first, hi after it; hi is placed first when the GPU frees. hi never preempts
    ``holder`` (preemptible: false)."""
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("holder", preemptible=False))
    assert kind == "ready"
    await c.submit(spec("lo"))
    await status_of(system, "lo", "pending")
    await c.submit(spec("hi", priorityClass="high"))
    await status_of(system, "hi", "pending")
    assert await PendingQueue(c.store.r).position("hi") == ("_", 1, 2)
    await asyncio.sleep(1.5)  # a few walker passes: hi may not preempt the holder
    assert (await c.store.get_block("holder") or {}).get("status") == "ready" and not await events(system, "holder", "preempted")
    await c.delete("holder")
    await status_of(system, "hi", "ready")
    assert (await c.store.get_block("lo") or {}).get("status") == "pending"


async def test_max_pending_s_fails_a_long_wait_and_no_queue_fails_at_once(quick_queue: None, system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("a"))
    assert kind == "ready"
    _, kind, env = await system.submit_and_wait(spec("nq", queue=False))
    assert kind == "failed" and "no healthy node with capacity" in env["data"]["reason"], env
    assert not await events(system, "nq", "pending")
    _, kind, env = await system.submit_and_wait(spec("short", maxPendingS=1))
    assert kind == "failed" and env["data"]["reason"].startswith("waited longer than maxPendingS"), env
    assert await events(system, "short", "pending")
    assert await PendingQueue(c.store.r).position("short") is None


@pytest.fixture
def no_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")  # inherited by the worker processes
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


async def test_a_block_that_may_preempt_wakes_the_walker_when_it_starts_waiting(no_resync: None, system: System) -> None:
    """A new waiting block that may preempt is a reason for a pass (the controller's ``on_pending``
    pokes the walker), not only capacity freed: with the periodic pass 300 s away and no capacity
    event, the high block still preempts the low one at once."""
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("lo"))
    assert kind == "ready"
    await asyncio.sleep(1.0)  # the walker's first pass is over: the next periodic one is 300 s away
    await c.submit(spec("hi", priorityClass="high"))
    await status_of(system, "hi", "ready", timeout=40)
    (preempted,) = await events(system, "lo", "preempted")
    assert preempted["preemptor"] == "hi", preempted


async def test_a_high_block_preempts_a_low_one_which_waits_and_returns(quick_queue: None, system: System) -> None:
    c = system.client
    await _ok(system, "priority-class", "add", "high", "1000")
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("lo"))
    assert kind == "ready"
    await c.submit(spec("hi", priorityClass="high"))
    await status_of(system, "hi", "ready")
    (preempted,) = await events(system, "lo", "preempted")
    assert preempted["preemptor"] == "hi" and preempted["reason"] == "Priority", preempted
    (preempting,) = await events(system, "hi", "preempting")
    assert preempting["victims"] == {"lo": ["lo-0"]}, preempting
    # the preemption decision replayed from hi's story (its recorded planner input): the same bytes
    report = json.loads(await _ok(system, "policy", "test", "builtin:preempt-min", "builtin:preempt-min", "--json"))
    replays = [r for r in report["replays"] if r["block_id"] == "hi"]
    assert replays and all(r["identical"] for r in replays) and report["counts"]["changed"] == 0, report
    lo = await status_of(system, "lo", "pending")
    assert lo["preempted_by"] == "hi"
    # the state the stream folds to is the live one (the victim waiting, the preemptor placed), and
    # recover rebuilds the queue from the stream
    rep = await check(c.bus, c.store, settled=False)
    assert rep.redis_digest == rep.stream_digest and not rep.violations, (rep.diff, rep.violations)
    await recover(c.bus, c.store, force=True)
    assert await PendingQueue(c.store.r).position("lo") == ("_", 1, 1)
    assert (await c.store.get_block("lo") or {}).get("status") == "pending"
    await c.delete("hi")
    lo = await status_of(system, "lo", "ready")
    assert sorted(await c.store.instances("lo")) != ["lo-0"]  # placed again under fresh instance ids
    await status_of(system, "hi", "deleted")
    rep = await check(c.bus, c.store, settled=False)
    assert rep.redis_digest == rep.stream_digest and not rep.violations, (rep.diff, rep.violations)


async def test_no_queue_flag_on_the_command_line(quick_queue: None, system: System, tmp_path: Any) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("a"))
    assert kind == "ready"
    f = tmp_path / "b.json"
    f.write_text(json.dumps(spec("b")))
    r = await run(system, "submit", str(f), "--no-queue", "--wait")
    assert r.returncode == 3, r.stdout + r.stderr
    r = await run(system, "submit", str(f), "--dry-run")
    assert "would wait behind 0 block(s)" in r.stdout + r.stderr, r.stdout + r.stderr


async def test_a_waiting_block_is_placed_when_a_cluster_is_added(quick_queue: None, system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=1)
    _, kind, _ = await system.submit_and_wait(spec("a"))
    assert kind == "ready"
    await c.submit(spec("b", resources={"gpus": 2, "cpu": 1, "memory": 1024}))
    block = await status_of(system, "b", "pending")
    assert "no healthy node with capacity" in block["reason"]
    await c.add_sim_cluster("c2", nodes=1, gpus=2)
    block = await status_of(system, "b", "ready")
    assert block["cluster"] == "c2"
    assert not block.get("reason"), block  # the wait's reason went with the wait (`blocks list` showed it)
    rep = await check(c.bus, c.store, settled=False)  # and the stream's fold agrees (no reason either)
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)


async def test_a_waiting_block_grows_its_virtual_cluster_and_is_placed_there(quick_queue: None, system: System) -> None:
    """An indivisible virtual cluster with limits grows by a node for a block that waits (as it
    did for one that failed), and the waiting block is placed on that node."""
    from aios_blocks.cli import vcluster as vcli

    c = system.client
    await c.add_sim_cluster("c1", nodes=3, gpus=1, node_labels={"nodeType": "A100"})
    ok, _ = await vcli.outcome(c, await vcli.create(c, "v", "c1", {"A100": 1}, limits={"A100": [1, 2]}))
    assert ok
    _, kind, _ = await system.submit_and_wait(spec("g1", virtualClusterId="v"))
    assert kind == "ready"
    await c.submit(spec("g2", virtualClusterId="v"))
    await status_of(system, "g2", "ready")
    assert (await events(system, "g2", "pending"))  # it waited first, then its cluster grew
