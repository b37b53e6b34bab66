"""Property: the parser turns ANY input into an IR or a list of errors with JSON paths - never an
exception (hypothesis: arbitrary bytes, arbitrary JSON, and near-valid specs with one field broken)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aios_blocks.handlers import parse

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://fuzz/model",
    "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}},
    ],
}
VALID = {"blockComponentURI": "aios://fuzz/model", "minInstances": 1, "maxInstances": 2}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=25,
)
FIELDS = [
    "blockComponentURI", "blockId", "minInstances", "maxInstances", "blockInitData", "initSettings", "parameters",
    "policyRulesSpec", "resources", "affinity", "affinityWith", "antiAffinityWith", "affinityTLV", "colour",
]


def run(raw: bytes) -> parse.ParseOutcome:
    """As the parser worker: read, build, and a CloudEvent's wrong attributes listed with the spec's."""
    outcome = parse.read(raw)
    envelope = parse.envelope_errors(outcome)
    if outcome.doc is not None:
        uri = parse.component_uri(outcome.doc)
        outcome = parse.build(outcome.doc, COMPONENT if uri == COMPONENT["componentURI"] else None, "fuzz-1")
    return parse.refused(outcome, envelope)


def assert_outcome(outcome: parse.ParseOutcome) -> None:
    if outcome.ir is not None:
        assert outcome.errors == []
        assert outcome.ir["blockId"] == "fuzz-1"
        json.dumps(outcome.ir)  # the IR travels as JSON
    else:
        assert outcome.errors, "neither an IR nor an error"
        for e in outcome.errors:
            assert isinstance(e.path, str) and e.path.startswith("$"), e
            assert isinstance(e.message, str) and e.message, e


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes(raw: bytes) -> None:
    assert_outcome(run(raw))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_document(doc: Any) -> None:
    assert_outcome(run(json.dumps(doc).encode()))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS), json_values, st.booleans())
def test_valid_spec_with_one_field_replaced(field: str, value: Any, as_cloudevent: bool) -> None:
    doc = {**VALID, field: value}
    body = {"specversion": "1.0", "id": "x", "source": "fuzz", "type": "io.aios.block.create", "data": doc} if as_cloudevent else doc
    outcome = run(json.dumps(body).encode())
    assert_outcome(outcome)
    if field == "colour":
        assert outcome.ir is None and any(e.path == "$.colour" for e in outcome.errors)


def test_deep_nesting_and_invalid_utf8_are_errors_not_crashes() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    assert_outcome(run(deep.encode()))
    nested = '{"a":' * 5000 + "{}" + "}" * 5000
    body = json.dumps(VALID)[:-1] + ', "blockInitData": ' + nested + "}"
    outcome = run(body.encode())
    assert_outcome(outcome)
    assert outcome.ir is None and "deeper" in outcome.errors[0].message
    assert_outcome(run(b'{"blockComponentURI": "\xff\xfe", "minInstances": 1, "maxInstances": 1}'))
    assert run(json.dumps(VALID).encode()).ir is not None  # the baseline is valid
