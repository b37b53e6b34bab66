"""The store's batched writes (one round trip each): what they leave is what the one-by-one calls
left, and a pipeline whose scripts the server lost loads them and runs again."""

from __future__ import annotations

import fakeredis

from aios_blocks.schemas.lifecycle import Step
from aios_blocks.state.store import Store, block_key, inst_key


def store() -> Store:
    return Store(fakeredis.aioredis.FakeRedis(decode_responses=True))


async def test_start_instances_records_the_step_the_index_and_the_instances_once() -> None:
    st = store()
    await st.create_block("b1", 7, "d", {"status": "allocating", "ir": {"blockId": "b1"}})
    rec = {"node": "n1", "gpus": ["g0"], "cluster": "c1", "status": "starting", "action": "allocation"}
    await st.start_instances("b1", {"b1-0": rec}, [("svc", "lease", "b1-0", "n1", "r1")], (7, Step.RESERVE, {"cluster": "c1"}))
    block = await st.get_block("b1")
    assert block is not None and block["status"] == "placing" and block["cluster"] == "c1"
    assert await st.instances("b1") == {"b1-0": rec}
    index = await st.index_read(["svc"], ["lease"])
    assert index == {"services": {"svc": [["n1", "r1"]]}, "leases": {"lease": "n1"}}
    # redone (a redelivery): a record that moved on keeps its status, the step does not move twice
    await st.set_instance_status("b1", "b1-0", "running")
    await st.start_instances("b1", {"b1-0": rec}, [("svc", "lease", "b1-0", "n1", "r1")], (7, Step.RESERVE, {"cluster": "c1"}))
    assert (await st.instances("b1"))["b1-0"]["status"] == "running"
    assert (await st.get_block("b1"))["version"] == block["version"]  # type: ignore[index]


async def test_set_instance_status_all_returns_every_record_after_the_write() -> None:
    st = store()
    a = {"node": "n1", "gpus": [], "cluster": "c1", "status": "starting", "action": "allocation"}
    b = {**a, "node": "n2", "status": "running"}
    await st.put_instances("b1", {"b1-0": a, "b1-1": b})
    rec, insts = await st.set_instance_status_all("b1", "b1-0", "running")
    assert rec == {**a, "status": "running"}  # an empty list stays a list
    assert insts == {"b1-0": {**a, "status": "running"}, "b1-1": b}
    assert await st.set_instance_status_all("b1", "nope", "running") == (None, {})
    assert await st.set_instance_status("b2", "b2-0", "running") is None


async def test_a_pipeline_whose_scripts_were_flushed_loads_them_and_runs_again() -> None:
    st = store()
    await st.create_block("b1", 1, "d", {"status": "allocating", "ir": {}})
    await st.r.script_flush()
    rec = {"node": "n1", "gpus": [], "cluster": "c1", "status": "starting", "action": "allocation"}
    await st.start_instances("b1", {"b1-0": rec}, [], (1, Step.RESERVE, {"cluster": "c1"}))
    assert (await st.r.hget(block_key("b1"), "status")) == "placing"
    assert await st.r.hlen(inst_key("b1")) == 1


async def test_block_view_reads_the_block_and_its_instances() -> None:
    st = store()
    assert await st.block_view("b1") == (None, {})
    await st.create_block("b1", 3, "d", {"status": "parsed", "ir": {"x": 1}})
    rec = {"node": "n1", "gpus": [], "cluster": "c1", "status": "starting", "action": "allocation"}
    await st.put_instances("b1", {"b1-0": rec})
    block, insts = await st.block_view("b1")
    assert block is not None and block["gen"] == 3 and block["ir"] == {"x": 1} and insts == {"b1-0": rec}


async def test_a_decided_gather_is_claimed_once_and_its_timer_dropped_with_the_step() -> None:
    st = store()
    await st.create_block("b1", 5, "d", {"status": "selecting", "ir": {}, "attempt": "0"})
    await st.gather_open("b1", 5, 0, ["c1", "c2"], deadline=100.0)
    await st.gather_add("b1", 5, 0, "c1", {"score": 1.0})
    won, block, g = await st.gather_decide_read("b1", 5, 0, "complete")
    assert won and block is not None and block["status"] == "selecting"
    assert g["expected"] == ["c1", "c2"] and g["results"] == {"c1": {"score": 1.0}} and g["decided"] == "complete"
    # another decider (the deadline timer) loses; the same token (a redelivery) decides again
    assert (await st.gather_decide_read("b1", 5, 0, "deadline"))[0] is False
    assert (await st.gather_decide_read("b1", 5, 0, "complete"))[0] is True
    assert await st.gather_done("b1", 5, 0, Step.CHOOSE, cluster="c1") == (True, "2")
    assert (await st.get_block("b1"))["status"] == "allocating"  # type: ignore[index]
    assert await st.gather_claim_due(1000.0) == ([], None)  # no timer left to fire
    # the CAS as ``transition``: a block that moved on is left alone
    await st.transition("b1", 5, Step.RESERVE)
    assert await st.gather_done("b1", 5, 0, Step.CHOOSE, cluster="c1") == (False, "placing")
