"""The AsyncAPI 3.0 document of the system, generated from the event catalog (``blocks asyncapi``).

One channel per catalog event (its subject pattern, with the named tokens as parameters), one
message per channel (the CloudEvents envelope with the payload struct's JSON Schema as ``data``, or
the raw body; its NATS headers; an example generated from the same schemas), a ``send`` operation
per publishing role and a ``receive`` operation per durable consumer that takes it.
``tests/unit/test_asyncapi.py`` validates it with the reference parser (npm's ``@asyncapi/parser``)
when Node is installed; ``tests/integration/test_asyncapi_wire.py`` validates what a real system
stores against it (payloads, headers, the ``id`` / ``Nats-Msg-Id`` relation), so the document
cannot drift from the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NotRequired, TypedDict

import msgspec

from .. import __version__
from ..schemas.records import JSON, JSONObject
from . import event_ids, subjects
from .catalog import EVENTS, TOKEN_FIELDS, Body, Event, Role

SCHEMA_REF = "#/components/schemas/{name}"

TOKEN_DOCS = {
    "bid": "block id (`_invalid` on the rejected answering a create whose subject named no valid id)",
    "cid": "cluster id",
    "nid": "node id",
    "iid": "instance id",
    "name": "policy name",
    "digest": "content digest",
    "consumer": "durable consumer name",
    "subject": "the original subject (several tokens)",
}

#: durable consumers, as deployed by default (per-node agents and per-cluster controllers use the
#: same events with one token fixed)
CONSUMERS = (subjects.PARSER, subjects.GATEWAY, subjects.controller(), subjects.LIFECYCLE, subjects.agent())


# The document's own parts are records built by name (below); the JSON Schemas inside them
# (payloads, headers, msgspec's components) and the examples' payloads are open JSON (``JSON``).


class Example(TypedDict):
    """One example message (``example``): what a publisher of the catalog would store."""

    name: str
    summary: str
    headers: dict[str, str]
    payload: JSON


class Message(TypedDict):
    """An AsyncAPI message (``_message``): one catalog event's payload schema, headers, example."""

    name: str
    title: str
    summary: str
    description: str
    contentType: str
    headers: JSONObject
    payload: JSONObject
    examples: list[Example]


class Channel(TypedDict):
    """An AsyncAPI channel (``_channel``): one catalog event's subject pattern (None: a reply's,
    the requester's own inbox)."""

    address: str | None
    title: str
    description: str
    messages: dict[str, JSONObject]
    parameters: NotRequired[dict[str, JSONObject]]


class Operation(TypedDict):
    """An AsyncAPI operation (``_operations``): a role's send or a durable consumer's receive."""

    action: str
    channel: JSONObject
    title: str
    messages: list[JSONObject]
    description: NotRequired[str]
    #: a task's answer (``_reply_parts``): its channel and message
    reply: NotRequired[JSONObject]


class Components(TypedDict):
    messages: dict[str, Message]
    #: msgspec's JSON Schemas of the payload structs, in draft-07
    schemas: JSONObject


class Document(TypedDict):
    """The AsyncAPI 3.0 document (``document``)."""

    asyncapi: str
    info: JSONObject
    defaultContentType: str
    servers: JSONObject
    channels: dict[str, Channel]
    operations: dict[str, Operation]
    components: Components


def channel_id(e: Event[Any]) -> str:
    return e.name.replace(".", "_")


#: what the ``id`` of every envelope is, and how the ``Nats-Msg-Id`` header relates to it
ID_DOC = (
    "the logical event id: the catalog's id rule filled in (e.g. `b1:42:parsed:0`), or the publisher's own id "
    "(a create: `create:<bid>:<uuid>` from the CLI). It is NOT the Nats-Msg-Id: that header is `k1:` + a keyed "
    "BLAKE2b of this id (src/aios_blocks/bus/event_ids.py), unguessable without the system's key"
)
#: the wire message id of every event the system publishes (``bus.event_ids``)
MSG_ID_PATTERN = "^" + event_ids.PREFIX + "[0-9a-f]{40}$"
#: the key the examples' ``Nats-Msg-Id`` headers are computed with (not any real system's key)
EXAMPLE_KEY = "00" * 32
#: example values of the subject tokens (and of the payload fields that fill them)
EXAMPLE_TOKENS = {"bid": "b1", "cid": "c1", "nid": "n1", "iid": "b1-0", "vid": "v1", "name": "p1",
                  "digest": "0f3c9a", "consumer": "parser", "subject": "aios.block.b1.create", "outcome": "ok"}
