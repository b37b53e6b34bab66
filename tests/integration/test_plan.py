"""`blocks submit --dry-run` (the plan) and `--if-index` (the state index), on real servers."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from aios_blocks.bus import subjects
from aios_blocks.recovery.rebuild import read_image, recover
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.state.store import Store, index_key

from .conftest import System
from .test_cli import blocks


def _p(iid: str, gpu: str = "g0") -> dict[str, Any]:
    return {"iid": iid, "block": "b", "node": "n", "gpus": [gpu], "cpu": 1, "mem": 0, "gpu_mem": 0,
            "exclusive": True, "share": False}


async def test_state_index_moves_with_every_change_placement_depends_on(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    st = Store.open(servers.redis_url)
    try:
        assert await st.state_index() == 0
        await st.put_cluster(Cluster(id="c", labels={"region": "eu"}))
        await st.put_cluster(Cluster(id="d"))
        assert await st.state_indexes() == {"c": 1, "d": 1}
        assert not await st.ensure_cluster(Cluster(id="c"))  # already there: nothing changed
        assert await st.state_index() == 2
        await st.put_node(Node(id="n", cluster="c", cpu=2, gpus=[Gpu(id="g0", memory=10), Gpu(id="g1", memory=10)]))
        assert await st.state_indexes() == {"c": 2, "d": 1}

        assert (await st.reserve_gang("c", [_p("i1")]))[0]  # taken: +1
        assert await st.state_indexes() == {"c": 3, "d": 1}
        assert (await st.reserve_gang("c", [_p("i1")]))[1] == "exists"  # a redelivery takes nothing
        assert not (await st.reserve_gang("c", [_p("i2")]))[0]  # refused: g0 is held
        assert await st.state_indexes() == {"c": 3, "d": 1}

        assert await st.release("c", "n", "i1")
        assert not await st.release("c", "n", "i1")  # nothing left to release
        assert await st.state_indexes() == {"c": 4, "d": 1}

        assert await st.set_node_health_cas("c", "n", False)
        assert not await st.set_node_health_cas("c", "n", False)  # no flip, no bump
        assert await st.state_indexes() == {"c": 5, "d": 1}
        await st.set_node_health("c", "n", True)
        assert await st.state_index() == 7  # the sum: a change in any cluster moves it

        # the keys carry the cluster's hash tag (same Redis Cluster slot as its nodes)
        assert index_key("c") == "aios:meta:{c:c}:index"
        # a recover restarts every index above what it was and above the stream's last sequence
        before = await st.scan_indexes()
        assert before == {"c": 6, "d": 1}
        await st.restart_indexes(["c", "d"], before, floor=3)
        assert await st.state_indexes() == {"c": 7, "d": 4}
    finally:
        await st.close()
        servers.stop()


# -- blocks submit --dry-run / --if-index, through the real CLI against the real workers ----------
async def _settled(system: System) -> tuple[int, str]:
    """(stream last sequence, digest of every aios:* key's serialized value), once two readings
    in a row agree (the workers finished what they were doing)."""
    last: tuple[int, str] | None = None
    for _ in range(50):
        now = (await _last_seq(system), await _digest(system))
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.2)
    raise AssertionError("the state never settled")


async def _last_seq(system: System) -> int:
    return int((await system.client.bus.js.stream_info(subjects.STREAM)).state.last_seq)


async def _digest(system: System) -> str:
    """Every aios:* key (volatile ones too: policy contexts, gathers, epoch, state indexes) and its
    value, canonically (a DUMP is not: a big hash's field order changes when Redis rehashes it)."""
    img = await read_image(system.client.store.r, kinds=("rebuilt", "volatile", "unknown"))
    canon = json.dumps(img, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else v)
    return hashlib.sha256(canon.encode()).hexdigest()


def _spec_file(tmp_path: Path, bid: str, text: str) -> str:
    f = tmp_path / f"{bid}.yaml"
    f.write_text(f"blockComponentURI: aios://test/model\nblockId: {bid}\n{text}")
    return str(f)


async def test_dry_run_plans_what_submit_gets_changes_nothing_and_if_index_guards_it(system: System, tmp_path: Path) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=2)
    await c.add_sim_cluster("c2", nodes=1, gpus=5, labels={"region": "us"})
    await c.add_sim_cluster("c3", nodes=1, gpus=0)  # no GPUs: filtered
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "pre",
                                               "minInstances": 4, "maxInstances": 4})
    assert kind == "ready"  # c2 (most free GPUs) now holds 4 of its 5: the plan must see that
    spec = _spec_file(tmp_path, "plan-a", "minInstances: 2\nmaxInstances: 2\n")
    before = await _settled(system)

    r = blocks(system, "submit", spec, "--dry-run", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert plan["places"] and plan["index"] == await c.state_index() > 0
    assert plan["cluster_id"] == "c1" and plan["stage"] == "" and plan["failure"] == "", plan
    assert plan["filtered"] == {"c3": "no healthy node with capacity for one instance (1 nodes)"}
    assert plan["dry_runs"]["c1"]["score"] == 1.0 and plan["dry_runs"]["c2"]["score"] == 0.5  # c2 fits 1 of 2
    assert [p["iid"] for p in plan["placements"]] == ["plan-a-0", "plan-a-1"]
    assert [a["action"] for a in plan["calls"]] == ["selection", "dry_run", "dry_run", "post_dry_run", "allocation", "allocation"]
    from aios_blocks.handlers.plan import PlanCall

    assert all(set(a) == set(PlanCall.__annotations__) for a in plan["calls"])  # each call has PlanCall's fields
    r = blocks(system, "submit", spec, "--dry-run")  # the table for people
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"at state index {plan['index']}" in r.stdout and "would place 2 instance(s) on c1" in r.stdout
    assert f"--if-index {plan['index']}" in r.stdout and "no healthy node with capacity" in r.stdout
    for p in plan["placements"]:
        assert p["iid"] in r.stdout and all(g in r.stdout for g in p["gpus"])
    # nothing was published, reserved, recorded or cached: not a message, not a byte of Redis
    assert await _settled(system) == before
    assert await c.store.get_block("plan-a") is None

    # with the index still current, the submit goes through and gets exactly the plan
    r = blocks(system, "submit", spec, "--if-index", str(plan["index"]), "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    block = await c.store.get_block("plan-a")
    assert block is not None and block["cluster"] == plan["cluster_id"]
    got = {iid: (i["node"], sorted(i["gpus"])) for iid, i in (await c.store.instances("plan-a")).items()}
    assert got == {p["iid"]: (p["node"], sorted(p["gpus"])) for p in plan["placements"]}

    # that placement moved the index: a submit planned at the old one is refused, and sends nothing
    now = await c.state_index()
    assert now > plan["index"]
    seq = await _last_seq(system)
    other = _spec_file(tmp_path, "plan-b", "minInstances: 1\nmaxInstances: 1\n")
    r = blocks(system, "submit", other, "--if-index", str(plan["index"]), "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"state changed since index {plan['index']} (now {now}): run --dry-run again" in r.stderr
    assert await _last_seq(system) == seq and await c.store.get_block("plan-b") is None

    # the index never goes back, not even when Redis is rebuilt from the stream
    await recover(c.bus, c.store, force=True)
    assert await c.state_index() > now


#: a resourceAllocator that counts its calls in its context (binpack otherwise)
NOTING = (
    "from aios_blocks.policies.builtin.resource import BinPackPolicy\n"
    "class Noting(BinPackPolicy):\n"
    "    def eval(self, parameters, input_data, context):\n"
    "        context[input_data['action']] = context.get(input_data['action'], 0) + 1\n"
    "        return super().eval(parameters, input_data, context)\n"
)


async def test_dry_run_that_cannot_place_exits_4_with_why_and_a_bad_spec_2(system: System, tmp_path: Path) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=2)
    assert await c.policy_put("noting", NOTING, "python") == 1
    before = await _settled(system)
    r = blocks(system, "submit", _spec_file(tmp_path, "huge", "minInstances: 1\nmaxInstances: 1\nresources: {gpus: 8}\n"), "--dry-run")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "would not place (selection): no cluster passed the filter rule (c1: no healthy node with capacity" in r.stderr
    assert "filtered" in r.stdout

    r = blocks(system, "submit", _spec_file(tmp_path, "wide", "minInstances: 5\nmaxInstances: 5\n"), "--dry-run", "--json")
    assert r.returncode == 4, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert not plan["places"] and plan["stage"] == "post_dry_run"
    assert plan["failure"] == "no cluster can hold minInstances (5) at once: c1 fits 4"
    assert plan["dry_runs"]["c1"]["placeable"] == 4

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "bad", "minInstances": 3,
                               "maxInstances": 1, "colour": "blue"}))
    r = blocks(system, "submit", str(bad), "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "$.minInstances: minInstances (3) is greater than maxInstances (1)" in r.stderr
    assert "$.colour: unknown field" in r.stderr

    r = blocks(system, "submit", str(bad), "--dry-run", "--wait")
    assert r.returncode == 2 and "--dry-run" in r.stderr

    # a policy that writes its context runs in the plan (pinned at the registry's version), and
    # what it wrote is dropped
    noting = _spec_file(tmp_path, "ctx-a", "minInstances: 2\nmaxInstances: 2\n"
                        "policyRulesSpec:\n  - {name: resourceAllocator, policyRuleURI: registry:noting}\n")
    r = blocks(system, "submit", noting, "--dry-run", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert [(x["action"], x["version"]) for x in plan["calls"] if x["uri"] == "registry:noting"] == [
        ("dry_run", 1), ("allocation", 1), ("allocation", 1)
    ]
    assert await _settled(system) == before
    # the same policy, placed for real, keeps what it wrote: the dry-run above really dropped it
    # (no dry_run count: the real first round, one candidate, asks none, workers/gateway.skip_reason)
    assert blocks(system, "submit", noting, "--wait").returncode == 0
    assert await c.store.context_load("ctx-a.resourceAllocator") == {"allocation": 2}
    got = {iid: (i["node"], i["gpus"]) for iid, i in (await c.store.instances("ctx-a")).items()}
    assert got == {p["iid"]: (p["node"], p["gpus"]) for p in plan["placements"]}
