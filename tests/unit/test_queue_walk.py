"""The pending queue's pure decisions (handlers/queue.py): which waiting blocks a capacity event
retries, in priority-then-age order with backfill, who may preempt, when a wait expires."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers import queue as hq


def node(nid: str, gpus: int, used: int = 0) -> dict[str, Any]:
    return {"id": nid, "healthy": True, "cpu_free": 64.0, "memory_free": 1 << 20, "labels": {},
            "gpus": [{"id": f"{nid}-g{i}", "model": "sim", "memory": 80, "memory_free": 0 if i < used else 80,
                      "memory_used": 80 if i < used else 0, "instances": 1 if i < used else 0, "exclusive": i < used,
                      "share_free": 1000} for i in range(gpus)]}


def block(bid: str, gpus: int, n: int = 1, priority: int = 0, **extra: Any) -> dict[str, Any]:
    ir = {"blockId": bid, "minInstances": n, "maxInstances": n, "priority": priority,
          "resources": {"gpus": gpus, "cpu": 1, "memory": 1024, "gpuMemory": 0},
          "policies": {"clusterAllocator": {"policyRuleURI": "builtin:cluster-rank", "settings": {}},
                       "resourceAllocator": {"policyRuleURI": "builtin:binpack", "settings": {}}}}
    return {"gen": 1, "status": "pending", "ir": ir, **extra}


CLUSTERS = {"c1": {"id": "c1", "labels": {}}}


def views(free: int) -> dict[str, Any]:
    """One node of 4 GPUs with ``free`` of them free."""
    return {"c1": {"n1": node("n1", 4, used=4 - free)}}


def test_the_head_is_retried_first_and_what_it_takes_is_not_offered_again() -> None:
    entries = [hq.Entry("hi", block("hi", 2, priority=100)), hq.Entry("lo", block("lo", 2)), hq.Entry("lo2", block("lo2", 1))]
    out = hq.walk(entries, CLUSTERS, views(3))
    assert out.retry == [("hi", 1, "c1"), ("lo2", 1, "c1")]  # lo (2 GPUs) no longer fits after hi took 2 of 3


def test_backfill_a_smaller_lower_block_when_the_head_cannot_use_the_capacity() -> None:
    """The head (priority 0: it may not preempt) needs 4 GPUs, 2 are free: a 1-GPU block behind it
    is released, since the head cannot use those 2 now."""
    entries = [hq.Entry("big", block("big", 4)), hq.Entry("small", block("small", 1, priority=-1))]
    out = hq.walk(entries, CLUSTERS, views(2))
    assert out.retry == [("small", 1, "c1")] and out.preempt == []


def test_nothing_behind_a_preemptor_is_released_while_its_victims_drain() -> None:
    entries = [hq.Entry("big", block("big", 4, priority=100, preempting="big:1:100:1000.000")), hq.Entry("small", block("small", 1))]
    out = hq.walk(entries, CLUSTERS, views(2), now=1010.0)
    assert out.retry == [] and out.blocked_by == "big" and out.preempt == []
    # a mark past PREEMPT_HOLD_S (a walker stopped between the mark and the evictions) holds nothing
    late = hq.walk(entries, CLUSTERS, views(2), now=1000.0 + hq.PREEMPT_HOLD_S + 1)
    assert late.blocked_by == "" and late.preempt == ["big"]


def test_the_first_block_that_may_preempt_stops_the_walk_until_the_policy_answered() -> None:
    entries = [hq.Entry("big", block("big", 4, priority=100)), hq.Entry("small", block("small", 1))]
    first = hq.walk(entries, CLUSTERS, views(2))
    assert first.preempt == ["big"] and first.retry == []
    again = hq.walk(entries, CLUSTERS, views(2), tried=frozenset({"big"}))
    assert again.preempt == [] and again.retry == [("small", 1, "c1")]


def test_a_preempted_block_that_waits_never_preempts() -> None:
    """No cascades: a victim waiting again (``preempted_by``) is never the one that preempts."""
    victim = block("v", 4, priority=100, preempted_by="hi")
    assert not hq.may_preempt(victim)
    assert hq.walk([hq.Entry("v", victim)], CLUSTERS, views(0)).preempt == []
    assert not hq.may_preempt(block("zero", 1, priority=0))
    assert hq.may_preempt(block("p", 1, priority=5))


def test_gone_entries_are_dropped_and_draining_victims_wait_for_their_instances() -> None:
    entries = [hq.Entry("gone", None), hq.Entry("placed", {**block("placed", 1), "status": "ready"}),
               hq.Entry("draining", block("draining", 1), holds=2), hq.Entry("ok", block("ok", 1))]
    out = hq.walk(entries, CLUSTERS, views(1))
    assert out.drop == ["gone", "placed"] and out.retry == [("ok", 1, "c1")]


def test_a_gang_fits_only_whole() -> None:
    assert hq.walk([hq.Entry("g", block("g", 2, n=2))], CLUSTERS, views(3)).retry == []
    assert hq.walk([hq.Entry("g", block("g", 2, n=2))], CLUSTERS, views(4)).retry == [("g", 1, "c1")]


def test_deadline_and_queue_flag() -> None:
    assert hq.deadline({}, 100.0, 60) == 160.0
    assert hq.deadline({"maxPendingS": 5}, 100.0, 60) == 105.0
    assert hq.deadline({"maxPendingS": 0}, 100.0, 60) == 0.0 and hq.deadline({}, 100.0, 0) == 0.0
    assert hq.waits({}) and hq.waits({"queue": True}) and not hq.waits({"queue": False})


def test_the_room_a_preemption_freed_stays_the_retried_preemptors() -> None:
    """The preemptor (2 GPUs) was retried and is on its way through selection; its victims wait
    again, and the 2 GPUs they freed are free in the views: the next pass does not give them to
    the victims (nor to a block of its own priority), only a higher block may take them."""
    two = {"c1": {"n1": node("n1", 4, used=2), "n2": node("n2", 4, used=4)}}
    hi = hq.Nominee("hi", block("hi", 1, n=2, priority=100)["ir"], ("n1",))
    victims = [hq.Entry(v, block(v, 1, preempted_by="hi")) for v in ("v1", "v2")]
    assert hq.walk(victims, CLUSTERS, two).retry == [("v1", 1, "c1"), ("v2", 1, "c1")]  # no nomination: they take it
    held = hq.walk(victims, CLUSTERS, two, nominated=[hi])
    assert held.retry == [] and held.work["c1"]["n1"]["gpus"][3]["instances"] == 1  # n1's free GPUs are hi's
    same = hq.walk([hq.Entry("peer", block("peer", 1, priority=100))], CLUSTERS, two, nominated=[hi])
    assert same.retry == []
    top = hq.walk([hq.Entry("top", block("top", 1, priority=1000)), *victims], CLUSTERS, two, nominated=[hi])
    # the higher block first; hi's whole gang no longer fits in the 1 GPU left: nothing is held for it
    assert top.retry == [("top", 1, "c1"), ("v1", 1, "c1")]
    # room beside the nominee's is still anybody's
    three = {"c1": {"n1": node("n1", 4, used=1)}}
    assert hq.walk(victims, CLUSTERS, three, nominated=[hi]).retry == [("v1", 1, "c1")]


def test_a_nominee_prefers_the_nodes_its_victims_freed() -> None:
    """First fit would take n1's free GPU; the nominee's room is on n2, where its victim was."""
    nodes = {"c1": {"n1": node("n1", 4, used=3), "n2": node("n2", 4, used=3)}}
    hi = hq.Nominee("hi", block("hi", 1, priority=100)["ir"], ("n2",))
    out = hq.walk([hq.Entry("lo", block("lo", 1))], CLUSTERS, nodes, nominated=[hi])
    assert out.retry == [("lo", 1, "c1")] and "n1" in out.work["c1"] and out.work["c1"]["n2"]["gpus"][3]["instances"] == 1


def test_the_placement_of_a_lower_block_sees_the_nominated_room_taken() -> None:
    nodes = {"n1": node("n1", 4, used=2)}
    hi = hq.Nominee("hi", block("hi", 1, n=2, priority=100)["ir"], ("n1",))
    lo = block("lo", 1)["ir"]
    free = lambda v: sum(1 for g in v["n1"]["gpus"] if not g["instances"])  # noqa: E731
    assert free(hq.held("lo", lo, "c1", CLUSTERS["c1"], nodes, [hi])) == 0
    assert free(hq.held("hi", hi.ir, "c1", CLUSTERS["c1"], nodes, [hi])) == 2  # its own room
    assert free(hq.held("top", block("top", 1, priority=1000)["ir"], "c1", CLUSTERS["c1"], nodes, [hi])) == 2
    assert free(nodes) == 2  # on copies
