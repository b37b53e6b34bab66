"""Scaling decisions the mutation run (``make mutate``) found unasserted: the reason stored on a
block for its target, the running count, the plan's target on every path, a third scale-up, the
``scale_down`` payload's defaults, the load figure and the refusals' words."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.handlers import scaling as sc


@pytest.mark.parametrize(("source", "reason", "note", "want"), [
    ("api", "", "", "api"),
    ("autoscaler", "queue 12 over 8", "", "autoscaler: queue 12 over 8"),
    ("api", "", "9 lowered to maxInstances 4", "api; clamped: 9 lowered to maxInstances 4"),
    ("autoscaler", "idle", "0 raised to minInstances 1", "autoscaler: idle; clamped: 0 raised to minInstances 1"),
])
def test_target_reason_names_who_asked_why_and_the_clamp(source: str, reason: str, note: str, want: str) -> None:
    assert sc.target_reason(source, reason, note) == want


def test_running_counts_only_running_instances() -> None:
    insts = {"a": {"status": "running"}, "b": {"status": "starting"}, "c": {"status": "removing"},
             "d": {"status": "running"}, "e": {}}
    assert sc.running(insts) == 2
    assert sc.running({}) == 0


def test_every_plan_carries_its_target_and_a_third_scale_up_gets_its_own_name() -> None:
    def name(rid: str) -> str:
        return "b-" + rid

    up = sc.plan_target("t", 3, {}, name)
    assert up.target == 3 and up.up == ["t:0", "t:1", "t:2"]
    down = sc.plan_target("t", 1, {"x": {"status": "running"}, "y": {"status": "running"}}, name)
    assert down.target == 1 and down.down == 1
    assert sc.plan_target("t", 1, {"x": {"status": "running"}}, name) == sc.TargetPlan(1)


def test_candidates_defaults_when_the_record_lacks_a_field() -> None:
    [c] = sc.candidates({"i": {}}, {}, now=100.0)
    assert c["node_id"] == "" and c["status"] == "" and c["gpus"] == []
    assert c["since"] == 0.0 and c["age_s"] is None and c["load"] is None  # placed when: unknown


def test_candidates_age_is_rounded_to_the_millisecond_and_never_negative() -> None:
    insts = {"old": {"status": "running", "since": 50.0}, "ahead": {"status": "running", "since": 200.0}}
    ahead, old = sc.candidates(insts, {}, now=100.123456)  # sorted by id
    assert old["instance_id"] == "old" and old["age_s"] == 50.123 and old["since"] == 50.0
    assert ahead["age_s"] == 0.0  # a clock ahead of ours: not a negative age


@pytest.mark.parametrize(("sample", "want"), [
    ({"inflight": 3}, 3.0),
    ({"inflight": 3, "running": 9, "waiting": 2}, 5.0),  # the executors' figure before the instance's
    ({"inflight": 0, "running": 9}, 0.0),  # zero in flight is a figure, not a missing one
    ({"running": 4, "waiting": 1}, 5.0),  # no executor figure: what the instance says it runs
    ({"waiting": 2}, 2.0),
    ({}, 0.0),
])
def test_load_is_tasks_at_the_instance_plus_tasks_waiting(sample: dict[str, Any], want: float) -> None:
    assert sc.load_of(sample) == want


def test_default_pick_counts_an_unknown_placement_time_as_the_oldest() -> None:
    cands = [{"instance_id": "a", "load": 0, "since": None, "status": "running"},
             {"instance_id": "b", "load": 0, "since": 0.5, "status": "running"}]
    assert sc.default_pick(cands) == "b"
    with pytest.raises(sc.ChoiceRefused, match=r"^no instance to remove$"):
        sc.default_pick([])


def test_refusals_name_what_was_wrong() -> None:
    cands = [{"instance_id": "b1-0"}, {"instance_id": "b1-1"}]
    with pytest.raises(sc.ChoiceRefused, match=r'must return \{"instance_id": str\}, got instance_id=7'):
        sc.choice({"instance_id": 7}, cands)
    with pytest.raises(sc.ChoiceRefused, match=r"named 'x', .*\(live: b1-0, b1-1\)$"):
        sc.choice({"instance_id": "x"}, cands)
    with pytest.raises(sc.ChoiceRefused, match=r"\(live: none\)$"):
        sc.choice({"instance_id": "x"}, [])
