"""Seed 002 §5: v1 allows Trust affinity with strength Required only ("only on attested nodes in
domain D"). Preferred or Adaptive Trust is refused in every form (JSON, TLV, encoding), with a
clear message, and alongside the spec's other problems (all listed at once)."""

from __future__ import annotations

import base64
import re
import struct

import pytest

from aios_blocks.schemas.affinity import (
    AffinityEntry,
    TLVError,
    decode_tlv,
    encode_entry,
    encode_tlv,
    normalize,
)
from aios_blocks.schemas.errors import SpecInvalid

from .test_ir import errors_of, spec

MSG = "strength {} is not allowed for category Trust in v1 (allowed: Required)"


def trust(strength: object, **kw: object) -> dict[str, object]:
    return {"category": "Trust", "strength": strength, "target": {"type": "TrustDomain", "value": "attested"}, **kw}


def tlv(category: int, strength: int, domain: bytes = b"attested") -> bytes:
    entry = struct.pack(">BBBH", category, strength, 0x05, len(domain)) + domain
    return struct.pack(">HH", 0x0910, len(entry)) + entry


@pytest.mark.parametrize(("strength", "name"), [("Preferred", "Preferred"), (2, "Preferred"), ("Adaptive", "Adaptive")])
def test_json_form_refuses_non_required_trust(strength: object, name: str) -> None:
    with pytest.raises(SpecInvalid) as exc:
        normalize([trust(strength)])
    assert [(e.path, e.message) for e in exc.value.errors] == [("$.affinity[0].strength", MSG.format(name))]
    with pytest.raises(SpecInvalid):  # away from a domain: the same rule
        normalize([trust(strength, anti=True)])


def test_required_trust_is_still_accepted_toward_and_away() -> None:
    assert normalize([trust("Required")]) == [AffinityEntry("Trust", "Required", False, "TrustDomain", "attested")]
    assert decode_tlv(tlv(4, 0x81)) == [AffinityEntry("Trust", "Required", True, "TrustDomain", "attested")]


@pytest.mark.parametrize(("byte", "name"), [(0x02, "Preferred"), (0x82, "Preferred"), (0x03, "Adaptive")])
def test_tlv_form_refuses_non_required_trust(byte: int, name: str) -> None:
    with pytest.raises(TLVError, match=re.escape("affinity entry 0 (offset 0): " + MSG.format(name))):
        decode_tlv(tlv(4, byte))
    with pytest.raises(SpecInvalid) as exc:
        normalize(affinity_tlv=base64.b64encode(tlv(4, byte)).decode())
    assert [e.path for e in exc.value.errors] == ["$.affinityTLV"]
    with pytest.raises(ValueError, match=re.escape(MSG.format(name))):
        encode_entry(AffinityEntry("Trust", name, byte & 0x80 != 0, "TrustDomain", "attested"))
    # other categories keep Preferred
    pref = AffinityEntry("Topology", "Preferred", True, "RackId", "42")
    assert decode_tlv(encode_tlv([pref])) == [pref]


def test_the_spec_parser_lists_the_trust_refusal_with_every_other_problem() -> None:
    errs = errors_of(spec(minInstances=3, maxInstances=1, affinity=[
        trust("Preferred"),
        {"category": "Trust", "strength": "Preferred", "target": {"type": "NodeId", "value": "x"}},
        {"category": "Facility", "strength": "Required", "target": {"type": "NodeId", "value": "x"}},
    ]))
    got = {(e.path, e.message) for e in errs}
    assert ("$.affinity[0].strength", MSG.format("Preferred")) in got
    assert ("$.affinity[1].strength", MSG.format("Preferred")) in got
    assert any(p == "$.affinity[1].target.type" and "NodeId is not allowed for category Trust" in m for p, m in got)
    assert any(p.startswith("$.affinity[2]") and "Facility" in m for p, m in got)
    assert any(p == "$.minInstances" for p, _ in got)
