"""Affinity model and TLV codec (seed 002): golden vectors, fail-closed rules, normalisation, properties."""

from __future__ import annotations

import base64
import re
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aios_blocks.schemas.affinity import (
    AIOS_NAMESPACE,
    ALLOWED_STRENGTHS,
    ALLOWED_TARGETS,
    CATEGORY,
    STRENGTH,
    TARGET_TYPE,
    TLV_TAG,
    AffinityEntry,
    TLVError,
    decode_tlv,
    encode_entry,
    encode_tlv,
    id128,
    normalize,
)
from aios_blocks.schemas.errors import SpecInvalid

U1 = "00112233-4455-6677-8899-aabbccddeeff"
U1_HEX = "00112233445566778899aabbccddeeff"
U2 = "f81d4fae-7dec-11d0-a765-00a0c91e6bf6"
U2_HEX = "f81d4fae7dec11d0a76500a0c91e6bf6"
ATTESTED_HEX = "6174746573746564"  # "attested"

# keep the file well under 5 s: structured properties run 200 examples, raw-bytes fuzzing 300
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def h(text: str) -> bytes:
    """Hex with spaces -> bytes."""
    return bytes.fromhex(text.replace(" ", ""))


def E(category: str, strength: str, anti: bool, target_type: str, target: str) -> AffinityEntry:
    return AffinityEntry(category, strength, anti, target_type, target)


# Hand-written from seed 002 §2: tag 0910, length, category, strength (bit 7 = away), target type,
# target_len, target. Every category x allowed target type, toward and away.
GOLDEN: list[tuple[str, AffinityEntry]] = [
    (f"0910 0015 01 01 01 0010 {U1_HEX}", E("Resource", "Required", False, "NodeId", U1)),
    (f"0910 0015 01 82 01 0010 {U1_HEX}", E("Resource", "Preferred", True, "NodeId", U1)),
    (f"0910 0015 01 02 02 0010 {U2_HEX}", E("Resource", "Preferred", False, "ResourceId", U2)),
    (f"0910 0015 01 81 02 0010 {U2_HEX}", E("Resource", "Required", True, "ResourceId", U2)),
    (f"0910 0015 02 01 01 0010 {U1_HEX}", E("State", "Required", False, "NodeId", U1)),
    (f"0910 0015 02 82 01 0010 {U1_HEX}", E("State", "Preferred", True, "NodeId", U1)),
    (f"0910 0015 02 02 03 0010 {U2_HEX}", E("State", "Preferred", False, "LeaseId", U2)),
    (f"0910 0015 02 81 03 0010 {U2_HEX}", E("State", "Required", True, "LeaseId", U2)),
    (f"0910 0015 03 02 01 0010 {U1_HEX}", E("Topology", "Preferred", False, "NodeId", U1)),
    (f"0910 0015 03 81 01 0010 {U1_HEX}", E("Topology", "Required", True, "NodeId", U1)),
    ("0910 0009 03 01 06 0004 ffffffff", E("Topology", "Required", False, "RackId", "4294967295")),
    ("0910 0009 03 81 06 0004 0000002a", E("Topology", "Required", True, "RackId", "42")),
    ("0910 0009 03 82 06 0004 00000000", E("Topology", "Preferred", True, "RackId", "0")),
    (f"0910 0015 03 01 04 0010 {U2_HEX}", E("Topology", "Required", False, "ServiceId", U2)),
    (f"0910 0015 03 81 04 0010 {U2_HEX}", E("Topology", "Required", True, "ServiceId", U2)),
    (f"0910 000d 04 01 05 0008 {ATTESTED_HEX}", E("Trust", "Required", False, "TrustDomain", "attested")),
    (f"0910 000d 04 81 05 0008 {ATTESTED_HEX}", E("Trust", "Required", True, "TrustDomain", "attested")),
    ("0910 000c 04 01 05 0007 7a6f6e652dc3a9", E("Trust", "Required", False, "TrustDomain", "zone-\u00e9")),
    # the LinkTier extension (docs/topology.md): 1 byte, the tier's code; toward only
    ("0910 0006 03 01 07 0001 02", E("Topology", "Required", False, "LinkTier", "NVLINK")),
    ("0910 0006 03 02 07 0001 03", E("Topology", "Preferred", False, "LinkTier", "PCIE_SWITCH")),
]

