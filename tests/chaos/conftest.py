"""Chaos fixtures: the integration system (real servers, real worker processes) plus helpers that
end every scenario in the invariant check (``recovery.invariants``) instead of a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.cli.client import Client
from aios_blocks.recovery.invariants import Report, check
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

from ..integration.conftest import COMPONENT, System

pytestmark = pytest.mark.integration

#: ``make chaos`` sets AIOS_CHAOS_SCALE=large: the issue's sizes (1,000 blocks, 10,000 bad messages)
LARGE = os.environ.get("AIOS_CHAOS_SCALE", "ci") == "large"


def size(ci: int, large: int) -> int:
    return large if LARGE else ci


@pytest.fixture
async def chaos(tmp_path: Path) -> AsyncIterator[System]:
    """Like the integration ``system``, with two copies of each worker kind (a SIGKILLed one is
    replaced while its sibling carries on) and the servers always embedded (they get restarted)."""
    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    layout = {"parser": 1, "gateway": 2, "controller": 2, "agent-sim": 1}
    sup = Supervisor(servers.nats_url, servers.redis_url, layout=layout, log_dir=str(data / "logs")).start()
    client = await Client.open(servers.nats_url, servers.redis_url)
    await client.add_component(COMPONENT)
    try:
        yield System(servers, sup, client, data)
    finally:
        await client.close()
        sup.stop()
        servers.stop()


async def settled_check(c: Client, expected: set[str], timeout: float = 60) -> Report:
    """The invariant check once the system has settled: retried while blocks are still in flight
    (bounded), then the final report (which the test asserts on)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rep = await check(c.bus, c.store, expected=expected, settled=True)
        if rep.ok or asyncio.get_running_loop().time() > deadline:
            return rep
        await asyncio.sleep(1.0)


def explain(rep: Report) -> str:
    return "\n".join([*rep.violations[:30], "-- diff --", *rep.diff])


def spec(**kw: Any) -> dict[str, Any]:
    """(``queue: false``: a block that fits nowhere fails, as these tests count it; the pending
    queue has its own tests, tests/integration/test_pending_queue.py)"""
    return {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 2, "queue": False, **kw}


TERMINAL_STATUSES = ("ready", "failed", "rejected", "deleted")


async def wait_terminal(c: Client, bids: set[str], timeout: float) -> dict[str, str]:
    """Poll Redis until every block is terminal (bounded): bid -> terminal status; a block that is
    missing or not terminal at the deadline is absent (``len(status) == len(bids)``: all terminal).
    Polling Redis, not a stream consumer, so it survives a NATS restart or a Redis flush."""
    deadline = asyncio.get_running_loop().time() + timeout
    order = sorted(bids)
    status: dict[str, str] = {}
    while True:
        try:
            pipe = c.store.r.pipeline(transaction=False)
            for bid in order:
                pipe.hget(f"aios:block:{bid}", "status")
            status = {b: s for b, s in zip(order, await pipe.execute(), strict=True) if s in TERMINAL_STATUSES}
        except Exception:  # Redis briefly away: poll again
            pass
        if len(status) == len(order) or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.5)


async def publish_create(c: Client, bid: str, body: dict[str, Any], attempts: int = 40) -> None:
    """Publish a create with a per-block message id, retrying (same id: deduplicated) while NATS
    is unreachable."""
    import msgspec

    for n in range(attempts):
        try:
            await c.bus.publish_raw(f"aios.block.{bid}.create", msgspec.json.encode({**body, "blockId": bid}), msg_id=f"create:{bid}")
            return
        except Exception:
            if n == attempts - 1:
                raise
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def grouped_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_point: str,
                         **env: str) -> AsyncIterator[tuple[System, Path]]:
    """The placement path's workers in ``blocks up``'s groups (parser+gateway in one process), the
    first process that reaches ``fault_point`` SIGKILLing itself there (once: the file yielded
    with the system is gone once it did); ``env``: more variables for the workers."""
    once = tmp_path / "fault-once"
    once.write_text("")
    monkeypatch.setenv("AIOS_FAULT", f"{fault_point}:{once}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    layout = {"parser": 1, "gateway": 1, "controller": 1, "agent-sim": 1}
    sup = Supervisor(servers.nats_url, servers.redis_url, layout=layout, log_dir=str(data / "logs"),
                     groups=DEFAULT_GROUPS).start()
    client = await Client.open(servers.nats_url, servers.redis_url)
    await client.add_component(COMPONENT)
    try:
        yield System(servers, sup, client, data), once
    finally:
        await client.close()
        sup.stop()
        servers.stop()
