"""Seed 004's reason words for a placement scriptlet's request: ``new``, ``evacuation`` (drain),
``relocation`` (anything else that moves an instance)."""

from __future__ import annotations

from aios_blocks.policies.starlark_runtime import placement_request
from aios_blocks.schemas.events import PlacementReason

BLOCK = {"blockId": "b", "resources": {"cpu": 1, "memory": 10}}


def test_first_placements_are_new() -> None:
    for action in ("allocation", "scale", "dry_run"):
        assert placement_request(BLOCK, {}, action)["reason"] == "new"


def test_a_drain_is_evacuation_everything_else_relocation() -> None:
    assert placement_request(BLOCK, {"reason": "evacuation"}, "reassignment")["reason"] == "evacuation"
    for why in ("requested", "node n1 unhealthy: no heartbeat for 5s", "probe failed 3 times", ""):
        assert placement_request(BLOCK, {"reason": why}, "reassignment")["reason"] == "relocation", why
    assert placement_request(BLOCK, {}, "reassignment")["reason"] == "relocation"
    assert PlacementReason.of_reassignment("evacuation") is PlacementReason.EVACUATION
