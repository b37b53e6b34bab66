"""The one periodic loop (``runtime.ticker``, issue 35): a tick that raises is logged and the loop
goes on, ``stop`` ends the wait, ``wake`` brings the next tick forward, ``next_in`` and the guard
are obeyed; and no worker outside the controller and the executor writes its own loop."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aios_blocks
from aios_blocks.runtime.ticker import Ticker

LONG = 3600.0  # an interval no test waits for: each tick below comes from a wake, a next_in or the start


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


async def test_a_failing_tick_is_logged_and_the_next_one_runs() -> None:
    stop, log = asyncio.Event(), Log()
    seen: list[int] = []

    async def tick() -> None:
        seen.append(len(seen))
        if len(seen) == 1:
            raise RuntimeError("redis away")
        stop.set()

    await asyncio.wait_for(Ticker(0.0, "x.tick_failed", log).run(tick, stop), 30)
    assert seen == [0, 1]
    assert log.lines == [("x.tick_failed", {"error": "RuntimeError('redis away')"})]


async def test_stop_ends_a_long_wait_and_wait_first_waits() -> None:
    stop, seen = asyncio.Event(), []

    async def tick() -> None:
        seen.append(1)

    run = asyncio.create_task(Ticker(LONG, "x", wait_first=True).run(tick, stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(run, 30)
    assert seen == []  # waited first, and the wait ended with stop


async def test_wake_brings_the_tick_forward_and_next_in_sets_the_wait() -> None:
    stop, wake, seen = asyncio.Event(), asyncio.Event(), []

    async def tick() -> int:
        seen.append(1)
        if len(seen) == 3:
            stop.set()
        return len(seen)

    # after the first tick (woken), next_in asks for the second at once, then the third is woken again
    t = Ticker(LONG, "x", wait_first=True, wake=wake, next_in=lambda n: 0.0 if n == 1 else LONG)
    run = asyncio.create_task(t.run(tick, stop))
    wake.set()
    while len(seen) < 2:
        await asyncio.sleep(0.01)
    wake.set()
    await asyncio.wait_for(run, 30)
    assert seen == [1, 1, 1] and t.ticks == 3 and not wake.is_set()


async def test_the_guard_holds_the_tick() -> None:
    stop, log, seen = asyncio.Event(), Log(), []

    class Guard:
        calls = 0

        async def current(self) -> str:
            Guard.calls += 1
            if Guard.calls == 1:
                raise RuntimeError("no epoch")
            return "e1"

    async def tick() -> None:
        seen.append(1)
        stop.set()

    await asyncio.wait_for(Ticker(0.0, "x.paused", log, guard=Guard()).run(tick, stop), 30)
    assert seen == [1] and [e for e, _ in log.lines] == ["x.paused"]


def test_no_worker_writes_its_own_periodic_loop() -> None:
    """A loop that waits on ``stop`` with a timeout is a ticker written by hand: the ones left are
    listed, so a new one elsewhere fails here."""
    root = Path(aios_blocks.__file__).resolve().parent
    hand = re.compile(r"wait_for\(\s*stop\.wait\(\)")
    found = {str(p.relative_to(root)) for p in root.rglob("*.py") if hand.search(p.read_text())}
    # the ticker itself; the side-car's wait between tries of its first subscribe (not periodic:
    # it ends once subscribed). The executor's, the outputs', the remote-write and the side-car's
    # fetch loops are on the ticker (tests/unit/test_periodic_loops.py); the queue walker's wait
    # before it listens again for the other copies' wake-ups after Redis went away (not periodic:
    # it ends once the subscription is back); `blocks submit --wait`'s look for its create's dead
    # letter beside the follow (a command's wait for one answer, no worker's: it ends with the create)
    assert found <= {"runtime/ticker.py", "sidecar.py", "workers/queue.py", "cli/client.py"}, found
