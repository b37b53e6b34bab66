"""Taking a durable consumer's messages (``bus.pull.Puller``) on a real JetStream server: a take
returns what is there without waiting for its batch to fill or its request to expire, copies
sharing a durable each get theirs, and a batch filled exactly does not hold the next take back.

nats-py's ``fetch``, which the runner used before, could wait the whole timeout on a partial
batch (its lingering second request): with two controller and gateway copies, one burst in three
stalled ~1 s. A take's request here expires in an hour: a take that waited for its batch to fill
or its request to expire would not return before the guard (60 s) and the test fails there. The
behaviour asserted is that it returns at all, with what was there; no speed is measured."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.pull import Puller
from aios_blocks.runtime.embedded import EmbeddedServers

TIMEOUT = 3600.0  # a take's request expiry: a take that waited for it would take this long
GUARD = 60.0  # how long a test waits for a take that should return now (it cannot by TIMEOUT)
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


async def _take_all(puller: Puller, want: int, batch: int) -> list[bytes]:
    """Take until ``want`` messages came (their ids); fails if a take waits for its expiry."""
    got: list[bytes] = []
    async with asyncio.timeout(GUARD):
        while len(got) < want:
            for m in await puller.take(batch, TIMEOUT):
                got.append(m.headers["Nats-Msg-Id"].encode())
                await m.ack()
    return got


async def _waiting(bus: Bus, durable: str, n: int) -> None:
    """Until the server holds ``n`` pull requests for ``durable`` (bounded)."""
    async with asyncio.timeout(GUARD):
        while (await bus.js.consumer_info(subjects.STREAM, durable)).num_waiting < n:
            await asyncio.sleep(0.02)


async def test_a_take_returns_a_partial_batch_as_soon_as_it_is_there(bus: Bus) -> None:
    puller = await bus.puller(subjects.STREAM, "pull-test")
    try:
        take = asyncio.create_task(puller.take(128, TIMEOUT))
        await _waiting(bus, "pull-test", 1)  # the take has asked, with nothing there
        await _publish(bus, 3, "late")
        async with asyncio.timeout(GUARD):  # a take waiting for 128 (or its expiry) never returns
            first = await take
        got = [m.headers["Nats-Msg-Id"].encode() for m in first]
        for m in first:
            await m.ack()
        got += await _take_all(puller, 3 - len(got), 128)  # a publish split over two deliveries
        assert len(set(got)) == 3 and 0 < len(first) <= 3
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
        await _waiting(bus, "pull-test", 2)
        await _publish(bus, 10, "shared")
        first = await asyncio.wait_for(asyncio.gather(ta, tb), GUARD)  # both return, neither at expiry
        ids = [m.headers["Nats-Msg-Id"] for msgs in first for m in msgs]
        for msgs in first:
            for m in msgs:
                await m.ack()
        left = 10 - len(ids)  # any the two requests did not get (they were answered first)
        more = await _take_all(a, left, 128) if left else []
        assert len(set(ids) | {m.decode() for m in more}) == 10, "every message taken once"
    finally:
        await a.stop()
        await b.stop()


async def test_a_batch_filled_exactly_does_not_hold_the_next_take(bus: Bus) -> None:
    await _publish(bus, 4, "filled")
    puller = await bus.puller(subjects.STREAM, "pull-test")
    try:
        # two requests of 2: the first ends with no status; a second take that waited for the
        # first request to expire would not return before the guard
        got = await _take_all(puller, 4, 2)
        assert len(set(got)) == 4
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
    consumer's ack wait (an hour here: without the nak they would not come back before the guard)."""
    await bus.js.add_consumer(subjects.STREAM, ConsumerConfig(
        durable_name="pull-nak", filter_subject="aios.cluster.pull-test.*", ack_policy=AckPolicy.EXPLICIT, ack_wait=TIMEOUT))
    await _publish(bus, 3, "tail")
    first = await bus.puller(subjects.STREAM, "pull-nak")
    await first._request(3, TIMEOUT)  # asked, never taken: the three arrive in its queue
    for _ in range(100):
        if first._queue.qsize() >= 3:
            break
        await asyncio.sleep(0.05)
    assert await first.stop() == 3  # given back (nak'd)
    second = await bus.puller(subjects.STREAM, "pull-nak")
    try:
        got = await _take_all(second, 3, 128)  # given back now, not after the hour's ack wait
        assert len(set(got)) == 3
    finally:
        await second.stop()


async def test_a_runner_stops_without_waiting_out_its_idle_take_and_loses_nothing(bus: Bus) -> None:
    """``stop`` ends a consumer runner whose take is waiting on an idle consumer at once, not at
    its request's expiry (an hour here; the agent's is 5 s, a worker's 1 s: every `blocks agent`
    and worker stop waited that out). A message published after the stop is not swallowed by the
    request left open: the next copy takes it now (the consumer's ack wait is an hour)."""
    from aios_blocks.bus.runner import ConsumerRunner, Delivery, RunnerOptions

    await bus.js.add_consumer(subjects.STREAM, ConsumerConfig(
        durable_name="pull-stop", filter_subject="aios.cluster.pull-test.*", ack_policy=AckPolicy.EXPLICIT, ack_wait=TIMEOUT))
    handled: list[Delivery] = []

    async def handler(d: Delivery) -> None:
        handled.append(d)

    spec = subjects.ConsumerSpec("pull-stop", ("aios.cluster.pull-test.*",))
    runner = ConsumerRunner(bus, spec, handler, RunnerOptions(fetch_timeout_s=TIMEOUT, handoff=False))
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    await _waiting(bus, "pull-stop", 1)  # its take has asked, with nothing there
    stop.set()
    async with asyncio.timeout(GUARD):  # a runner that waited for its take's expiry is still running
        await running
    assert handled == []
    await _publish(bus, 1, "after-stop")
    second = await bus.puller(subjects.STREAM, "pull-stop")
    try:
        assert len(await _take_all(second, 1, 128)) == 1  # now, not after the hour's ack wait
    finally:
        await second.stop()