TWO = f"0910 0009 03 81 06 0004 0000002a 0910 000d 04 01 05 0008 {ATTESTED_HEX}"
TWO_ENTRIES = [
    E("Topology", "Required", True, "RackId", "42"),
    E("Trust", "Required", False, "TrustDomain", "attested"),
]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def spec_errors(**kw: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecInvalid) as exc:
        normalize(**kw)
    return [(e.path, e.message) for e in exc.value.errors]


def entry(
    category: Any = "Topology", strength: Any = "Required", ttype: Any = "RackId", value: Any = 42, **kw: Any
) -> dict[str, Any]:
    return {"category": category, "strength": strength, "target": {"type": ttype, "value": value}, **kw}


# -- golden vectors ----------------------------------------------------------------------------


def test_golden_vectors_cover_every_category_target_type_and_direction() -> None:
    combos = {(e.category, e.target_type, e.anti) for _, e in GOLDEN}
    assert combos == {(c, t, a) for c, ts in ALLOWED_TARGETS.items() for t in ts for a in (False, True)
                      if (t, a) != ("LinkTier", True)}  # a link tier is toward only


@pytest.mark.parametrize(("hexstr", "expected"), GOLDEN, ids=[e.describe() for _, e in GOLDEN])
def test_golden_vector(hexstr: str, expected: AffinityEntry) -> None:
    wire = h(hexstr)
    assert decode_tlv(wire) == [expected]
    assert encode_tlv([expected]) == wire
    assert encode_entry(expected) == wire[4:]


def test_seed_example_topology_required_away_rack_42() -> None:
    e = E("Topology", "Required", True, "RackId", "42")
    assert encode_tlv([e]) == h("0910 0009 03 81 06 0004 0000002a")
    assert e.describe() == "Required away from RackId 42"
    assert E("Resource", "Preferred", False, "NodeId", U1).describe() == f"Preferred toward NodeId {U1}"


def test_two_entry_blob() -> None:
    assert decode_tlv(h(TWO)) == TWO_ENTRIES
    assert encode_tlv(TWO_ENTRIES) == h(TWO)


def test_constants() -> None:
    assert TLV_TAG == 0x0910
    assert CATEGORY == {"Resource": 1, "State": 2, "Topology": 3, "Trust": 4}
    assert STRENGTH == {"Required": 1, "Preferred": 2, "Adaptive": 3}
    assert TARGET_TYPE == {
        "NodeId": 1,
        "ResourceId": 2,
        "LeaseId": 3,
        "ServiceId": 4,
        "TrustDomain": 5,
        "RackId": 6,
        "LinkTier": 7,  # the extension of docs/topology.md
    }
    assert AIOS_NAMESPACE == uuid.UUID("12c8198f-b4ae-5857-b04d-085eabe56645")


def test_decoder_skips_other_tags() -> None:
    wire = (
        h("0101 0002 abcd") + h("0910 0009 03 81 06 0004 0000002a") + h("0101 0000") + h("ffff 0003 091000")
    )
    assert decode_tlv(wire) == [E("Topology", "Required", True, "RackId", "42")]
    assert decode_tlv(h("0101 0002 abcd")) == []
    assert decode_tlv(b"") == []


def test_id128() -> None:
    assert id128(U1) == uuid.UUID(U1)
    assert id128(U1.upper()) == uuid.UUID(U1)
    assert id128("node-17") == uuid.uuid5(AIOS_NAMESPACE, "node-17")
    assert id128("node-17") != id128("node-18")


