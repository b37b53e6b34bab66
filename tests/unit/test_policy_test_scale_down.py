"""`blocks policy test` on recorded scale_down decisions. Found as a stranger: the table showed the
recorded choice as `None[]` (a scale_down answer read as a placement) and counted a candidate that
leaves the choice to the framework, as the recorded policy did, as "changed"."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers.policy_test import compare, summarize


def _recorded(output: Any) -> dict[str, Any]:
    return {"block_id": "b1", "action": "scale_down", "input": {"action": "scale_down"}, "output": output, "error": ""}


async def test_scale_down_decisions_are_shown_by_the_instance_named_or_the_default_pick() -> None:
    assert summarize("scale_down", {"instance_id": "b1-3"}) == "b1-3"
    assert summarize("scale_down", None) == "default pick"
    assert summarize("scale_down", {}) == "default pick"

    async def defers(_: dict[str, Any]) -> Any:
        return None

    async def names(_: dict[str, Any]) -> Any:
        return {"instance_id": "b1-0"}

    both_default = await compare([_recorded({}), _recorded(None)], defers)
    assert both_default["counts"]["same"] == 2 and both_default["changes"] == []
    changed = await compare([_recorded({"instance_id": "b1-3"})], names)
    assert changed["changes"] == [{"block_id": "b1", "action": "scale_down", "before": "b1-3", "after": "b1-0", "verdict": "changed"}]
