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
