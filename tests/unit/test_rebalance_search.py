"""``builtin:rebalance-min``'s search (issue 38, docs/rebalance.md "The planner's search"): the
destinations ranked once per instance shape and step (``_Dests``), the pending block's count
kept per node (``_Counts``) and the subsets that cannot beat the best plan so far skipped give
the very plans of the plain search, which measures every node for every instance of every
subset. The plain search is written here (``ref_*``: the planner's code before, on the same
primitives) and both run on seeded random clusters with CPU, memory, GPU shares, two models,
Required targets and Preferred scores; then the work: how many node measurements one plan takes."""

from __future__ import annotations

import itertools
import random
from typing import Any

from aios_blocks.policies.builtin import rebalance as rb
from aios_blocks.policies.builtin.preempt import EPS, Need, node_fits, placement

SCENARIOS = 300


def ref_destination(c: rb.Cluster, nodes: dict[str, Any], i: rb.Inst, avoid: set[str]) -> Any:
    best = None
    for nid, n in nodes.items():
        if nid in avoid or nid == i.node:
            continue
        e = rb._entry(c, nid, n, i)
        if e is not None and (best is None or e[:3] < best[:3]):
            best = e
    return None if best is None else (best[2], best[3], best[0])


def ref_free_room(c: rb.Cluster, need: Need, src: str, insts: list[rb.Inst], budget: dict[str, int], size: int,
                  before: int) -> Any:
    _, cpu, mem = rb._short_of(c.nodes[src], need)

    def frees(i: rb.Inst) -> float:
        return (min(1.0, i.cpu / cpu) if cpu > 0 else 0.0) + (min(1.0, i.memory / mem) if mem > 0 else 0.0)

    order = sorted(insts, key=lambda i: (i.gpu_amount, -frees(i), i.priority, -i.created, i.iid))
    if size > len(order) or rb._too_short(c.nodes[src], need, order, size):
        return None
    best = None
    for subset in itertools.islice(itertools.combinations(order, size), rb.SUBSETS):
        if not rb._within_budget(subset, budget):
            continue
        nodes = dict(c.nodes)
        src_node = nodes[src] = rb._copy(c.nodes[src])
        for i in subset:
            rb.Cluster.release(src_node, i)
        if node_fits(src_node, need, 1) < 1 and rb._count(rb._on(nodes, c.room), need) <= before:
            continue
        src_saved = c.frag(src) - c.frag(src, src_node)
        moves, cost, ok = [], 0.0, True
        for i in subset:
            dest = ref_destination(c, nodes, i, {src})
            if dest is None:
                ok = False
                break
            nid, gpus, d = dest
            n = nodes[nid] = rb._copy(nodes[nid])
            rb.Cluster.take(n, i, gpus)
            moves.append(rb.Move(i, nid, gpus, d))
            cost += d
        if not ok or rb._count(rb._on(nodes, c.room), need) <= before or cost > src_saved + EPS:
            continue
        rank = (size, sum(i.gpu_amount for i in subset), max(i.priority for i in subset), cost - src_saved,
                tuple(sorted(i.iid for i in subset)))
        if best is None or rank < best[0]:
            best = (rank, moves, nodes)
    return best


def ref_plan_pending(c: rb.Cluster, need: Need, insts: list[rb.Inst], budget: dict[str, int], max_moves: int) -> Any:
    moves: list[rb.Move] = []
    where = {i.iid: i for i in insts}
    budget = dict(budget)
    while not placement(rb._on(c.nodes, c.room), need):
        left = max_moves - len(moves)
        if left <= 0:
            return None
        on: dict[str, list[rb.Inst]] = {}
        for i in where.values():
            on.setdefault(i.node, []).append(i)
        sources = sorted((nid for nid in on if nid in c.nodes and (c.room is None or nid in c.room)),
                         key=lambda nid: (-c.room_score(nid), *rb._source_key(c.nodes[nid], need), nid))
        sources = [nid for nid in sources[:rb.SOURCES] if rb._shortfall(c.nodes[nid], need) != float("inf")]
        before = rb._count(rb._on(c.nodes, c.room), need)
        best = None
        for size in range(1, left + 1):
            for src in sources:
                found = ref_free_room(c, need, src, on[src], budget, size, before)
                if found is None:
                    continue
                rank = (-c.room_score(src), *found[0])
                if best is None or rank < best[0]:
                    best = (rank, found[1], found[2])
            if best is not None:
                break
        if best is None:
            return None
        _, step, c.nodes = best
        for m in step:
            del where[m.inst.iid]
            budget[m.inst.bid] -= 1
            moves.append(m)
    return moves, ""


