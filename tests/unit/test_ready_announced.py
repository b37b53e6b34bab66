"""A block made ready in Redis is announced on the stream even when its ``block.ready`` publish
fails and the handler's redelivery decides otherwise (docs/reliability.md, "Announcements").

Found by the partition suite (tests/chaos/test_partitions.py seeds 33 and 48): the controller
CAS'd the block to ``ready``, the publish timed out (a NATS server SIGSTOPped); before the
redelivery the instance was lost with its SIGKILLed agent and replaced; the redelivered
``added`` found the instance gone ("not wanted here"), the replacement's ``added`` found the block
ready already (a scale-up, "announced already"): the stream never got ``block.ready``, and after
``blocks recover`` the block was stuck ``placing``. The step's announcement is now marked pending
before the CAS and the reconciler's pass publishes what the stream has not acked.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from aios_blocks.bus.catalog import E, Emit
from aios_blocks.handlers.lifecycle import fail_placing
from aios_blocks.recovery import image as im
from aios_blocks.recovery.fold import fold
from aios_blocks.recovery.rebuild import read_image
from aios_blocks.schemas.events import InstanceEvent
from aios_blocks.state.keys import ANNOUNCE
from aios_blocks.testing import MemorySystem
from aios_blocks.workers import reconciler
from aios_blocks.workers.effects import commit

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}


async def folds_to_the_state(s: MemorySystem, bid: str) -> dict[str, Any]:
    """The block's record and instances as the stream folds them equal what Redis holds (``blocks
    check``; ``blocks recover`` writes the fold). Returns the folded record."""
    f = fold((m.subject, m.data, m.seq, time.time()) for m in s.bus.stream)
    ours = (f"aios:block:{bid}", f"aios:block:{bid}:inst")
    img = {k: v for k, v in (await read_image(s.store.r)).items() if k in ours}
    rebuilt = {k: v for k, v in f.image(include_gathers=False).items() if k in ours}
    assert img and im.digest(img) == im.digest(rebuilt), im.diff(img, rebuilt)
    return rebuilt[f"aios:block:{bid}"]


async def test_a_ready_whose_publish_failed_is_announced_after_its_instance_was_lost_and_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        real_emit = s.bus._emit
        lost: list[str] = []

        async def stream_stalls_then_agent_dies(e: Emit) -> Any:
            if e.event is E.block_ready and not lost:
                # the CAS to ready is taken; the publish gets no ack (a NATS server SIGSTOPped) and
                # the handler is to be retried; before that, the simulated agent is SIGKILLed: its
                # instance is reported lost (and replaced)
                bid = e.payload.block_id
                ((iid, rec),) = (await s.store.instances(bid)).items()
                lost.append(iid)
                await real_emit(Emit(E.instance_removed, InstanceEvent(bid, e.payload.gen, iid, rec["node"], [], "lost", "", "boot-2"),
                                     qualifier="lost:boot-2"))
                raise TimeoutError("no ack from the stream")
            return await real_emit(e)

        monkeypatch.setattr(s.bus, "_emit", stream_stalls_then_agent_dies)
        bid = await s.submit(dict(SPEC))
        await s.run()

        block = await s.store.get_block(bid) or {}
        insts = await s.store.instances(bid)
        assert lost and block.get("status") == "ready", block
        assert list(insts) != lost and [r["status"] for r in insts.values()] == ["running"], insts  # replaced, running
        assert s.bus.events(E.block_ready, bid=bid) == []  # the redelivery did not announce it (the bug's state)
        assert await s.store.r.hlen(ANNOUNCE) == 1  # but it is marked pending

        monkeypatch.setattr(reconciler, "ANNOUNCE_AFTER_S", 0.0)
        r = reconciler.Reconciler(s.worker)
        await r.tick()
        assert r.announced == (1, 0)
        (ready,) = s.bus.events(E.block_ready, bid=bid)
        assert ready["gen"] == block["gen"] and ready["instances"] == lost
        assert await s.store.r.hlen(ANNOUNCE) == 0
        assert (await folds_to_the_state(s, bid))["status"] == "ready"  # recover would write ready, not placing

        await r.tick()  # nothing left to announce
        assert r.announced == (0, 0) and len(s.bus.events(E.block_ready, bid=bid)) == 1


async def test_an_announcement_acked_is_unmarked_and_one_whose_step_did_not_take_is_dropped() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        assert (await s.store.get_block(bid) or {}).get("status") == "ready"
        assert len(s.bus.events(E.block_ready, bid=bid)) == 1
        assert await s.store.r.hlen(ANNOUNCE) == 0  # acked: unmarked

        # a fail step on a block that is ready: the CAS does not take, nothing is announced or kept
        gen = int((await s.store.get_block(bid) or {})["gen"])
        await commit(s.worker, fail_placing(bid, gen, "c1", "too late"))
        assert s.bus.events(E.block_failed, bid=bid) == [] and await s.store.r.hlen(ANNOUNCE) == 0


async def test_a_failed_whose_publish_failed_is_announced_by_the_reconciler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same shape on another step (``Transition`` with a publish): a placing block failed in
    Redis whose ``block.failed`` got no ack."""
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        gen = int((await s.store.get_block(bid) or {})["gen"])
        await s.store.r.hset(f"aios:block:{bid}", "status", "placing")  # as before its instance ran
        real_emit = s.bus._emit

        async def no_ack_for_failed(e: Emit) -> Any:
            if e.event is E.block_failed:
                raise TimeoutError("no ack from the stream")
            return await real_emit(e)

        monkeypatch.setattr(s.bus, "_emit", no_ack_for_failed)
        with pytest.raises(TimeoutError):
            await commit(s.worker, fail_placing(bid, gen, "c1", "instance failed"))
        assert (await s.store.get_block(bid) or {}).get("status") == "failed"
        assert await s.store.r.hlen(ANNOUNCE) == 1

        monkeypatch.setattr(s.bus, "_emit", real_emit)
        monkeypatch.setattr(reconciler, "ANNOUNCE_AFTER_S", 0.0)
        r = reconciler.Reconciler(s.worker)
        await r.tick()
        assert r.announced == (1, 0)
        (failed,) = s.bus.events(E.block_failed, bid=bid)
        assert failed["reason"] == "instance failed" and await s.store.r.hlen(ANNOUNCE) == 0


