"""The rebalancer's moves obey what a placement obeys (issue 38, docs/rebalance.md): a move's
target is one the block's placement filters admit (its virtual cluster, its Required affinity,
computed by ``handlers.rebalance`` with the placement's own code), on a node with a GPU topology
the topology's pick of GPUs and never a worse tier than the instance has; the planner's GPUs go
out with the request; the periodic round's trigger. Inputs built from real node views
(``tests/unit/views.py``) through ``handlers.rebalance.rebalance_input``."""

from __future__ import annotations

from typing import Any

import msgspec

from aios_blocks.handlers import rebalance as hr
from aios_blocks.policies import affinity
from aios_blocks.policies.builtin.rebalance import plan
from aios_blocks.schemas.affinity import normalize
from aios_blocks.schemas.topology import PROFILES

from .views import busy_gpu, gpu, node, nodes_of


def view(nid: str, busy: set[int], gpus: int = 4, vc: str = "", topo: str = "") -> dict[str, Any]:
    v = node(nid, gpus=[busy_gpu(f"{nid}-g{i}") if i in busy else gpu(f"{nid}-g{i}") for i in range(gpus)])
    if vc:
        v["virtualCluster"] = vc
    if topo:
        v["topology"] = PROFILES[topo].model_dump(mode="json")
    return v


def row(bid: str, node_id: str, gpus: list[int], **ir: Any) -> dict[str, Any]:
    res = {"gpus": len(gpus), "gpuMemory": 0, "cpu": 0, "memory": 0}
    return {"block_id": bid, "status": "ready", "gen": 1, "created": 0.0,
            "ir": {"blockId": bid, "priority": 0, "minInstances": 1, "resources": res, **ir},
            "instances": {f"{bid}-0": {"node": node_id, "gpus": [f"{node_id}-g{g}" for g in gpus], "status": "running"}}}


def pending(gpus: int = 4, bid: str = "p", **ir: Any) -> dict[str, Any]:
    return {"ir": {"blockId": bid, "priority": 100, "minInstances": 1,
                   "resources": {"gpus": gpus, "gpuMemory": 0, "cpu": 0, "memory": 0}, **ir}}


def without(data: dict[str, Any], key: str) -> dict[str, Any]:
    """The same input with ``key`` dropped from every movable block and instance (what the
    rebalancer saw before it modelled the placement's filters)."""
    out = msgspec.json.decode(msgspec.json.encode(data))
    for m in out["movable"]:
        m.pop(key, None)
        for i in m["instances"].values():
            i.pop(key, None)
    for p in out["pending"]:
        p.pop(key, None)
    out.pop(key, None)
    return out


def test_a_move_never_leaves_its_virtual_cluster() -> None:
    """a0 (of virtual cluster v1) and n1 have the same hole, a0 first by name; the block that must
    move for the pending one is of the primary (unassigned) nodes: it goes to n1, not a0, and the
    pending block's room is made where it may go. And the other way round for a block of v1."""
    views = nodes_of(view("n0", {0}), view("n1", {0, 1, 2}), view("a0", {0, 1, 2}, vc="v1"))
    data = hr.rebalance_input("c1", views, [row("s1", "n0", [0])], [pending()], 2, hr.Trigger.PENDING)
    assert data["movable"][0]["targets"] == ["n0", "n1"] and data["pending"][0]["targets"] == ["n0", "n1"]
    blind = plan(without(data, "targets"))
    assert [m["to"] for m in blind["moves"]] == ["a0"], blind  # what it did before: out of its place
    out = plan(data)
    assert [m["to"] for m in out["moves"]] == ["n1"] and out["fits"] == {"n0": 1}, out
    views = nodes_of(view("n0", {0}, vc="v1"), view("n1", {0, 1, 2}, vc="v1"), view("a0", {0, 1, 2}))
    data = hr.rebalance_input("c1", views, [row("s1", "n0", [0], virtualClusterId="v1")],
                              [pending(virtualClusterId="v1")], 2, hr.Trigger.PENDING)
    assert [m["to"] for m in plan(without(data, "targets"))["moves"]] == ["a0"]
    out = plan(data)
    assert [m["to"] for m in out["moves"]] == ["n1"] and out["fits"] == {"n0": 1}, out


