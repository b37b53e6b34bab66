"""A block's ``priorityClass`` and ``preemptible`` in its IR (issue 36, docs/priority.md)."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.schemas.errors import SpecInvalid
from aios_blocks.schemas.ir import block_create_IR

from .test_ir import COMPONENT, spec

CLASSES: dict[str, dict[str, Any]] = {
    "high": {"name": "high", "value": 1000},
    "normal": {"name": "normal", "value": 100, "default": True},
    "batch": {"name": "batch", "value": 0},
}


def test_a_named_class_sets_the_priority() -> None:
    ir = block_create_IR(spec(priorityClass="high"), COMPONENT, "b1", CLASSES)
    assert (ir["priorityClass"], ir["priority"]) == ("high", 1000)


def test_no_class_named_gets_the_default_class() -> None:
    ir = block_create_IR(spec(), COMPONENT, "b1", CLASSES)
    assert (ir["priorityClass"], ir["priority"]) == ("normal", 100)


def test_without_classes_the_ir_is_unchanged() -> None:
    plain = block_create_IR(spec(), COMPONENT, "b1")
    assert "priorityClass" not in plain and "priority" not in plain and "preemptible" not in plain
    no_default = {k: {**v, "default": False} for k, v in CLASSES.items()}
    assert block_create_IR(spec(), COMPONENT, "b1", no_default) == plain


def test_an_unknown_class_is_an_error_listing_the_classes() -> None:
    with pytest.raises(SpecInvalid) as exc:
        block_create_IR(spec(priorityClass="urgent"), COMPONENT, "b1", CLASSES)
    (err,) = exc.value.errors
    assert err.path == "$.priorityClass"
    assert "unknown priority class 'urgent'" in err.message and "high (1000), normal (100), batch (0)" in err.message
    with pytest.raises(SpecInvalid) as exc:
        block_create_IR(spec(priorityClass="urgent"), COMPONENT, "b1", {})
    assert "no priority class is registered" in exc.value.errors[0].message



def test_an_unknown_class_is_listed_with_the_specs_other_problems() -> None:
    """Every problem in one ``rejected``: an unknown class was left out when another field failed
    validation (a policy URI, a count of the wrong type), though listed next to min > max."""
    for bad in ({"policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "builtin:nope"}}]},
                {"maxInstances": "x"}, {"colour": "red", "minInstances": -1}):
        with pytest.raises(SpecInvalid) as exc:
            block_create_IR(spec(priorityClass="urgent", **bad), COMPONENT, "b1", CLASSES)
        paths = [e.path for e in exc.value.errors]
        assert "$.priorityClass" in paths and len(paths) >= 2, (bad, paths)
    with pytest.raises(SpecInvalid) as exc:  # a class that is there: no error of its own
        block_create_IR(spec(priorityClass="high", maxInstances="x"), COMPONENT, "b1", CLASSES)
    assert [e.path for e in exc.value.errors] == ["$.maxInstances"]
    with pytest.raises(SpecInvalid) as exc:  # no string: the type error only, once
        block_create_IR(spec(priorityClass=5, maxInstances="x"), COMPONENT, "b1", CLASSES)
    assert sorted(e.path for e in exc.value.errors) == ["$.maxInstances", "$.priorityClass"]


def test_preemptible_false_is_kept_and_must_be_a_boolean() -> None:
    assert block_create_IR(spec(preemptible=False), COMPONENT, "b1")["preemptible"] is False
    with pytest.raises(SpecInvalid) as exc:
        block_create_IR(spec(preemptible="maybe"), COMPONENT, "b1")
    assert exc.value.errors[0].path == "$.preemptible"
