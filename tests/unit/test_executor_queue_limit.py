"""Which limit ends a queued task's wait (``executor.engine.Route.acquire``): the task's own time
limit (``Aios-Timeout-Ms``, the ``deadline``) or the block's queue timeout, and the refusal says
which (a 300 ms task used to be told "no instance free within 10 s")."""

from __future__ import annotations

import asyncio

import pytest

from aios_blocks.executor.engine import Refused

from .test_executor_engine import builtin_route


async def test_the_tasks_own_limit_ends_the_wait_and_is_named() -> None:
    r = builtin_route(n=1, max_ongoing=1, queue_size=5, queue_timeout_s=60)
    held = await r.acquire({})
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(Refused) as exc:
        await asyncio.wait_for(r.acquire({}, deadline=deadline), 30)  # bound: the queue's 60 s never comes
    assert exc.value.status == 503 and "no instance free within the task's time limit" in exc.value.reason
    assert "60 s" not in exc.value.reason and r.rejected == 1
    r.release(held)


async def test_the_queue_timeout_ends_the_wait_when_it_comes_first() -> None:
    r = builtin_route(n=1, max_ongoing=1, queue_size=5, queue_timeout_s=0.05)
    held = await r.acquire({})
    deadline = asyncio.get_running_loop().time() + 60
    with pytest.raises(Refused) as exc:
        await asyncio.wait_for(r.acquire({}, deadline=deadline), 30)
    assert exc.value.status == 503 and "no instance free within 0.05 s (queueTimeoutS)" in exc.value.reason
    r.release(held)