def test_encode_rejects_invalid_or_unnormalised_entries() -> None:
    bad = [
        E("Trust", "Required", False, "NodeId", U1),  # target type not allowed
        E("Facility", "Required", False, "NodeId", U1),
        E("Resource", "Sometimes", False, "NodeId", U1),
        E("Resource", "Required", False, "NodeId", "node-17"),  # not a canonical UUID
        E("Resource", "Required", False, "NodeId", U1.upper()),
        E("Topology", "Required", False, "RackId", "042"),
        E("Topology", "Required", False, "RackId", "4294967296"),
        E("Trust", "Required", False, "TrustDomain", ""),
    ]
    for e in bad:
        with pytest.raises(ValueError, match="cannot encode"):
            encode_entry(e)


# -- fail closed: wire form -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hexstr", "message"),
    [
        ("0910 0009 07 01 06 0004 0000002a", "unknown category 0x07"),
        ("0910 0009 00 01 06 0004 0000002a", "unknown category 0x00"),
        ("0910 0009 ff 01 06 0004 0000002a", "unknown category 0xff"),
        ("0910 0009 05 01 06 0004 0000002a", "Facility (0x05) is not supported in v1"),
        ("0910 0009 03 04 06 0004 0000002a", "unknown strength 0x04"),
        ("0910 0009 03 84 06 0004 0000002a", "unknown strength 0x04"),
        ("0910 0009 03 00 06 0004 0000002a", "unknown strength 0x00"),
        ("0910 0009 03 41 06 0004 0000002a", "unknown strength 0x41"),
        ("0910 0009 03 01 08 0004 0000002a", "unknown target type 0x08"),
        ("0910 0009 03 01 00 0004 0000002a", "unknown target type 0x00"),
        (f"0910 0015 04 01 01 0010 {U1_HEX}", "target type NodeId is not allowed for category Trust"),
        (f"0910 0015 01 01 03 0010 {U1_HEX}", "target type LeaseId is not allowed for category Resource"),
        ("0910 0009 02 01 06 0004 0000002a", "target type RackId is not allowed for category State"),
        (
            "0910 000d 03 01 05 0008 6174746573746564",
            "target type TrustDomain is not allowed for category Topology",
        ),
        ("0910 0009 01 01 01 0004 00000001", "NodeId target must be 16 bytes (u128 BE), got 4"),
        (f"0910 0015 03 01 06 0010 {U1_HEX}", "RackId target must be 4 bytes (u32 BE), got 16"),
        ("0910 0005 04 01 05 0000", "TrustDomain target must be 1..255 bytes of UTF-8, got 0"),
        ("0910 0006 04 01 05 0001 ff", "TrustDomain target is not valid UTF-8"),
        ("0910 0007 04 01 05 0002 c328", "TrustDomain target is not valid UTF-8"),
        ("0910 0003 03 81 06", "truncated entry: 3 byte(s), an entry needs at least 5"),
        ("0910 0000", "truncated entry: 0 byte(s)"),
        ("0910 000a 03 81 06 0004 0000002a 00", "entry length 10 != 5 + target_len 4"),
        ("0910 0009 03 81 06 0005 0000002a", "entry length 9 != 5 + target_len 5"),
        ("0910 0009 03 81 06 0004 0000", "truncated TLV: length 9 but only 7 byte(s) follow"),
        ("09", "truncated TLV header at offset 0: 1 byte(s) left"),
        ("0910 00", "truncated TLV header"),
        ("0101 0004 ab", "TLV tag 0x0101 (offset 0): truncated TLV"),
    ],
)
def test_wire_fail_closed(hexstr: str, message: str) -> None:
    with pytest.raises(TLVError, match=re.escape(message)):
        decode_tlv(h(hexstr))


