"""A block made ready in Redis whose ``block.ready`` never went out is still announced
(docs/reliability.md, "Announcements"), on real NATS JetStream and Redis with the real worker
processes: the partition suite's seeds 33 and 48 made deterministic.

The controller is SIGKILLed right after its CAS to ``ready`` (fault point
``lifecycle.ready.stored``: the step in Redis, its announcement not published), and the simulated
agents are SIGKILLed with it (their instances die: the restarted fleet reports them ``lost``, and
the block's instance is replaced on the other node). The ``instance.added`` that made the block
ready is redelivered only after the consumer's ack wait (30 s), when its instance is gone ("not
wanted here"); the replacement's ``added`` found the block ready already. Before the fix the
stream never said ``ready`` (the create's waiter timed out, ``blocks recover`` wrote ``placing``);
now the reconciler publishes the announcement marked before the CAS.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.recovery.invariants import check

from ..integration.conftest import System
from ..integration.test_pending_queue import events, spec, status_of
from .conftest import grouped_system

pytestmark = pytest.mark.integration


@pytest.fixture
async def grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[System, Path]]:
    # AIOS_RECONCILE_RESYNC_S: the restarted reconciler's lease and passes come sooner
    async with grouped_system(tmp_path, monkeypatch, "lifecycle.ready.stored", AIOS_RECONCILE_RESYNC_S="2") as got:
        yield got


async def test_a_ready_not_announced_when_its_instance_was_lost_and_replaced_is_announced(
    grouped: tuple[System, Path],
) -> None:
    system, once = grouped
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=1)  # the replacement goes to the other node
    await c.submit(spec("r1"))
    async with asyncio.timeout(90):
        while await asyncio.to_thread(once.exists):  # the controller died after its CAS
            await asyncio.sleep(0.05)
    for pid in system.supervisor.pids("agent-sim"):  # the simulated agents die now: the instance is lost
        os.kill(pid, signal.SIGKILL)
    (first,) = (await c.store.instances("r1")).keys()
    assert (await c.store.get_block("r1") or {})["status"] == "ready"

    try:
        kind, _ = await c.wait("r1", timeout=120)  # the create's answer: ready, not a timeout
    except TimeoutError:
        story = [s.split(".", 3)[3] for s, _, _ in await c.history("r1", idle=0.2)]
        status = (await c.store.get_block("r1") or {}).get("status")
        raise AssertionError(f"r1 never announced: Redis says {status}, the stream {story}") from None
    assert kind == "ready"

    insts = await c.store.instances("r1")
    assert first not in insts and [i["status"] for i in insts.values()] == ["running"], insts  # replaced, running
    (ready,) = await events(system, "r1", "ready")
    assert ready["instances"] == [first]  # the announcement of the step taken before the kill
    # ... published by the reconciler from the mark (the handler died before its publish; its
    # redelivery comes after the consumer's 30 s ack wait and finds the instance replaced)
    log = await asyncio.to_thread(Path(system.supervisor.log_file("controller") or "").read_text)
    assert any('"announce.republished"' in line and '"block": "r1"' in line for line in log.splitlines()), log[-3000:]
    await status_of(system, "r1", "ready", timeout=5)
    rep = await check(c.bus, c.store, settled=False)
    assert not rep.violations and rep.redis_digest == rep.stream_digest, (rep.violations, rep.diff)


async def test_a_recover_before_the_reconciler_announced_the_ready_keeps_it(grouped: tuple[System, Path]) -> None:
    """The same step, every worker stopped before any pass announced it, then `blocks recover
    --force` (what the partition suite does right after its faults; seed 14 found it: the Redis
    primary's failover made the settle check tolerate the difference, and the recover rebuilt the
    block ``placing``, where nothing takes it again). The recover publishes the marked
    announcements first, so the rebuilt state keeps the step."""
    from aios_blocks.recovery.rebuild import recover

    system, once = grouped
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=1)
    await c.submit(spec("r2"))
    async with asyncio.timeout(90):
        while await asyncio.to_thread(once.exists):  # the controller died after its CAS
            await asyncio.sleep(0.05)
    await asyncio.to_thread(system.supervisor.stop)  # no reconciler pass, no redelivery
    assert (await c.store.get_block("r2") or {})["status"] == "ready"
    assert await events(system, "r2", "ready") == []  # the stream has not heard it

    rep = await recover(c.bus, c.store, force=True)
    assert rep.announced == 1
    assert (await c.store.get_block("r2") or {})["status"] == "ready"  # rebuilt ready, not placing
    (ready,) = await events(system, "r2", "ready")
    assert ready["instances"] == list((await c.store.instances("r2")).keys())
    after = await check(c.bus, c.store, settled=False)
    assert after.redis_digest == after.stream_digest, after.diff
