"""The store's batched writes (one round trip each): what they leave is what the one-by-one calls
left, and a pipeline whose scripts the server lost loads them and runs again."""

from __future__ import annotations

import fakeredis

from aios_blocks.schemas.lifecycle import Step
from aios_blocks.state.keys import gather_key
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
    _, insts = await st.set_instance_status_all("b1", "b1-1", "removing")
    assert len(insts) == 2 and sorted(insts) == ["b1-0", "b1-1"] and insts["b1-1"]["status"] == "removing"


async def test_block_and_instances_reads_the_block_and_every_record() -> None:
    st = store()
    await st.create_block("b1", 7, "d", {"status": "placing", "ir": {"blockId": "b1"}})
    a = {"node": "n1", "gpus": [], "cluster": "c1", "status": "starting", "action": "allocation"}
    await st.put_instances("b1", {"b1-0": a, "b1-1": {**a, "node": "n2"}})
    block, insts = await st.block_and_instances("b1")
    assert block is not None and block["gen"] == 7 and block["status"] == "placing"
    assert insts.one("b1-1") == {**a, "node": "n2"} and insts.one("b1-9") is None
    assert dict(insts) == {"b1-0": a, "b1-1": {**a, "node": "n2"}}
    block, insts = await st.block_and_instances("nope")
    assert block is None and len(insts) == 0


async def test_set_status_then_ready_takes_the_step_only_when_enough_run_of_the_expected_instances() -> None:
    st = store()
    a = {"node": "n1", "gpus": [], "cluster": "c1", "status": "starting", "action": "allocation"}
    await st.create_block("b1", 7, "d", {"status": "placing", "ir": {"blockId": "b1"}})
    await st.put_instances("b1", {"b1-0": a, "b1-1": {**a, "node": "n2"}})
    # the instance absent: nothing written, not tried
    assert await st.set_status_then_ready("b1", "b1-9", "running", None, 1, ["b1-0", "b1-1"], 7, Step.READY) == (None, {}, None)
    # one of two running, two wanted: the status set, the step not tried
    rec, insts, cas = await st.set_status_then_ready("b1", "b1-0", "running", "http://x:1", 2, ["b1-0", "b1-1"], 7, Step.READY)
    assert rec == {**a, "status": "running", "endpoint": "http://x:1"} and cas is None
    assert dict(insts) == {"b1-0": rec, "b1-1": {**a, "node": "n2"}}
    assert (await st.get_block("b1"))["status"] == "placing"  # type: ignore[index]
    # both running, but the caller expected other instances: not tried
    rec, insts, cas = await st.set_status_then_ready("b1", "b1-1", "running", None, 2, ["b1-1"], 7, Step.READY)
    assert rec == {**a, "node": "n2", "status": "running"} and cas is None and len(insts) == 2
    assert (await st.get_block("b1"))["status"] == "placing"  # type: ignore[index]
    # as expected: the step taken, as Store.transition takes it (a stale gen refused)
    assert (await st.set_status_then_ready("b1", "b1-1", "running", None, 2, ["b1-0", "b1-1"], 6, Step.READY))[2] \
        == (False, "stale-gen:7")
    rec, insts, cas = await st.set_status_then_ready("b1", "b1-1", "running", None, 2, ["b1-1", "b1-0"], 7, Step.READY)
    assert cas == (True, "2") and len(insts) == 2
    block = await st.get_block("b1")
    assert block is not None and block["status"] == "ready" and block["version"] == 2
    # again (a redelivery): the step refused, the block already holds its target
    assert (await st.set_status_then_ready("b1", "b1-1", "running", None, 2, ["b1-0", "b1-1"], 7, Step.READY))[2] \
        == (False, "ready")


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


async def test_a_decided_gather_is_claimed_once_and_its_timer_dropped_once_stored() -> None:
    st = store()
    await st.create_block("b1", 5, "d", {"status": "selecting", "ir": {}, "attempt": "0"})
    await st.gather_open("b1", 5, 0, ["c1", "c2"], deadline=100.0)
    # an answer sees its round's state as of its write: no second read for a late answer
    assert await st.gather_add_state("b1", 5, 0, "c1", {"score": 1.0}) == (1, 2, None, 100.0)
    won, block, g = await st.gather_decide_read("b1", 5, 0, "complete")
    assert won and block is not None and block["status"] == "selecting"
    assert g["expected"] == ["c1", "c2"] and g["results"] == {"c1": {"score": 1.0}} and g["decided"] == "complete"
    # another decider (the deadline timer) loses; the same token (a redelivery) decides again
    assert (await st.gather_decide_read("b1", 5, 0, "deadline"))[0] is False
    assert (await st.gather_decide_read("b1", 5, 0, "complete"))[0] is True
    assert await st.gather_add_state("b1", 5, 0, "c2", {"score": 0.5}) == (2, 2, "complete", 100.0)
    assert await st.transition("b1", 5, Step.CHOOSE, cluster="c1") == (True, "2")
    assert (await st.get_block("b1"))["status"] == "allocating"  # type: ignore[index]
    # the round's outcome is recorded once: a later decider (another copy, a redelivery) gets it
    assert await st.gather_settle("b1", 5, 0, "c1") == "c1"
    assert await st.gather_settle("b1", 5, 0, "!no cluster") == "c1"
    await st.gather_finish("b1", 5, 0)  # once the decision is stored
    assert await st.gather_claim_due(1000.0) == ([], None)  # no timer left to fire
    assert not await st.r.exists(gather_key("b1", 5, 0))
    # the CAS: a block that moved on is left alone
    await st.transition("b1", 5, Step.RESERVE)
    assert await st.transition("b1", 5, Step.CHOOSE, cluster="c1") == (False, "placing")


