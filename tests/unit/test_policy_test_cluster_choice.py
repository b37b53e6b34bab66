"""`blocks policy test` on recorded clusterAllocator decisions. Found as a stranger: a candidate
whose post_dry_run names a cluster that was not a candidate (the gateway fails every such block:
"clusterAllocator chose 'c2', which was not a candidate") was reported merely "changed" (c1 -> c2),
as was a selection naming a cluster the filter rule took out."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers.policy_test import compare

C1 = {"cluster_id": "c1", "id": "c1", "labels": {}}


def _recorded(action: str, input_data: dict[str, Any], output: Any) -> dict[str, Any]:
    return {"block_id": "b1", "action": action, "input": {"action": action, **input_data}, "output": output, "error": ""}


def _answers(output: Any) -> Any:
    async def run(_: dict[str, Any]) -> Any:
        return output

    return run


async def test_a_choice_the_gateway_refuses_is_newly_failing_not_changed() -> None:
    post = _recorded("post_dry_run", {"clusters": [{**C1, "score_data": {"score": 0.5, "node_info": {}}}]}, C1)
    report = await compare([post], _answers("c2"))
    assert report["changes"] == [{"block_id": "b1", "action": "post_dry_run", "before": "c1",
                                  "after": "error: clusterAllocator chose 'c2', which was not a candidate",
                                  "verdict": "newly_failing"}]

    sel = _recorded("selection", {"filter_result": [C1]}, {"clusters": [C1]})
    report = await compare([sel], _answers({"clusters": [C1, "c2"]}))
    ((change,),) = [report["changes"]]
    assert change["verdict"] == "newly_failing" and "not candidates: ['c2']" in change["after"], change
    report = await compare([sel], _answers({"clusters": []}))
    assert report["changes"][0]["after"] == "error: clusterAllocator selected no cluster"


async def test_a_recorded_answer_the_gateway_refused_counts_as_the_failure_it_was() -> None:
    # the recorded policy chose c2 (no policy error, the step failed); a candidate choosing c1 fixes it
    post = _recorded("post_dry_run", {"clusters": [{**C1, "score_data": {"score": 0.5, "node_info": {}}}]}, "c2")
    fixed = await compare([post], _answers(C1))
    assert fixed["changes"][0]["verdict"] == "newly_feasible", fixed
    again = await compare([post], _answers("c2"))
    assert again["counts"]["same"] == 1, again
