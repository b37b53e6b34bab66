"""GPU sharing needs a memory figure: ``gpuSharing: true`` with ``gpuMemory: 0`` would let any
number of instances stack on one GPU, so it is refused at ``component add`` (the model) and at
parse (the merged block), with the reason and where to fix it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from aios_blocks.schemas.errors import SpecInvalid
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.schemas.spec import Component

SHARE = {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {"gpuSharing": True}}
PLAIN = {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}}
CLUSTER = {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}}


def component(rule: dict[str, Any], gpu_memory: int, gpus: int = 1) -> dict[str, Any]:
    return {"componentURI": "aios://m", "image": "m:1", "resources": {"gpus": gpus, "gpuMemory": gpu_memory},
            "policies": [CLUSTER, rule]}


def parse(doc: dict[str, Any], comp: dict[str, Any]) -> dict[str, Any]:
    return block_create_IR({"blockComponentURI": "aios://m", "minInstances": 1, "maxInstances": 1, **doc}, copy.deepcopy(comp), "b1")


def test_component_sharing_without_gpu_memory_is_refused_at_component_add() -> None:
    with pytest.raises(ValidationError, match=r"gpuSharing is true but resources.gpuMemory is 0"):
        Component.model_validate(component(SHARE, 0))
    Component.model_validate(component(SHARE, 40000))  # with the figure: fine
    Component.model_validate(component(SHARE, 0, gpus=0))  # no GPUs: nothing to share
    Component.model_validate(component(PLAIN, 0))  # exclusive GPUs need no figure


@pytest.mark.parametrize("value", ["false", "yes", 1, None])
def test_gpu_sharing_must_be_a_boolean(value: Any) -> None:
    rule = {**SHARE, "settings": {"gpuSharing": value}}
    with pytest.raises(ValidationError, match="gpuSharing must be true or false"):
        Component.model_validate(component(rule, 40000))


def test_block_turning_sharing_on_without_a_memory_figure_is_rejected_at_parse() -> None:
    with pytest.raises(SpecInvalid) as info:
        parse({"policyRulesSpec": [{"values": SHARE}]}, component(PLAIN, 0))
    [err] = info.value.errors
    assert err.path == "$.<component>.resources" and "gpuMemory is 0" in err.message and "any number of instances" in err.message


def test_block_overriding_gpu_memory_to_zero_under_sharing_is_rejected_at_parse() -> None:
    with pytest.raises(SpecInvalid) as info:
        parse({"resources": {"gpus": 1, "gpuMemory": 0}}, component(SHARE, 40000))
    assert [e.path for e in info.value.errors] == ["$.resources"]
    ir = parse({"resources": {"gpus": 1, "gpuMemory": 20000}}, component(SHARE, 40000))  # a figure: accepted
    assert ir["resources"]["gpuMemory"] == 20000


def test_a_stored_component_that_breaks_the_rule_rejects_its_blocks_instead_of_crashing() -> None:
    with pytest.raises(SpecInvalid) as info:
        parse({}, component(SHARE, 0))
    assert [e.path for e in info.value.errors] == ["$.<component>"]
    assert "gpuSharing is true but resources.gpuMemory is 0" in info.value.errors[0].message
