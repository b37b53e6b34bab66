"""Autoscaler and stabilityChecker rules whose parameters / settings the framework or the built-in
cannot read are refused where they are given (the parser, ``blocks component add``), every
problem at once; before, the block was placed and every tick of its autoscaler or checker failed
with the first problem only (``autoscale.failed`` / ``health.failed``)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from aios_blocks.handlers import parse
from aios_blocks.schemas.spec import Component

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://t/echo",
    "resources": {"gpus": 0, "cpu": 0.1, "memory": 64},
    "policies": [{"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
                 {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"}],
}


def _errors(rule: dict[str, Any]) -> list[tuple[str, str]]:
    spec = {"blockComponentURI": "aios://t/echo", "blockId": "b1", "minInstances": 1, "maxInstances": 4,
            "policyRulesSpec": [{"values": rule}]}
    outcome = parse.build(spec, COMPONENT, "b1")
    return [(e.path, e.message) for e in outcome.errors]


def test_bad_autoscaler_parameters_are_rejected_at_parse_with_every_problem() -> None:
    errors = _errors({"name": "autoscaler", "policyRuleURI": "builtin:target-inflight",
                      "parameters": {"target": -2, "downscaleDelayS": "sixty", "stableWindowS": 0,
                                     "maxUpFactor": 0.5, "downscaleDelay": 60}})
    assert len(errors) == 1 and errors[0][0] == "$.policyRulesSpec[0].values"
    message = errors[0][1]
    for part in ("target must be a number > 0, got -2", "downscaleDelayS must be a number >= 0, got 'sixty'",
                 "stableWindowS must be a number > 0, got 0", "maxUpFactor must be a number > 1, got 0.5",
                 "unknown parameter 'downscaleDelay' for builtin:target-inflight (did you mean 'downscaleDelayS'?"):
        assert part in message, (part, message)


def test_bad_probe_threshold_settings_are_rejected_at_parse_with_every_problem() -> None:
    errors = _errors({"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold",
                      "settings": {"stallS": "fast", "failureThreshold": 0, "startupGraceS": -3, "probePath": 5,
                                   "probe": "no", "minWeight": 2, "stalS": 1}})
    assert len(errors) == 1 and errors[0][0] == "$.policyRulesSpec[0].values"
    message = errors[0][1]
    for part in ("stallS must be a number > 0, got 'fast'", "failureThreshold must be a whole number >= 1, got 0",
                 "startupGraceS must be a number >= 0, got -3", "probePath must be a path starting with '/', got 5",
                 "probe must be true or false, got 'no'", "minWeight must be a number in (0, 1], got 2",
                 "unknown setting 'stalS'"):
        assert part in message, (part, message)


@pytest.mark.parametrize("rule", [
    {"name": "autoscaler", "policyRuleURI": "builtin:target-inflight",
     "parameters": {"target": 2, "upscaleDelayS": 0, "stableWindowS": 20, "burstWindowS": 4, "downscaleDelayS": 10}},
    {"name": "autoscaler", "policyRuleURI": "builtin:queue-depth", "parameters": {"target": 4, "runningTarget": 8}},
    {"name": "autoscaler", "policyRuleURI": "registry:mine", "parameters": {"myKnob": "anything", "tolerance": 0.2}},
    {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold",
     "settings": {"stallS": "2", "failureThreshold": 2, "startupGraceS": 30, "probePath": "/ready", "probe": False}},
])
def test_usable_rules_pass(rule: dict[str, Any]) -> None:
    assert _errors(rule) == []


def test_component_add_refuses_a_bad_autoscaler_rule() -> None:
    bad = {**COMPONENT, "policies": [*COMPONENT["policies"], {"name": "autoscaler", "policyRuleURI": "builtin:queue-depth",
                                                                 "parameters": {"runningTarget": 0, "tolerance": 7}}]}
    with pytest.raises(ValidationError) as err:
        Component.model_validate(bad)
    assert "runningTarget must be a number > 0" in str(err.value) and "tolerance must be a number in [0, 1)" in str(err.value)