def test_trust_domain_length_limit_on_the_wire() -> None:
    ok = h("0910 0104 04 01 05 00ff") + b"d" * 255
    assert decode_tlv(ok) == [E("Trust", "Required", False, "TrustDomain", "d" * 255)]
    too_long = h("0910 0105 04 01 05 0100") + b"d" * 256
    with pytest.raises(TLVError, match=re.escape("TrustDomain target must be 1..255 bytes")):
        decode_tlv(too_long)


def test_wire_error_names_the_entry_index_and_lists_every_bad_entry() -> None:
    wire = (
        h("0910 0009 03 81 06 0004 0000002a")  # entry 0: fine
        + h("0101 0001 00")  # not an affinity TLV: not counted
        + h("0910 0009 05 01 06 0004 0000002a")  # entry 1: Facility
        + h("0910 0009 03 81 06 0004 0000002b")  # entry 2: fine
        + h("0910 0009 03 04 06 0004 0000002a")  # entry 3: strength 0x04
    )
    with pytest.raises(TLVError) as exc:
        decode_tlv(wire)
    assert len(exc.value.problems) == 2
    assert exc.value.problems[0].startswith("affinity entry 1 (offset 18): category Facility")
    assert exc.value.problems[1].startswith("affinity entry 3 (offset 44): unknown strength 0x04")
    assert "affinity entry 1" in str(exc.value) and "affinity entry 3" in str(exc.value)


def test_decode_rejects_non_bytes_with_tlv_error() -> None:
    with pytest.raises(TLVError):
        decode_tlv("0910")  # type: ignore[arg-type]
    assert decode_tlv(bytearray(h("0910 0009 03 81 06 0004 0000002a"))) == [
        E("Topology", "Required", True, "RackId", "42")
    ]


# -- JSON form ---------------------------------------------------------------------------------


def test_json_form_normalises_targets() -> None:
    got = normalize(
        [
            entry("Resource", "Required", "ResourceId", "gpu-3"),
            entry("State", "Preferred", "LeaseId", U1.upper(), direction="away"),
            entry(3, 2, 6, "42", anti=True),
            entry("Trust", "Required", "TrustDomain", "attested", direction="toward", anti=False),
            entry("Topology", "Required", "ServiceId", "my-block", anti=True),
        ]
    )
    assert got == [
        E("Resource", "Required", False, "ResourceId", str(uuid.uuid5(AIOS_NAMESPACE, "gpu-3"))),
        E("State", "Preferred", True, "LeaseId", U1),
        E("Topology", "Preferred", True, "RackId", "42"),
        E("Trust", "Required", False, "TrustDomain", "attested"),
        E("Topology", "Required", True, "ServiceId", str(uuid.uuid5(AIOS_NAMESPACE, "my-block"))),
    ]


def test_nothing_given_is_empty() -> None:
    assert normalize() == []
    assert normalize([]) == []


def test_duplicates_collapse_including_id_and_its_uuid5() -> None:
    as_uuid = str(uuid.uuid5(AIOS_NAMESPACE, "node-17"))
    got = normalize(
        [
            entry("Resource", "Preferred", "NodeId", "node-17"),
            entry("Resource", "Preferred", "NodeId", as_uuid),
            entry("Resource", "Preferred", "NodeId", "node-17"),
        ],
        affinity_with="node-17",
    )
    assert got == [E("Resource", "Preferred", False, "NodeId", as_uuid)]


def test_path_prefix() -> None:
    errors = spec_errors(affinity=[entry("Facility")], path="$.<component>")
    assert [p for p, _ in errors] == ["$.<component>.affinity[0].category"]