EXAMPLE_TIME = "2026-01-01T00:00:00.000000Z"


def _headers_schema(e: Event[Any], content_type: str) -> JSONObject:
    """The NATS headers of a stored message (a core-NATS one has no message id)."""
    if e in CREATES:
        msg_id: JSONObject = {"type": "string", "description": "optional, chosen by the publisher (its own retries are "
                                  "deduplicated within the stream's duplicate window); the CLI's is `k1:` + the keyed "
                                  "digest of the envelope's `id`; a tenant's is stored as `tenant:<t>:<its id>`, so "
                                  "only the tenant's own retries are deduplicated"}
    else:
        msg_id = {"type": "string", "pattern": MSG_ID_PATTERN,
                  "description": "`k1:` + keyed BLAKE2b (hex, 20 bytes) of the logical id (the envelope's `id`; for a raw "
                  "body, of the id rule): deterministic, so a redelivered step is deduplicated by JetStream"}
    framing: JSONObject = {"type": "string", "description": "the body's framing"}
    props: JSONObject = {"Content-Type": framing}
    if e.body is not Body.CORE:
        framing["enum"] = [content_type, "application/json"] if e in CREATES else [content_type]
    if e.stored or e in CREATES:
        props["Nats-Msg-Id"] = msg_id
    if e in TASKS:
        props.update(TASK_HEADERS)
    required: list[JSON] = ["Content-Type", "Nats-Msg-Id"] if e.stored and e not in CREATES else []
    out: JSONObject = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


def _envelope_schema(e: Event[Any], data: JSONObject) -> JSONObject:
    if e in CREATES:
        return _create_envelope_schema(e, data)
    return {
        "type": "object",
        "description": "CloudEvents 1.0, structured mode (Content-Type: application/cloudevents+json)",
        "required": ["id", "source", "type", "subject", "time", "specversion", "data"],
        "properties": {
            "id": {"type": "string", "description": ID_DOC, "not": {"pattern": "^" + event_ids.PREFIX}},
            "source": {"type": "string", "description": "absolute URI of the publishing process"},
            "type": {"type": "string", "const": e.type},
            "subject": {"type": "string", "description": "the NATS subject"},
            "time": {"type": "string", "format": "date-time"},
            "specversion": {"type": "string", "const": "1.0"},
            "datacontenttype": {"type": "string", "const": "application/json"},
            "data": data,
        },
    }


def _create_envelope_schema(e: Event[Any], data: JSONObject) -> JSONObject:
    """A create as an upstream client sends it (README "Publishing a block from any NATS client"):
    the attributes CloudEvents 1.0 requires (``specversion``, ``id``, ``source``, ``type``) and the
    spec in ``data`` or ``data_base64``; ``subject`` and ``time`` are optional there, as in
    CloudEvents (the events the system stores carry both)."""
    return {
        "type": "object",
        "description": "CloudEvents 1.0, structured mode (Content-Type: application/cloudevents+json): the spec in "
                       "`data`, or base64 of its JSON in `data_base64`",
        "required": ["id", "source", "type", "specversion"],
        "anyOf": [{"required": ["data"]}, {"required": ["data_base64"]}],
        "properties": {
            "id": {"type": "string", "description": ID_DOC, "not": {"pattern": "^" + event_ids.PREFIX}},
            "source": {"type": "string", "description": "a URI naming the publisher"},
            "type": {"type": "string", "const": E_CREATE.type, "description": "a tenant's clients send the same type"},
            "subject": {"type": "string", "description": "optional"},
            "time": {"type": "string", "format": "date-time", "description": "optional"},
            "specversion": {"type": "string", "const": "1.0"},
            "datacontenttype": {"type": "string", "const": "application/json"},
            "data": data,
            "data_base64": {"type": "string", "contentEncoding": "base64", "description": "base64 of the spec's JSON"},
        },
    }


def _draft07(node: JSON) -> JSON:
    """msgspec writes JSON Schema 2020-12; AsyncAPI's default schema format is draft-07-based:
    ``$defs`` refs are already rewritten by ``ref_template``; ``prefixItems`` -> ``items`` list."""
    if isinstance(node, dict):
        out = {k: _draft07(v) for k, v in node.items()}
        if "prefixItems" in out:
            out["items"] = out.pop("prefixItems")
        return out
    if isinstance(node, list):
        return [_draft07(v) for v in node]
    return node


def _object(node: JSON) -> JSONObject:
    """A JSON Schema's sub-schema (an object; anything else reads as the empty schema)."""
    return node if isinstance(node, dict) else {}


