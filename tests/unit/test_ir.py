"""block_create_IR and decode_spec (seed 000 "Block specification")."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aios_blocks.schemas.errors import SpecError, SpecInvalid
from aios_blocks.schemas.ir import block_create_IR, decode_create, decode_spec

CLUSTER_RULE = {
    "name": "clusterAllocator",
    "policyRuleURI": "builtin:cluster-rank",
    "parameters": {"maxCandidates": 3},
    "settings": {"filter": {"matchLabels": {"region": "eu"}}},
}
RESOURCE_RULE = {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}}

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://models/m",
    "image": "aios/m:1",
    "componentInitData": {"model": "m", "quant": "fp16"},
    "componentInitSettings": {"batch": 4},
    "componentParameters": {"temperature": 0.5},
    "componentMetadata": {"owner": "team-a"},
    "componentInputProtocol": {"type": "http"},
    "componentOutputProtocol": {"type": "json"},
    "tags": ["llm", "inference"],
    "resources": {"gpus": 1, "gpuMemory": 1000, "cpu": 2, "memory": 4096},
    "policies": [CLUSTER_RULE, RESOURCE_RULE],
}


def spec(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"blockComponentURI": "aios://models/m", "minInstances": 1, "maxInstances": 2}
    doc.update(over)
    return doc


def build(doc: dict[str, Any], comp: dict[str, Any] | None = COMPONENT, bid: str | None = "b1") -> dict[str, Any]:
    return block_create_IR(doc, copy.deepcopy(comp) if comp is not None else None, bid)


def errors_of(doc: dict[str, Any], comp: dict[str, Any] | None = COMPONENT, bid: str | None = "b1") -> list[SpecError]:
    with pytest.raises(SpecInvalid) as info:
        build(doc, comp, bid)
    assert info.value.errors, "SpecInvalid must carry at least one error"
    assert all(isinstance(e, SpecError) for e in info.value.errors)
    return info.value.errors


def paths(errors: list[SpecError]) -> set[str]:
    return {e.path for e in errors}


# -- inheritance ------------------------------------------------------------------------------------

INHERITED = [
    ("blockInitData", "componentInitData"),
    ("initSettings", "componentInitSettings"),
    ("parameters", "componentParameters"),
    ("blockMetadata", "componentMetadata"),
    ("inputProtocol", "componentInputProtocol"),
    ("outputProtocol", "componentOutputProtocol"),
    ("tags", "tags"),
]


@pytest.mark.parametrize(("block_field", "comp_field"), INHERITED)
def test_every_field_is_inherited_from_the_component(block_field: str, comp_field: str) -> None:
    ir = build(spec())
    assert ir[block_field] == COMPONENT[comp_field]


@pytest.mark.parametrize(
    ("block_field", "value"),
    [
        ("blockInitData", {"model": "other"}),
        ("initSettings", {"batch": 64}),
        ("parameters", {"temperature": 0.1, "top_p": 0.9}),
    ],
)
def test_block_values_override_the_component(block_field: str, value: dict[str, Any]) -> None:
    ir = build(spec(**{block_field: value}))
    assert ir[block_field] == value
    # the other inherited fields are untouched by one override
    for other, comp_field in INHERITED:
        if other != block_field:
            assert ir[other] == COMPONENT[comp_field]


def test_an_empty_object_given_by_the_block_is_an_override_not_an_omission() -> None:
    ir = build(spec(parameters={}))
    assert ir["parameters"] == {}


def test_explicit_null_means_inherit() -> None:
    ir = build(spec(parameters=None, blockInitData=None))
    assert ir["parameters"] == COMPONENT["componentParameters"]
    assert ir["blockInitData"] == COMPONENT["componentInitData"]


def test_ir_carries_ids_scaling_image_and_resources() -> None:
    ir = build(spec(minInstances=2, maxInstances=5))
    assert ir["blockId"] == "b1"
    assert ir["blockComponentURI"] == "aios://models/m"
    assert ir["image"] == "aios/m:1"
    assert (ir["minInstances"], ir["maxInstances"]) == (2, 5)
    assert ir["resources"] == {"gpus": 1, "gpuMemory": 1000, "cpu": 2.0, "memory": 4096}


def test_block_resources_override_the_component() -> None:
    ir = build(spec(resources={"gpus": 2, "gpuMemory": 5}))
    assert ir["resources"] == {"gpus": 2, "gpuMemory": 5, "cpu": 0.0, "memory": 0}


def test_block_id_from_the_spec_when_no_subject_id() -> None:
    assert build(spec(blockId="my-block_1"), bid=None)["blockId"] == "my-block_1"


def test_block_id_from_the_subject_when_the_spec_has_none() -> None:
    assert build(spec(), bid="from-subject")["blockId"] == "from-subject"


def test_matching_block_id_in_spec_and_subject_is_fine() -> None:
    assert build(spec(blockId="same"), bid="same")["blockId"] == "same"


def test_component_input_is_not_mutated() -> None:
    comp = copy.deepcopy(COMPONENT)
    block_create_IR(spec(policyRulesSpec=[{"values": {**RESOURCE_RULE, "policyRuleURI": "builtin:spread"}}]), comp, "b1")
    assert comp == COMPONENT


# -- policies ---------------------------------------------------------------------------------------


def test_policies_inherited_as_is_when_policy_rules_spec_is_omitted() -> None:
    ir = build(spec())
    assert ir["policies"] == {"clusterAllocator": CLUSTER_RULE, "resourceAllocator": RESOURCE_RULE}


def test_block_policy_with_the_same_name_overrides_the_component_one() -> None:
    mine = {"name": "resourceAllocator", "policyRuleURI": "builtin:spread", "parameters": {"x": 1}, "settings": {"gpuSharing": True}}
    ir = build(spec(policyRulesSpec=[{"values": mine}]))
    assert ir["policies"]["resourceAllocator"] == mine
    assert ir["policies"]["clusterAllocator"] == CLUSTER_RULE


def test_block_policy_with_a_new_name_extends_the_set() -> None:
    lb = {"name": "loadBalancer", "policyRuleURI": "registry:rr", "parameters": {}, "settings": {}}
    ir = build(spec(policyRulesSpec=[{"values": lb}]))
    assert ir["policies"] == {"clusterAllocator": CLUSTER_RULE, "resourceAllocator": RESOURCE_RULE, "loadBalancer": lb}


def test_override_and_extend_in_one_spec_and_defaults_filled_in() -> None:
    ir = build(
        spec(
            policyRulesSpec=[
                {"values": {"name": "clusterAllocator", "policyRuleURI": "registry:mine"}},
                {"values": {"name": "autoscaler", "policyRuleURI": "registry:scale"}},
            ]
        )
    )
    assert ir["policies"]["clusterAllocator"] == {
        "name": "clusterAllocator",
        "policyRuleURI": "registry:mine",
        "parameters": {},
        "settings": {},
    }
    assert ir["policies"]["autoscaler"]["policyRuleURI"] == "registry:scale"
    assert ir["policies"]["resourceAllocator"] == RESOURCE_RULE


def test_empty_policy_rules_spec_keeps_the_component_policies() -> None:
    assert build(spec(policyRulesSpec=[]))["policies"] == build(spec())["policies"]


def test_bare_rule_form_is_accepted_like_the_values_form() -> None:
    rule = {"name": "resourceAllocator", "policyRuleURI": "builtin:spread", "parameters": {"a": 1}, "settings": {}}
    wrapped = build(spec(policyRulesSpec=[{"values": rule}]))
    bare = build(spec(policyRulesSpec=[rule]))
    assert bare["policies"] == wrapped["policies"]
    assert bare["policies"]["resourceAllocator"]["policyRuleURI"] == "builtin:spread"


def test_later_entries_with_the_same_name_win() -> None:
    ir = build(
        spec(
            policyRulesSpec=[
                {"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:spread"}},
                {"values": {"name": "resourceAllocator", "policyRuleURI": "registry:last"}},
            ]
        )
    )
    assert ir["policies"]["resourceAllocator"]["policyRuleURI"] == "registry:last"


@pytest.mark.parametrize("missing", ["clusterAllocator", "resourceAllocator"])
def test_missing_required_policy_after_merge_is_an_error(missing: str) -> None:
    comp = {**COMPONENT, "policies": [p for p in COMPONENT["policies"] if p["name"] != missing]}
    errors = errors_of(spec(), comp)
    assert [e.path for e in errors] == ["$.policyRulesSpec"]
    assert missing in errors[0].message


def test_a_required_policy_missing_in_the_component_can_come_from_the_block() -> None:
    comp = {**COMPONENT, "policies": [CLUSTER_RULE]}
    ir = build(spec(policyRulesSpec=[{"values": RESOURCE_RULE}]), comp)
    assert ir["policies"]["resourceAllocator"] == RESOURCE_RULE


# -- validation -------------------------------------------------------------------------------------


def test_min_greater_than_max_is_an_error() -> None:
    errors = errors_of(spec(minInstances=3, maxInstances=2))
    assert paths(errors) == {"$.minInstances"}
    assert "3" in errors[0].message and "2" in errors[0].message


def test_min_equal_max_is_fine() -> None:
    ir = build(spec(minInstances=2, maxInstances=2))
    assert ir["minInstances"] == ir["maxInstances"] == 2


@pytest.mark.parametrize(("lo", "hi"), [(5.0, 2), ("5", "2"), (5, 2.0)])
def test_min_greater_than_max_is_an_error_for_every_number_form(lo: Any, hi: Any) -> None:
    errors = errors_of(spec(minInstances=lo, maxInstances=hi))
    assert "$.minInstances" in paths(errors)


def test_unknown_component_is_an_error() -> None:
    errors = errors_of(spec(), comp=None)
    assert paths(errors) == {"$.blockComponentURI"}
    assert "unknown component" in errors[0].message
    assert "aios://models/m" in errors[0].message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("minInstances", "many"),
        ("maxInstances", [2]),
        ("blockInitData", "not-an-object"),
        ("initSettings", 3),
        ("parameters", ["a"]),
        ("policyRulesSpec", {"values": {}}),
        ("blockComponentURI", 7),
        ("resources", {"gpus": "two"}),
    ],
)
def test_wrong_types_are_reported_at_their_path(field: str, value: Any) -> None:
    errors = errors_of(spec(**{field: value}))
    assert any(p == f"$.{field}" or p.startswith(f"$.{field}.") for p in paths(errors)), errors


@pytest.mark.parametrize(("field", "value"), [("minInstances", -1), ("maxInstances", 0), ("resources", {"gpus": -1})])
def test_out_of_range_numbers_are_errors(field: str, value: Any) -> None:
    errors = errors_of(spec(**{field: value}))
    assert any(p.startswith(f"$.{field}") for p in paths(errors))


@pytest.mark.parametrize("missing", ["blockComponentURI", "minInstances", "maxInstances"])
def test_required_fields(missing: str) -> None:
    doc = spec()
    del doc[missing]
    errors = errors_of(doc)
    assert f"$.{missing}" in paths(errors)


def test_unknown_fields_are_errors() -> None:
    errors = errors_of(spec(replicas=3, parameter={"typo": True}))
    unknown = {e.path for e in errors if e.message == "unknown field"}
    assert unknown == {"$.replicas", "$.parameter"}


def test_unknown_field_inside_a_policy_rule() -> None:
    errors = errors_of(spec(policyRulesSpec=[{"values": {"name": "x", "policyRuleURI": "my.mod:Policy", "setings": {}}}]))
    assert SpecError("$.policyRulesSpec[0].values.setings", "unknown field") in errors


def test_policy_rule_errors_carry_index_paths() -> None:
    errors = errors_of(
        spec(
            policyRulesSpec=[
                {"values": {"name": "ok", "policyRuleURI": "my.mod:Policy"}},
                {"values": {"name": 3, "policyRuleURI": "my.mod:Policy"}},
                {"values": {"name": "no-uri"}},
            ]
        )
    )
    assert paths(errors) == {"$.policyRulesSpec[1].values.name", "$.policyRulesSpec[2].values.policyRuleURI"}


def test_bare_rule_errors_are_reported_too() -> None:
    errors = errors_of(spec(policyRulesSpec=[{"policyRuleURI": "u"}]))
    assert "$.policyRulesSpec[0].values.name" in paths(errors)


def test_block_id_mismatch_with_the_subject() -> None:
    errors = errors_of(spec(blockId="other"), bid="b1")
    assert paths(errors) == {"$.blockId"}
    assert "other" in errors[0].message and "b1" in errors[0].message


def test_no_block_id_anywhere_is_an_error() -> None:
    errors = errors_of(spec(), bid=None)
    assert paths(errors) == {"$.blockId"}


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "a>b", "*", "has space", "", "-lead"])
def test_invalid_subject_block_ids(bad: str) -> None:
    errors = errors_of(spec(), bid=bad)
    assert paths(errors) == {"$.blockId"}
    assert repr(bad) in " ".join(e.message for e in errors)


@pytest.mark.parametrize("bad", ["a.b", "a*", "x>"])
def test_invalid_block_ids_in_the_spec(bad: str) -> None:
    errors = errors_of(spec(blockId=bad), bid=None)
    assert paths(errors) == {"$.blockId"}


def test_every_problem_is_reported_at_once() -> None:
    doc = spec(
        minInstances=5,
        maxInstances=2,
        blockId="x.y",
        color="blue",
        parameters="nope",
        policyRulesSpec=[{"values": {"name": "r"}}],
    )
    errors = errors_of(doc, comp=None, bid=None)
    got = paths(errors)
    assert {
        "$.minInstances",
        "$.blockId",
        "$.color",
        "$.parameters",
        "$.policyRulesSpec[0].values.policyRuleURI",
        "$.blockComponentURI",
    } <= got
    assert any(e.path == "$.color" and e.message == "unknown field" for e in errors)


def test_spec_invalid_message_lists_every_error() -> None:
    with pytest.raises(SpecInvalid) as info:
        build(spec(minInstances=4, maxInstances=1, extra=1))
    text = str(info.value)
    assert "$.minInstances" in text and "$.extra" in text


def test_missing_required_policy_is_reported_with_other_errors() -> None:
    comp = {**COMPONENT, "policies": [CLUSTER_RULE]}
    errors = errors_of(spec(minInstances=9, maxInstances=1), comp)
    assert {"$.minInstances", "$.policyRulesSpec"} <= paths(errors)


# -- decode_spec ------------------------------------------------------------------------------------


def test_decode_bare_spec() -> None:
    doc = spec(parameters={"a": 1})
    assert decode_spec(json.dumps(doc).encode()) == doc


def test_decode_cloudevents_envelope_returns_its_data() -> None:
    doc = spec()
    env = {
        "specversion": "1.0",
        "id": "e1",
        "source": "/cli",
        "type": "io.aios.block.create",
        "datacontenttype": "application/json",
        "data": doc,
    }
    assert decode_spec(json.dumps(env).encode()) == doc


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"a": 1'])
def test_decode_invalid_json(raw: bytes) -> None:
    with pytest.raises(SpecInvalid) as info:
        decode_spec(raw)
    assert [e.path for e in info.value.errors] == ["$"]
    assert "not valid JSON" in info.value.errors[0].message


@pytest.mark.parametrize(("raw", "kind"), [(b"[1, 2]", "list"), (b'"s"', "str"), (b"3", "int"), (b"null", "NoneType")])
def test_decode_non_object(raw: bytes, kind: str) -> None:
    with pytest.raises(SpecInvalid) as info:
        decode_spec(raw)
    assert [e.path for e in info.value.errors] == ["$"]
    assert kind in info.value.errors[0].message


def test_decoded_envelope_builds_the_same_ir_as_the_bare_spec() -> None:
    doc = spec(blockInitData={"k": "v"})
    env = {"specversion": "1.0", "id": "1", "source": "s", "type": "io.aios.block.create", "data": doc}
    assert build(decode_spec(json.dumps(env).encode())) == build(decode_spec(json.dumps(doc).encode()))


# -- property ---------------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-3, 20_000) | st.floats(allow_nan=True) | st.text(max_size=6)
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8
)
_KEYS = [
    "blockComponentURI",
    "blockId",
    "minInstances",
    "maxInstances",
    "blockInitData",
    "initSettings",
    "parameters",
    "policyRulesSpec",
    "resources",
    "affinity",
    "affinityWith",
    "antiAffinityWith",
    "affinityTLV",
]
_rule = st.fixed_dictionaries(
    {},
    optional={"name": _json | st.sampled_from(["clusterAllocator", "resourceAllocator"]), "policyRuleURI": _json, "parameters": _json, "settings": _json},
)
_values = {
    "blockComponentURI": st.just("aios://models/m") | _json,
    "minInstances": st.integers(-2, 12) | _json,
    "maxInstances": st.integers(-2, 12) | _json,
    "policyRulesSpec": st.lists(_rule | st.fixed_dictionaries({"values": _rule}) | _json, max_size=3) | _json,
}
_docs = st.fixed_dictionaries({}, optional={k: _values.get(k, _json) for k in _KEYS}) | st.dictionaries(
    st.sampled_from(_KEYS) | st.text(max_size=6), _json, max_size=6
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_docs, bid=st.sampled_from([None, "b1", "a.b", ""]), known=st.booleans())
def test_property_returns_a_dict_or_raises_spec_invalid(doc: dict[str, Any], bid: str | None, known: bool) -> None:
    try:
        ir = block_create_IR(doc, copy.deepcopy(COMPONENT) if known else None, bid)
    except SpecInvalid as exc:
        assert exc.errors and all(isinstance(e, SpecError) and e.path.startswith("$") for e in exc.errors)
        return
    assert isinstance(ir, dict)
    assert known, "an unknown component can never produce an IR"
    assert {"clusterAllocator", "resourceAllocator"} <= set(ir["policies"])


def test_an_unknown_policy_uri_is_refused_with_the_known_builtins() -> None:
    """`builtin:binpak` used to be accepted and fail every block later ("No module named 'builtin'")."""
    errors = errors_of(spec(policyRulesSpec=[
        {"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpak"}},
        {"values": {"name": "clusterAllocator", "policyRuleURI": "builtin:binpack"}},
        {"values": {"name": "autoscaler", "policyRuleURI": "not a uri"}},
        {"values": {"name": "loadBalancer", "policyRuleURI": "registry:bad name"}},
    ]))
    by_path = {e.path: e.message for e in errors}
    assert "unknown built-in policy 'builtin:binpak'" in by_path["$.policyRulesSpec[0].values.policyRuleURI"]
    assert ("builtin:best-fit, builtin:binpack, builtin:cluster-rank, builtin:dot-product, builtin:fgd, builtin:fgd-plus, "
            "builtin:gpu-clustering, "
            "builtin:gpu-packing, builtin:least-inflight, builtin:least-queue, builtin:preempt-min, builtin:probe-threshold, builtin:queue-depth, "
            "builtin:random, builtin:rebalance-min, builtin:round-robin, builtin:spread, builtin:target-inflight") in by_path["$.policyRulesSpec[0].values.policyRuleURI"]
    assert "not a clusterAllocator one; for clusterAllocator: builtin:cluster-rank" in by_path["$.policyRulesSpec[1].values.policyRuleURI"]
    assert "is not a policyRuleURI" in by_path["$.policyRulesSpec[2].values.policyRuleURI"]
    assert "registry:NAME" in by_path["$.policyRulesSpec[3].values.policyRuleURI"]


@pytest.mark.parametrize("uri", ["builtin:binpack", "registry:my-packer", "registry:my-packer@3", "my_packer.py",
                                 "placement.star", "some.package.module:Policy", "/abs/path/p.py"])
def test_every_loadable_policy_uri_form_is_accepted(uri: str) -> None:
    from aios_blocks.schemas.spec import PolicyRule

    assert PolicyRule(name="resourceAllocator", policyRuleURI=uri).policyRuleURI == uri


def test_the_builtin_table_matches_the_runtime() -> None:
    from aios_blocks.policies import runtime, uris

    assert set(uris.BUILTIN_KINDS) == set(runtime.BUILTINS)


@pytest.mark.parametrize(("field", "value", "path"), [
    ("minInstances", True, "$.minInstances"),
    ("maxInstances", False, "$.maxInstances"),
    ("resources", {"gpus": True}, "$.resources.gpus"),
])
def test_true_or_false_is_not_a_number(field: str, value: Any, path: str) -> None:
    # pydantic's lax mode read "minInstances": true as 1, and the block was placed
    errors = errors_of(spec(**{field: value}))
    assert SpecError(path, "must be a number, not true or false") in errors


@pytest.mark.parametrize(("name", "kind"), [
    ("resourceAlocator", "resourceAllocator"), ("ResourceAllocator", "resourceAllocator"),
    ("loadbalancer", "loadBalancer"), ("autoscaller", "autoscaler"), ("stabilityCheck", "stabilityChecker"),
])
def test_a_misspelt_policy_kind_is_refused_naming_the_kind(name: str, kind: str) -> None:
    # a new name extends the block's policies, but nothing would call it: the component's policy
    # would silently stay in charge
    errors = errors_of(spec(policyRulesSpec=[{"values": {"name": name, "policyRuleURI": "my.mod:Policy"}}]))
    [e] = [e for e in errors if e.path == "$.policyRulesSpec[0].values.name"]
    assert e.message.startswith(f"unknown policy kind {name!r}: did you mean {kind!r}?")


def test_a_policy_name_far_from_every_kind_still_extends_the_set() -> None:
    extra = {"name": "myOwnScorer", "policyRuleURI": "my.mod:Policy", "parameters": {}, "settings": {}}
    assert build(spec(policyRulesSpec=[{"values": extra}]))["policies"]["myOwnScorer"] == extra


@pytest.mark.parametrize(("data", "got"), [('"notaspec"', "str"), ("[1]", "list"), ("null", "nothing")])
def test_a_cloudevent_whose_data_is_not_an_object_says_so(data: str, got: str) -> None:
    raw = ('{"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create", "data": ' + data + "}").encode()
    with pytest.raises(SpecInvalid) as info:
        decode_spec(raw)
    assert info.value.errors == [SpecError("$.data", f"a CloudEvent's data must be the spec, a JSON object; got {got}")]


def test_a_cloudevent_with_data_base64_carries_the_spec_too() -> None:
    import base64

    doc = {"blockComponentURI": "aios://models/m", "minInstances": 1, "maxInstances": 2}
    env = {"specversion": "1.0", "id": "x", "source": "s", "type": "io.aios.block.create",
           "data_base64": base64.b64encode(json.dumps(doc).encode()).decode()}
    assert decode_spec(json.dumps(env).encode()) == doc
    for bad, says in (("%%%", "not base64 text"), (base64.b64encode(b"{no").decode(), "does not hold JSON")):
        with pytest.raises(SpecInvalid) as info:
            decode_spec(json.dumps({**env, "data_base64": bad}).encode())
        assert info.value.errors[0].path == "$.data_base64" and says in info.value.errors[0].message


def test_a_cloudevent_create_with_wrong_attributes_is_refused_listing_each() -> None:
    """A create sent as a CloudEvent of another version, type, or without id and source was placed
    as if it were right (docs/subjects.md and the AsyncAPI document require them): now every wrong
    attribute is an error of its own, with the data's, in one rejection."""
    from aios_blocks.schemas.catalog import E
    from aios_blocks.schemas.ir import CREATE_TYPE

    assert CREATE_TYPE == E.block_create.type
    raw = json.dumps({"specversion": "0.3", "type": "com.example.thing", "source": "", "data": [1]}).encode()
    with pytest.raises(SpecInvalid) as info:
        decode_spec(raw)
    assert [e.path for e in info.value.errors] == ["$.specversion", "$.id", "$.source", "$.type", "$.data"]
    assert "'0.3'" in info.value.errors[0].message and "got nothing" in info.value.errors[1].message
    assert "'io.aios.block.create'" in info.value.errors[3].message and "com.example.thing" in info.value.errors[3].message
    # a bad data_base64 is listed with them, not instead of them
    with pytest.raises(SpecInvalid) as info:
        decode_spec(json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "t", "data_base64": "%%"}).encode())
    assert [e.path for e in info.value.errors] == ["$.type", "$.data_base64"]
    # the README's create is taken as it is
    doc = spec()
    assert decode_spec(json.dumps({"specversion": "1.0", "id": "my-create-1", "source": "urn:me",
                                   "type": "io.aios.block.create", "data": doc}).encode()) == doc


def test_a_cloudevent_with_wrong_attributes_still_gives_its_spec_to_check() -> None:
    """``decode_create``: the spec of a CloudEvent with wrong attributes beside their problems (so
    the spec's own are listed with them in one rejection); ``decode_spec`` refuses it as before."""
    doc = spec(minInstances=3, maxInstances=1)
    raw = json.dumps({"specversion": "0.3", "id": "", "source": "urn:me", "type": "x", "data": doc}).encode()
    got, errors = decode_create(raw)
    assert got == doc and [e.path for e in errors] == ["$.specversion", "$.id", "$.type"]
    with pytest.raises(SpecInvalid) as info:
        decode_spec(raw)
    assert info.value.errors == errors
    assert decode_create(json.dumps(doc).encode()) == (doc, [])
