"""The parser's turn does each piece of work once (docs/trace.md "Where a create's time goes"): a
component's stored record is validated once for every create of it (``parse.ComponentCache``,
``schemas.ir.KnownComponent``), a create's body is decoded once for its ``submitted`` and its
parse (``parse.intake``), and the IRs are the same as before, byte for byte."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest

from aios_blocks.handlers import parse
from aios_blocks.schemas.errors import SpecInvalid
from aios_blocks.schemas.ir import KnownComponent, block_create_IR
from aios_blocks.schemas.spec import Component
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://test/model", "image": "aios/test:1", "tags": ["a"],
    "componentInitData": {"k": [1, 2]}, "resources": {"gpus": 1, "cpu": 2, "memory": 1024},
    "launch": {"command": ["run"], "ports": ["http"]},
    "sidecars": [{"name": "log", "image": "aios/log:1"}],
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {"w": [{"cpu": 1}]}},
    ],
}
SPECS: list[dict[str, Any]] = [
    {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 2},
    {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1, "resources": {"gpus": 2},
     "labels": {"qos": "LS"}, "initSettings": {"x": 1}, "tags": ["b"]},
    {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
     "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:spread",
                                     "settings": {"sampleNodes": 3}}}]},
    {"blockComponentURI": "aios://test/model", "minInstances": 3, "maxInstances": 1, "resources": {"gpus": True}},
]


def _stored(comp: dict[str, Any]) -> str:
    """A component's record as Redis holds it (``Store.put_component``)."""
    return Component.model_validate(comp).model_dump_json()


def _built(spec: dict[str, Any], component: Any) -> bytes | list[Any]:
    """The IR's JSON that ``parse.build`` makes (with the settings' pinned defaults), or its errors."""
    out = parse.build(dict(spec), component, "b1", {"resourceAllocator": 4}, Settings(), {})
    return msgspec.json.encode(out.ir) if out.ir is not None else [(e.path, e.message) for e in out.errors]


@pytest.mark.parametrize("spec", SPECS)
def test_a_known_component_builds_the_same_ir_as_its_record(spec: dict[str, Any]) -> None:
    raw = _stored(COMPONENT)
    known = parse.ComponentCache().get(raw)
    assert known is not None
    assert _built(spec, known) == _built(spec, json.loads(raw))
    assert _built(spec, known) == _built(spec, known)  # building changed nothing it keeps


def test_a_record_that_no_longer_validates_gives_the_same_errors() -> None:
    bad = {**json.loads(_stored(COMPONENT)), "resources": {"gpus": -1}}
    known = KnownComponent(bad)
    assert known.model is None and known.errors
    for spec in SPECS:
        with pytest.raises(SpecInvalid) as a:
            block_create_IR(dict(spec), known, "b1")
        with pytest.raises(SpecInvalid) as b:
            block_create_IR(dict(spec), dict(bad), "b1")
        assert a.value.errors == b.value.errors


def test_the_cache_keys_on_the_whole_record_and_keeps_the_recent_ones() -> None:
    cache = parse.ComponentCache(size=2)
    one, two = _stored(COMPONENT), _stored({**COMPONENT, "image": "aios/test:2"})
    a = cache.get(one)
    assert cache.get(one) is a and cache.get(one.encode()) is a and cache.get(None) is None and cache.get("") is None
    b = cache.get(two)
    assert b is not a and b is not None and b.model is not None and b.model.image == "aios/test:2"
    assert cache.get(one) is a  # now two is the least recently used
    cache.get(_stored({**COMPONENT, "image": "aios/test:3"}))  # and goes
    assert cache.get(one) is a and cache.get(two) is not b


async def test_the_parser_validates_a_components_record_once_for_its_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    validate = Component.model_validate.__func__

    def counted(cls: type[Component], obj: Any, *a: Any, **k: Any) -> Component:
        calls.append(obj)
        return validate(cls, obj, *a, **k)

    async with MemorySystem.open() as s:
        await s.add_component("aios://test/once-only")  # a record no other test's parser has seen
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        monkeypatch.setattr(Component, "model_validate", classmethod(counted))
        bids = [await s.submit({"blockComponentURI": "aios://test/once-only", "minInstances": 1, "maxInstances": 1})
                for _ in range(3)]
        await s.run()
        for bid in bids:
            block = await s.store.get_block(bid)
            assert block is not None and block["status"] == "ready", block
    # once for the three creates (was once per create)
    assert len([c for c in calls if isinstance(c, dict) and c.get("componentURI") == "aios://test/once-only"]) == 1


BODIES = [
    json.dumps(SPECS[0]).encode(),
    json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create", "data": SPECS[1]}).encode(),
    json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create",
                "data_base64": base64.b64encode(json.dumps(SPECS[0]).encode()).decode()}).encode(),
    json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create", "data": 3}).encode(),
    b"null", b"[1]", b"not json \xff", b"[" * 80 + b"]" * 80, b"x" * 300,
]


@pytest.mark.parametrize("body", BODIES)
def test_intake_is_submitted_and_read_with_the_body_decoded_once(body: bytes) -> None:
    sub, outcome = parse.intake("aios.block.b1.create", "b1", 7, body, {"Nats-Msg-Id": "m"}, 200)
    assert msgspec.json.encode(sub.payload) == msgspec.json.encode(
        parse.submitted("aios.block.b1.create", "b1", 7, body, {"Nats-Msg-Id": "m"}, 200).payload)
    again = parse.read(body, 200)
    assert (outcome.doc, outcome.errors) == (again.doc, again.errors)
    if outcome.doc is not None:  # the submitted's spec is the parse's: one decode for both
        assert sub.payload.spec is outcome.doc


async def test_a_create_without_a_tenant_label_has_no_tenant_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from aios_blocks.workers import parser

    checked: list[Any] = []
    check = parser._no_account_label

    async def counted(w: Any, outcome: parse.ParseOutcome) -> parse.ParseOutcome:
        checked.append(outcome.doc)
        return await check(w, outcome)

    monkeypatch.setattr(parser, "_no_account_label", counted)
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        plain = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        labelled = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                                   "labels": {"tenant": "team-a"}})  # a quota group, no account: allowed
        await s.run()
        for bid in (plain, labelled):
            block = await s.store.get_block(bid)
            assert block is not None and block["status"] == "ready", block
    # the labelled create's label checked (no account of that name); the plain one's not at all (was: a task each)
    assert [d["blockId"] for d in checked] == [labelled]