def _example_value(schema: JSONObject, schemas: JSONObject, name: str = "", depth: int = 0) -> JSON:
    """A value that its (draft-07) JSON Schema accepts, every property filled: the examples."""
    if "$ref" in schema:
        return _example_value(_object(schemas[str(schema["$ref"]).rsplit("/", 1)[-1]]), schemas, name, depth)
    if "const" in schema:
        return schema["const"]
    if isinstance(enum := schema.get("enum"), list):
        return enum[0]
    if isinstance(any_of := schema.get("anyOf"), list):
        options = [_object(o) for o in any_of]
        return _example_value(([o for o in options if o.get("type") != "null"] or options)[0], schemas, name, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = _object(schema.get("properties"))
        return {} if depth > 6 else {k: _example_value(_object(v), schemas, k, depth + 1) for k, v in props.items()}
    if kind == "array":
        return _example_array(schema.get("items"), schemas, name, depth)
    if kind == "string":
        return _example_string(schema, name)
    scalar = _EXAMPLE_SCALARS.get(kind) if isinstance(kind, str) else None
    return None if scalar is None else scalar(schema)


def _example_array(items: JSON, schemas: JSONObject, name: str, depth: int) -> list[JSON]:
    if isinstance(items, list):
        return [_example_value(_object(i), schemas, name, depth + 1) for i in items]
    return [] if not isinstance(items, dict) or depth > 6 else [_example_value(items, schemas, name, depth + 1)]


def _example_string(schema: JSONObject, name: str) -> str:
    if schema.get("format") == "date-time":
        return EXAMPLE_TIME
    for tok, fld in TOKEN_FIELDS.items():
        if fld == name and tok in EXAMPLE_TOKENS:
            return EXAMPLE_TOKENS[tok]
    return {"vcluster_id": "v1", "request_id": "r1", "consumer": "parser", "subject": "aios.block.b1.create"}.get(name, "x")


#: JSON Schema scalar type -> its example value
_EXAMPLE_SCALARS: dict[str, Callable[[JSONObject], JSON]] = {
    "integer": lambda schema: max(1, int(_number(schema.get("minimum", 1)))),
    "number": lambda schema: 1.0,
    "boolean": lambda schema: True,
}


def _number(v: JSON) -> float:
    return v if isinstance(v, int | float) else 1


def example(e: Event[Any], schemas: JSONObject, key: str = EXAMPLE_KEY) -> Example:
    """One message of ``e`` as a publisher of the catalog would store it: the payload from its
    schema, the subject's tokens from the payload's fields, the id from the id rule, the
    ``Nats-Msg-Id`` from the id with ``key``."""
    if e.payload is not None:
        data: JSON = _example_value({"$ref": SCHEMA_REF.format(name=e.payload.__name__)}, schemas)
    elif e in CREATES:
        data = {"blockId": "b1", "blockComponentURI": "aios://models/llama-8b-instruct", "minInstances": 1, "maxInstances": 2}
    else:
        data = {"body": "any JSON"}
    own = dict(e.token_fields)
    tokens: dict[str, str] = {}
    for tok in e.tokens:
        fld = own.get(tok) or TOKEN_FIELDS.get(tok, tok)
        value = data.get(fld) if isinstance(data, dict) else None
        tokens[tok] = value if isinstance(value, str) and value else EXAMPLE_TOKENS.get(tok, "x")
    subject = e.subject(**tokens)
    logical = e.msg_id(data, tokens) if e.id_rule else ("create:b1:4f1c2a9e" if e in CREATES else "q-1")
    wire = event_ids.EventIds(key).wire(logical)
    if e.body is Body.CLOUDEVENT:
        payload: JSON = {"id": logical, "source": "aios-blocks://host-1/" + _example_source(e),
                         "type": E_CREATE.type if e in CREATES else e.type,
                        "subject": subject, "time": EXAMPLE_TIME, "specversion": "1.0",
                        "datacontenttype": "application/json", "data": data}
        content_type = "application/cloudevents+json"
    else:
        payload, content_type = data, "application/json"
    headers: dict[str, str] = {}
    if e.body is not Body.CORE:
        headers["Content-Type"] = content_type
    if e.stored:
        headers["Nats-Msg-Id"] = wire
    summary = f"{e.name} on {subject}"
    if e.stored:
        summary += f"; id {logical!r}, Nats-Msg-Id its keyed digest (example key)"
    return {"name": channel_id(e), "summary": summary, "headers": headers, "payload": payload}


def _example_source(e: Event[Any]) -> str:
    return e.publishers[0].value if e.publishers else "unknown"


def _message(e: Event[Any], schemas: JSONObject) -> Message:
    """The AsyncAPI message of one catalog event: its payload schema, headers, notes, example."""
    if e.payload is not None:
        data: JSONObject = {"$ref": SCHEMA_REF.format(name=e.payload.__name__)}
    elif e in CREATES:
        data = {"type": "object", "description": "a block spec (docs/spec.md)"}
    elif e in TASKS:
        data = {"description": "any body: the instance's input as sent (JSON or not; passed on to its input protocol)"}
    else:
        data = {"type": "object", "description": "a JSON document"}
    if e.body is Body.CLOUDEVENT:
        payload, content_type = _envelope_schema(e, data), "application/cloudevents+json"
    else:
        payload, content_type = data, "application/json"
    if e in CREATES:  # another client's bare spec is stored as sent
        payload = {"oneOf": [payload, {"type": "object", "not": {"required": ["specversion"]},
                                       "description": "a bare block spec from another client, stored as sent"}]}
    return {
        "name": e.name,
        "title": e.type,
        "summary": e.meaning,
        "description": "; ".join(_notes(e)),
        "contentType": content_type,
        "headers": _headers_schema(e, content_type),
        "payload": payload,
        "examples": [example(e, schemas)],
    }


def _notes(e: Event[Any]) -> list[str]:
    notes = [f"stored in the {e.stream} stream" if e.stored else "core NATS only, never stored"]
    if e.id_rule and e.stored:
        notes.append(f"message id rule `{e.id_rule}` (deduplicated by JetStream)")
    elif e.id_rule:
        notes.append(f"CloudEvents id rule `{e.id_rule}` (not stored: nothing deduplicates it)")
    if e.body is Body.CLOUDEVENT:
        notes.append("the envelope's `id` is the logical id; the Nats-Msg-Id header is `k1:` + its keyed digest, not the id")
    return notes


def _channel(e: Event[Any], cid: str) -> Channel:
    channel: Channel = {
        "address": e.pattern,
        "title": e.name,
        "description": e.meaning,
        "messages": {cid: {"$ref": f"#/components/messages/{cid}"}},
    }
    if e.tokens:
        channel["parameters"] = {t: {"description": TOKEN_DOCS.get(t, t)} for t in e.tokens}
    return channel


#: a task's request headers (docs/executor.md); any other header is passed on to the instance
TASK_HEADERS: JSONObject = {
    "Aios-Task-Id": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$",
                     "description": "optional: the task's id (else the executor makes one); every answer carries it back"},
    "Aios-Idempotent": {"type": "string", "description": "optional: `true` lets the executor retry the task on another instance"},
    "Aios-Timeout-Ms": {"type": "string", "description": "optional: the task's whole time limit in ms (above 0, at most "
                        "86400000): queue wait, every attempt and backoff; else AIOS_EXECUTOR_TASK_TIMEOUT_S"},
}


