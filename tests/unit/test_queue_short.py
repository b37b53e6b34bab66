"""A short ready block in the pending queue's pure walk (handlers/queue.py, docs/priority.md "A
short block preempts"): its missing instances are a pending placement of its priority, in its own
cluster; asked for (not retried) when they fit, preempting as a waiting block would when they do
not; the planner's rules (the delta rule, ``preemptible: false``) are the same."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers import queue as hq
from aios_blocks.handlers.preemption import preempt_input
from aios_blocks.policies.builtin.preempt import plan

from .test_queue_walk import CLUSTERS, block, node, views


def short(bid: str, gpus: int, missing: int = 1, priority: int = 1000, cluster: str = "c1", **extra: Any) -> hq.Entry:
    """A ready block of ``cluster`` short of ``missing`` instances, as ``workers.queue.short_entries`` reads it."""
    b = block(bid, gpus, n=missing, priority=priority, status="ready", cluster=cluster, **extra)
    return hq.Entry(bid, b, short=True)


def test_missing_instances_that_do_not_fit_preempt_and_hold_back_the_blocks_behind() -> None:
    """Without it the 1-GPU block behind was released into the room and ``hi`` stayed short."""
    entries = hq.with_short([hq.Entry("lo", block("lo", 1))], [short("hi", 2)])
    out = hq.walk(entries, CLUSTERS, views(1))
    assert out.preempt == ["hi"] and out.retry == [] and out.drop == [] and out.ask == []
    # the planner found no victim for it: the walk goes on behind it (backfill), as for a waiting block
    again = hq.walk(entries, CLUSTERS, views(1), tried=frozenset({"hi"}))
    assert again.preempt == [] and again.retry == [("lo", 1, "c1")]


def test_missing_instances_that_fit_are_asked_for_and_their_room_is_not_given_away() -> None:
    entries = hq.with_short([hq.Entry("lo", block("lo", 2))], [short("hi", 2)])
    out = hq.walk(entries, CLUSTERS, views(3))
    assert out.ask == [("hi", 1, "c1")] and out.retry == [] and out.drop == []  # lo no longer fits in the GPU left
    assert hq.walk([hq.Entry("lo", block("lo", 2))], CLUSTERS, views(3)).retry == [("lo", 1, "c1")]


def test_a_short_block_places_in_its_own_cluster_only() -> None:
    clusters = {"c1": {"id": "c1", "labels": {}}, "c2": {"id": "c2", "labels": {}}}
    two = {"c1": {"n1": node("n1", 4, used=4)}, "c2": {"n2": node("n2", 4)}}
    out = hq.walk([short("hi", 1)], clusters, two)
    assert out.ask == [] and out.preempt == ["hi"]  # c2's room is of no use to it: scale steps place in c1
    assert hq.walk([short("hi", 1, cluster="c2")], clusters, two).ask == [("hi", 1, "c2")]
    assert hq.own({"cluster": "c9"}, clusters) == {} and hq.own({"cluster": "c2"}, clusters) == {"c2": clusters["c2"]}


def test_a_short_block_whole_again_or_gone_is_skipped_never_dropped() -> None:
    whole = hq.Entry("w", {**block("w", 1, priority=1000), "status": "deleting"}, short=True)
    out = hq.walk([whole, hq.Entry("gone", None, short=True), hq.Entry("lo", block("lo", 1))], CLUSTERS, views(1))
    assert out.drop == [] and out.retry == [("lo", 1, "c1")] and out.preempt == []


def test_its_preemption_under_way_holds_back_the_blocks_behind_until_the_victims_drain() -> None:
    hi = short("hi", 2, preempting="hi:1:1000:1000.000")
    out = hq.walk(hq.with_short([hq.Entry("lo", block("lo", 1))], [hi]), CLUSTERS, views(1), now=1010.0)
    assert out.blocked_by == "hi" and out.retry == [] and out.preempt == []
    done = hq.walk([hi], CLUSTERS, views(2), now=1010.0)  # they drained: the missing instances fit
    assert done.ask == [("hi", 1, "c1")] and done.blocked_by == ""


def test_priority_zero_and_a_lower_short_block_behind_a_higher_waiting_one() -> None:
    assert hq.walk([short("z", 2, priority=0)], CLUSTERS, views(1)).preempt == []  # priority 0 never preempts
    entries = hq.with_short([hq.Entry("top", block("top", 4, priority=5000))], [short("hi", 1)])
    assert [e.bid for e in entries] == ["top", "hi"]
    assert hq.walk(entries, CLUSTERS, views(1)).preempt == ["top"]


def test_with_short_puts_each_before_the_waiting_blocks_of_a_lower_priority() -> None:
    head = [hq.Entry("a", block("a", 1, priority=2000)), hq.Entry("b", block("b", 1, priority=1000)),
            hq.Entry("gone", None), hq.Entry("c", block("c", 1, priority=10))]
    shorts = [short("s3", 1, priority=10), short("s1", 1, priority=1000), short("s0", 1, priority=5000),
              short("s2", 1, priority=1000)]
    assert [e.bid for e in hq.with_short(head, shorts)] == ["s0", "a", "s1", "s2", "b", "gone", "s3", "c"]
    assert [e.bid for e in hq.with_short([], [short("x", 1)])] == ["x"]


def test_the_missing_instances_are_those_not_live() -> None:
    ir = block("hi", 1, n=3)["ir"]
    insts = {"a": {"status": "running"}, "b": {"status": "starting"}, "c": {"status": "removing"}}
    assert hq.short_of(ir, insts)["minInstances"] == 1
    assert hq.short_of(ir, insts, replaced="a")["minInstances"] == 2
    assert hq.short_of(ir, {**insts, "d": {"status": "running"}})["minInstances"] == 0


def test_a_short_nominee_holds_room_in_its_own_cluster_only() -> None:
    clusters = {"c1": {"id": "c1", "labels": {}}, "c2": {"id": "c2", "labels": {}}}
    two = {"c1": {"n1": node("n1", 2, used=1)}, "c2": {"n2": node("n2", 2, used=1)}}
    hi = hq.Nominee("hi", block("hi", 1, priority=1000)["ir"], (), "c2")
    out = hq.walk([hq.Entry("lo", block("lo", 1)), hq.Entry("lo2", block("lo2", 1))], clusters, two, nominated=[hi])
    assert out.retry == [("lo", 1, "c1")]  # c2's free GPU is hi's: lo2 fits nowhere else
    free = lambda v: sum(1 for g in v["n1"]["gpus"] if not g["instances"])  # noqa: E731
    lo = block("lo", 1)["ir"]
    assert free(hq.held("lo", lo, "c1", clusters["c1"], two["c1"], [hi])) == 1  # nothing held in c1


def _victims(priority: int, preemptible: bool = True, missing: int = 1) -> dict[str, Any]:
    """The planner's answer for a short ``hi`` (priority 1000, 1 GPU per instance) whose
    ``missing`` instances need the GPUs ``other`` holds (2 instances of 1 GPU on a full node)."""
    gpus = [{"id": f"n0-g{i}", "model": "m", "instances": 1, "exclusive": True} for i in range(2)]
    views = {"n0": {"healthy": True, "cpu_free": 8, "memory_free": 1 << 20, "gpus": gpus}}
    other = {"block_id": "other", "gen": 1, "created": 1.0,
             "ir": {"priority": priority, "minInstances": 1, "preemptible": preemptible, "resources": {"gpus": 1}},
             "instances": {f"o-{i}": {"node": "n0", "gpus": [f"n0-g{i}"]} for i in range(2)}}
    ir = hq.short_of({"priority": 1000, "minInstances": 3, "resources": {"gpus": 1}},
                     {"hi-a": {"status": "running"}, "hi-b": {"status": "running"}} if missing == 1 else {"hi-a": {"status": "running"}})
    return plan(preempt_input("hi", ir, "c1", views, [other], 10))["victims"]


def test_the_planner_takes_what_the_missing_instances_need_by_the_same_rules() -> None:
    # one instance missing: one victim instance (other keeps its minInstances), not a gang of 3's room
    (one,) = _victims(0)["n0"]
    assert one in ("o-0", "o-1")
    assert _victims(0, missing=2) == {"n0": ["o-0", "o-1"]}
    assert _victims(995) == {} and _victims(1000) == {}  # within the delta rule, or its own priority
    assert _victims(0, preemptible=False) == {}


def test_the_preempting_line_says_a_short_block_preempts_for_its_missing_instances() -> None:
    from aios_blocks.projections.lines import line

    data = {"block_id": "hi", "gen": 1, "reason": "Priority", "victims": {"lo": ["lo-0"]}, "gpus_freed": 1,
            "request_id": "r", "short": 1}
    _, detail, _ = line("aios.block.hi.preempting", {"data": data})
    assert detail == "Priority: 1 GPU(s) freed from lo (lo-0) for its 1 missing instance(s) (ready, short)"
    _, detail, _ = line("aios.block.hi.preempting", {"data": {**data, "short": 0}})
    assert detail == "Priority: 1 GPU(s) freed from lo (lo-0)"
