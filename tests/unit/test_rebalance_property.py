"""``builtin:rebalance-min`` over random clusters (issue 38): every plan checked with code of its
own. Seeded scenarios: 2-6 nodes of 4 or 8 GPUs, blocks of 1-8 GPUs (1-2 instances, some not
preemptible, priorities 0/100/1000, budgets 1-2), then one pending block of 1-8 GPUs (1-2
instances) or none (the fragmentation trigger).

Checked per plan: at most ``maxMoves`` moves; each moves an instance where it is to a node where
it fits then (applied in order); never a ``preemptible: false`` block, never one of higher
priority than the pending block, never more of a block than its budget; for a pending block, its
whole gang fits after the moves (first fit) and did not before, and the same call with one move
less finds nothing (the fewest moves the planner can find); the cluster's FGD fragmentation
(``policies.builtin.frag.Workload`` on the same shapes) is never higher after the plan, and for
the fragmentation trigger every single move lowers it."""

from __future__ import annotations

import random
from typing import Any

from aios_blocks.policies.builtin.frag import Workload
from aios_blocks.policies.builtin.rebalance import plan

SCENARIOS = 1000


def scenario(seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    nodes: dict[str, dict[str, Any]] = {}
    free: dict[str, list[str]] = {}
    for n in range(rnd.randint(2, 6)):
        nid, size = f"n{n}", rnd.choice((4, 8))
        nodes[nid] = {"cpu_free": 64, "mem_free": 1 << 20, "gpus": {f"{nid}-g{g}": {"model": "A", "free": 1.0} for g in range(size)}}
        free[nid] = [f"{nid}-g{g}" for g in range(size)]
    movable = []
    for b in range(rnd.randint(2, 14)):
        gpus = rnd.choice((1, 1, 1, 2, 2, 4, 8))
        insts: dict[str, Any] = {}
        for i in range(rnd.choice((1, 1, 2))):
            spots = [nid for nid, f in free.items() if len(f) >= gpus]
            if not spots:
                break
            nid = rnd.choice(spots)
            got, free[nid] = free[nid][:gpus], free[nid][gpus:]
            for g in got:
                nodes[nid]["gpus"][g]["free"] = 0.0
            insts[f"b{b}-{i}"] = {"node_id": nid, "gpus": got, "share": 1.0, "cpu": 0, "memory": 0, "created": float(b)}
        if insts:
            movable.append({"block_id": f"b{b}", "priority": rnd.choice((0, 100, 1000)), "created": float(b),
                            "minInstances": len(insts), "preemptible": rnd.random() > 0.15,
                            "maxMoving": rnd.choice((1, 1, 2)), "moving": 0, "instances": insts})
    pending = []
    if rnd.random() < 0.8:
        pending = [{"block_id": "p", "priority": rnd.choice((0, 100, 1000)), "minInstances": rnd.choice((1, 1, 2)),
                    "resources": {"gpus": rnd.choice((1, 2, 4, 8))}}]
    return {"action": "rebalance", "maxMoves": rnd.choice((1, 2, 3)), "trigger": "pending" if pending else "fragmentation",
            "cluster": {"cluster_id": "c", "nodes": nodes}, "pending": pending, "movable": movable}


def _free(nodes: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {nid: {g: v["free"] for g, v in n["gpus"].items()} for nid, n in nodes.items()}


def fits(free: dict[str, dict[str, float]], gpus: int, count: int) -> bool:
    left = count
    for f in free.values():
        left -= sum(1 for v in f.values() if v >= 1) // gpus
    return left <= 0


def frag(free: dict[str, dict[str, float]], wl: Workload) -> float:
    return sum(wl.frag("A", 64, tuple(round(v * 1000) for v in f.values())) for f in free.values())


def workload(data: dict[str, Any]) -> Workload:
    counts: dict[int, float] = {}
    for p in data["pending"]:
        counts[p["resources"]["gpus"]] = counts.get(p["resources"]["gpus"], 0) + max(1, p["minInstances"])
    for b in data["movable"]:
        for i in b["instances"].values():
            counts[len(i["gpus"])] = counts.get(len(i["gpus"]), 0) + 1
    total = sum(counts.values()) or 1
    return Workload([{"gpus": g, "cpu": 0, "weight": w / total} for g, w in counts.items()])


def check(data: dict[str, Any], out: dict[str, Any]) -> list[str]:
    """The rule violations of one plan (empty: none)."""
    bad = []
    free = _free(data["cluster"]["nodes"])
    wl = workload(data)
    by_iid = {iid: (b, i) for b in data["movable"] for iid, i in b["instances"].items()}
    where = {iid: i["node_id"] for iid, (_, i) in by_iid.items()}
    per_block: dict[str, int] = {}
    before = frag(free, wl)
    p = data["pending"][0] if data["pending"] else None
    if len(out["moves"]) > data["maxMoves"]:
        bad.append("more moves than maxMoves")
    if p and out["moves"] and fits(free, p["resources"]["gpus"], p["minInstances"]):
        bad.append("moves for a block that fits without")
    for m in out["moves"]:
        b, inst = by_iid[m["instance_id"]]
        if b.get("preemptible") is False:
            bad.append(f"moved {m['instance_id']}, not preemptible")
        if p and out["for"] and b["priority"] > p["priority"]:
            bad.append(f"moved {m['instance_id']} (priority {b['priority']}) for a lower block")
        per_block[b["block_id"]] = per_block.get(b["block_id"], 0) + 1
        if per_block[b["block_id"]] > b["maxMoving"]:
            bad.append(f"{b['block_id']} moved beyond its budget")
        if where[m["instance_id"]] != m["from"] or m["from"] == m["to"]:
            bad.append(f"{m['instance_id']} is not on {m['from']}")
        if any(free[m["to"]].get(g, 0) < 1 for g in m["to_gpus"]) or len(m["to_gpus"]) != len(inst["gpus"]):
            bad.append(f"{m['instance_id']} does not fit on {m['to']}")
            continue
        step_before = frag(free, wl)
        for g in inst["gpus"]:
            free[m["from"]][g] = 1.0
        for g in m["to_gpus"]:
            free[m["to"]][g] = 0.0
        where[m["instance_id"]] = m["to"]
        if not out["for"] and frag(free, wl) >= step_before:
            bad.append(f"move of {m['instance_id']} does not lower the fragmentation")
    if frag(free, wl) > before + 1e-6:
        bad.append("the plan raises the cluster's fragmentation")
    if out["for"] and not fits(free, p["resources"]["gpus"], p["minInstances"]):  # type: ignore[index]
        bad.append("the pending block does not fit after the moves")
    return bad


def run_all(n: int = SCENARIOS) -> dict[str, Any]:
    counts = {"scenarios": n, "room_made": 0, "moves": 0, "frag_plans": 0, "violations": 0, "not_fewest": 0}
    failures = []
    for seed in range(n):
        data = scenario(seed)
        out = plan(data)
        bad = check(data, out)
        if out["moves"]:
            counts["moves"] += len(out["moves"])
            if out["for"]:
                counts["room_made"] += 1
                if len(out["moves"]) > 1 and plan({**data, "maxMoves": len(out["moves"]) - 1})["for"]:
                    counts["not_fewest"] += 1
                    bad.append("a plan with one move less exists")
            else:
                counts["frag_plans"] += 1
        if bad:
            counts["violations"] += 1
            failures.append((seed, bad))
    counts["failures"] = failures[:5]
    return counts


def test_every_plan_keeps_the_rules() -> None:
    counts = run_all()
    print(counts)
    assert counts["violations"] == 0, counts["failures"]
    # the scenarios exercise both triggers
    assert counts["room_made"] > 10 and counts["frag_plans"] > 5


def test_the_checks_catch_a_planner_that_breaks_the_rules() -> None:
    """A mutant that moves the instance of a block that is not preemptible is caught."""
    for seed in range(SCENARIOS):
        data = scenario(seed)
        keep = [b for b in data["movable"] if b.get("preemptible") is False]
        if not keep:
            continue
        b = keep[0]
        iid, inst = next(iter(b["instances"].items()))
        others = [nid for nid in data["cluster"]["nodes"] if nid != inst["node_id"]]
        out = {"moves": [{"instance_id": iid, "from": inst["node_id"], "to": others[0], "to_gpus": []}], "for": ""}
        assert any("not preemptible" in v for v in check(data, out))
        return
    raise AssertionError("no scenario with a block that is not preemptible")
