"""Virtual clusters (seed 003): the pure decisions (handlers.vcluster), the placement scope kept
incrementally, and a 1,000-operation random sequence through the real routers and Lua scripts
in memory (MemorySystem: fakeredis + an in-memory bus) keeping every node in exactly one place."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import vcluster as h
from aios_blocks.policies.capacity import Nodes
from aios_blocks.schemas.events import InventoryHint
from aios_blocks.schemas.vcluster import (
    VClusterCreate,
    VClusterKind,
    VClusterRecord,
    VClusterRemove,
    VClusterUpdate,
    job_cluster_id,
    node_type,
)
from aios_blocks.settings import Settings
from aios_blocks.state.vcluster import VClusterStore
from aios_blocks.testing import MemorySystem
from aios_blocks.workers import vcluster as vw


def view(nid: str, t: str = "A100", vc: str = "", healthy: bool = True, busy: bool = False) -> dict[str, Any]:
    v: dict[str, Any] = {
        "node_id": nid, "cluster": "c1", "labels": {"nodeType": t}, "healthy": healthy, "cpu": 8.0,
        "cpu_free": 7.0 if busy else 8.0, "memory": 100, "memory_free": 100,
        "gpus": [{"id": f"{nid}-g0", "model": "m", "memory": 10, "memory_used": 0, "memory_free": 10, "instances": 0,
                  "exclusive": False}],
    }
    if vc:
        v["virtualCluster"] = vc
    return v


def cluster(n_a: int, n_h: int = 0) -> dict[str, dict[str, Any]]:
    out = {f"a{i}": view(f"a{i}") for i in range(n_a)}
    out.update({f"h{i}": view(f"h{i}", "H100") for i in range(n_h)})
    return out


def apply_plan(nodes: dict[str, dict[str, Any]], records: dict[str, VClusterRecord], plan: h.Plan) -> None:
    """What VC_COMMIT does, on the views (for chaining pure decisions)."""
    for m in plan.moves:
        assert h.place(nodes[m.node]) == m.src, m
        v = dict(nodes[m.node])
        v.pop("virtualCluster", None)
        if m.dst:
            v["virtualCluster"] = m.dst
        nodes[m.node] = v
    for w in plan.writes:
        if w.record is None:
            records.pop(w.vid, None)
        else:
            records[w.vid] = w.record


def test_node_type_is_the_label_else_the_gpu_model_else_cpu() -> None:
    assert node_type({"labels": {"nodeType": "A100"}, "gpus": [{"model": "x"}]}) == "A100"
    assert node_type({"labels": {}, "gpus": [{"model": "H100-80G"}]}) == "H100-80G"
    assert node_type({"labels": {}, "gpus": []}) == "cpu"
    assert job_cluster_id("b1") == "job-b1" and len(job_cluster_id("x" * 128)) <= 128


def test_create_takes_idle_healthy_unassigned_nodes_and_refuses_whole() -> None:
    nodes = cluster(3, 1)
    nodes["a0"] = view("a0", busy=True)
    nodes["a1"] = view("a1", healthy=False)
    clusters = {"c1": {}}
    r = h.plan_create(VClusterCreate("v", "c1", {"A100": 2}, "r"), 1, clusters, nodes, {}, None)
    assert isinstance(r, h.Refusal) and "A100: 2 wanted, 1 available" in r.reason
    r = h.plan_create(VClusterCreate("v", "c1", {"A100": 1, "H100": 1}, "r"), 1, clusters, nodes, {}, None)
    assert isinstance(r, h.Plan) and [(m.node, m.src, m.dst) for m in r.moves] == [("a2", "", "v"), ("h0", "", "v")]
    assert r.writes[0].expect == -1 and r.events[0].record.nodes == {"a2": "A100", "h0": "H100"}
    bad = h.plan_create(VClusterCreate("bad id", "c9", {"X": -1, "": 1}, "r"), 1, clusters, nodes, {}, None)
    assert isinstance(bad, h.Refusal)
    for part in ("'bad id' is not a valid id", "no cluster 'c9'", "count of 'X' must be >= 0", "'' is not a non-empty"):
        assert part in bad.reason


def test_update_revision_kind_scale_up_and_down() -> None:
    nodes = cluster(5)
    records: dict[str, VClusterRecord] = {}
    plan = h.plan_create(VClusterCreate("v", "c1", {"A100": 2}, "r1"), 1, {"c1": {}}, nodes, records, None)
    assert isinstance(plan, h.Plan)
    apply_plan(nodes, records, plan)
    stale = h.plan_update(VClusterUpdate("v", 3, {"A100": 1}, "r2"), nodes, records)
    assert isinstance(stale, h.Refusal) and stale.revision == 1 and "stale revision 3" in stale.reason
    kind = h.plan_update(VClusterUpdate("v", 1, {"A100": 1}, "r2", divisible=True), nodes, records)
    assert isinstance(kind, h.Refusal) and "cannot change between divisible and indivisible" in kind.reason
    up = h.plan_update(VClusterUpdate("v", 1, {"A100": 4}, "r2"), nodes, records)
    assert isinstance(up, h.Plan) and sorted(m.node for m in up.moves) == ["a2", "a3"]
    apply_plan(nodes, records, up)
    assert records["v"].revision == 2 and len(records["v"].nodes) == 4
    nodes["a0"] = view("a0", vc="v", busy=True)
    down = h.plan_update(VClusterUpdate("v", 2, {"A100": 0}, "r3"), nodes, records)
    assert isinstance(down, h.Refusal) and "4 to give back, 3 idle (1 busy" in down.reason
    down = h.plan_update(VClusterUpdate("v", 2, {"A100": 1}, "r3"), nodes, records)
    assert isinstance(down, h.Plan) and all(m.dst == "" and m.node != "a0" for m in down.moves)
    apply_plan(nodes, records, down)
    assert list(records["v"].nodes) == ["a0"]
    busy = h.plan_remove(VClusterRemove("v", "r4"), nodes, records)
    assert isinstance(busy, h.Refusal) and "still runs instances on a0" in busy.reason


def test_job_clusters_carve_undivided_nodes_and_block_removal_of_their_parent() -> None:
    nodes = cluster(4)
    records: dict[str, VClusterRecord] = {}
    plan = h.plan_create(VClusterCreate("D", "c1", {"A100": 3}, "r1", divisible=True), 1, {"c1": {}}, nodes, records, None)
    assert isinstance(plan, h.Plan)
    apply_plan(nodes, records, plan)
    ind = h.plan_job_create("b", 9, "v-none", {"A100": 1}, "c1", nodes, records)
    assert isinstance(ind, h.Refusal) and "no virtual cluster 'v-none'" in ind.reason
    job = h.plan_job_create("b", 9, "D", {"A100": 2}, "c1", nodes, records)
    assert isinstance(job, h.Plan) and {(m.src, m.dst) for m in job.moves} == {("D", "job-b")}
    apply_plan(nodes, records, job)
    assert records["job-b"].parent == "D" and records["job-b"].gen == 9
    assert set(records["job-b"].nodes) <= set(records["D"].nodes)  # V_divisible = V_undivided + sum V_job
    more = h.plan_job_create("b2", 10, "D", {"A100": 2}, "c1", nodes, records)
    assert isinstance(more, h.Refusal) and "A100: 2 wanted, 1 available" in more.reason
    assert "still holds job clusters: job-b" in h.plan_remove(VClusterRemove("D", "x"), nodes, records).reason  # type: ignore[union-attr]
    assert "updated" in h.plan_update(VClusterUpdate("job-b", 1, {"A100": 1}, "x"), nodes, records).reason  # type: ignore[union-attr]
    gone = h.plan_job_remove(records["job-b"], nodes, "deleted")
    assert isinstance(gone, h.Plan) and {(m.src, m.dst) for m in gone.moves} == {("job-b", "D")}
    apply_plan(nodes, records, gone)
    assert "job-b" not in records and sum(1 for v in nodes.values() if h.place(v) == "D") == 3


def test_replenish_follows_the_seeds_four_cases() -> None:
    nodes = cluster(8)
    records: dict[str, VClusterRecord] = {}
    for req in (VClusterCreate("I", "c1", {"A100": 1}, "r"), VClusterCreate("D", "c1", {"A100": 3}, "r", True)):
        p = h.plan_create(req, 1, {"c1": {}}, nodes, records, None)
        assert isinstance(p, h.Plan)
        apply_plan(nodes, records, p)
    job = h.plan_job_create("b", 5, "D", {"A100": 1}, "c1", nodes, records)
    assert isinstance(job, h.Plan)
    apply_plan(nodes, records, job)
    # primary: a dead unassigned node is nobody's business
    nodes["a7"] = view("a7", healthy=False)
    assert all(h.plan_replenish(r, nodes, records) is None for r in records.values())
    # indivisible: replaced from the primary, published
    nodes["a0"] = view("a0", vc="I", healthy=False)
    p = h.plan_replenish(records["I"], nodes, records)
    assert p is not None and p.events[0].published and [(m.node, m.dst) for m in p.moves] == [("a0", ""), ("a4", "I")]
    apply_plan(nodes, records, p)
    # divisible: replaced from the primary, stored only
    (undiv,) = [n for n, v in nodes.items() if h.place(v) == "D"][:1]
    nodes[undiv] = view(undiv, vc="D", healthy=False)
    p = h.plan_replenish(records["D"], nodes, records)
    assert p is not None and p.events[0].published is False and len(p.writes) == 1
    apply_plan(nodes, records, p)
    # job: from the primary first; both the job cluster and its divisible cluster are stored
    (jn,) = records["job-b"].nodes
    nodes[jn] = view(jn, vc="job-b", healthy=False)
    p = h.plan_replenish(records["job-b"], nodes, records)
    assert p is not None and {w.vid for w in p.writes} == {"job-b", "D"}
    assert [e.published for e in p.events] == [True, False]
    new = next(m.node for m in p.moves if m.dst == "job-b")
    assert next(m.src for m in p.moves if m.dst == "job-b") == ""
    apply_plan(nodes, records, p)
    assert new in records["D"].nodes and jn not in records["D"].nodes
    # ... then from the divisible cluster's undivided nodes when the primary has none
    for nid, v in list(nodes.items()):
        if not h.place(v) and v["healthy"]:
            nodes[nid] = view(nid, healthy=False)
    nodes[new] = view(new, vc="job-b", healthy=False)
    p = h.plan_replenish(records["job-b"], nodes, records)
    assert p is not None and next(m.src for m in p.moves if m.dst == "job-b") == "D"


def test_scope_is_kept_incrementally_and_is_the_cluster_itself_without_virtual_clusters() -> None:
    nodes = Nodes(cluster(50))
    assert h.scope({"blockId": "b"}, nodes) is nodes  # no virtual cluster: the very dict, memos and all
    rng = random.Random(3)
    places = ["", "A", "B", "job-b"]
    for step in range(400):
        nid = f"a{rng.randrange(60)}"
        if rng.random() < 0.1:
            nodes.pop(nid, None)
        else:
            nodes[nid] = view(nid, vc=rng.choice(places), healthy=rng.random() < 0.9)
        for ir in ({"blockId": "x"}, {"blockId": "x", "virtualClusterId": "A"},
                   {"blockId": "b", "virtualClusterId": "B", "jobCluster": {"replicaSets": {"A100": 1}}}):
            got = h.scope(ir, nodes)
            where = h.place_of(ir, nodes)
            want = {n: v for n, v in nodes.items() if h.place(v) == where}
            assert dict(got) == want, (step, ir)
            assert all(got[n] is nodes[n] for n in got)  # the same views, never copies
    plain = {n: dict(v) for n, v in nodes.items()}  # a plain dict is rescanned
    assert dict(h.part(plain, "A")) == {n: v for n, v in plain.items() if h.place(v) == "A"}


# -- 1,000 random operations through the real wiring, in memory -------------------------------------
async def _check_partition(s: MemorySystem, cid: str, instances: bool = True) -> None:
    views = await s.store.read_nodes(cid, await s.store.node_ids(cid))
    recs = await VClusterStore(s.store).records(cid)
    owners: dict[str, str] = {}
    for nid, v in views.items():
        p = h.place(v)
        assert not p or nid in recs[p].nodes, (nid, p)
    for r in recs.values():
        if r.kind == VClusterKind.JOB:
            assert set(r.nodes) <= set(recs[r.parent].nodes)
            continue
        for nid in r.nodes:
            assert nid not in owners, (nid, owners.get(nid), r.id)
            owners[nid] = r.id
            assert h.place(views[nid]) in {r.id, *(j.id for j in recs.values() if j.parent == r.id)}
    # every instance is inside its block's place
    for bid in await s.store.list_blocks() if instances else []:
        block = await s.store.get_block(bid)
        assert block is not None
        ir = block["ir"] if isinstance(block.get("ir"), dict) else {}
        want = ir.get("virtualClusterId") or ""
        if want and ir.get("jobCluster"):
            want = job_cluster_id(bid)
        for iid, inst in (await s.store.instances(bid)).items():
            if views[inst["node"]]["healthy"]:
                assert h.place(views[inst["node"]]) == want, (bid, iid, inst["node"], want)


@pytest.mark.parametrize("seed", [1])
async def test_a_thousand_random_operations_keep_every_node_in_exactly_one_place(seed: int) -> None:
    rng = random.Random(seed)
    settings = Settings(sim_start_delay_s=0.0, dry_run_deadline_s=0.0, dry_run_patience_s=0.0, selection_rounds=1)
    async with MemorySystem.open(settings) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=8, gpus=2, node_labels={"nodeType": "A100"})
        for n in range(8, 12):  # four H100 nodes
            from aios_blocks.schemas.spec import Gpu, Node

            await s.store.put_node(Node(id=f"c1-n{n}", cluster="c1", labels={"nodeType": "H100"},
                                        gpus=[Gpu(id=f"c1-n{n}-g{g}") for g in range(2)]))
        await s.bus.emit(E.inventory_hint, InventoryHint("c1"))
        vs = VClusterStore(s.store)
        ids = ["A", "B", "D"]
        live: set[str] = set()
        wanted: dict[str, str] = {}
        counts = {"create": 0, "update": 0, "remove": 0, "place": 0, "delete": 0, "health": 0, "applied": 0, "refused": 0}
        for op_n in range(1000):
            op = rng.choices(["create", "update", "remove", "place", "delete", "health"], [3, 5, 2, 4, 4, 1])[0]
            counts[op] += 1
            rid = f"r{op_n}"
            vid = rng.choice(ids)
            rs = {"A100": rng.randint(0, 3), "H100": rng.randint(0, 2)}
            if op == "create":
                await s.bus.emit(E.vcluster_create, VClusterCreate(vid, "c1", rs, rid, divisible=vid == "D"))
            elif op == "update":
                rec = await vs.get(vid)
                rev = rec.revision if rec and rng.random() < 0.8 else rng.randint(1, 5)
                await s.bus.emit(E.vcluster_update, VClusterUpdate(vid, rev, rs, rid))
            elif op == "remove":
                await s.bus.emit(E.vcluster_remove, VClusterRemove(vid, rid))
            elif op == "place":
                spec: dict[str, Any] = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                                        "blockId": f"b{op_n}"}
                where = rng.choice(["", "A", "B", "D"])
                if where:
                    spec["virtualClusterId"] = where
                if where == "D":
                    spec["jobCluster"] = {"replicaSets": {"A100": 1}}
                bid = await s.submit(spec)
                live.add(bid)
                wanted[bid] = where
            elif op == "delete" and live:
                bid = rng.choice(sorted(live))
                live.discard(bid)
                await s.delete(bid)
            elif op == "health":
                nid = f"c1-n{rng.randrange(12)}"
                healthy = rng.random() < 0.5
                await s.store.set_node_health_cas("c1", nid, healthy)
                await s.bus.emit(E.inventory_hint, InventoryHint("c1", [nid]))
                await vw.sweep(s.worker)
            await s.run(wait_deferred=0.0)
            if op_n % 25 == 0:
                await vw.sweep(s.worker)  # the periodic sweep: replenishment, job clusters left behind
                await s.run(wait_deferred=0.0)
            await _check_partition(s, "c1", instances=op_n % 20 == 0)
        await _check_partition(s, "c1")
        counts["applied"] = len(s.bus.events(E.vcluster_changed))
        counts["refused"] = len(s.bus.events(E.vcluster_refused))
        # the sequence exercised every path: changes applied and refused, blocks placed in each place
        assert counts["applied"] > 50 and counts["refused"] > 100, counts
        placed = {wanted[p["block_id"]] for p in s.bus.events(E.block_placement)}
        assert placed == {"", "A", "B", "D"}, placed
        ops = {e["op"] for e in s.bus.events(E.vcluster_changed)}
        assert {"create", "update", "remove", "job_create", "job_remove", "replenish"} <= ops, ops
        assert s.dead == []


def test_autoscaling_grows_to_max_by_fitting_types_and_shrinks_to_min() -> None:
    nodes = cluster(3, 2)
    records: dict[str, VClusterRecord] = {}
    bad = h.plan_create(VClusterCreate("v", "c1", {"A100": 3}, "r", limits={"A100": [1, 2], "H100": [2, 1]}), 1,
                        {"c1": {}}, nodes, records, None)
    assert isinstance(bad, h.Refusal) and "count of 'A100' (3) is outside its limits [1, 2]" in bad.reason
    assert "limits of 'H100' must be [min, max]" in bad.reason
    # limits are an indivisible cluster's: a divisible one was stored with them, never autoscaled
    div = h.plan_create(VClusterCreate("d", "c1", {"A100": 1}, "r", divisible=True, limits={"A100": [1, 2]}), 1,
                        {"c1": {}}, nodes, records, None)
    assert isinstance(div, h.Refusal) and "limits are for indivisible virtual clusters" in div.reason
    p = h.plan_create(VClusterCreate("v", "c1", {"A100": 1}, "r", limits={"A100": [1, 2], "H100": [0, 1]}), 1,
                      {"c1": {}}, nodes, records, None)
    assert isinstance(p, h.Plan)
    apply_plan(nodes, records, p)
    needs = {"gpus": 1, "cpu": 1, "memory": 1}
    grow = h.plan_grow(records["v"], nodes, records, needs, False, "g1", "block b could not be placed")
    assert isinstance(grow, h.Plan) and grow.events[0].op == "autoscale" and "grown by one A100" in grow.events[0].reason
    apply_plan(nodes, records, grow)
    grow = h.plan_grow(records["v"], nodes, records, needs, False, "g2", "again")  # A100 at its max: H100
    assert isinstance(grow, h.Plan) and "grown by one H100" in grow.events[0].reason
    apply_plan(nodes, records, grow)
    assert isinstance(h.plan_grow(records["v"], nodes, records, needs, False, "g3", "x"), h.Refusal)
    huge = h.plan_grow(records["v"], nodes, records, {"gpus": 8}, False, "g4", "x")
    assert isinstance(huge, h.Refusal) and "cannot grow" in huge.reason
    assert h.plan_shrink(records["v"], nodes, records, set(), "s") is None  # nothing idle long enough
    shrink = h.plan_shrink(records["v"], nodes, records, set(records["v"].nodes), "s1")
    assert shrink is not None and "shrunk by one A100" in shrink.events[0].reason
    apply_plan(nodes, records, shrink)
    assert records["v"].replica_sets == {"A100": 1, "H100": 1}


async def test_a_block_that_cannot_be_placed_grows_its_virtual_cluster_and_idle_nodes_shrink_it() -> None:
    settings = Settings(sim_start_delay_s=0.0, dry_run_deadline_s=0.0, dry_run_patience_s=0.0, selection_rounds=1,
                        vcluster_idle_s=0.01)
    async with MemorySystem.open(settings) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=4, gpus=1, node_labels={"nodeType": "A100"})
        await s.bus.emit(E.vcluster_create, VClusterCreate("v", "c1", {"A100": 1}, "r1", limits={"A100": [1, 3]}))
        await s.run()
        vs = VClusterStore(s.store)
        spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1, "virtualClusterId": "v"}
        await s.submit({**spec, "blockId": "b1"})
        await s.run()
        assert (await s.store.get_block("b1"))["status"] == "ready"
        await s.submit({**spec, "blockId": "b2", "queue": False})  # v is full: b2 fails (not pending), v grows by one node
        await s.run()
        assert (await s.store.get_block("b2"))["status"] == "failed"
        rec = await vs.get("v")
        assert rec is not None and rec.replica_sets == {"A100": 2} and len(rec.nodes) == 2
        (grown,) = [e for e in s.bus.events(E.vcluster_changed) if e["op"] == "autoscale"]
        assert "block b2 could not be placed" in grown["reason"]
        await s.submit({**spec, "blockId": "b3"})
        await s.run()
        assert (await s.store.get_block("b3"))["status"] == "ready"
        # idle nodes give it back down to its min: b1 and b3 deleted, two sweeps (idle since, then long enough)
        for bid in ("b1", "b3"):
            await s.delete(bid)
        await s.run()
        for _ in range(3):
            await vw.sweep(s.worker)
            await s.run()
            await asyncio.sleep(0.02)
        rec = await vs.get("v")
        assert rec is not None and rec.replica_sets == {"A100": 1} and len(rec.nodes) == 1
        await _check_partition(s, "c1")


async def test_a_change_committed_by_a_controller_that_died_before_publishing_is_published_from_the_outbox() -> None:
    async with MemorySystem.open() as s:
        await s.add_sim_cluster("c1", nodes=3, gpus=1, node_labels={"nodeType": "A100"})
        vs = VClusterStore(s.store)
        nodes = await s.worker.inventory.nodes("c1")
        plan = h.plan_create(VClusterCreate("v", "c1", {"A100": 2}, "req-1"), 7, {"c1": {}}, nodes, {}, None)
        assert isinstance(plan, h.Plan)
        import time

        import msgspec

        for ev in plan.events:
            ev.at = time.time()
        res = await vs.commit("c1", plan.writes, plan.moves, ("req-1", msgspec.json.encode(plan.events).decode()))
        assert res.ok and res.index > 0  # ... and the controller dies here: nothing published
        assert s.bus.events(E.vcluster_changed) == []
        assert list(await vs.outbox_pending("c1")) == ["req-1"]
        assert await vw.sweep(s.worker) == 0  # too fresh for the sweep's grace: left to its controller
        assert await vw.flush_outbox(s.worker, "c1") == 1
        (ev,) = s.bus.events(E.vcluster_changed)
        assert ev["index"] == res.index and ev["request_id"] == "req-1" and sorted(ev["moved"]) == ["c1-n0", "c1-n1"]
        assert await vs.outbox_pending("c1") == {}
