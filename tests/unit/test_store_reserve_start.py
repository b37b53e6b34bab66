"""``Store.reserve_then_start`` (the gang's reservation and its records in one script, one Redis
server): what it leaves is what ``reserve_gang`` then ``start_instances`` then the nomination's drop
left, and a refused reservation leaves everything as it was."""

from __future__ import annotations

from typing import Any

import fakeredis

from aios_blocks.schemas.lifecycle import Step
from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.state.queue import NOMINATED
from aios_blocks.state.store import Store

REC = {"node": "n1", "gpus": ["g1"], "cluster": "c1", "status": "starting", "action": "allocation", "since": 1.0}


def _placement(iid: str, node: str, gpu: str) -> dict[str, Any]:
    return {"iid": iid, "block": "b1", "node": node, "cpu": 1.0, "mem": 512, "gpus": [gpu], "gpu_mem": 1024,
            "exclusive": False, "quota": {"gpus": 1}}


async def _store() -> Store:
    st = Store(fakeredis.aioredis.FakeRedis(decode_responses=True))
    await st.put_cluster(Cluster(id="c1"))
    for i in (1, 2):
        await st.put_node(Node(id=f"n{i}", cluster="c1", cpu=8, memory=8192, gpus=[Gpu(id=f"g{i}", memory=16384)]))
    await st.create_block("b1", 7, "d", {"status": "allocating", "ir": {"blockId": "b1"}})
    await st.r.hset(NOMINATED, "b1", "{}")
    return st


async def _state(st: Store) -> dict[str, Any]:
    """Every key's content, the timestamps of the step left out."""
    out: dict[str, Any] = {}
    for key in sorted(await st.r.keys("*")):
        kind = await st.r.type(key)
        out[key] = await st.r.hgetall(key) if kind == "hash" else await st.r.get(key) if kind == "string" else kind
    out["aios:block:b1"].pop("updated", None)
    return out


PLACEMENTS = [_placement("b1-0", "n1", "g1"), _placement("b1-1", "n2", "g2")]
RECORDS = {"b1-0": REC, "b1-1": {**REC, "node": "n2", "gpus": ["g2"]}}
INDEX = [("svc", "l0", "b1-0", "n1", "r1"), ("svc", "l1", "b1-1", "n2", "")]
STEP = (7, Step.RESERVE, {"cluster": "c1"})


async def test_the_one_script_leaves_what_the_two_calls_left() -> None:
    one, two = await _store(), await _store()
    assert await one.reserve_then_start("c1", PLACEMENTS, "b1", RECORDS, INDEX, STEP, True) == (True, "ok", "", True)
    assert await two.reserve_gang("c1", PLACEMENTS) == (True, "ok", "")
    assert await two.start_instances("b1", RECORDS, INDEX, STEP) == []
    assert await two.r.hdel(NOMINATED, "b1") == 1
    after = await _state(one)
    assert after == await _state(two)
    assert after["aios:block:b1"]["status"] == "placing" and after["aios:block:b1"]["cluster"] == "c1"
    assert set(await one.instances("b1")) == {"b1-0", "b1-1"}
    # again (a redelivery whose reservations exist): reserved before, records kept, no second step
    await one.set_instance_status("b1", "b1-0", "running")
    await two.set_instance_status("b1", "b1-0", "running")
    assert await one.reserve_then_start("c1", PLACEMENTS, "b1", RECORDS, INDEX, STEP, True) == (True, "exists", "", False)
    assert await two.reserve_gang("c1", PLACEMENTS) == (True, "exists", "")
    await two.start_instances("b1", RECORDS, INDEX, STEP)
    assert await _state(one) == await _state(two)
    assert (await one.instances("b1"))["b1-0"]["status"] == "running"


async def test_a_refused_reservation_writes_nothing() -> None:
    st = await _store()
    before = await _state(st)
    await st.r.hset("aios:{c:c1}:node:n2", "healthy", 0)
    before["aios:{c:c1}:node:n2"]["healthy"] = "0"
    assert await st.reserve_then_start("c1", PLACEMENTS, "b1", RECORDS, INDEX, STEP, True) == \
        (False, "node n2 is not healthy", "n2", False)
    assert await _state(st) == before  # no reservation, no step, no record, no index, the nomination kept


async def test_without_a_step_or_a_nomination() -> None:
    one, two = await _store(), await _store()
    assert await one.reserve_then_start("c1", PLACEMENTS[:1], "b1", {"b1-0": REC}, INDEX[:1], None, False) == (True, "ok", "", False)
    await two.reserve_gang("c1", PLACEMENTS[:1])
    await two.start_instances("b1", {"b1-0": REC}, INDEX[:1], None)
    assert await _state(one) == await _state(two)
    assert (await one.get_block("b1"))["status"] == "allocating"
