"""The parser's answers to creates a publisher could not otherwise understand (pure decisions):
an id token that is no block id gets a ``rejected`` on ``aios.block._invalid.rejected``; the same
spec created again under a live block's id is named a retry, with what to set; and the CLI's hint
for a refused inbox subscription names the setting."""

from __future__ import annotations

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import inbox_hint
from aios_blocks.handlers import parse
from aios_blocks.schemas.events import Rejected


def test_an_invalid_id_token_is_answered_on_the_invalid_subject() -> None:
    assert parse.invalid_id("aios.block.b-1.create", "b-1", 7) is None
    for subject, token, given, why in (
        ("aios.block.*.create", "*", "*", "is a wildcard"),
        ("aios.block.{x}.create", "{x}", "{x}", "is not a valid id"),
        ("aios.block.a.b.create", None, "a.b", "contains a dot"),
    ):
        effect = parse.invalid_id(subject, token, 42)
        assert effect is not None and effect.event is E.block_rejected
        assert effect.subject() == "aios.block._invalid.rejected"
        assert isinstance(effect.payload, Rejected) and effect.payload.gen == 42 and effect.payload.block_id == given
        assert why in effect.payload.errors[0].message and subject in effect.payload.errors[0].message
    # "_invalid" is no valid id itself: no block can ever have it
    assert parse.invalid_id("aios.block._invalid.create", "_invalid", 1) is not None


def test_the_same_spec_again_is_named_a_retry() -> None:
    ir = {"blockId": "b1", "minInstances": 1, "policies": {"x": {"version": 2}}}
    same = parse.in_use("block id already in use (status ready)", {"gen": 5, "ir": {**ir}}, ir)
    assert "same spec (gen 5)" in same.message and "Nats-Msg-Id" in same.message and "inbox_prefix" in same.message
    other = parse.in_use("block id already in use (status ready)", {"gen": 5, "ir": {**ir, "minInstances": 2}}, ir)
    assert other.message == "block id already in use (status ready)"
    assert parse.in_use("block id already in use (status ready)", None, ir).message == "block id already in use (status ready)"


def test_a_refused_inbox_subscription_names_the_setting() -> None:
    denial = 'nats: permissions violation for subscription to "_inbox.9vdmhctwoj6pijxar5ff0k.*"'
    hint = inbox_hint(denial)
    assert "_INBOX.<user>" in hint and "inbox_prefix" in hint and "inboxPrefix" in hint and "--inbox-prefix" in hint
    assert inbox_hint('nats: permissions violation for publish to "aios.block.b1.ready"') == ""


def test_every_event_the_system_stores_is_a_cloudevent() -> None:
    """Creates (the CLI's, the SDK's) and dead letters were raw JSON, so a CloudEvents reader of the
    stream failed on them; only core-NATS messages (never stored) are not CloudEvents."""
    from aios_blocks.bus.catalog import EVENTS, Body

    assert [e.name for e in EVENTS if e.stored and e.body is not Body.CLOUDEVENT] == []


def test_a_cloudevent_with_wrong_attributes_is_refused_with_its_specs_problems_too() -> None:
    """A create sent as a CloudEvent with wrong attributes was refused for them alone, its spec
    checked only once they were right: a client needed two rounds to see every problem. Now the
    spec is read all the same and one rejection lists both, the attributes' first; it is never
    placed, however right its spec."""
    import json

    from aios_blocks.settings import Settings

    component = {"componentURI": "aios://test/model", "resources": {"gpus": 1, "cpu": 1, "memory": 1024}, "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}}]}
    bad = {"blockComponentURI": "aios://test/model", "minInstances": 3, "maxInstances": 1, "colour": "red"}
    attributes = ["$.specversion", "$.id", "$.source", "$.type"]
    first = parse.read(json.dumps({"specversion": "0.3", "type": "io.aios.block.delete", "data": bad}).encode())
    assert first.doc == bad and [e.path for e in first.errors] == attributes
    envelope = parse.envelope_errors(first)
    out = parse.refused(parse.build(bad, component, "b1", None, Settings(), {}), envelope)
    assert out.ir is None and [e.path for e in out.errors][:4] == attributes, out.errors
    assert {"$.colour", "$.minInstances"} <= {e.path for e in out.errors[4:]}, out.errors
    # a right spec under wrong attributes: refused for them alone, no IR
    good = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}
    built = parse.build(good, component, "b1", None, Settings(), {})
    assert built.ir is not None
    assert parse.refused(built, envelope) == parse.ParseOutcome(errors=envelope, doc=good)
    # right attributes, or no spec to read: nothing added
    right = parse.read(json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create",
                                   "data": good}).encode())
    assert right.errors == [] and parse.envelope_errors(right) == [] and parse.refused(built, []) is built
    none = parse.read(json.dumps({"specversion": "0.3", "data": [1]}).encode())
    assert none.doc is None and parse.envelope_errors(none) == []