def _anti(target_bid: str) -> list[dict[str, Any]]:
    raw = [{"category": "Topology", "strength": "Required", "anti": True,
            "target": {"type": "ServiceId", "value": affinity.uid(target_bid)}}]
    return [msgspec.to_builtins(e) for e in normalize(raw)]


def test_a_move_never_lands_against_required_anti_affinity() -> None:
    """s must stay away from t's service; the only room for the pending block is made by moving
    s next to t: no move (the queue may preempt instead). Without s's index, s is not moved."""
    views = nodes_of(view("n0", {0}), view("n1", {0}))
    t = row("t", "n1", [0], preemptible=False)
    s = row("s", "n0", [0], affinity=_anti("t"))
    index = affinity.add_to_index(affinity.empty_index(), "t", "t-0", "n1", "")
    data = hr.rebalance_input("c1", views, [s, t], [pending()], 2, hr.Trigger.PENDING, indexes={"s": index})
    assert [m["targets"] for m in data["movable"] if m["block_id"] == "s"] == [["n0"]]  # its own node only
    blind = plan(without(data, "targets"))
    assert [(m["instance_id"], m["to"]) for m in blind["moves"]] == [("s-0", "n1")], blind
    assert plan(data)["moves"] == []
    unknown = hr.rebalance_input("c1", views, [s, t], [pending()], 2, hr.Trigger.PENDING)
    assert plan(unknown)["moves"] == []
    # with the entry toward t instead, n1 is where it may go
    toward = [{**e, "anti": False} for e in _anti("t")]
    s2 = row("s", "n0", [0], affinity=toward)
    data = hr.rebalance_input("c1", views, [s2, t], [pending()], 2, hr.Trigger.PENDING, indexes={"s": index})
    assert [(m["instance_id"], m["to"]) for m in plan(data)["moves"]] == [("s-0", "n1")]


def test_a_move_never_takes_a_worse_link_tier_when_a_better_is_free() -> None:
    """s runs on an NVLink pair of n0; n1 has two free GPUs across the pairs (HOST_BRIDGE), n2 a
    free NVLink pair. Both fragment the same: the move goes to n2's pair, not to n1."""
    views = nodes_of(view("n0", {0, 1}, topo="nvlink-pairs-4"), view("n1", {0, 2}, topo="nvlink-pairs-4"),
                     view("n2", {0, 1}, topo="nvlink-pairs-4"))
    s = row("s", "n0", [0, 1])
    data = hr.rebalance_input("c1", views, [s], [pending()], 2, hr.Trigger.PENDING)
    assert data["movable"][0]["instances"]["s-0"]["tier"] == "NVLINK" and set(data["topology"]) == {"n0", "n1", "n2"}
    blind = plan(without(data, "tier"))
    assert [m["to"] for m in blind["moves"]] == ["n1"], blind  # the first of two equal nodes
    (m,) = plan(data)["moves"]
    assert m["to"] == "n2" and m["to_gpus"] == ["n2-g2", "n2-g3"], m


def test_the_moves_gpus_are_the_topologys_pick() -> None:
    """On n1 (GPU 0 busy) a 2-GPU instance gets the free NVLink pair 2,3, not 1,2 across the pairs."""
    views = nodes_of(view("n0", {0, 1}, topo="nvlink-pairs-4"), view("n1", {0}, topo="nvlink-pairs-4"))
    data = hr.rebalance_input("c1", views, [row("s", "n0", [0, 1])], [pending()], 2, hr.Trigger.PENDING)
    (m,) = plan(data)["moves"]
    assert m["to"] == "n1" and m["to_gpus"] == ["n1-g2", "n1-g3"], m
    (blind,) = plan(without(without(data, "topology"), "tier"))["moves"]
    assert blind["to_gpus"] == ["n1-g1", "n1-g2"]
    # and the request carries them to the controller (the reservation takes them: test_moves_memory)
    (ev,) = hr.requests("c1", plan(data), {"s": 1}, hr.Trigger.PENDING, 100.0)
    assert ev.payload.to_node == "n1" and ev.payload.to_gpus == ["n1-g2", "n1-g3"]


