"""Every channel's message has an example, generated from the catalog, that its own schemas accept
(``jsonschema`` here, and the reference parser's dereferenced schemas with Ajv), and the examples
show the documented relation of the envelope's ``id`` and the ``Nats-Msg-Id`` header."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema

from aios_blocks.bus import asyncapi, catalog, event_ids

from .test_asyncapi import _parser_dir

EXAMPLES = Path(__file__).with_name("asyncapi") / "examples.mjs"


def _errors(schema: dict[str, Any], value: Any) -> list[str]:
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(value)]


def test_every_message_has_an_example_its_schemas_accept() -> None:
    doc = asyncapi.document()
    for e in catalog.EVENTS:
        payload, headers = asyncapi.message_schemas(doc, e)
        examples = doc["components"]["messages"][asyncapi.channel_id(e)]["examples"]
        assert len(examples) == 1, e.name
        ex = examples[0]
        assert _errors(payload, ex["payload"]) == [], e.name
        assert _errors(headers, ex["headers"]) == [], e.name


def test_the_id_is_the_logical_id_and_the_msg_id_its_keyed_digest() -> None:
    """The envelope's ``id`` is the logical id the catalog's id rule gives (not a ``k1:`` digest);
    ``Nats-Msg-Id`` is ``k1:`` + the keyed digest of it: the documented relation."""
    doc = asyncapi.document()
    ids = event_ids.EventIds(asyncapi.EXAMPLE_KEY)
    described = doc["components"]["messages"]["block_ready"]["payload"]["properties"]["id"]["description"]
    assert "logical" in described and "NOT the Nats-Msg-Id" in described
    seen = 0
    for e in catalog.EVENTS:
        ex = doc["components"]["messages"][asyncapi.channel_id(e)]["examples"][0]
        if e.body is not catalog.Body.CLOUDEVENT or not e.stored:
            continue
        assert not ex["payload"]["id"].startswith(event_ids.PREFIX), e.name
        assert ex["headers"]["Nats-Msg-Id"] == ids.wire(ex["payload"]["id"]), e.name
        assert catalog.parse(ex["payload"]["subject"]) is not None and catalog.parse(ex["payload"]["subject"])[0] is e
        seen += 1
    assert seen > 40
    ready = doc["components"]["messages"]["block_ready"]["examples"][0]["payload"]
    assert ready["id"] == "b1:1:ready"


def test_a_wrong_example_or_header_is_caught() -> None:
    """The checks can fail: a payload of the wrong type, a logical id as the Nats-Msg-Id."""
    doc = asyncapi.document()
    payload, headers = asyncapi.message_schemas(doc, catalog.E.block_parsed)
    ex = copy.deepcopy(doc["components"]["messages"]["block_parsed"]["examples"][0])
    ex["payload"]["data"]["gen"] = "one"
    assert _errors(payload, ex["payload"])
    assert _errors(headers, {**ex["headers"], "Nats-Msg-Id": "b1:1:parsed:0"})
    assert _errors(payload, {**ex["payload"], "type": "io.aios.block.ready"})


def test_the_reference_parser_validates_every_example(tmp_path: Path) -> None:
    where = _parser_dir()
    shutil.copy(EXAMPLES, where / "examples.mjs")
    path = tmp_path / "doc.json"

    def run(doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        path.write_text(json.dumps(doc))
        return subprocess.run(["node", str(where / "examples.mjs"), str(path)], capture_output=True, text=True, timeout=120)

    r = run(asyncapi.document())
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"over {len(catalog.EVENTS) + len(asyncapi.TASKS)} messages" in r.stdout
    broken = asyncapi.document()
    broken["components"]["messages"]["block_ready"]["examples"][0]["headers"]["Nats-Msg-Id"] = "b1:1:ready"
    r = run(broken)
    assert r.returncode == 1 and "block_ready headers" in r.stderr, r.stdout + r.stderr


def test_the_creates_an_upstream_client_sends_are_what_the_document_describes() -> None:
    """A create as README "Publishing a block from any NATS client" sends it (a CloudEvent with the
    attributes CloudEvents requires: no ``subject``, no ``time``; its spec in ``data`` or
    ``data_base64``; its own Nats-Msg-Id or none), or a bare spec, fits the document's block.create
    and tenant.block.create (stored as sent in AIOS_INTAKE), while one without ``id`` or without
    the spec does not. The document used to require ``subject`` and ``time`` of it, as of the
    events the system stores, and tenants' creates a ``k1:`` Nats-Msg-Id and a CloudEvent."""
    doc = asyncapi.document()
    spec = {"blockComponentURI": "aios://models/llama-8b-instruct", "minInstances": 2, "maxInstances": 4}
    readme = {"specversion": "1.0", "id": "my-create-1", "source": "urn:me", "type": "io.aios.block.create", "data": spec}
    b64 = {**{k: v for k, v in readme.items() if k != "data"}, "data_base64": "eyJtaW5JbnN0YW5jZXMiOiAxfQ=="}
    for e in (catalog.E.block_create, catalog.E.tenant_block_create):
        payload, headers = asyncapi.message_schemas(doc, e)
        for body in (readme, b64, spec):
            assert _errors(payload, body) == [], (e.name, body)
        for sent in ({"Content-Type": "application/cloudevents+json", "Nats-Msg-Id": "my-create-1"},
                     {"Content-Type": "application/json"}, {}):
            assert _errors(headers, sent) == [], (e.name, sent)
        assert _errors(payload, {k: v for k, v in readme.items() if k != "id"}), e.name
        assert _errors(payload, {k: v for k, v in readme.items() if k != "data"}), e.name
        assert _errors(payload, {**readme, "specversion": "0.3"}), e.name


def test_a_task_is_any_body_with_its_headers_and_its_answer_is_the_operations_reply() -> None:
    """block.task (and a tenant's) as docs/executor.md has it: any body (it said a JSON object),
    the request headers Aios-Task-Id, Aios-Idempotent, Aios-Timeout-Ms, and the answer on the
    requester's inbox, each send operation's ``reply``: Aios-Status always, an error's Aios-Error,
    Retry-After-Ms and JSON body (none of which the document had)."""
    doc = asyncapi.document()
    for e in asyncapi.TASKS:
        payload, headers = asyncapi.message_schemas(doc, e)
        for body in ("hello", 7, [1], {"prompt": "hi"}, None):
            assert _errors(payload, body) == [], (e.name, body)
        props = headers["properties"]
        assert {"Aios-Task-Id", "Aios-Idempotent", "Aios-Timeout-Ms"} <= set(props), e.name
        assert _errors(headers, {"Aios-Task-Id": "t-1", "Aios-Idempotent": "true", "Aios-Timeout-Ms": "5000"}) == []
        assert _errors(headers, {"Aios-Task-Id": "no spaces"}), e.name
        rid = asyncapi.reply_id(e)
        sends = [op for op in doc["operations"].values() if op["channel"]["$ref"] == f"#/channels/{asyncapi.channel_id(e)}"
                 and op["action"] == "send"]
        assert sends and all(op["reply"]["channel"]["$ref"] == f"#/channels/{rid}" for op in sends), e.name
        assert doc["channels"][rid]["address"] is None  # the requester's own inbox
        reply = doc["components"]["messages"][rid]
        assert reply["headers"]["required"] == ["Aios-Status"]
        assert _errors(reply["headers"], {"Aios-Status": "200", "Aios-Instance": "b1-0", "Aios-Task-Id": "t-1"}) == []
        assert _errors(reply["headers"], {"Aios-Error": "no status"}), e.name
