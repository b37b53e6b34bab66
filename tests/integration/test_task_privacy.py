"""Tasks and their outputs are the users' data, not events (docs/security.md "Tasks and outputs are
not events"): on real servers with credentials, an observer reads every event but no task
(``aios.block.B.task``, a tenant's ``aios.tenant.T.block.B.task``), no output (``aios.output.>``)
and no output's dead letter, whatever wildcard it subscribes to (``aios.>``, one block's
``aios.block.B.>``: NATS filters them out of its deliveries; a subscription to them is refused); the
executors still take the tasks, and the gateway's relay gets none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NC

from aios_blocks.bus.nats_bus import security_options
from aios_blocks.runtime.embedded import EmbeddedServers

pytestmark = pytest.mark.integration
SECRET = b'{"prompt": "the secret of priv-1"}'


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServers]:
    s = EmbeddedServers(data_dir=tmp_path_factory.mktemp("privacy"), auth=True).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def connect(servers: EmbeddedServers) -> AsyncIterator[Any]:
    conns: list[tuple[NC, list[str]]] = []

    async def open_(role: str) -> tuple[NC, list[str]]:
        errors: list[str] = []

        async def error_cb(exc: Exception) -> None:
            errors.append(str(exc).lower())

        url = servers.endpoints.nats_url(role)
        nc = await nats.connect(servers=[url], error_cb=error_cb, allow_reconnect=False, connect_timeout=5,
                                **security_options(url))
        conns.append((nc, errors))
        return nc, errors

    yield open_
    for nc, _ in conns:
        await nc.close()


async def _denied(nc: NC, errors: list[str], subject: str) -> bool:
    needle = f'permissions violation for subscription to "{subject}"'
    for _ in range(100):
        await nc.flush(timeout=5)
        if any(needle in e for e in errors):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_an_observer_reads_events_but_no_task_output_or_dead_letter(connect: Any) -> None:
    ob, ob_errors = await connect("observer")
    seen: list[tuple[str, bytes]] = []

    async def on(msg: Any) -> None:
        seen.append((msg.subject, msg.data))

    # every event, through any wildcard (NATS filters the denied task data out of their deliveries:
    # one block's whole life, aios.block.B.>, as README shows), and narrower ones
    wide = ("aios.>", "aios.block.>", "aios.block.*.ready", "aios.block.priv-1.ready", "aios.block.priv-1.>",
            "aios.block.priv-1.*", "aios.block.*.>", "aios.node.>", "aios.tenant.t1.>", "aios.tenant.t1.event.>",
            "aios.output.>", "aios.dlq.>")
    for subject in wide:
        await ob.subscribe(subject, cb=on)
    await ob.flush()
    assert ob_errors == [], ob_errors
    # a subscription to task data itself is refused
    for subject in ("aios.block.priv-1.task", "aios.block.*.task", "aios.tenant.t1.block.priv-1.task",
                    "aios.output.priv-1.*", "aios.output.*.dlq.*.*", "aios.output.priv-1.dlq.store.ok",
                    "aios.dlq.*.aios.output.>"):
        await ob.subscribe(subject, cb=on)
        assert await _denied(ob, ob_errors, subject), subject

    # the executors still take the tasks (their queue group), and the requester gets the answer
    ex, ex_errors = await connect("executor")
    tasks: list[bytes] = []

    async def serve(msg: Any) -> None:
        tasks.append(msg.data)
        await msg.respond(b'{"answer": "the output"}')

    await ex.subscribe("aios.block.*.task", queue="executor", cb=serve)
    await ex.flush()
    up, _ = await connect("upstream")
    reply = await up.request("aios.block.priv-1.task", SECRET, timeout=5)
    assert reply.data == b'{"answer": "the output"}' and tasks == [SECRET] and ex_errors == []
    admin, _ = await connect("admin")
    # an output's dead letter (output.dlq; and where an older version put it, in AIOS)
    for subject in ("aios.tenant.t1.block.priv-1.task", "aios.output.priv-1.ok", "aios.output.priv-1.dlq.store.ok",
                    "aios.dlq.sidecar-priv-1-store.aios.output.priv-1.ok"):
        await admin.publish(subject, SECRET)
    await admin.publish("aios.block.priv-1.ready", b'{"marker": 1}')
    await admin.flush()
    async with asyncio.timeout(10):
        # aios.>, .block.>, *.ready, priv-1.ready, priv-1.>, priv-1.*, *.>
        while len([s for s, _ in seen if s == "aios.block.priv-1.ready"]) < 7:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    assert not [s for s, d in seen if b"secret" in d], seen
    assert {s for s, _ in seen} == {"aios.block.priv-1.ready"}, seen


async def test_a_task_nobody_serves_gets_no_responders_though_the_relay_and_observers_listen(connect: Any) -> None:
    """The gateway's tenant relay subscribes to ``aios.block.*.>`` (queue ``tenant-relay``) and an
    observer to ``aios.>``: neither gets the task (denied), so with no executor subscribed NATS
    answers *no responders* at once (``send_task`` waits for an executor that is starting) instead
    of the requester waiting out its whole timeout."""
    gw, gw_errors = await connect("gateway")
    relayed: list[str] = []

    async def relay(msg: Any) -> None:
        relayed.append(msg.subject)

    await gw.subscribe("aios.block.*.>", queue="tenant-relay", cb=relay)
    ob, _ = await connect("observer")
    await ob.subscribe("aios.>", cb=relay)
    await gw.flush()
    await ob.flush()
    up, _ = await connect("upstream")
    with pytest.raises(nats.errors.NoRespondersError):
        await up.request("aios.block.priv-2.task", SECRET, timeout=5)
    admin, _ = await connect("admin")
    await admin.publish("aios.block.priv-2.ready", b"{}")
    await admin.flush()
    async with asyncio.timeout(10):
        while relayed.count("aios.block.priv-2.ready") < 2:
            await asyncio.sleep(0.02)
    assert "aios.block.priv-2.task" not in relayed and gw_errors == [], (relayed, gw_errors)
