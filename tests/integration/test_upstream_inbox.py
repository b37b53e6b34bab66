"""An upstream publisher with nats-py's default configuration (no inbox prefix), as a stranger
would connect, against the documented ways (README "Publishing a block from any NATS client"):

* default config: its PubAck cannot be read (each user may read only its own ``_INBOX.<user>``),
  so it sees a permissions violation and a timeout for a create that was stored and placed; our
  hint for that denial names the setting; a retry of the same spec is answered with a ``rejected``
  that says it is the same spec as the block's create and what to set, and the block is untouched;
* default config, documented: a core publish with a ``Nats-Msg-Id`` of its own: stored once
  however often it is retried, placed;
* the inbox prefix set (``inbox_prefix="_INBOX.upstream"``): the PubAck, and a retry with the
  same ``Nats-Msg-Id`` gets the first one's (``duplicate``, same ``seq``: the same generation)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from aios_blocks.bus.nats_bus import inbox_hint

from .conftest import System
from .test_create_cloudevents import connect_as, stored

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}


def create(bid: str) -> bytes:
    """The create as docs/subjects.md shows it: a CloudEvent whose data is the spec."""
    return json.dumps({"specversion": "1.0", "id": f"ext-{bid}", "source": "urn:example:upstream",
                       "type": "io.aios.block.create", "datacontenttype": "application/json", "data": SPEC}).encode()


HEADERS = {"Content-Type": "application/cloudevents+json"}


async def _answers(system: System, bid: str, kind: str, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    async with asyncio.timeout(timeout):
        while True:
            found = [env for s, env, _ in await system.client.history(bid, idle=0.2) if s.endswith(f".{kind}")]
            if len(found) >= n:
                return found
            await asyncio.sleep(0.1)


async def test_a_default_client_is_told_what_to_set_and_the_documented_ways_work(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=2)
    if system.servers is None:
        pytest.skip("your own servers: their permissions are yours")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    plain = await connect_as(system, "upstream", error_cb=on_error)  # nats-py's defaults: no inbox prefix
    try:
        with pytest.raises(TimeoutError):
            await plain.jetstream(timeout=2).publish("aios.block.up-def.create", create("up-def"), headers=HEADERS)
        denial = next(e for e in errors if "permissions violation" in e.lower())
        assert "subscription" in denial.lower() and "_inbox." in denial.lower(), errors
        hint = inbox_hint(denial)
        assert "inbox_prefix" in hint and "inboxPrefix" in hint and "--inbox-prefix" in hint and "_INBOX.<user>" in hint
        # the create was stored all the same, and the block placed
        kind, env = await c.wait("up-def", 60)
        assert kind == "ready"
        first_gen = env["data"]["gen"]
        # retried: the answer says it is the same spec as the block's create, and what to set
        with pytest.raises(TimeoutError):
            await plain.jetstream(timeout=2).publish("aios.block.up-def.create", create("up-def"), headers=HEADERS)
        (rejected,) = await _answers(system, "up-def", "rejected", 1)
        message = rejected["data"]["errors"][0]["message"]
        assert rejected["data"]["gen"] != first_gen and f"same spec (gen {first_gen})" in message, message
        assert "Nats-Msg-Id" in message and "inbox_prefix" in message and "--inbox-prefix" in message
        block = await c.store.get_block("up-def")
        assert block is not None and block["status"] == "ready" and block["gen"] == first_gen
        assert len(await c.store.instances("up-def")) == 1

        # default config, the documented way: a core publish with an id of its own, retried at will
        for _ in range(3):
            await plain.publish("aios.block.up-core.create", create("up-core"), headers={**HEADERS, "Nats-Msg-Id": "up-core-1"})
        await plain.flush()
        kind, _ = await c.wait("up-core", 60)
        assert kind == "ready"
    finally:
        await plain.close()
    # stored once in AIOS_INTAKE, so submitted once to AIOS
    creates = [s for _, s, _, _ in await stored(system) if s == "aios.block.up-core.submitted"]
    assert len(creates) == 1
    assert await _answers(system, "up-core", "rejected", 0) == []

    # the inbox prefix set: the PubAck; a retry with the same Nats-Msg-Id gets the first one's
    ok = await connect_as(system, "upstream", inbox_prefix="_INBOX.upstream")
    try:
        js = ok.jetstream(timeout=10)
        first = await js.publish("aios.block.up-ok.create", create("up-ok"), headers={**HEADERS, "Nats-Msg-Id": "up-ok-1"})
        again = await js.publish("aios.block.up-ok.create", create("up-ok"), headers={**HEADERS, "Nats-Msg-Id": "up-ok-1"})
        assert not first.duplicate and again.duplicate and again.seq == first.seq
    finally:
        await ok.close()
    kind, env = await c.wait("up-ok", 60)
    assert kind == "ready" and env["data"]["gen"] == first.seq
    assert env["data"]["block_id"] == "up-ok"