@pytest.mark.parametrize(
    ("item", "path", "message"),
    [
        (entry("Facility"), "$.affinity[0].category", "Facility (0x05) is not supported in v1"),
        (entry(5), "$.affinity[0].category", "Facility (0x05) is not supported in v1"),
        (entry(9), "$.affinity[0].category", "unknown category code 9"),
        (entry("topology"), "$.affinity[0].category", "did you mean 'Topology'"),
        (entry(True), "$.affinity[0].category", "category must be one of"),
        (entry(strength="adaptive"), "$.affinity[0].strength", "did you mean 'Adaptive'"),
        (entry(strength=4), "$.affinity[0].strength", "unknown strength code 4"),
        (entry(strength="required"), "$.affinity[0].strength", "did you mean 'Required'"),
        (entry(strength=0x81), "$.affinity[0].strength", "unknown strength code 129"),
        (
            entry("Trust", ttype="NodeId", value="x"),
            "$.affinity[0].target.type",
            "NodeId is not allowed for category Trust",
        ),
        (
            entry("Resource", ttype="RackId"),
            "$.affinity[0].target.type",
            "RackId is not allowed for category Resource",
        ),
        (entry(ttype="GpuId"), "$.affinity[0].target.type", "unknown target type 'GpuId'"),
        (entry(ttype=9), "$.affinity[0].target.type", "unknown target type code 9"),
        (entry(value=-1), "$.affinity[0].target.value", "RackId must be an integer 0..4294967295"),
        (entry(value=2**32), "$.affinity[0].target.value", "RackId must be an integer"),
        (entry(value="4294967296"), "$.affinity[0].target.value", "RackId must be an integer"),
        (entry(value="rack-1"), "$.affinity[0].target.value", "RackId must be an integer"),
        (entry(value=True), "$.affinity[0].target.value", "RackId must be an integer"),
        (entry(value=4.0), "$.affinity[0].target.value", "RackId must be an integer"),
        (
            entry("Trust", ttype="TrustDomain", value=""),
            "$.affinity[0].target.value",
            "TrustDomain must be a non-empty string",
        ),
        (
            entry("Trust", ttype="TrustDomain", value="\u00e9" * 128),
            "$.affinity[0].target.value",
            "256 UTF-8 bytes; at most 255",
        ),
        (entry("Trust", ttype="TrustDomain", value="\ud800"), "$.affinity[0].target.value", "valid UTF-8"),
        (
            entry("Resource", ttype="NodeId", value=""),
            "$.affinity[0].target.value",
            "NodeId must be a non-empty string id",
        ),
        (
            entry("Resource", ttype="ResourceId", value=7),
            "$.affinity[0].target.value",
            "ResourceId must be a non-empty string id",
        ),
        (entry(weight=2), "$.affinity[0].weight", "unknown key 'weight'"),
        (
            {**entry(), "target": {"type": "RackId", "value": 1, "x": 0}},
            "$.affinity[0].target.x",
            "unknown key 'x'",
        ),
        ({**entry(), "target": {"type": "RackId"}}, "$.affinity[0].target.value", "missing target value"),
        ({**entry(), "target": "rack 42"}, "$.affinity[0].target", "target must be a mapping"),
        (
            {"strength": "Required", "target": {"type": "RackId", "value": 1}},
            "$.affinity[0].category",
            "missing category",
        ),
        (
            {"category": "Topology", "target": {"type": "RackId", "value": 1}},
            "$.affinity[0].strength",
            "missing strength",
        ),
        ({"category": "Topology", "strength": "Required"}, "$.affinity[0].target", "missing target"),
        (entry(anti="yes"), "$.affinity[0].anti", "anti must be true or false"),
        (entry(direction="sideways"), "$.affinity[0].direction", "direction must be 'away' or 'toward'"),
        (entry(direction="away", anti=False), "$.affinity[0].direction", "contradicts anti: false"),
        (entry(direction="toward", anti=True), "$.affinity[0].direction", "contradicts anti: true"),
        ("Topology", "$.affinity[0]", "an affinity entry must be a mapping"),
    ],
)
def test_json_fail_closed(item: Any, path: str, message: str) -> None:
    errors = spec_errors(affinity=[item])
    assert path in [p for p, _ in errors], errors
    assert any(p == path and message in m for p, m in errors), errors