def test_the_periodic_rounds_trigger() -> None:
    """Fragmentation moves only while some block waits (AIOS_REBALANCE_FRAG_IDLE: also when none)."""
    T = hr.Trigger
    assert hr.round_trigger(True, 0.2, 0.1) == (T.FRAGMENTATION, "")
    assert hr.round_trigger(True, 0.05, 0.1) == (T.PENDING, "")
    assert hr.round_trigger(True, 0.2, 0.1, waited=False) == (T.PENDING, "")  # nobody has waited long yet
    kind, why = hr.round_trigger(False, 0.2, 0.1)
    assert kind is None and "no pending block" in why and "AIOS_REBALANCE_FRAG_IDLE" in why
    assert hr.round_trigger(False, 0.2, 0.1, idle=True) == (T.FRAGMENTATION, "")
    kind, why = hr.round_trigger(False, 0.05, 0.1, idle=True)
    assert kind is None and "below the threshold" in why


async def test_the_worker_round_moves_for_fragmentation_only_while_a_block_has_waited() -> None:
    """``plan_rounds`` as the rebalancer worker calls it, on the in-memory system: a fragmented
    cluster where nothing waits is left alone (AIOS_REBALANCE_FRAG_IDLE on: the old behaviour, a
    fragmentation move); a block that has just arrived gets the pending trigger, one that has
    waited AIOS_REBALANCE_FRAG_WAIT_S the fragmentation trigger."""
    import time

    from aios_blocks.policies.runtime import PolicyRuntime
    from aios_blocks.testing import MemorySystem
    from aios_blocks.workers.rebalancer import plan_rounds

    runtime = PolicyRuntime()
    rule = {"name": "rebalancer", "policyRuleURI": "builtin:rebalance-min"}

    async def invoke(r: dict[str, Any], data: dict[str, Any]) -> Any:
        return await runtime.invoke(r, "test", data, {})

    spread = [{"name": "resourceAllocator", "policyRuleURI": "builtin:spread"}]

    def spec(bid: str, gpus: int) -> dict[str, Any]:
        return {"blockComponentURI": "aios://test/model", "blockId": bid, "minInstances": 1, "maxInstances": 1,
                "resources": {"gpus": gpus}, "policyRulesSpec": spread}

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        for bid, gpus in (("s1", 1), ("s2", 1), ("t", 2)):
            await s.submit(spec(bid, gpus))
            await s.run()
        kw: dict[str, Any] = {"threshold": 0.01, "trigger": hr.Trigger.FRAGMENTATION, "wait_s": 30.0}
        (quiet,) = await plan_rounds(s.store, invoke, rule, 2, 16, **kw)
        assert quiet.data["fragmentation"]["ratio"] >= 0.01 and not quiet.output, quiet.as_dict()
        assert "AIOS_REBALANCE_FRAG_IDLE off" in quiet.skipped
        (idle,) = await plan_rounds(s.store, invoke, rule, 2, 16, idle=True, **kw)
        assert idle.trigger is hr.Trigger.FRAGMENTATION and idle.output["moves"], idle.as_dict()
        await s.submit(spec("p", 4))
        await s.run()
        assert (await s.store.get_block("p") or {}).get("status") == "pending"
        (fresh,) = await plan_rounds(s.store, invoke, rule, 2, 16, **kw)
        assert fresh.trigger is hr.Trigger.PENDING and not fresh.skipped
        (later,) = await plan_rounds(s.store, invoke, rule, 2, 16, now=time.time() + 31, **kw)
        assert later.trigger is hr.Trigger.FRAGMENTATION and later.data["trigger"] == "fragmentation"


def _toward(strength: str, *nodes: str) -> list[dict[str, Any]]:
    raw = [{"category": "Topology", "strength": strength, "anti": False,
            "target": {"type": "NodeId", "value": affinity.uid(n)}} for n in nodes]
    return [msgspec.to_builtins(e) for e in normalize(raw)]


#: n0 and n1 each one 1-GPU instance short of a 4-GPU block (s0, s1); n2 has 2 GPUs free (t stays)
def _two_rooms() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    views = nodes_of(view("n0", {0}), view("n1", {0}), view("n2", {0, 1}))
    return views, [row("s0", "n0", [0]), row("s1", "n1", [0]), row("t", "n2", [0, 1], preemptible=False)]


