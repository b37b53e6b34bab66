"""What the Lua scripts of ``state.scripts`` decide, through their callers in ``state.Store``, on a
real Redis (the embedded one): block creation and reuse (CREATE_BLOCK), lifecycle compare-and-set
(TRANSITION), the desired count (SET_DESIRED), a scale-down's floor (DRAIN_INSTANCE), an instance's
status and endpoint (SET_INSTANCE_STATUS), a node's health flip (NODE_HEALTH_CAS), the gather's
answers, one outcome and due timers (GATHER_ADD, GATHER_SETTLE, CLAIM_DUE), the policy registry's
head (POLICY_HEAD) and leases (LEASE, LEASE_RELEASE). The reservation scripts (RESERVE_GANG,
RELEASE, ADD_INSTANCES) are in test_reservation_mutants.py and test_store_*."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.lifecycle import LIVE, Step
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import Store

pytestmark = pytest.mark.integration


@pytest.fixture
async def st(tmp_path: Path) -> AsyncIterator[Store]:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    store = Store.open(servers.redis_url)
    try:
        yield store
    finally:
        await store.close()
        servers.stop()


async def _block(st: Store, bid: str = "b", gen: int = 1, status: str = "parsed", **fields: Any) -> None:
    ok, what = await st.create_block(bid, gen, f"digest-{gen}", {"status": status, "attempt": "1", **fields})
    assert (ok, what) == (True, "created")


# -- CREATE_BLOCK ------------------------------------------------------------------------------------
async def test_create_block_creates_repeats_and_refuses_a_live_id(st: Store) -> None:
    await _block(st, ir={"blockId": "b"})
    block = await st.get_block("b")
    assert block is not None and (block["gen"], block["version"], block["status"], block["digest"]) == (1, 1, "parsed", "digest-1")
    assert block["ir"] == {"blockId": "b"}
    # the same create again (a redelivery): nothing changes
    assert await st.create_block("b", 1, "digest-1", {"status": "parsed"}) == (True, "same")
    # another create under a live id: refused, naming the status it is in
    assert await st.create_block("b", 2, "digest-2", {"status": "parsed"}) == (False, "block id already in use (status parsed)")
    assert (await st.get_block("b") or {})["gen"] == 1


@pytest.mark.parametrize("ended", ["deleted", "rejected", "failed"])
async def test_create_block_reuses_an_ended_id_from_scratch(st: Store, ended: str) -> None:
    await _block(st, status=ended, reason="old reason")
    assert await st.create_block("b", 2, "digest-2", {"status": "parsed"}) == (True, "created")
    block = await st.get_block("b") or {}
    # the old record is gone, not merged: no stale reason, version back to 1
    assert (block["gen"], block["version"], block["status"]) == (2, 1, "parsed") and "reason" not in block


# -- TRANSITION --------------------------------------------------------------------------------------
async def test_transition_moves_only_from_its_sources_and_bumps_the_version(st: Store) -> None:
    await _block(st)
    assert await st.transition("b", 1, Step.SELECT, in_round=1) == (True, "2")
    assert (await st.get_block("b") or {})["status"] == "selecting"
    # READY's source is placing: from selecting it is refused with the status that blocked it
    assert await st.transition("b", 1, Step.READY) == (False, "selecting")
    assert await st.transition("b", 1, Step.CHOOSE, cluster="c1") == (True, "3")
    block = await st.get_block("b") or {}
    assert (block["status"], block["cluster"], block["version"]) == ("allocating", "c1", 3)


async def test_transition_refuses_another_generation_round_or_an_absent_block(st: Store) -> None:
    assert await st.transition("nowhere", 1, Step.SELECT) == (False, "absent")
    await _block(st, gen=4)
    assert await st.transition("b", 3, Step.SELECT) == (False, "stale-gen:4")
    assert await st.transition("b", 4, Step.SELECT, in_round=2) == (False, "superseded:1")
    assert (await st.get_block("b") or {})["version"] == 1  # nothing written by a refusal
    assert await st.transition("b", None, Step.SELECT, in_round=1) == (True, "2")  # any generation


# -- SET_DESIRED -------------------------------------------------------------------------------------
async def test_set_desired_latest_target_wins_only_on_a_live_block_of_its_generation(st: Store) -> None:
    await _block(st, status="ready")
    assert await st.set_desired("b", 1, 3, 10, LIVE, source="autoscaler") == (True, "ok")
    block = await st.get_block("b") or {}
    assert (block["desired"], block["desired_seq"], block["source"]) == (3, 10, "autoscaler")
    assert await st.set_desired("b", 1, 3, 10, LIVE) == (True, "ok")  # the same target again (a redelivery)
    assert await st.set_desired("b", 1, 1, 9, LIVE) == (False, "superseded:10")  # an older one
    assert await st.set_desired("b", 2, 5, 11, LIVE) == (False, "stale-gen:1")
    assert await st.set_desired("nowhere", 1, 5, 11, LIVE) == (False, "absent")
    assert (await st.get_block("b") or {})["desired"] == 3
    await _block(st, bid="p", status="parsed")
    assert await st.set_desired("p", 1, 2, 1, LIVE) == (False, "parsed")  # not live yet


# -- DRAIN_INSTANCE and SET_INSTANCE_STATUS -----------------------------------------------------------
def _inst(node: str, status: str = "running", endpoint: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"node": node, "gpus": [], "status": status}
    if endpoint is not None:
        rec["endpoint"] = endpoint
    return rec


async def _instances(st: Store, bid: str, **recs: dict[str, Any]) -> None:
    assert await st.start_instances(bid, recs, []) == []


async def test_drain_never_takes_the_block_to_its_floor(st: Store) -> None:
    await _instances(st, "b", **{"b-0": _inst("n0"), "b-1": _inst("n1"), "b-2": _inst("n2")})
    assert await st.drain_instance("b", "b-0", 1, "r1", 2) == "ok"
    assert await st.drain_instance("b", "b-0", 1, "r1", 2) == "removing"  # already on its way out
    assert await st.drain_instance("b", "b-1", 1, "r2") == "ok"
    assert await st.drain_instance("b", "b-2", 1, "r3") == "floor"  # the last one of floor 1
    assert await st.drain_instance("b", "b-9", 0, "r3") == "absent"
    insts = await st.instances("b")
    assert {i: r["status"] for i, r in insts.items()} == {"b-0": "removing", "b-1": "removing", "b-2": "running"}
    assert insts["b-0"]["drain"] == "r1" and insts["b-1"]["drain"] == "r2" and "drain" not in insts["b-2"]


async def test_drain_counts_what_one_request_marked_already(st: Store) -> None:
    await _instances(st, "b", **{f"b-{k}": _inst(f"n{k}") for k in range(4)})
    assert await st.drain_instance("b", "b-0", 0, "r1", 1) == "ok"
    # the same request handled twice at once (a redelivery in one batch): its count is reached
    assert await st.drain_instance("b", "b-1", 0, "r1", 1) == "done"
    assert (await st.instances("b"))["b-1"]["status"] == "running"


async def test_two_racing_scale_downs_stop_at_the_floor(st: Store) -> None:
    await _instances(st, "b", **{f"b-{k}": _inst(f"n{k}") for k in range(6)})
    outcomes = await asyncio.gather(*(st.drain_instance("b", f"b-{k}", 2, f"r{k % 2}") for k in range(6)))
    assert sorted(outcomes) == ["floor", "floor", "ok", "ok", "ok", "ok"]
    assert sum(1 for r in (await st.instances("b")).values() if r["status"] != "removing") == 2


async def test_set_instance_status_replaces_status_and_endpoint_in_place(st: Store) -> None:
    await _instances(st, "b", **{"b-0": _inst("n0", "starting"), "b-1": _inst("n1", "running", "http://h:1")})
    rec, every = await st.set_instance_status_all("b", "b-0", "running", "http://h:2")
    assert rec == {"node": "n0", "gpus": [], "status": "running", "endpoint": "http://h:2"}
    assert set(every) == {"b-0", "b-1"} and every["b-1"]["status"] == "running"
    # an endpoint already there is replaced; an empty list stays a list (no JSON round trip in Lua)
    rec = await st.set_instance_status("b", "b-1", "removing", 'http://h:3/"quoted"%1')
    assert rec == {"node": "n1", "gpus": [], "status": "removing", "endpoint": 'http://h:3/"quoted"%1'}
    assert await st.set_instance_status("b", "b-1", "running") == {**rec, "status": "running"}
    assert await st.set_instance_status("b", "b-9", "running") is None
    assert await st.set_instance_status_all("nowhere", "x", "running") == (None, {})


# -- NODE_HEALTH_CAS ---------------------------------------------------------------------------------
async def test_node_health_flips_once_and_bumps_the_cluster_index(st: Store) -> None:
    await st.put_node(Node(id="n1", cluster="c", gpus=[Gpu(id="g0")]))
    before = (await st.state_indexes(["c"]))["c"]
    assert await st.set_node_health_cas("c", "n1", False) is True
    assert await st.set_node_health_cas("c", "n1", False) is False  # a second reporter changes nothing
    assert (await st.state_indexes(["c"]))["c"] == before + 1
    assert await st.nodes_healthy([("c", "n1"), ("c", "gone")]) == [False, None]
    assert await st.set_node_health_cas("c", "gone", True) is False  # never registered: not created
    assert await st.nodes_healthy([("c", "gone")]) == [None]
    assert await st.set_node_health_cas("c", "n1", True) is True
    assert (await st.state_indexes(["c"]))["c"] == before + 2


# -- GATHER_ADD, GATHER_SETTLE, CLAIM_DUE ------------------------------------------------------------
async def test_gather_counts_only_expected_answers_and_settles_one_outcome(st: Store) -> None:
    await st.gather_open("b", 1, 1, ["c0", "c1"], deadline=1000.0, at=7)
    assert await st.gather_add_state("b", 1, 1, "c0", {"score": 0.5}) == (1, 2, None, 1000.0)
    assert await st.gather_add("b", 1, 1, "zz", {"score": 1.0}) == (1, 2)  # not asked: not counted
    assert await st.gather_add("b", 1, 1, "c0", {"score": 0.7}) == (1, 2)  # an answer again replaces it
    won, _, g = await st.gather_decide_read("b", 1, 1, "deadline")
    assert won and g["decided"] == "deadline"
    assert await st.gather_add_state("b", 1, 1, "c1", {"score": 0.0}) == (2, 2, "deadline", 1000.0)
    g = await st.gather_read("b", 1, 1)
    assert g["results"] == {"c0": {"score": 0.7}, "zz": {"score": 1.0}, "c1": {"score": 0.0}} and g["at"] == 7
    assert (await st.gather_decide_read("b", 1, 1, "complete"))[0] is False  # one decider
    # one outcome, whoever records first
    assert await st.gather_settle("b", 1, 1, "c0") == "c0"
    assert await st.gather_settle("b", 1, 1, "!no room") == "c0"


async def test_claim_due_claims_each_due_timer_once_per_lease(st: Store) -> None:
    await st.gather_open("a", 1, 1, ["c0"], deadline=100.0)
    await st.gather_open("b", 2, 3, ["c0"], deadline=200.0)
    await st.gather_open("c", 1, 1, ["c0"], deadline=500.0)
    assert await st.gather_claim_due(50.0) == ([], 100.0)  # none due: when the first is
    claimed, nxt = await st.gather_claim_due(250.0, lease_s=30.0)
    assert sorted(claimed) == [("a", 1, 1), ("b", 2, 3)] and nxt == 280.0  # claimed until 280
    assert await st.gather_claim_due(260.0) == ([], 280.0)  # another copy: nothing to claim
    assert (await st.gather_claim_due(600.0, limit=1))[0] == [("a", 1, 1)]  # at most ``limit``
    await st.gather_timer("a", 1, 1, None)
    await st.gather_finish("b", 2, 3)
    await st.gather_finish("c", 1, 1)
    assert await st.gather_claim_due(10_000.0) == ([], None)
    assert await st.gather_read("b", 2, 3) == {"expected": [], "deadline": 0.0, "results": {}, "decided": None, "at": 0}


# -- POLICY_HEAD ------------------------------------------------------------------------------------
async def test_the_policy_registry_head_only_moves_forward(st: Store) -> None:
    await st.policy_store("p", 2, "v2 source", "python")
    await st.policy_store("p", 1, "v1 source", "starlark")  # a replay of an older version
    head = await st.policy_get("p") or {}
    assert (head["version"], head["source"], head["language"]) == (2, "v2 source", "python")
    assert (await st.policy_get("p", 1) or {})["source"] == "v1 source"  # kept as a version
    await st.policy_store("p", 3, "v3 source", "python")
    assert (await st.policy_get("p") or {})["version"] == 3 and await st.policy_names() == ["p"]


# -- LEASE, LEASE_RELEASE ---------------------------------------------------------------------------
async def test_a_replacement_claim_has_one_holder_and_is_released_only_by_it(st: Store) -> None:
    assert await st.claim_replacement("b", "b-0", "r1", 60) == "r1"
    assert await st.claim_replacement("b", "b-0", "r1", 60) == "r1"  # a redelivery keeps it
    assert await st.claim_replacement("b", "b-0", "r2", 60) == "r1"  # another request: held
    await st.release_replacement("b", "b-0", "r2")  # not the holder: nothing
    assert await st.claim_replacement("b", "b-0", "r2", 60) == "r1"
    await st.release_replacement("b", "b-0", "r1")
    assert await st.claim_replacement("b", "b-0", "r2", 60) == "r2"
    assert await st.claim_replacement("b", "b-1", "r1", 60) == "r1"  # per instance


async def test_a_lease_lapses_on_its_own(st: Store) -> None:
    assert await st.claim_replacement("b", "b-0", "r1", 0.05) == "r1"
    async with asyncio.timeout(10):  # the holder died: the lease goes by itself (PX)
        while await st.claim_replacement("b", "b-0", "r2", 60) != "r2":
            await asyncio.sleep(0.02)
