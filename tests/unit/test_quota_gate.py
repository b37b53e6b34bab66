"""The quota gate of the pending queue (handlers/queue.py ``gate``/``walk`` with a ``QuotaView``)
and the reclamation plan (handlers/preemption.py ``reclaim_plan``): pure, no servers."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers import preemption as pre
from aios_blocks.handlers import queue as hq
from aios_blocks.policies.quota import Holding, Verdict
from aios_blocks.schemas.priority import Quota

from .test_queue_walk import CLUSTERS, block, views


def tenant(bid: str, name: str, gpus: int = 1, **extra: Any) -> dict[str, Any]:
    b = block(bid, gpus, **extra)
    b["ir"]["labels"] = {"tenant": name}
    return b


def held(bid: str, name: str, gpus: int = 1, created: float = 0.0) -> Holding:
    return Holding(bid, name, {"*": {"gpus": float(gpus), "cpu": 1.0, "memory": 1024.0}}, 0, created)


def q(name: str, gpus: int, cohort: str | None = None) -> Quota:
    return Quota(tenant=name, cohort=cohort, nominal={"*": {"gpus": gpus}})


def test_over_quota_without_a_cohort_waits_with_nominal_used_and_borrowed_and_holds_no_one_back() -> None:
    view = hq.QuotaView({"c": q("c", 1)}, [held("c1", "c")])
    d, reason = hq.gate(tenant("c2", "c")["ir"], view) or (None, "")
    assert d is not None and d.verdict is Verdict.WAIT
    assert reason.startswith("quota: tenant c over its nominal quota") and "nominal *.gpus=1" in reason
    assert "used *.gpus=1" in reason and "borrowed 0" in reason, reason
    entries = [hq.Entry("c2", tenant("c2", "c", priority=100)), hq.Entry("x", block("x", 1))]
    out = hq.walk(entries, CLUSTERS, views(2), quota=view)
    assert out.retry == [("x", 1, "c1")] and out.preempt == [] and out.reclaim == []
    raised = hq.QuotaView({"c": q("c", 2)}, [held("c1", "c")])
    assert hq.walk(entries, CLUSTERS, views(2), quota=raised).retry == [("c2", 1, "c1"), ("x", 1, "c1")]


def test_two_blocks_of_one_tenant_are_not_both_admitted_on_one_unit_of_quota() -> None:
    view = hq.QuotaView({"c": q("c", 1)}, [])
    entries = [hq.Entry("a", tenant("a", "c")), hq.Entry("b", tenant("b", "c"))]
    assert hq.walk(entries, CLUSTERS, views(4), quota=view).retry == [("a", 1, "c1")]


def test_the_owner_reclaims_from_the_borrower_and_waits_while_the_victims_drain() -> None:
    quotas = {"a": q("a", 1, "lab"), "b": q("b", 1, "lab")}
    view = hq.QuotaView(quotas, [held("a1", "a", created=1), held("a2", "a", created=2)])
    entries = [hq.Entry("b1", tenant("b1", "b")), hq.Entry("x", block("x", 1))]
    out = hq.walk(entries, CLUSTERS, views(2), quota=view)
    assert out.reclaim == [("b1", ["a2"])] and out.retry == []  # the youngest borrower
    marked = [hq.Entry("b1", tenant("b1", "b", preempting="b1:1:0:1000.000")), entries[1]]
    drain = hq.walk(marked, CLUSTERS, views(2), quota=view, now=1001.0)
    assert drain.blocked_by == "b1" and drain.reclaim == [] and drain.retry == []
    # a waiting victim never reclaims (no cascades); a borrower over quota just waits
    victim = [hq.Entry("b1", tenant("b1", "b", preempted_by="z"))]
    assert hq.walk(victim, CLUSTERS, views(2), quota=view).reclaim == []
    after = hq.QuotaView(quotas, [held("a1", "a", created=1)])
    assert hq.walk(entries, CLUSTERS, views(2), quota=after).retry == [("b1", 1, "c1"), ("x", 1, "c1")]


def test_a_borrower_is_admitted_when_the_cohort_has_it_idle() -> None:
    quotas = {"a": q("a", 1, "lab"), "b": q("b", 1, "lab")}
    d, reason = hq.gate(tenant("a2", "a")["ir"], hq.QuotaView(quotas, [held("a1", "a")])) or (None, "")
    assert d is not None and d.verdict is Verdict.ADMIT_BORROWING and "borrowed *.gpus=1" not in reason
    assert hq.gate(block("x", 1)["ir"], hq.QuotaView(quotas, [])) is None  # no tenant: no gate


def test_reclaim_plan_takes_every_instance_of_each_victim_with_the_reason() -> None:
    placed = [{"block_id": "a2", "gen": 3, "created": 2.0, "ir": tenant("a2", "a")["ir"],
               "instances": {"a2-0": {"node": "n1", "gpus": ["n1-g1"]}}},
              {"block_id": "a1", "gen": 1, "created": 1.0, "ir": tenant("a1", "a")["ir"],
               "instances": {"a1-0": {"node": "n1", "gpus": ["n1-g0"]}}}]
    data, output = pre.reclaim_plan("b1", tenant("b1", "b")["ir"], ["a2"], placed)
    assert output["victims"] == {"n1": ["a2-0"]} and output["blocks"] == {"a2": ["a2-0"]}
    events = pre.events(data, output, 1, "b1:1", output["reason"])
    assert [e.payload.reason for e in events] == ["InCohortReclamation"] * 2
    assert events[0].payload.block_id == "a2" and events[0].payload.gen == 3
