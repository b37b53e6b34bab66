"""Creates as third-party clients and the CLI send them, and what the stream then holds: every
message the system stores is a CloudEvent (a CloudEvents SDK parses the whole stream), and a
create whose subject names no valid block id (``aios.block.*.create``) is answered with a stored
``rejected`` its publisher can watch (``aios.block._invalid.rejected``, ``gen`` = its PubAck
``seq``), where before it was PubAcked and only dead-lettered."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import msgspec
import nats
from nats.js.errors import NotFoundError

from aios_blocks.bus import subjects

from .conftest import System

try:
    from cloudevents.v1.http import from_http
except ImportError:  # cloudevents < 2
    from cloudevents.http import from_http  # type: ignore[no-redef]

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}


async def connect_as(system: System, user: str, **options: Any) -> nats.NATS:
    """A plain nats-py client (a third party), as ``user`` of the data dir's secrets file."""
    if system.servers is None:
        return await nats.connect(system.supervisor.nats_url, **options)
    endpoints = json.loads((system.data_dir / "endpoints.json").read_text())
    login: dict[str, Any] = {}
    if endpoints["auth"]:
        login = {"user": user, "password": json.loads((system.data_dir / "auth" / "secrets.json").read_text())["nats"][user]}
    if endpoints.get("nats_ca"):
        login["tls"] = ssl.create_default_context(cafile=endpoints["nats_ca"])
    return await nats.connect(endpoints["nats"], **login, **options)


async def stored(system: System) -> list[tuple[int, str, dict[str, str], bytes]]:
    js = system.client.bus.js
    info = await js.stream_info(subjects.STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(subjects.STREAM, seq)
        except NotFoundError:
            continue
        out.append((seq, m.subject, dict(m.headers or {}), m.data or b""))
    return out


async def test_every_stored_message_is_a_cloudevent_and_an_invalid_id_is_answered(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=1, gpus=2)
    # the CLI's create (before: a bare spec stored as sent)
    _, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "ce-cli"})
    assert kind == "ready"
    _, kind, _ = await system.submit_and_wait({**SPEC, "blockId": "ce-bad", "minInstances": 2})
    assert kind == "rejected"
    up = await connect_as(system, "upstream", inbox_prefix="_INBOX.upstream")
    ob = await connect_as(system, "observer", inbox_prefix="_INBOX.observer")
    try:
        answers: asyncio.Queue[Any] = asyncio.Queue()

        async def on_answer(msg: Any) -> None:
            await answers.put(msg)

        await ob.subscribe("aios.block._invalid.rejected", cb=on_answer)
        await ob.flush()
        js = up.jetstream(timeout=10)
        # a third party's CloudEvent create, structured mode, as docs/subjects.md shows it
        event = {"specversion": "1.0", "id": "ext-1", "source": "urn:example:upstream", "type": "io.aios.block.create",
                 "datacontenttype": "application/json", "data": {**SPEC}}
        ack = await js.publish("aios.block.ce-ext.create", json.dumps(event).encode(),
                               headers={"Content-Type": "application/cloudevents+json"})
        kind, env = await c.wait("ce-ext", 60)
        assert kind == "ready" and env["data"]["gen"] == ack.seq
        # ids that are not ids: a wildcard token (which permissions cannot tell from a literal) and
        # a Redis hash tag; each is answered, with the publisher's seq and the id it gave
        for token in ("*", "{x}"):
            ack = await js.publish(f"aios.block.{token}.create", json.dumps({**event, "id": f"ext-{token}"}).encode(),
                                   headers={"Content-Type": "application/cloudevents+json"})
            msg = await asyncio.wait_for(answers.get(), 30)
            env = json.loads(msg.data)
            assert env["data"]["gen"] == ack.seq and env["data"]["block_id"] == token, env
            assert env["data"]["errors"][0]["path"] == "$.blockId" and token in env["data"]["errors"][0]["message"]
    finally:
        await up.close()
        await ob.close()

    messages = await stored(system)
    assert not [s for _, s, _, _ in messages if s.startswith("aios.dlq.")], "an invalid id was only dead-lettered"
    not_ce = []
    for seq, subject, headers, body in messages:
        try:
            ce = from_http(headers, body)
        except Exception as exc:  # which message, and why, is the report
            not_ce.append(f"#{seq} {subject}: {type(exc).__name__}: {exc}")
            continue
        assert ce["specversion"] == "1.0" and ce["type"].startswith("io.aios.") and ce["id"], (seq, subject)
    assert not_ce == [], "\n".join(not_ce)
    # the creates themselves, as the parser stored them from AIOS_INTAKE (test_create_intake.py)
    creates = [msgspec.json.decode(b) for _, s, _, b in messages if s.endswith(".submitted")]
    assert {(e["data"].get("spec") or {}).get("blockId") for e in creates} >= {"ce-cli", "ce-bad"}


