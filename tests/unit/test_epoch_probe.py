"""The epoch check after a handler: a read that started after the handler finished, shared by the
handlers that finish together."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from aios_blocks.workers.base import EpochProbe


class CountingStore:
    def __init__(self) -> None:
        self.value: str | None = "e1"
        self.reads = 0

    async def epoch(self) -> str | None:
        self.reads += 1
        seen = self.value
        await asyncio.sleep(0.01)  # a round trip
        return seen


async def test_callers_share_reads_and_each_read_starts_after_its_callers() -> None:
    store = CountingStore()
    probe = EpochProbe(store)  # type: ignore[arg-type]
    results = await asyncio.gather(*(probe.after() for _ in range(50)))
    assert results == ["e1"] * 50 and store.reads == 1

    # a caller that arrives while a read is in flight is answered by the next read, which sees
    # what changed in between (the in-flight read began before it)
    first = asyncio.create_task(probe.after())
    await asyncio.sleep(0.001)  # the read of "e1" is in flight
    store.value = "e2"
    second = asyncio.create_task(probe.after())
    assert await first == "e1" and await second == "e2"
    assert store.reads == 3
    assert probe.last[1] == "e2"


async def test_a_failed_read_fails_its_callers_only() -> None:
    class Flaky(CountingStore):
        async def epoch(self) -> str | None:
            self.reads += 1
            if self.reads == 1:
                raise ConnectionError("redis went away")
            return "e1"

    store = Flaky()
    probe = EpochProbe(store)  # type: ignore[arg-type]
    try:
        await probe.after()
        raise AssertionError("expected the read error")
    except ConnectionError:
        pass
    assert await probe.after() == "e1"


# The probe holds its read loop's task: the event loop keeps only a weak reference to a task, and
# a task whose only other holder is the read it awaits (a cycle: task -> coroutine -> future ->
# the task's wake-up) can be collected mid-read, leaving every caller of ``after`` waiting on a
# future nobody sets (a consumer runner's batch stuck in its guard for good).


class _SlowStore:
    """``epoch()`` waits on a future only its own coroutine holds (the test keeps a weak reference)."""

    def __init__(self) -> None:
        self.pending: weakref.ref[asyncio.Future[str]] | None = None

    async def epoch(self) -> str:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.pending = weakref.ref(fut)
        return await fut


async def test_a_read_in_flight_survives_a_garbage_collection() -> None:
    store = _SlowStore()
    probe = EpochProbe(store)  # type: ignore[arg-type]
    waiter: asyncio.Task[Any] = asyncio.ensure_future(probe.after())
    for _ in range(3):  # the read loop starts and reaches its read
        await asyncio.sleep(0)
    assert store.pending is not None
    gc.collect()
    fut = store.pending()
    assert fut is not None, "the read loop's task was collected mid-read: its callers would wait forever"
    fut.set_result("e1")
    assert await asyncio.wait_for(waiter, timeout=5) == "e1"