def test_trust_domain_of_255_utf8_bytes_is_fine() -> None:
    got = normalize([entry("Trust", ttype="TrustDomain", value="\u00e9" * 127 + "x")])
    assert got[0].target == "\u00e9" * 127 + "x"
    assert len(encode_entry(got[0])) == 5 + 255


def test_every_problem_is_listed() -> None:
    errors = spec_errors(
        affinity=[
            entry("Facility", "Sometimes", weight=1),
            entry(),
            entry("Trust", ttype="NodeId", value="n"),
        ],
        affinity_with=17,
        anti_affinity_with="",
        affinity_tlv="not base64!",
    )
    assert [p for p, _ in errors] == [
        "$.affinity[0].weight",
        "$.affinity[0].category",
        "$.affinity[0].strength",
        "$.affinity[2].target.type",
        "$.affinityWith",
        "$.antiAffinityWith",
        "$.affinityTLV",
    ]


def test_affinity_must_be_a_list() -> None:
    assert [p for p, _ in spec_errors(affinity={"category": "Topology"})] == ["$.affinity"]


def test_affinity_tlv_errors() -> None:
    [(path, message)] = spec_errors(affinity_tlv="#!")
    assert path == "$.affinityTLV" and "not valid base64" in message
    [(path, message)] = spec_errors(affinity_tlv=b64(h("0910 0009 05 01 06 0004 0000002a")))
    assert path == "$.affinityTLV" and message.startswith("affinity entry 0 (offset 0): category Facility")
    [(path, message)] = spec_errors(affinity_tlv=b64(h("0910 0009 03 81 06 0004 00")))
    assert path == "$.affinityTLV" and "truncated TLV" in message
    [(path, _)] = spec_errors(affinity_tlv=b"\x09\x10")
    assert path == "$.affinityTLV"
    assert normalize(affinity_tlv="") == []


def test_affinity_tlv_tolerates_whitespace_in_base64() -> None:
    text = b64(h(TWO))
    assert normalize(affinity_tlv=f"{text[:8]}\n  {text[8:]}\n") == TWO_ENTRIES


# -- contradictions ------------------------------------------------------------------------------


def test_required_toward_and_away_same_target_is_contradictory_across_categories() -> None:
    errors = spec_errors(
        affinity=[
            entry("Resource", "Required", "NodeId", "node-1"),
            entry("Topology", "Preferred", "RackId", 1),
            entry("Topology", "Required", "NodeId", str(uuid.uuid5(AIOS_NAMESPACE, "node-1")), anti=True),
        ]
    )
    [(path, message)] = errors
    assert path == "$.affinity[2]"
    assert "$.affinity[0]" in message and "$.affinity[2]" in message
    assert "Required toward NodeId" in message and "Required away from NodeId" in message


def test_contradiction_between_json_and_tlv_forms() -> None:
    [(path, message)] = spec_errors(
        affinity=[entry("Topology", "Required", "RackId", 42)],
        affinity_tlv=b64(h("0910 0009 03 81 06 0004 0000002a")),
    )
    assert path == "$.affinityTLV"
    assert "$.affinity[0]" in message and "$.affinityTLV entry 0" in message


def test_preferred_toward_and_away_is_not_contradictory() -> None:
    got = normalize([entry(strength="Preferred"), entry(strength="Preferred", anti=True), entry(anti=True)])
    assert len(got) == 3


def test_required_toward_and_preferred_away_is_not_contradictory() -> None:
    assert len(normalize([entry(), entry(strength="Preferred", anti=True)])) == 2


# -- shorthand and equivalent forms ---------------------------------------------------------------


def test_affinity_with_is_resource_preferred_toward_node() -> None:
    explicit = normalize([entry("Resource", "Preferred", "NodeId", "node-3")])
    assert normalize(affinity_with="node-3") == explicit
    assert explicit == [E("Resource", "Preferred", False, "NodeId", str(id128("node-3")))]