def reply_id(e: Event[Any]) -> str:
    """The channel and message id of a task's answer."""
    return channel_id(e) + "_reply"


def _reply_parts(e: Event[Any], rid: str) -> tuple[Channel, Message]:
    """A task's answer, on the requester's inbox: the instance's answer as it sent it, or an error
    the executor (or, for a tenant, the gateway) makes itself (docs/executor.md "Answers")."""
    channel: Channel = {
        "address": None,
        "title": f"{e.name} reply",
        "description": "the requester's own inbox (`_INBOX.<user>.…`): the request's reply subject (NATS request/reply)",
        "messages": {rid: {"$ref": f"#/components/messages/{rid}"}},
    }
    reason = "no instance free within the queue timeout"
    error: JSONObject = {"error": reason, "status": 503, "retry_after_ms": 250}
    message: Message = {
        "name": f"{e.name}.reply",
        "title": f"{e.type}.reply",
        "summary": f"the answer to a {e.name}",
        "description": "the instance's answer as it sent it (Aios-Status: its HTTP status; Aios-Instance), or an error "
                       "of the executor's (400 bad header, 404 unknown block, 429, 500, 502, 503, 504; for a tenant, "
                       "the gateway's 403/404) with Aios-Error and the JSON body {error, status, retry_after_ms}",
        "contentType": "application/json",
        "headers": {"type": "object", "required": ["Aios-Status"], "properties": {
            "Aios-Status": {"type": "string", "pattern": "^[1-5][0-9][0-9]$", "description": "the instance's HTTP status, or the error's"},
            "Aios-Error": {"type": "string", "description": "an error's reason (one line)"},
            "Retry-After-Ms": {"type": "string", "pattern": "^[0-9]+$", "description": "an overload's (429, 503): when to ask again"},
            "Aios-Instance": {"type": "string", "description": "the instance that answered"},
            "Aios-Task-Id": {"type": "string", "description": "the task's id (the request's, or the executor's)"},
        }},
        "payload": {"description": "the instance's answer (any body), or an error: {error, status, retry_after_ms}"},
        "examples": [{"name": rid, "summary": "an overloaded block's answer",
                      "headers": {"Aios-Status": "503", "Aios-Error": reason, "Retry-After-Ms": "250",
                                  "Aios-Task-Id": "t-1"},
                      "payload": error}],
    }
    return channel, message


