"""What a turn makes tasks of: the tests that say a turn gathers no task of its own (each task is
a turn of the event loop and its wake-ups on the create's path) count them with this."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def tasks_made() -> Iterator[list[str]]:
    """The qualified names of the coroutines the running loop makes tasks of inside the block,
    in order (the list is filled as they are made; the loop's own factory is put back after)."""
    loop = asyncio.get_running_loop()
    made: list[str] = []
    before = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(factory)
    try:
        yield made
    finally:
        loop.set_task_factory(before)
