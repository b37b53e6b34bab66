"""Quotas gate placement on real servers (issue 36, docs/priority.md "Quota gating"): a tenant
borrows what its cohort leaves idle, the owner reclaims it by preempting the borrower (reason
InCohortReclamation; the borrower waits), a tenant over its quota in no cohort waits with the
quota's reason while a GPU is free, and raising its quota places it."""

from __future__ import annotations

import pytest

from aios_blocks.recovery.invariants import check

from .conftest import System
from .test_pending_queue import events, spec, status_of
from .test_priority_cli import _ok

pytestmark = pytest.mark.integration


@pytest.fixture
def event_driven(monkeypatch: pytest.MonkeyPatch) -> None:
    """No resync pass during the test: every placement below comes from a capacity event (a block
    removed, the quota raised: ``quota.set``), not from the walker's periodic pass."""
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "300")  # inherited by the worker processes
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


def of(bid: str, tenant: str) -> dict[str, object]:
    return spec(bid, labels={"tenant": tenant})


async def test_borrow_reclaim_wait_and_raise(event_driven: None, system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=4)
    await _ok(system, "quota", "set", "team-a", "--nominal", "*:gpus=1", "--cohort", "lab")
    await _ok(system, "quota", "set", "team-b", "--nominal", "*:gpus=1", "--cohort", "lab")
    await _ok(system, "quota", "set", "team-c", "--nominal", "*:gpus=1")
    for bid in ("a1", "a2"):  # a2 borrows team-b's idle GPU
        _, kind, _ = await system.submit_and_wait(of(bid, "team-a"))
        assert kind == "ready", bid
    await c.submit(of("b1", "team-b"))  # the owner: within its nominal, the cohort's room is lent
    await status_of(system, "b1", "ready")
    (preempted,) = await events(system, "a2", "preempted")
    assert preempted["preemptor"] == "b1" and preempted["reason"] == "InCohortReclamation", preempted
    (preempting,) = await events(system, "b1", "preempting")
    assert preempting["victims"] == {"a2": ["a2-0"]} and preempting["reason"] == "InCohortReclamation", preempting
    a2 = await status_of(system, "a2", "pending")
    assert a2["preempted_by"] == "b1"
    assert (await c.store.get_block("a1") or {})["status"] == "ready"  # within its nominal: kept
    _, kind, _ = await system.submit_and_wait(of("c1", "team-c"))
    assert kind == "ready"
    await c.submit(of("c2", "team-c"))  # over its quota, in no cohort: waits though a GPU is free
    c2 = await status_of(system, "c2", "pending")
    assert c2["reason"].startswith("quota: tenant team-c over its nominal quota"), c2["reason"]
    assert "nominal *.gpus=1" in c2["reason"] and "used *.gpus=1" in c2["reason"] and "borrowed" in c2["reason"]
    await _ok(system, "quota", "set", "team-c", "--nominal", "*:gpus=2")  # quota raised: placed
    await status_of(system, "c2", "ready")
    assert (await c.store.get_block("a2") or {})["status"] == "pending"  # its cohort has no room idle
    rep = await check(c.bus, c.store, settled=False)
    assert rep.redis_digest == rep.stream_digest and not rep.violations, "\n".join(rep.diff) + str(rep.violations)