def _operations(e: Event[Any], cid: str) -> dict[str, Operation]:
    """Who sends the event (each publishing role) and which durable consumers receive it."""
    operations: dict[str, Operation] = {}
    msg_ref: list[JSONObject] = [{"$ref": f"#/channels/{cid}/messages/{cid}"}]
    for role in e.publishers:
        op: Operation = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{cid}"},
            "title": f"{role.value} sends {e.name}",
            "messages": msg_ref,
        }
        if role is Role.RUNNER:
            op["description"] = "every worker's consumer runner, for its own consumers' messages"
        if e.responders:
            op["description"] = "request/reply: " + ", ".join(r.value for r in e.responders) + " replies"
        if e in TASKS:
            rid = reply_id(e)
            op["reply"] = {"channel": {"$ref": f"#/channels/{rid}"}, "messages": [{"$ref": f"#/channels/{rid}/messages/{rid}"}]}
        operations[f"{role.value}_sends_{cid}"] = op
    for c in CONSUMERS:
        if e in c.events:
            operations[f"{c.durable.replace('-', '_')}_receives_{cid}"] = {
                "action": "receive",
                "channel": {"$ref": f"#/channels/{cid}"},
                "title": f"durable consumer {c.durable} receives {e.name}",
                "messages": msg_ref,
            }
    return operations


def document() -> Document:
    structs = sorted({e.payload for e in EVENTS if e.payload is not None}, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(structs, ref_template=SCHEMA_REF)
    schemas: JSONObject = {k: _draft07(v) for k, v in sorted(components.items())}

    channels: dict[str, Channel] = {}
    messages: dict[str, Message] = {}
    operations: dict[str, Operation] = {}
    for e in EVENTS:
        cid = channel_id(e)
        messages[cid] = _message(e, schemas)
        channels[cid] = _channel(e, cid)
        operations.update(_operations(e, cid))
        if e in TASKS:
            rid = reply_id(e)
            channels[rid], messages[rid] = _reply_parts(e, rid)
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "aios-blocks",
            "version": __version__,
            "description": (
                "Every event of the aios-blocks control plane: a block's story (spec parsed, cluster selection, dry_run, "
                "post_dry_run, allocation, scale, reassignment, instance added/removed), node agents' facts and "
                "commands. Generated from src/aios_blocks/bus/catalog.py."
            ),
        },
        "defaultContentType": "application/cloudevents+json",
        "servers": {
            "embedded": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "the NATS JetStream server `blocks up` starts (its URL is in <data dir>/endpoints.json)",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


EVENTS_BY_NAME = {e.name: e for e in EVENTS}
E_CREATE = EVENTS_BY_NAME["block.create"]
#: the creates, stored in AIOS_INTAKE as their publishers sent them (a block's, a tenant's): a
#: CloudEvent or a bare spec, the Nats-Msg-Id the publisher's own
CREATES = (E_CREATE, EVENTS_BY_NAME["tenant.block.create"], EVENTS_BY_NAME["tenant.create.request"])
#: the tasks (core NATS request/reply): any body in, the instance's answer (or an error) back on
#: the requester's inbox (``reply_id``)
TASKS = (EVENTS_BY_NAME["block.task"], EVENTS_BY_NAME["tenant.block.task"])


def message_schemas(doc: Document, event: Event[Any]) -> tuple[JSONObject, JSONObject]:
    """The JSON Schemas (draft-07) of ``event``'s message in ``doc``: (payload, headers), each one
    self-contained (the document's components go with it, so its ``$ref`` s resolve): what a
    validator checks a stored message's body and headers against."""
    msg = doc["components"]["messages"][channel_id(event)]
    return {**msg["payload"], "components": _plain(doc["components"])}, msg["headers"]


def _plain(record: Mapping[str, Any]) -> JSONObject:
    """A record of the document as the JSON object it is (``Components`` inside a schema)."""
    return dict(record)