def test_anti_affinity_with_is_topology_preferred_away_node() -> None:
    explicit = normalize([entry("Topology", "Preferred", "NodeId", "node-3", anti=True)])
    assert normalize(anti_affinity_with="node-3") == explicit
    assert explicit == [E("Topology", "Preferred", True, "NodeId", str(id128("node-3")))]


def test_shorthand_matches_its_golden_tlv() -> None:
    tlv = b64(h(f"0910 0015 01 02 01 0010 {U1_HEX} 0910 0015 03 82 01 0010 {U2_HEX}"))
    assert normalize(affinity_with=U1, anti_affinity_with=U2) == normalize(affinity_tlv=tlv)


def test_json_and_tlv_forms_normalise_to_the_same_list() -> None:
    json_form = [
        entry("Topology", "Required", "RackId", "42", direction="away"),
        entry(4, 1, "TrustDomain", "attested"),
    ]
    assert normalize(json_form) == normalize(affinity_tlv=b64(h(TWO))) == TWO_ENTRIES


def test_all_golden_entries_as_json_match_their_tlv() -> None:
    json_form = [
        entry(
            e.category,
            e.strength,
            e.target_type,
            int(e.target) if e.target_type == "RackId" else e.target,
            anti=e.anti,
        )
        for _, e in GOLDEN
        if not (e.strength == "Required" and e.target_type in ("NodeId", "ServiceId", "TrustDomain"))
    ]
    wire = b"".join(
        h(x)
        for x, e in GOLDEN
        if not (e.strength == "Required" and e.target_type in ("NodeId", "ServiceId", "TrustDomain"))
    )
    assert normalize(json_form) == normalize(affinity_tlv=b64(wire)) == decode_tlv(wire)


def test_affinity_entry_instances_are_accepted_and_normalised() -> None:
    got = normalize([E("Resource", "Preferred", False, "NodeId", "node-3")])
    assert got == normalize(affinity_with="node-3")


# -- properties ----------------------------------------------------------------------------------

_TARGETS: dict[str, st.SearchStrategy[str]] = {
    **{t: st.uuids().map(str) for t in ("NodeId", "ResourceId", "LeaseId", "ServiceId")},
    "RackId": st.integers(0, 2**32 - 1).map(str),
    "TrustDomain": st.text(min_size=1, max_size=80).filter(lambda s: len(s.encode("utf-8")) <= 255),
    "LinkTier": st.sampled_from(["NVSWITCH", "NVLINK", "PCIE_SWITCH", "HOST_BRIDGE", "NUMA", "SYSTEM"]),
}


@st.composite
def entries(draw: st.DrawFn) -> AffinityEntry:
    category = draw(st.sampled_from(sorted(CATEGORY)))
    target_type = draw(st.sampled_from(sorted(ALLOWED_TARGETS[category])))
    return AffinityEntry(
        category,
        draw(st.sampled_from(ALLOWED_STRENGTHS[category])),
        draw(st.booleans()) and target_type != "LinkTier",  # a link tier is toward only
        target_type,
        draw(_TARGETS[target_type]),
    )


@PROPS
@given(st.lists(entries(), max_size=8))
def test_round_trip(es: list[AffinityEntry]) -> None:
    assert decode_tlv(encode_tlv(es)) == es


@PROPS
@given(st.lists(entries(), max_size=6))
def test_json_form_and_tlv_form_agree(es: list[AffinityEntry]) -> None:
    json_form = [entry(e.category, e.strength, e.target_type, e.target, anti=e.anti) for e in es]
    outcomes = []
    for kw in ({"affinity": json_form}, {"affinity_tlv": b64(encode_tlv(es))}):
        try:
            outcomes.append(normalize(**kw))
        except SpecInvalid as exc:
            outcomes.append(len(exc.errors))
    assert outcomes[0] == outcomes[1]
    if isinstance(outcomes[0], list):
        assert outcomes[0] == list(dict.fromkeys(es))