async def test_an_announcement_not_yet_due_is_left_to_its_publisher_and_a_moved_on_one_is_dropped() -> None:
    from aios_blocks.handlers import reconcile as rc
    from aios_blocks.state.announce import Pending

    def p(key: str, bid: str, gen: int, target: str, at: float) -> Pending:
        return Pending(key, bid, gen, target, at, ())

    pending = [p("a", "b1", 1, "ready", 0.0), p("b", "b2", 1, "ready", 0.0), p("c", "b3", 2, "ready", 0.0),
               p("d", "b4", 1, "ready", 9.0), p("e", "gone", 1, "deleted", 0.0), p("f", "b5", 1, "failed", 0.0)]
    status = {"b1": ("ready", 1), "b2": ("deleting", 1), "b3": ("ready", 3), "b4": ("placing", 1), "b5": ("failed", 1)}
    again, drop = rc.announcements(pending, status, now=10.0, after_s=5.0)
    assert again == ["a", "f"]
    assert drop == ["b", "c", "e"]  # moved on, another generation, no block; "d" is not due yet


async def test_a_pending_whose_publish_failed_is_announced_by_the_reconciler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue's ``wait`` step (``workers.queue.wait_or_fail``): the block fits nowhere and is
    made pending in Redis; its ``block.pending`` gets no ack, and the redelivered ``parsed`` finds
    the block past its selection step and does nothing: the reconciler announces it."""
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        real_emit = s.bus._emit
        failed: list[str] = []

        async def no_ack_for_pending(e: Emit) -> Any:
            if e.event is E.block_pending and not failed:
                failed.append(e.payload.block_id)
                raise TimeoutError("no ack from the stream")
            return await real_emit(e)

        monkeypatch.setattr(s.bus, "_emit", no_ack_for_pending)
        bid = await s.submit({**SPEC, "minInstances": 2, "maxInstances": 2})  # 2 GPUs on a 1-GPU cluster
        await s.run()
        block = await s.store.get_block(bid) or {}
        assert failed == [bid] and block.get("status") == "pending", block
        assert s.bus.events(E.block_pending, bid=bid) == []  # the redelivery did not announce it
        assert await s.store.r.hlen(ANNOUNCE) == 1

        monkeypatch.setattr(reconciler, "ANNOUNCE_AFTER_S", 0.0)
        r = reconciler.Reconciler(s.worker)
        await r.tick()
        (pending,) = s.bus.events(E.block_pending, bid=bid)
        assert r.announced == (1, 0) and pending["gen"] == block["gen"] and await s.store.r.hlen(ANNOUNCE) == 0
        assert (await folds_to_the_state(s, bid))["status"] == "pending"