def ref_plan_fragmentation(c: rb.Cluster, insts: list[rb.Inst], budget: dict[str, int], max_moves: int) -> list[rb.Move]:
    moves: list[rb.Move] = []
    where = {i.iid: i for i in insts}
    budget = dict(budget)
    while len(moves) < max_moves:
        best = None
        for i in where.values():
            if budget.get(i.bid, 0) <= 0 or i.node not in c.nodes or not i.gpus:
                continue
            src = rb._copy(c.nodes[i.node])
            rb.Cluster.release(src, i)
            saved = c.frag(i.node) - c.frag(i.node, src)
            dest = ref_destination(c, c.nodes, i, {i.node})
            if dest is None:
                continue
            nid, gpus, cost = dest
            gain = saved - cost
            if gain <= EPS:
                continue
            rank = (-gain / max(i.gpu_amount, EPS), i.gpu_amount, i.priority, i.iid)
            if best is None or rank < best[0]:
                after = rb._copy(c.nodes[nid])
                rb.Cluster.take(after, i, gpus)
                best = (rank, rb.Move(i, nid, gpus, cost - saved), src, after)
        if best is None:
            break
        _, m, src, after = best
        c.nodes = {**c.nodes, m.inst.node: src, m.to: after}
        del where[m.inst.iid]
        budget[m.inst.bid] -= 1
        moves.append(m)
    return moves


def scenario(seed: int) -> dict[str, Any]:
    """A random cluster: 5-14 nodes of 4 or 8 GPUs (models A, or B on a few), 32-96 CPU; blocks of
    0-8 GPUs (whole, or a share of one GPU), 1-24 CPU, some memory, a few shapes repeated; a
    pending block of 1-8 GPUs (sometimes a share), with CPU, sometimes Required targets or a
    Preferred score; some movable blocks with targets or scores too."""
    rnd = random.Random(seed)
    nodes: dict[str, dict[str, Any]] = {}
    for n in range(rnd.randint(5, 14)):
        nid, size, model = f"n{n:02d}", rnd.choice((4, 8, 8)), "B" if rnd.random() < 0.2 else "A"
        nodes[nid] = {"cpu_free": float(rnd.choice((32, 64, 96))), "mem_free": float(rnd.choice((64, 256))) * 1024,
                      "gpus": {f"{nid}-g{g}": {"model": model, "free": 1.0} for g in range(size)}}
    ids = sorted(nodes)
    movable = []
    for b in range(rnd.randint(6, 40)):
        gpus = rnd.choice((0, 1, 1, 1, 1, 2, 2, 4, 8))
        share = rnd.choice((0.25, 0.5)) if gpus == 1 and rnd.random() < 0.25 else 1.0
        cpu, mem = float(rnd.choice((1, 2, 4, 8, 16, 24))), float(rnd.choice((1, 4, 16))) * 1024
        insts: dict[str, Any] = {}
        for k in range(rnd.choice((1, 1, 2))):
            spots = []
            for nid in ids:
                node = nodes[nid]
                ok = [g for g, v in node["gpus"].items() if v["free"] >= share - 1e-9]
                if node["cpu_free"] >= cpu and node["mem_free"] >= mem and len(ok) >= gpus:
                    spots.append((nid, ok))
            if not spots:
                break
            nid, ok = rnd.choice(spots)
            got = ok[:gpus]
            for g in got:
                nodes[nid]["gpus"][g]["free"] = round(nodes[nid]["gpus"][g]["free"] - share, 3)
            nodes[nid]["cpu_free"] -= cpu
            nodes[nid]["mem_free"] -= mem
            insts[f"b{b:02d}-{k}"] = {"node_id": nid, "gpus": got, "share": share, "cpu": cpu, "memory": mem,
                                      "created": float(rnd.randint(0, 50))}
        if not insts:
            continue
        entry: dict[str, Any] = {"block_id": f"b{b:02d}", "priority": rnd.choice((0, 0, 100)), "created": float(b),
                                 "minInstances": len(insts), "preemptible": rnd.random() > 0.1,
                                 "maxMoving": rnd.choice((1, 2)), "moving": 0, "instances": insts}
        if rnd.random() < 0.1:
            entry["targets"] = rnd.sample(ids, rnd.randint(1, len(ids)))
        if rnd.random() < 0.1:
            entry["prefer"] = {nid: float(rnd.randint(0, 2)) for nid in rnd.sample(ids, 3)}
        movable.append(entry)
    p: dict[str, Any] = {"block_id": "p", "priority": 100, "minInstances": rnd.choice((1, 1, 2)),
                         "resources": {"gpus": rnd.choice((1, 2, 4, 8)), "cpu": float(rnd.choice((0, 4, 16, 32))),
                                       "memory": float(rnd.choice((0, 8))) * 1024}}
    if p["resources"]["gpus"] == 1 and rnd.random() < 0.3:
        p["resources"]["gpuShare"] = 0.5
    if rnd.random() < 0.15:
        p["targets"] = rnd.sample(ids, rnd.randint(2, len(ids)))
    if rnd.random() < 0.15:
        p["prefer"] = {nid: float(rnd.randint(0, 3)) for nid in rnd.sample(ids, 4)}
    return {"action": "rebalance", "maxMoves": rnd.choice((1, 2, 2, 3)), "trigger": "pending",
            "cluster": {"cluster_id": "c", "nodes": nodes}, "pending": [p], "movable": movable}


