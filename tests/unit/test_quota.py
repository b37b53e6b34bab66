"""Quotas that borrow (issue 36): the pure accounting of ``policies.quota``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aios_blocks.policies.quota import (
    Holding,
    Verdict,
    decide,
    instance_usage,
    report,
    request_usage,
    tenant_of,
)
from aios_blocks.schemas.priority import Quota


def _q(tenant: str, gpus: float, cohort: str | None = "lab", limit: float | None = None) -> Quota:
    return Quota(tenant=tenant, cohort=cohort, nominal={"A100": {"gpus": gpus}},
                 borrowingLimit={"A100": {"gpus": limit}} if limit is not None else None)


def _hold(bid: str, tenant: str, gpus: float, priority: int = 0, created: float = 0.0, preemptible: bool = True) -> Holding:
    return Holding(bid, tenant, {"A100": {"gpus": gpus}, "*": {"gpus": gpus}}, priority, created, preemptible)


def _req(gpus: float) -> dict[str, dict[str, float]]:
    return {"A100": {"gpus": gpus}, "*": {"gpus": gpus}}


QUOTAS = {"a": _q("a", 8), "b": _q("b", 8), "solo": _q("solo", 4, cohort=None)}


def test_within_nominal_is_admitted() -> None:
    d = decide("a", _req(4), QUOTAS, [_hold("x", "a", 4)])
    assert d.verdict is Verdict.ADMIT and not d.borrowed


def test_above_nominal_borrows_what_the_cohort_leaves_idle() -> None:
    d = decide("a", _req(4), QUOTAS, [_hold("x", "a", 8), _hold("y", "b", 2)])
    assert d.verdict is Verdict.ADMIT_BORROWING
    assert d.borrowed == {"A100": {"gpus": 4.0}}


def test_above_nominal_waits_when_the_cohort_has_not_that_much_idle() -> None:
    d = decide("a", _req(4), QUOTAS, [_hold("x", "a", 8), _hold("y", "b", 6)])
    assert d.verdict is Verdict.WAIT and "idle" in d.reason


def test_a_tenant_in_no_cohort_never_borrows() -> None:
    assert decide("solo", _req(1), QUOTAS, [_hold("x", "solo", 4)]).verdict is Verdict.WAIT


def test_borrowing_limit_caps_what_is_borrowed() -> None:
    quotas = {**QUOTAS, "a": _q("a", 8, limit=2)}
    assert decide("a", _req(2), quotas, [_hold("x", "a", 8)]).verdict is Verdict.ADMIT_BORROWING
    assert decide("a", _req(3), quotas, [_hold("x", "a", 8)]).verdict is Verdict.WAIT


def test_the_owner_reclaims_from_borrowers_lowest_priority_then_youngest_first() -> None:
    # b borrows 6 of a's 8: a (using 0) asks for 6, within its nominal: reclaim
    holdings = [_hold("b-own", "b", 8, priority=0), _hold("b1", "b", 2, priority=5, created=1),
                _hold("b2", "b", 2, priority=0, created=1), _hold("b3", "b", 2, priority=0, created=2)]
    d = decide("a", _req(6), QUOTAS, holdings)
    assert d.verdict is Verdict.RECLAIM and d.victim_reason == "InCohortReclamation"
    # the cohort (16) is 4 over once a takes 6: the two youngest priority-0 blocks of b free it;
    # b1 (priority 5) comes after every priority-0 block, the oldest (b-own) last
    assert d.victims == ["b3", "b2"]


def test_reclaim_never_takes_from_a_tenant_within_its_nominal() -> None:
    # c (nominal 0) borrows 4 and b sits at its nominal 8: a, asking its 8, takes c's block only
    quotas = {**QUOTAS, "c": _q("c", 0)}
    d = decide("a", _req(8), quotas, [_hold("b-old", "b", 8, created=0), _hold("c1", "c", 4, created=0)])
    assert d.verdict is Verdict.RECLAIM and d.victims == ["c1"]


def test_reclaim_skips_blocks_that_are_not_preemptible_and_waits_if_that_leaves_too_little() -> None:
    holdings = [_hold("b-own", "b", 8), _hold("b1", "b", 8, preemptible=False)]
    d = decide("a", _req(8), QUOTAS, holdings)
    assert d.verdict is Verdict.RECLAIM and d.victims == ["b-own"]  # b-own frees the room while b borrows
    d = decide("a", _req(8), QUOTAS, [_hold("b1", "b", 16, preemptible=False)])
    assert d.verdict is Verdict.WAIT


def test_no_quota_admits_and_says_why() -> None:
    assert decide(None, _req(64), QUOTAS, []).verdict is Verdict.ADMIT
    assert "no quota" in decide("stranger", _req(64), QUOTAS, []).reason


def test_resources_a_quota_leaves_out_are_not_limited_and_star_counts_every_model() -> None:
    quotas = {"a": Quota(tenant="a", nominal={"*": {"cpu": 16}})}
    assert decide("a", {"*": {"cpu": 8, "gpus": 100}}, quotas, []).verdict is Verdict.ADMIT
    assert decide("a", {"*": {"cpu": 17}}, quotas, []).verdict is Verdict.WAIT


def test_usage_of_instances_and_requests() -> None:
    u = instance_usage({"gpus": 2, "cpu": 4, "memory": 1024}, ["g1", "g2"], {"g1": "A100", "g2": "A100"})
    assert u == {"*": {"cpu": 4.0, "memory": 1024.0, "gpus": 2.0}, "A100": {"cpu": 4.0, "memory": 1024.0, "gpus": 2.0}}
    shared = instance_usage({"gpus": 1, "gpuShare": 0.25}, ["g1"], {"g1": "T4"})
    assert shared["T4"]["gpuShare"] == 0.25 and "gpus" not in shared["T4"]
    r = request_usage({"gpus": 1, "cpu": 2}, 3, "A100")
    assert r["A100"]["gpus"] == 3 and r["*"]["cpu"] == 6


def test_tenant_is_the_label_else_the_virtual_cluster() -> None:
    assert tenant_of({"labels": {"tenant": "t1"}, "virtualClusterId": "v"}) == "t1"
    assert tenant_of({"virtualClusterId": "v"}) == "v"
    assert tenant_of({}) is None


def test_report_shows_usage_nominal_and_borrowed() -> None:
    rows = report(QUOTAS, [_hold("x", "a", 10)])
    a = next(r for r in rows if r["tenant"] == "a")
    assert a["usage"] == {"gpus": 10.0} and a["nominal"] == {"gpus": 8.0} and a["borrowed"] == {"gpus": 2.0}


def test_a_negative_amount_is_refused() -> None:
    with pytest.raises(ValidationError):
        Quota(tenant="a", nominal={"A100": {"gpus": -1}})


def test_a_request_on_no_known_model_counts_against_every_models_quota() -> None:
    quotas = {"a": _q("a", 2)}
    assert decide("a", {"*": {"gpus": 2}}, quotas, []).verdict is Verdict.ADMIT
    assert decide("a", {"*": {"gpus": 3}}, quotas, []).verdict is Verdict.WAIT
    # a request on a known model counts there only
    assert decide("a", {"H100": {"gpus": 3}, "*": {"gpus": 3}}, quotas, []).verdict is Verdict.ADMIT