def _decode_only_tlv_error(data: bytes) -> None:
    try:
        decoded = decode_tlv(data)
    except TLVError:
        return
    # whatever decodes is valid v1: it encodes and round-trips
    assert decode_tlv(encode_tlv(decoded)) == decoded


@FUZZ
@given(st.binary(max_size=300))
def test_decode_arbitrary_bytes_raises_only_tlv_error(data: bytes) -> None:
    _decode_only_tlv_error(data)


@FUZZ
@given(st.binary(max_size=40).map(lambda b: h("0910") + len(b).to_bytes(2, "big") + b))
def test_decode_arbitrary_affinity_values_raises_only_tlv_error(data: bytes) -> None:
    _decode_only_tlv_error(data)


@FUZZ
@given(st.lists(entries(), min_size=1, max_size=4), st.data())
def test_decode_mutated_blobs_raises_only_tlv_error(es: list[AffinityEntry], data: st.DataObject) -> None:
    blob = bytearray(encode_tlv(es))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and blob:
            blob[pos] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del blob[pos:]
        elif op == "insert":
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and blob:
            del blob[pos]
    _decode_only_tlv_error(bytes(blob))


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12,
)
_KEYS = st.sampled_from(["category", "strength", "anti", "direction", "target", "type", "value", "x"])
_ENTRYISH = st.dictionaries(
    _KEYS,
    _JSON
    | st.sampled_from([*CATEGORY, *STRENGTH, "away", "toward", 1, 3, 5, 6])
    | st.fixed_dictionaries(
        {
            "type": st.sampled_from([*TARGET_TYPE, 1, 6, 9]),
            "value": _JSON | st.sampled_from(["n", 42, "42", ""]),
        }
    ),
    max_size=6,
)


@PROPS
@given(st.lists(_ENTRYISH | _JSON, max_size=4), _JSON, _JSON, _JSON | st.binary(max_size=30).map(b64))
def test_normalize_on_junk_raises_only_spec_invalid(affinity: Any, aw: Any, aaw: Any, tlv: Any) -> None:
    try:
        got = normalize(affinity, aw, aaw, tlv)
    except SpecInvalid as exc:
        assert exc.errors and all(e.path.startswith("$.") for e in exc.errors)
    else:
        assert decode_tlv(encode_tlv(got)) == got


# -- Adaptive (0x03): accepted; scores like Preferred with an adapted weight -----------------------


def test_adaptive_strength_is_accepted_in_every_form_and_round_trips() -> None:
    by_name = normalize([entry("Topology", "Adaptive", ttype="RackId", value=7)])
    by_code = normalize([entry(3, 3, ttype="RackId", value=7)])
    assert by_name == by_code == [E("Topology", "Adaptive", False, "RackId", "7")]
    wire = encode_tlv(by_name)
    assert wire == h("0910 0009 03 03 06 0004 00000007")
    assert decode_tlv(wire) == by_name
    away = decode_tlv(h("0910 0009 03 83 06 0004 00000007"))
    assert away == [E("Topology", "Adaptive", True, "RackId", "7")]
    # Adaptive toward and Required away on one target is no contradiction (only Required pairs are)
    normalize([entry("Topology", "Adaptive", ttype="RackId", value=7),
               {**entry("Topology", "Required", ttype="RackId", value=7), "anti": True}])


@given(st.text(max_size=40) | st.sampled_from([U1, U1_HEX, U2, "{" + U1 + "}", "urn:uuid:" + U1, "b1", "b1-0", ""]))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_policy_uid_is_str_of_id128(value: str) -> None:
    """``policies.affinity.uid`` computes short ids' uuid5 without ``uuid.UUID``: same string."""
    from aios_blocks.policies.affinity import uid

    try:
        expected = str(id128(value))
    except UnicodeEncodeError:  # a lone surrogate: neither can encode it
        with pytest.raises(UnicodeEncodeError):
            uid(value)
        return
    assert uid(value) == expected
