"""The runner's hand-off (``bus/runner.py``, "Hand-off") against a real JetStream server: a stored
event a handler of this process committed is handled at once by the consumer of this process
that takes it, exactly once; the stream's own delivery of it is then acked unhandled; a hand-off
that fails leaves the event to that delivery, which handles it as usual; with the hand-off off,
only the delivery handles it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.runner import HANDOFFS, ConsumerRunner, Delivery, RunnerOptions
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import BlockStatusReport
from aios_blocks.settings import Settings

pytestmark = pytest.mark.integration

#: the first step's subjects (taken by consumer A) and the next step's (taken by B)
FIRST = "aios.cluster.ho-{n}.allocation"
NEXT_FILTER = "aios.block.*.ready"


@dataclass
class Rig:
    bus: Bus
    servers: EmbeddedServers


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    # atomic batches from one event on: the commit path every worker's batch takes with a few events
    bus = await Bus.open(servers.nats_url, settings=Settings(atomic_batch_min=1))
    await bus.ensure_stream()
    try:
        yield Rig(bus, servers)
    finally:
        await bus.close()
        servers.stop()


def count(consumer: str, outcome: str) -> float:
    return HANDOFFS.labels(consumer, outcome)._value.get()  # type: ignore[attr-defined]


async def run_pair(rig: Rig, tag: str, fail_first: bool = False, handoff: bool = True) -> tuple[list[Delivery], int]:
    """Consumer A's handler stores ``block.<tag>.ready``; consumer B takes it. Returns B's
    deliveries once B has handled it and both consumers have nothing left, and the ready event's
    stream sequence."""
    bus = rig.bus
    # B has its own connection, as each kind of a group process has; its pull loop is behind (it
    # takes each batch 0.5 s late, as one busy with other batches would be), so the event reaches it
    # by the hand-off first (on an idle loop the stream's delivery may come first: then that one
    # handles it and nothing is handed off)
    bus_b = await Bus.open(rig.servers.nats_url, settings=bus.settings)
    make_puller = bus_b.puller

    async def behind(stream: str, durable: str) -> Any:
        puller = await make_puller(stream, durable)
        take = puller.take

        async def late(n: int, timeout: float) -> list[Any]:
            await asyncio.sleep(0.5)
            return await take(n, timeout)

        puller.take = late  # type: ignore[method-assign]
        return puller

    bus_b.puller = behind  # type: ignore[method-assign]
    spec_a = subjects.ConsumerSpec(f"ho-a-{tag}", (FIRST.format(n=tag),))
    spec_b = subjects.ConsumerSpec(f"ho-b-{tag}", (NEXT_FILTER,))
    for spec in (spec_a, spec_b):
        await bus.ensure_consumer(spec)
    seen: list[Delivery] = []
    done = asyncio.Event()

    async def first(d: Delivery) -> None:
        await bus.emit(E.block_ready, BlockStatusReport(tag, 1, "ready"), bid=tag)

    async def then(d: Delivery) -> None:
        seen.append(d)
        if fail_first and len(seen) == 1:
            raise RuntimeError("the first try fails")
        done.set()

    opts = RunnerOptions(fetch_timeout_s=0.2, backoff_s=(0.05,), handoff=handoff)
    stop = asyncio.Event()
    runners = [ConsumerRunner(bus, spec_a, first, opts), ConsumerRunner(bus_b, spec_b, then, opts)]
    tasks = [asyncio.create_task(r.run(stop)) for r in runners]
    try:
        await asyncio.sleep(0.8)  # both pulling
        await bus.publish_raw(FIRST.format(n=tag), b"{}", msg_id=f"first-{tag}")
        await asyncio.wait_for(done.wait(), 20)
        for spec in (spec_a, spec_b):  # every delivery acked (B's by the hand-off's outcome)
            for _ in range(100):
                info = await bus.js.consumer_info(subjects.STREAM, spec.durable)
                if info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq > 0:
                    break
                await asyncio.sleep(0.1)
            assert info.num_pending == 0 and info.num_ack_pending == 0, (spec.durable, info)
        await asyncio.sleep(0.3)  # a second handling, if any, would come now
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
        await bus_b.close()
    msg = await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=tag))
    return seen, msg.seq


async def test_the_next_step_is_handed_off_once_and_its_delivery_is_acked_unhandled(rig: Rig) -> None:
    seen, seq = await run_pair(rig, "once")
    assert len(seen) == 1  # handled once: by the hand-off, not again by the stream's delivery
    (d,) = seen
    assert d.subject == E.block_ready.subject(bid="once") and d.stream_seq == seq and d.deliveries == 1
    assert b'"block_id":"once"' in d.data and d.headers["Nats-Msg-Id"]
    assert count("ho-b-once", "given") == 1 and count("ho-b-once", "skipped") == 1
    assert count("ho-b-once", "redone") == 0
    assert count("ho-a-once", "given") == 0  # A does not take its own event


async def test_a_failed_hand_off_is_handled_by_the_delivery(rig: Rig) -> None:
    seen, seq = await run_pair(rig, "fails", fail_first=True)
    assert len(seen) == 2  # the hand-off (failed), then the stream's delivery (handled)
    assert [d.stream_seq for d in seen] == [seq, seq] and [d.deliveries for d in seen] == [1, 1]
    assert count("ho-b-fails", "given") == 1 and count("ho-b-fails", "redone") == 1
    assert count("ho-b-fails", "skipped") == 0


async def test_without_hand_off_the_delivery_handles_it(rig: Rig) -> None:
    assert not RunnerOptions().handoff  # off by default (AIOS_HANDOFF=1 turns it on)
    seen, seq = await run_pair(rig, "off", handoff=False)
    assert [d.stream_seq for d in seen] == [seq]
    assert count("ho-b-off", "given") == 0 and count("ho-b-off", "skipped") == 0