def _planned(moves: list[rb.Move] | None) -> list[tuple[str, str, tuple[str, ...], float]] | None:
    return None if moves is None else [(m.inst.iid, m.to, m.to_gpus, m.frag_delta) for m in moves]


def _clusters(data: dict[str, Any]) -> tuple[Need, Any, rb.Cluster, rb.Cluster]:
    need = rb.need_of(data["pending"][0])
    parsed = rb._parse(data, [need], None)
    p = data["pending"][0]
    room = None if p.get("targets") is None else frozenset(p["targets"])
    one, two = parsed.cluster(), parsed.cluster()
    for c in (one, two):
        c.room, c.prefer = room, rb._prefer_of(p) or {}
    return need, parsed, one, two


def test_the_search_plans_what_the_plain_search_plans() -> None:
    planned = two_moves = frag_moves = 0
    for seed in range(SCENARIOS):
        data = scenario(seed)
        need, parsed, fast, plain = _clusters(data)
        insts, budget = parsed.movable_of(100)
        got = rb.plan_pending(fast, need, insts, budget, data["maxMoves"])
        want = ref_plan_pending(plain, need, insts, budget, data["maxMoves"])
        assert _planned(got and got[0]) == _planned(want and want[0]), seed
        assert fast.nodes == plain.nodes, seed
        if got and got[0]:
            planned += 1
            two_moves += len(got[0]) >= 2
        # the fragmentation trigger's greedy moves, on the same cluster
        insts, budget = parsed.movable_of(None)
        fast, plain = parsed.cluster(), parsed.cluster()
        got_f = rb.plan_fragmentation(fast, insts, budget, data["maxMoves"])
        assert _planned(got_f) == _planned(ref_plan_fragmentation(plain, insts, budget, data["maxMoves"])), seed
        assert fast.nodes == plain.nodes, seed
        frag_moves += len(got_f)
    # the scenarios exercise what is compared: plans of one move and of more, fragmentation moves
    assert planned >= 40 and two_moves >= 10 and frag_moves >= 100, (planned, two_moves, frag_moves)


def test_a_plan_measures_each_node_once_per_instance_shape(monkeypatch: Any) -> None:
    """30 nodes of model A, each with four 1-GPU instances and a 2-GPU one (12 CPU each) and 2
    GPUs and 4 CPU free, 10 empty nodes of model B; the pending block asks 4 GPUs of A and 20 CPU:
    a pair moved off a node (to B) makes its room. The plain search measured every node for every
    instance of every pair tried (24 sources x 10 pairs x 2 instances x 39 nodes); the search
    measures each node once per instance shape, and a pair's second instance again only on the
    node its first one took."""
    nodes = {f"n{k:02d}": {"cpu_free": 4.0, "mem_free": 1 << 20,
                           "gpus": {f"n{k:02d}-g{g}": {"model": "A", "free": 1.0 if g >= 6 else 0.0} for g in range(8)}}
             for k in range(30)}
    nodes.update({f"n{k:02d}": {"cpu_free": 96.0, "mem_free": 1 << 20,
                                "gpus": {f"n{k:02d}-g{g}": {"model": "B", "free": 1.0} for g in range(8)}}
                  for k in range(30, 40)})
    movable = [{"block_id": f"b{k:02d}-{j}", "priority": 0, "created": float(j), "minInstances": 1, "moving": 0,
                "instances": {f"b{k:02d}-{j}-0": {"node_id": f"n{k:02d}", "gpus": [f"n{k:02d}-g{g}" for g in gpus],
                                                   "share": 1.0, "cpu": 12.0, "memory": 0}}}
               for k in range(30) for j, gpus in enumerate(((0,), (1,), (2,), (3,), (4, 5)))]
    data = {"action": "rebalance", "maxMoves": 2, "trigger": "pending", "cluster": {"cluster_id": "c", "nodes": nodes},
            "movable": movable, "pending": [{"block_id": "p", "priority": 0, "minInstances": 1,
                                             "resources": {"gpus": 4, "cpu": 20.0, "gpuModels": ["A"]}}]}
    calls = [0]
    real = rb.Cluster.pick_on

    def counted(self: rb.Cluster, nid: str, n: Any, i: rb.Inst) -> Any:
        calls[0] += 1
        return real(self, nid, n, i)

    monkeypatch.setattr(rb.Cluster, "pick_on", counted)
    need, parsed, fast, plain = _clusters(data)
    insts, budget = parsed.movable_of(0)
    got = rb.plan_pending(fast, need, insts, budget, 2)
    fast_calls, calls[0] = calls[0], 0
    want = ref_plan_pending(plain, need, insts, budget, 2)
    assert _planned(got and got[0]) == _planned(want and want[0])
    assert got and len(got[0]) == 2  # the room takes two moves: every source's pairs are searched
    shapes = len({i.dest_key for i in insts})
    assert shapes == 2
    # each node once per shape, and one node again per pair tried (24 sources x 10 pairs at most)
    assert fast_calls <= 40 * shapes + rb.SOURCES * 10, (fast_calls, calls[0])
    assert calls[0] > 10 * fast_calls, (fast_calls, calls[0])