async def test_a_reservation_of_our_own_updates_our_view_without_a_read_unless_it_changed_meanwhile() -> None:
    from aios_blocks.policies import capacity
    from aios_blocks.schemas.spec import Gpu, Node
    from aios_blocks.state.inventory import Inventory

    st = store()
    for nid in ("n1", "n2"):
        await st.put_node(Node(id=nid, cluster="c1", cpu=8, memory=4096, gpus=[Gpu(id=f"{nid}-g0", memory=1000)]))
    inv = Inventory(st)
    nodes = await inv.nodes("c1")
    before = {nid: nodes[nid] for nid in ("n1", "n2")}
    needs = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 100}
    taken = {nid: capacity.copy_node(v) for nid, v in before.items()}
    for v in taken.values():
        capacity.take(v, [v["gpus"][0]["id"]], needs, False)
    inv.invalidate("c1", ["n2"])  # another process's change to n2 was hinted meanwhile
    inv.apply("c1", taken, before)
    reads: list[object] = []
    real = st.read_nodes

    async def counting(cid: str, nids: object) -> dict:  # type: ignore[type-arg]
        reads.append(sorted(nids))  # type: ignore[call-overload]
        return await real(cid, nids)  # type: ignore[arg-type]

    st.read_nodes = counting  # type: ignore[method-assign]
    after = await inv.nodes("c1")
    assert after["n1"] is taken["n1"] and after["n1"]["cpu_free"] == 7 and after["n1"]["gpus"][0]["instances"] == 1
    assert reads == [["n2"]]  # only the node someone else changed is read again
    assert after["n2"]["gpus"][0]["instances"] == 0  # as Redis has it (nothing was reserved there)
    assert before["n1"]["gpus"][0]["instances"] == 0  # the view planned on is not changed in place


async def test_a_step_can_require_the_selection_round() -> None:
    st = store()
    await st.create_block("b1", 2, "d", {"status": "parsed", "ir": {}})
    assert await st.transition("b1", 2, Step.SELECT, in_round=1) == (False, "superseded:0")
    assert (await st.transition("b1", 2, Step.SELECT, in_round=0))[0]
    await st.r.hset(block_key("b1"), "attempt", "1")
    assert await st.transition("b1", 2, Step.SELECT, in_round=0) == (False, "superseded:1")
    assert (await st.transition("b1", 2, Step.SELECT, in_round=1))[0]
    assert (await st.transition("b1", 2, Step.SELECT))[0]  # no round asked: any


async def test_create_block_lists_a_block_once_and_a_reused_id_on_top() -> None:
    st = store()
    assert await st.create_block("b1", 1, "d", {"status": "deleted"}) == (True, "created")
    assert await st.create_block("b2", 2, "d", {"status": "parsed"}) == (True, "created")
    assert await st.list_blocks() == ["b2", "b1"]
    assert await st.create_block("b1", 1, "d", {"status": "deleted"}) == (True, "same")
    assert await st.create_block("b2", 5, "d", {"status": "parsed"}) == (False, "block id already in use (status parsed)")
    assert await st.list_blocks() == ["b2", "b1"]
    assert await st.create_block("b1", 9, "d", {"status": "parsed"}) == (True, "created")  # deleted: reusable
    assert await st.list_blocks() == ["b1", "b2"]


def test_figures_derived_from_a_node_view_are_kept_per_view_and_dropped_when_it_is_taken_from() -> None:
    from aios_blocks.policies import capacity

    node = {"healthy": True, "cpu_free": 4.0, "memory_free": 1000,
            "gpus": [{"id": "g0", "memory": 100, "memory_free": 100, "memory_used": 0, "instances": 0, "exclusive": False}]}
    needs = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 10}
    first = capacity.node_fits_cached(node, needs, False)
    assert first == capacity.node_fits(node, needs, False) and capacity.node_fits_cached(node, needs, False) is first
    calls: list[int] = []
    assert capacity.derived(node, "x", lambda n: calls.append(1) or 7) == 7
    assert capacity.derived(node, "x", lambda n: calls.append(1) or 8) == 7 and calls == [1]
    capacity.take(node, ["g0"], needs, False)  # changed in place: nothing derived before holds
    assert capacity.node_fits_cached(node, needs, False) is None
    assert capacity.derived(node, "x", lambda n: 9) == 9
    other = capacity.copy_node(node)  # another view: its own figures
    assert capacity.derived(other, "x", lambda n: 10) == 10