def test_a_pending_block_with_required_affinity_gets_room_where_it_may_go() -> None:
    """p must run on n1 (Required): its room is made there (s1 moves off n1), not on n0, which a
    block without affinity gets. Before, a pending block with affinity got no moves at all."""
    views, placed = _two_rooms()
    free = plan(hr.rebalance_input("c1", views, placed, [pending()], 2, hr.Trigger.PENDING))
    assert free["fits"] == {"n0": 1}, free  # the first room by name, without affinity
    p = pending(affinity=_toward("Required", "n1"))
    assert hr.matches(p["ir"], {"labels": {}})
    data = hr.rebalance_input("c1", views, placed, [p], 2, hr.Trigger.PENDING, indexes={"p": affinity.empty_index()})
    assert data["pending"][0]["targets"] == ["n1"]
    out = plan(data)
    assert [(m["instance_id"], m["from"]) for m in out["moves"]] == [("s1-0", "n1")] and out["fits"] == {"n1": 1}, out
    # its index unknown (not read): no room anywhere, rather than room it may not use
    assert plan(hr.rebalance_input("c1", views, placed, [p], 2, hr.Trigger.PENDING))["moves"] == []


def test_a_pending_block_with_preferred_affinity_gets_room_on_its_preferred_node() -> None:
    """p prefers n1 (Preferred, and Adaptive: the same score here, no samples): both rooms cost one
    move; the room is made on n1. Without its ``prefer`` the planner makes it on n0."""
    views, placed = _two_rooms()
    for strength in ("Preferred", "Adaptive"):
        p = pending(affinity=_toward(strength, "n1"))
        data = hr.rebalance_input("c1", views, placed, [p], 2, hr.Trigger.PENDING, indexes={"p": affinity.empty_index()})
        assert data["pending"][0]["prefer"] == {"n0": 0.0, "n1": 1.0, "n2": 0.0}, data["pending"][0]
        assert plan(without(data, "prefer"))["fits"] == {"n0": 1}
        out = plan(data)
        assert [m["from"] for m in out["moves"]] == ["n1"] and out["fits"] == {"n1": 1}, (strength, out)


def test_a_moved_instance_keeps_its_preferred_affinity() -> None:
    """s (on n1) prefers n1 and n2; p's room is on n1; n0 and n2 each take s as well (the same
    fragmentation): s goes to n2 (score kept), not n0 (first by name, score lower)."""
    views = nodes_of(view("n0", {0, 1, 2}), view("n1", {0}), view("n2", {0, 1, 2}))
    placed = [row("a", "n0", [0, 1, 2], preemptible=False), row("b", "n2", [0, 1, 2], preemptible=False),
              row("s", "n1", [0], affinity=_toward("Preferred", "n1", "n2"))]
    data = hr.rebalance_input("c1", views, placed, [pending()], 2, hr.Trigger.PENDING, indexes={"s": affinity.empty_index()})
    (s,) = [m for m in data["movable"] if m["block_id"] == "s"]
    assert s["prefer"] == {"n0": 0.0, "n1": 1.0, "n2": 1.0}
    assert [m["to"] for m in plan(without(data, "prefer"))["moves"]] == ["n0"]
    out = plan(data)
    assert [(m["instance_id"], m["to"]) for m in out["moves"]] == [("s-0", "n2")], out
    # only n0 left for it (n2 full): no move rather than a worse place
    views = nodes_of(view("n0", {0, 1, 2}), view("n1", {0}), view("n2", {0, 1, 2, 3}))
    placed[1] = row("b", "n2", [0, 1, 2, 3], preemptible=False)
    data = hr.rebalance_input("c1", views, placed, [pending()], 2, hr.Trigger.PENDING, indexes={"s": affinity.empty_index()})
    assert plan(without(data, "prefer"))["moves"] and plan(data)["moves"] == []


async def test_the_worker_reads_a_waiting_blocks_affinity_index() -> None:
    """``plan_rounds`` asks ``affinity_indexes`` for the placed rows and the waiting blocks' records
    (``{"ir": ...}``, no ``block_id``): a waiting block with affinity gets its index, by its
    ``ir.blockId`` (without it, its room would be on no node)."""
    from aios_blocks.state.rebalance import affinity_indexes

    p = pending(affinity=_toward("Required", "n1"))
    got = await affinity_indexes(None, [row("s0", "n0", [0]), p])
    assert set(got) == {"p"} and got["p"]["services"] == {} and got["p"]["leases"] == {}
