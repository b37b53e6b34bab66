"""Taking a durable consumer's messages (``bus.pull.Puller``) on a real JetStream server: a take
returns what is there without waiting for its batch to fill or its request to expire, copies
sharing a durable each get theirs, and a batch filled exactly does not hold the next take back.

nats-py's ``fetch``, which the runner used before, could wait the whole timeout on a partial
batch (its lingering second request): with two controller and gateway copies, one burst in three
stalled ~1 s. The timeouts below are long (20 s) so that "returned before its timeout" is the
behaviour asserted, with a wide margin, not a speed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.pull import Puller
from aios_blocks.workers.embedded import EmbeddedServers

TIMEOUT = 20.0  # a take's request expiry: a take that waited for it would take this long
SUBJECT = "aios.cluster.pull-test.scale"


@pytest.fixture
async def bus(tmp_path: Path):  # type: ignore[no-untyped-def]
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    b = await Bus.open(servers.nats_url)
    try:
        await b.ensure_stream()
        await b.ensure_consumer(subjects.ConsumerSpec("pull-test", ("aios.cluster.pull-test.*",)))
        yield b
    finally:
        await b.close()
        servers.stop()


async def _publish(bus: Bus, n: int, tag: str) -> None:
    for i in range(n):
        await bus.publish_raw(SUBJECT, b"{}", msg_id=f"{tag}-{i}")


async def _take_all(puller: Puller, want: int, batch: int) -> tuple[list[bytes], float]:
    """Take until ``want`` messages came; (their ids, seconds the slowest take lasted)."""
    got: list[bytes] = []
    slowest = 0.0
    while len(got) < want:
        t0 = time.monotonic()
        msgs = await puller.take(batch, TIMEOUT)
        slowest = max(slowest, time.monotonic() - t0)
        for m in msgs:
            got.append(m.headers["Nats-Msg-Id"].encode())
            await m.ack()
    return got, slowest


async def test_a_take_returns_a_partial_batch_as_soon_as_it_is_there(bus: Bus) -> None:
    puller = await bus.puller(subjects.STREAM, "pull-test")
    try:
        later = asyncio.create_task(_publish(bus, 3, "late"))  # after the take has asked (idle)
        got, slowest = await _take_all(puller, 3, 128)
        await later
        assert len(set(got)) == 3
        assert slowest < TIMEOUT / 2, f"a take waited {slowest:.1f} s for a batch of 128 to fill"
        # nothing more: a take comes back empty at its expiry (here a short one), not with an error
        assert await puller.take(128, 0.3) == []
    finally:
        assert await puller.stop() == 0  # nothing delivered and left untaken


async def test_copies_sharing_a_durable_each_return_what_they_got(bus: Bus) -> None:
    a = await bus.puller(subjects.STREAM, "pull-test")
    b = await bus.puller(subjects.STREAM, "pull-test")
    try:
        # both ask while the stream is empty, so the server spreads the messages over both requests
        ta = asyncio.create_task(a.take(128, TIMEOUT))
        tb = asyncio.create_task(b.take(128, TIMEOUT))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await _publish(bus, 10, "shared")
        first = await asyncio.wait_for(asyncio.gather(ta, tb), TIMEOUT / 2)
        assert time.monotonic() - t0 < TIMEOUT / 2
        ids = [m.headers["Nats-Msg-Id"] for msgs in first for m in msgs]
        for msgs in first:
            for m in msgs:
                await m.ack()
        left = 10 - len(ids)  # any the two requests did not get (they were answered first)
        more, slowest = await _take_all(a, left, 128) if left else ([], 0.0)
        assert len(set(ids) | {m.decode() for m in more}) == 10, "every message taken once"
        assert slowest < TIMEOUT / 2
    finally:
        await a.stop()
        await b.stop()


async def test_a_batch_filled_exactly_does_not_hold_the_next_take(bus: Bus) -> None:
    await _publish(bus, 4, "filled")
    puller = await bus.puller(subjects.STREAM, "pull-test")
    try:
        t0 = time.monotonic()
        got, _ = await _take_all(puller, 4, 2)  # two requests of 2: the first ends with no status
        assert len(set(got)) == 4
        assert time.monotonic() - t0 < TIMEOUT / 2, "the second take waited for the first request to expire"
        await bus.nc.flush()
        for _ in range(50):  # acks are published, not awaited: the server settles them shortly
            info = await bus.js.consumer_info(subjects.STREAM, "pull-test")
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.1)
        assert info.num_ack_pending == 0 and info.num_pending == 0  # each taken once, none left
    finally:
        await puller.stop()


async def test_messages_delivered_and_not_taken_are_given_back_at_stop(bus: Bus) -> None:
    """A worker that stops with messages delivered to it and not yet taken (a request's tail)
    hands them back (``stop`` naks them), so another copy gets them at once rather than after the
    consumer's 30 s ack wait."""
    await _publish(bus, 3, "tail")
    first = await bus.puller(subjects.STREAM, "pull-test")
    await first._request(3, TIMEOUT)  # asked, never taken: the three arrive in its queue
    for _ in range(100):
        if first._queue.qsize() >= 3:
            break
        await asyncio.sleep(0.05)
    assert await first.stop() == 3  # given back (nak'd)
    second = await bus.puller(subjects.STREAM, "pull-test")
    try:
        got, slowest = await _take_all(second, 3, 128)
        assert len(set(got)) == 3 and slowest < TIMEOUT / 2  # not the 30 s ack wait
    finally:
        await second.stop()
