"""``blocks policy test`` on recorded preemption decisions (issue 36): the planner's recorded
input re-run gives its recorded output byte for byte, and a candidate that keeps the victims but
changes anything else of the output is reported as changed, not as the same summary."""

from __future__ import annotations

from typing import Any

import msgspec

from aios_blocks.handlers.policy_test import compare
from aios_blocks.policies.builtin import preempt

INPUT: dict[str, Any] = {
    "action": "preempt", "minDelta": 10,
    "block": {"block_id": "hi", "priority": 1000, "minInstances": 1, "resources": {"gpus": 1, "cpu": 1, "memory": 1024}},
    "cluster": {"cluster_id": "c1", "nodes": {"c1-n0": {"cpu_free": 63, "mem_free": 523264,
                                                       "gpus": {"c1-n0-g0": {"model": "sim", "free": 0.0}}}}},
    "candidates": [{"block_id": "lo", "priority": 0, "created": 12, "preemptible": True, "minInstances": 1,
                    "instances": {"lo-0": {"node_id": "c1-n0", "gpus": ["c1-n0-g0"], "share": 1.0, "cpu": 1,
                                           "memory": 1024, "created": 12}}}],
}


def recorded() -> dict[str, Any]:
    """A decision as ``Client.decisions`` reads it back: the input inline, the output decoded
    from the bytes the record stored."""
    out = msgspec.json.decode(msgspec.json.encode(preempt.plan(INPUT)))
    return {"block_id": "hi", "action": "preempt", "input": INPUT, "output": out, "error": ""}


async def test_a_preemption_replayed_from_its_recorded_input_is_byte_identical() -> None:
    async def builtin(inp: dict[str, Any]) -> Any:
        return preempt.plan(inp)

    report = await compare([recorded()], builtin)
    assert report["counts"]["same"] == 1 and report["changes"] == []
    (replay,) = report["replays"]
    assert replay["identical"] and replay["recorded_sha256"] == replay["replayed_sha256"]
    assert report["identical"] == 1


async def test_same_victims_but_another_output_is_a_change() -> None:
    async def other_reason(inp: dict[str, Any]) -> Any:
        return {**preempt.plan(inp), "reason": "something else"}

    report = await compare([recorded()], other_reason)
    assert report["counts"]["changed"] == 1 and report["identical"] == 0
    (row,) = report["changes"]
    assert row["before"] == "lo-0" and row["after"] == "lo-0 (output differs)"
    assert not report["replays"][0]["identical"]
