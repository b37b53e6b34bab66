"""Creates land in ``AIOS_INTAKE`` as their publishers sent them; the parser stores each in ``AIOS``
as a ``block.submitted`` CloudEvent (issue 32 item 9): a bare spec from a plain NATS client no
longer puts a message that is not a CloudEvent into ``AIOS`` (nor its observers' mirror). The
publisher's interface is unchanged: the same subject, and a PubAck whose ``seq`` is the block's
``gen``; recovery rebuilds the same state from the ``submitted`` events."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import msgspec

from aios_blocks.bus import subjects
from aios_blocks.recovery.invariants import check
from aios_blocks.recovery.rebuild import recover

from .conftest import System
from .test_asyncapi_wire import stored_messages
from .test_create_cloudevents import SPEC, connect_as

try:
    from cloudevents.v1.http import from_http
except ImportError:  # cloudevents < 2
    from cloudevents.http import from_http  # type: ignore[no-redef]


def not_cloudevents(stored: list[tuple[int, str, dict[str, str], bytes]]) -> list[str]:
    out = []
    for seq, subject, headers, body in stored:
        try:
            ce = from_http(headers, body)
        except Exception as exc:  # which message, and why, is the report
            out.append(f"#{seq} {subject}: {type(exc).__name__}: {exc}")
            continue
        if not (ce["specversion"] == "1.0" and ce["type"].startswith("io.aios.") and ce["id"]):
            out.append(f"#{seq} {subject}: {ce}")
    return out


async def settled(system: System, expected: set[str], timeout: float = 60) -> Any:
    """The invariant check once the blocks have settled (retried, bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        rep = await check(system.client.bus, system.client.store, expected=expected, settled=True)
        if rep.ok or asyncio.get_running_loop().time() > deadline:
            return rep
        await asyncio.sleep(1.0)


async def test_a_bare_create_is_stored_in_aios_as_a_cloudevent(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=1, gpus=4)
    up = await connect_as(system, "upstream", inbox_prefix="_INBOX.upstream")
    bare = json.dumps({**SPEC, "blockId": "in-bare"}).encode()
    event = {"specversion": "1.0", "id": "ext-1", "source": "urn:example:upstream", "type": "io.aios.block.create",
             "datacontenttype": "application/json", "data": {**SPEC}}
    ce_body = json.dumps(event).encode()
    try:
        js = up.jetstream(timeout=10)
        ack_bare = await js.publish("aios.block.in-bare.create", bare, headers={"Nats-Msg-Id": "in-bare-1"})
        ack_ce = await js.publish("aios.block.in-ce.create", ce_body, headers={"Content-Type": "application/cloudevents+json"})
        # a retry of the bare create with its own Nats-Msg-Id: the first one's PubAck
        again = await js.publish("aios.block.in-bare.create", bare, headers={"Nats-Msg-Id": "in-bare-1"})
        assert again.duplicate and again.seq == ack_bare.seq
    finally:
        await up.close()
    assert ack_bare.stream == ack_ce.stream == subjects.STREAM_INTAKE
    for bid, ack in (("in-bare", ack_bare), ("in-ce", ack_ce)):
        kind, env = await c.wait(bid, 60)
        assert kind == "ready" and env["data"]["gen"] == ack.seq, (bid, kind, env)
        block = await c.store.get_block(bid) or {}
        assert block["gen"] == ack.seq and block["created"] == ack.seq
    assert (await c.store.get_block("in-bare") or {})["digest"] == hashlib.sha256(bare).hexdigest()[:16]
    # the CLI's own create goes the same way
    _, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "in-cli"})
    assert kind == "ready"

    aios = await stored_messages(system, subjects.STREAM)
    assert not_cloudevents(aios) == []
    assert not [s for _, s, _, _ in aios if s.endswith(".create") and s.startswith("aios.block.")]
    got = {s.split(".")[2]: msgspec.json.decode(b)["data"] for _, s, _, b in aios if s.endswith(".submitted")}
    assert got["in-bare"]["framing"] == "bare" and got["in-bare"]["spec"] == {**SPEC, "blockId": "in-bare"}
    assert got["in-bare"]["gen"] == ack_bare.seq and got["in-bare"]["headers"] == {"Nats-Msg-Id": "in-bare-1"}
    assert got["in-ce"]["framing"] == "cloudevent" and got["in-ce"]["spec"] == SPEC
    assert got["in-ce"]["gen"] == ack_ce.seq and got["in-ce"]["attributes"]["id"] == "ext-1"
    assert got["in-ce"]["subject"] == "aios.block.in-ce.create"
    assert len([s for _, s, _, _ in aios if s == "aios.block.in-bare.submitted"]) == 1  # once, the retry deduplicated
    # the creates as sent are in AIOS_INTAKE, the bare one as the publisher sent it
    intake = await stored_messages(system, subjects.STREAM_INTAKE)
    assert [(q, b) for q, s, _, b in intake if s == "aios.block.in-bare.create"] == [(ack_bare.seq, bare)]

    # the observers' mirror holds the same messages: all CloudEvents (bounded wait for it to catch up)
    last = (await c.bus.js.stream_info(subjects.STREAM)).state.last_seq
    async with asyncio.timeout(30):
        while (await c.bus.js.stream_info(subjects.STREAM_OBSERVE)).state.last_seq < last:
            await asyncio.sleep(0.2)
    observed = await stored_messages(system, subjects.STREAM_OBSERVE)
    assert len(observed) >= len(aios) and not_cloudevents(observed) == []

    # replay shows the create step; recovery rebuilds the same state from the submitted events
    timeline = await c.timeline("in-bare")
    assert [s for s, _, _, _ in timeline][:2] == ["aios.block.in-bare.submitted", "aios.block.in-bare.parsed"]
    rep = await settled(system, {"in-bare", "in-ce", "in-cli"})
    assert rep.ok, rep.violations[:20] + rep.diff[:20]
    before = rep.redis_digest
    report = await recover(c.bus, c.store, force=True)
    assert report.digest == before
    rep = await settled(system, {"in-bare", "in-ce", "in-cli"})
    assert rep.ok and rep.redis_digest == before, rep.violations[:20] + rep.diff[:20]
    assert (await c.store.get_block("in-bare") or {})["digest"] == hashlib.sha256(bare).hexdigest()[:16]
