"""``parse.submitted``: every create taken from ``AIOS_INTAKE`` becomes one ``block.submitted``
CloudEvent payload in ``AIOS``, whatever its publisher sent (issue 32 item 9)."""

from __future__ import annotations

import json

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.handlers import parse

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1}


def test_a_bare_spec_and_a_cloudevent_carry_the_spec_and_gen() -> None:
    bare = json.dumps(SPEC).encode()
    e = parse.submitted("aios.block.b1.create", "b1", 7, bare, {"Nats-Msg-Id": "m1", "X-Other": "y"})
    assert e.event is E.block_submitted and e.subject() == "aios.block.b1.submitted"
    p = e.payload
    assert (p.block_id, p.gen, p.spec, p.framing, p.headers) == ("b1", 7, SPEC, "bare", {"Nats-Msg-Id": "m1"})
    assert p.digest == parse.digest(bare) and p.body == "" and p.attributes == {}
    ce = json.dumps({"specversion": "1.0", "id": "x1", "source": "urn:s", "type": "io.aios.block.create", "data": SPEC}).encode()
    p = parse.submitted("aios.block.b1.create", "b1", 8, ce, None).payload
    assert (p.spec, p.framing, p.attributes) == (SPEC, "cloudevent", {"specversion": "1.0", "id": "x1", "source": "urn:s", "type": "io.aios.block.create"})


def test_its_id_is_the_creates_so_a_redelivery_is_deduplicated() -> None:
    body = json.dumps(SPEC).encode()
    one, two = (parse.submitted("aios.block.b1.create", "b1", 7, body, {}) for _ in range(2))
    assert one.logical_id() == two.logical_id() == "b1:7:submitted"
    assert parse.submitted("aios.block.b1.create", "b1", 9, body, {}).logical_id() != one.logical_id()


def test_a_body_with_no_spec_is_kept_as_text_and_an_invalid_id_goes_to_invalid() -> None:
    p = parse.submitted("aios.block.b1.create", "b1", 3, b"not json \xff", {}).payload
    assert p.spec is None and p.body.startswith("not json") and p.framing == "bare"
    big = b"x" * 5000
    p = parse.submitted("aios.block.b1.create", "b1", 4, big, {}, max_bytes=100).payload
    assert p.spec is None and len(p.body) == parse.BODY_EXCERPT
    for subject, bid in (("aios.block.*.create", "*"), ("aios.block.a.b.create", None)):
        e = parse.submitted(subject, bid, 5, json.dumps(SPEC).encode(), {})
        assert e.subject() == "aios.block._invalid.submitted" and e.payload.subject == subject
        assert any(subjects.matches(f, e.subject()) for f in subjects.STREAM_SUBJECTS)