async def test_a_cloudevent_create_with_wrong_attributes_is_rejected_with_each_not_placed(system: System) -> None:
    """A plain NATS client's create whose CloudEvent attributes are not the ones docs/subjects.md
    requires (specversion 1.0, id, source, type io.aios.block.create) was placed as a block: it is
    rejected, every wrong attribute listed with its path, and nothing is placed."""
    c = system.client
    await c.add_sim_cluster("c0", nodes=1, gpus=2)
    up = await connect_as(system, "upstream", inbox_prefix="_INBOX.upstream")
    try:
        event = {"specversion": "0.3", "type": "io.aios.block.delete", "data": {**SPEC}}
        ack = await up.jetstream(timeout=10).publish("aios.block.ce-wrong.create", json.dumps(event).encode(),
                                                     headers={"Content-Type": "application/cloudevents+json"})
    finally:
        await up.close()
    kind, env = await c.wait("ce-wrong", 60)
    assert kind == "rejected" and env["data"]["gen"] == ack.seq, env
    assert [e["path"] for e in env["data"]["errors"]] == ["$.specversion", "$.id", "$.source", "$.type"], env
    assert not (await c.store.get_block("ce-wrong") or {}).get("cluster")


async def test_a_cloudevent_create_with_wrong_attributes_and_a_wrong_spec_is_rejected_once_listing_both(
        system: System) -> None:
    """"Every problem listed at once": the spec of a CloudEvent with wrong attributes was checked
    only once they were right, so its client saw the spec's problems in a second round. Now one
    rejected lists the attributes' problems, then the spec's (the event's shape as before), and
    the create as sent is stored with its spec."""
    c = system.client
    await c.add_sim_cluster("c0", nodes=1, gpus=2)
    up = await connect_as(system, "upstream", inbox_prefix="_INBOX.upstream")
    try:
        event = {"specversion": "0.3", "type": "io.aios.block.delete",
                 "data": {**SPEC, "minInstances": 3, "colour": "red"}}
        ack = await up.jetstream(timeout=10).publish("aios.block.ce-both.create", json.dumps(event).encode(),
                                                     headers={"Content-Type": "application/cloudevents+json"})
    finally:
        await up.close()
    kind, env = await c.wait("ce-both", 60)
    assert kind == "rejected" and env["data"]["gen"] == ack.seq, env
    paths = [e["path"] for e in env["data"]["errors"]]
    assert paths[:4] == ["$.specversion", "$.id", "$.source", "$.type"], env
    assert {"$.colour", "$.minInstances"} <= set(paths[4:]), env
    assert set(env["data"]) == {"block_id", "gen", "errors"}, env
    assert (await c.store.get_block("ce-both") or {}).get("status") == "rejected"
    [created] = [msgspec.json.decode(b) for _, s, _, b in await stored(system) if s == "aios.block.ce-both.submitted"]
    assert created["data"]["spec"] == event["data"] and created["data"]["framing"] == "cloudevent", created
