"""The AsyncAPI document (``blocks asyncapi``) against what a real system stores: a block driven
through its life (create, ready, scale, delete) and a rejected one, then every stored message of
the ``AIOS`` stream validated against the schemas of its channel (body and headers), and the
documented relation of the envelope's ``id`` and the ``Nats-Msg-Id`` header checked, so the
contract cannot drift from the wire again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import jsonschema
import msgspec
from nats.js.errors import NotFoundError

from aios_blocks.bus import asyncapi, catalog, event_ids, subjects

from .conftest import System

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 2}
#: the events a block's life must have stored (more may come: decisions, node health...)
LIFE = {"block.create", "block.submitted", "block.parsed", "block.rejected", "block.selection", "block.post_dry_run", "cluster.allocation",
        "block.placement", "node.instance.create", "block.instance.added", "block.ready", "cluster.scale",
        "block.delete", "node.instance.remove", "block.instance.removed", "block.deleted", "node.registered",
        "component.registered"}


async def _until(pred: Callable[[], Awaitable[bool]], timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.05)


async def stored_messages(system: System, stream: str = subjects.STREAM) -> list[tuple[int, str, dict[str, str], bytes]]:
    """Every message ``stream`` holds: (seq, subject, headers, body)."""
    js = system.client.bus.js
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(stream, seq)
        except NotFoundError:
            continue
        out.append((seq, m.subject, dict(m.headers or {}), m.data or b""))
    return out


def _errors(schema: dict[str, Any], value: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(value)]


async def test_every_stored_message_matches_its_asyncapi_channel(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=2)
    bid, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "wire-1"})
    assert kind == "ready"
    await c.scale(bid)

    async def two_running() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 2 and all(i["status"] == "running" for i in insts.values())

    await _until(two_running)
    await c.delete(bid)

    async def deleted() -> bool:
        return any(s.endswith(".deleted") for s, _, _ in await c.history(bid, idle=0.2))

    await _until(deleted)
    rid, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "wire-bad", "minInstances": 3})
    assert kind == "rejected"

    doc = asyncapi.document()
    ids = await c.bus.ids()
    seen: dict[str, int] = {}
    problems: list[str] = []
    # AIOS, and AIOS_INTAKE (the creates as sent; the parser stores each in AIOS as submitted)
    stored = [(st, *m) for st in (subjects.STREAM, subjects.STREAM_INTAKE) for m in await stored_messages(system, st)]
    for st, seq, subject, headers, body in stored:
        found = catalog.parse(subject)
        assert found is not None, f"#{seq} {subject}: no channel of the document has this subject"
        event, tokens = found
        assert event.stored and event.stream == st, f"#{seq} {subject}: the document says not stored in {st}"
        seen[event.name] = seen.get(event.name, 0) + 1
        payload_schema, headers_schema = asyncapi.message_schemas(doc, event)
        value = msgspec.json.decode(body)
        problems += [f"#{seq} {subject} payload {e}" for e in _errors(payload_schema, value)]
        problems += [f"#{seq} {subject} headers {e}" for e in _errors(headers_schema, headers)]
        if event.body is catalog.Body.CLOUDEVENT:
            # as documented: the id is the logical id, the Nats-Msg-Id its keyed digest (not the id)
            assert not value["id"].startswith(event_ids.PREFIX), (seq, subject, value["id"])
            assert headers["Nats-Msg-Id"] == ids.wire(value["id"]), (seq, subject, value["id"], headers)
            assert value["subject"] == subject and value["type"] == event.type
            if event.id_rule:  # the logical id is the catalog's id rule (plus a qualifier for a repeat)
                rule_id = event.msg_id(value["data"], tokens)
                assert value["id"] == rule_id or value["id"].startswith(rule_id + ":"), (seq, subject, value["id"], rule_id)
    assert problems == [], "\n".join(problems[:30])
    assert LIFE <= set(seen), sorted(LIFE - set(seen))
    assert seen["block.create"] == seen["block.submitted"] == 2 and seen["block.rejected"] == 1


async def test_a_message_off_the_contract_is_caught(system: System) -> None:
    """The validation can fail: a stored event whose id is the digest (what the document used to
    say) and a payload missing a field are both reported."""
    c = system.client
    await c.add_sim_cluster("c0", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "wire-2"})
    assert kind == "ready"
    doc = asyncapi.document()
    ready = [(h, b) for _, s, h, b in await stored_messages(system) if s == "aios.block.wire-2.ready"]
    assert len(ready) == 1
    headers, body = ready[0]
    env = msgspec.json.decode(body)
    payload_schema, headers_schema = asyncapi.message_schemas(doc, catalog.E.block_ready)
    assert _errors(payload_schema, env) == [] and _errors(headers_schema, headers) == []
    ids = await c.bus.ids()
    assert headers["Nats-Msg-Id"] != env["id"] and headers["Nats-Msg-Id"] == ids.wire(env["id"])
    del env["data"]["block_id"]
    assert _errors(payload_schema, env)
    assert _errors(headers_schema, {**headers, "Nats-Msg-Id": env["id"]})
