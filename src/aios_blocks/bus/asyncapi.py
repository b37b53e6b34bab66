"""The AsyncAPI 3.0 document of the system, generated from the event catalog (``blocks asyncapi``).

One channel per catalog event (its subject pattern, with the named tokens as parameters), one
message per channel (the CloudEvents envelope with the payload struct's JSON Schema as ``data``, or
the raw body), a ``send`` operation per publishing role and a ``receive`` operation per durable
consumer that takes it. ``tests/unit/test_asyncapi.py`` validates it with the reference parser
(npm's ``@asyncapi/parser``) when Node is installed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import __version__
from . import subjects
from .catalog import EVENTS, Body, Event, Role

SCHEMA_REF = "#/components/schemas/{name}"

TOKEN_DOCS = {
    "bid": "block id",
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


def channel_id(e: Event[Any]) -> str:
    return e.name.replace(".", "_")


def _envelope_schema(e: Event[Any], data: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "description": "CloudEvents 1.0, structured mode (Content-Type: application/cloudevents+json)",
        "required": ["id", "source", "type", "subject", "time", "specversion", "data"],
        "properties": {
            "id": {"type": "string", "description": "keyed digest of the logical id (`k1:` + BLAKE2b), also the Nats-Msg-Id"},
            "source": {"type": "string", "description": "absolute URI of the publishing process"},
            "type": {"type": "string", "const": e.type},
            "subject": {"type": "string", "description": "the NATS subject"},
            "time": {"type": "string", "format": "date-time"},
            "specversion": {"type": "string", "const": "1.0"},
            "datacontenttype": {"type": "string", "const": "application/json"},
            "data": data,
        },
    }


def _draft07(node: Any) -> Any:
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


def document() -> dict[str, Any]:
    structs = sorted({e.payload for e in EVENTS if e.payload is not None}, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(structs, ref_template=SCHEMA_REF)
    schemas = {k: _draft07(v) for k, v in sorted(components.items())}

    channels: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for e in EVENTS:
        cid = channel_id(e)
        if e.payload is not None:
            data: dict[str, Any] = {"$ref": SCHEMA_REF.format(name=e.payload.__name__)}
        elif e is EVENTS_BY_NAME["block.create"]:
            data = {"type": "object", "description": "a block spec (docs/spec.md), bare or as a CloudEvent's data"}
        else:
            data = {"type": "object", "description": "a JSON document"}
        if e.body is Body.CLOUDEVENT:
            payload, content_type = _envelope_schema(e, data), "application/cloudevents+json"
        else:
            payload, content_type = data, "application/json"
        notes = []
        notes.append("stored in the AIOS stream" if e.stored else "core NATS only, never stored")
        if e.id_rule and e.stored:
            notes.append(f"message id rule `{e.id_rule}` (deduplicated by JetStream)")
        elif e.id_rule:
            notes.append(f"CloudEvents id rule `{e.id_rule}` (not stored: nothing deduplicates it)")
        messages[cid] = {
            "name": e.name,
            "title": e.type,
            "summary": e.meaning,
            "description": "; ".join(notes),
            "contentType": content_type,
            "payload": payload,
        }
        channel: dict[str, Any] = {
            "address": e.pattern,
            "title": e.name,
            "description": e.meaning,
            "messages": {cid: {"$ref": f"#/components/messages/{cid}"}},
        }
        if e.tokens:
            channel["parameters"] = {t: {"description": TOKEN_DOCS.get(t, t)} for t in e.tokens}
        channels[cid] = channel
        msg_ref = [{"$ref": f"#/channels/{cid}/messages/{cid}"}]
        for role in e.publishers:
            op: dict[str, Any] = {
                "action": "send",
                "channel": {"$ref": f"#/channels/{cid}"},
                "title": f"{role.value} sends {e.name}",
                "messages": msg_ref,
            }
            if role is Role.RUNNER:
                op["description"] = "every worker's consumer runner, for its own consumers' messages"
            if e.responders:
                op["description"] = "request/reply: " + ", ".join(r.value for r in e.responders) + " replies"
            operations[f"{role.value}_sends_{cid}"] = op
        for c in CONSUMERS:
            if e in c.events:
                operations[f"{c.durable.replace('-', '_')}_receives_{cid}"] = {
                    "action": "receive",
                    "channel": {"$ref": f"#/channels/{cid}"},
                    "title": f"durable consumer {c.durable} receives {e.name}",
                    "messages": msg_ref,
                }
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
