"""A task sent while no executor listens yet waits for one (bounded). Found trying issue 32's
restart as a stranger: `blocks up` stopped and started, `blocks task` at once got `503 no executor
is running` (NATS answers "no responders" at once while the executor process is still starting);
the same command a few seconds later was answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.cli.client import send_task
from aios_blocks.runtime.embedded import EmbeddedServers

pytestmark = pytest.mark.integration


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[Bus]:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    b = await Bus.open(servers.nats_url, source="test")
    try:
        yield b
    finally:
        await b.close()
        servers.stop()


async def test_a_task_sent_before_the_executor_subscribes_is_answered_once_it_does(bus: Bus) -> None:
    refused = asyncio.Event()
    sent = asyncio.create_task(send_task(bus, "b1", b"{}", {"Content-Type": "application/json"}, timeout=600,
                                         no_executor_wait_s=600, on_no_executor=refused.set))
    try:
        await asyncio.wait_for(refused.wait(), 30)  # NATS said: nobody listens on the task subject
        assert not sent.done()  # still waiting for an executor

        async def executor(msg: object) -> None:  # the executor comes up and answers
            await msg.respond(b'{"ok": true}')  # type: ignore[attr-defined]

        sub = await bus.nc.subscribe(E.block_task.subject(bid="b1"), cb=executor)
        status, body, _ = await asyncio.wait_for(sent, 60)
        await sub.unsubscribe()
    finally:
        sent.cancel()
    assert (status, body) == (200, b'{"ok": true}')


async def test_with_no_executor_at_all_the_task_is_refused_with_why(bus: Bus) -> None:
    asked: list[int] = []
    status, _, headers = await send_task(bus, "b1", b"{}", timeout=600, no_executor_wait_s=0.2,
                                         on_no_executor=lambda: asked.append(1))
    assert status == 503
    assert "no executor is running" in headers["Aios-Error"]
    assert len(asked) >= 2  # asked again before giving up
