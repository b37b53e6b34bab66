"""The rebalance planner's destinations kept across plans (issue 38, docs/rebalance.md "The
planner's search on multigpu50"): ``rebalance_dests.DestCache`` keeps each node's entries per
instance shape while its state object is the same, and each shape's ranked nodes from one base to
the next, patched for the nodes that changed. Checked against the plain answer (every node of the
base measured) on seeded clusters whose nodes change between the bases as a replay's and a plan's
do (a few replaced, a step's copies and back, many at once, nodes gone and back), and end to end:
the online replay with the cache kept across plans makes the moves and placements of the replay
with a fresh cache per plan."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aios_blocks.policies.builtin import rebalance as rb
from aios_blocks.policies.builtin import rebalance_dests as rd
from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb

from .test_online_rebalance_index import nodes as replay_nodes
from .test_online_rebalance_index import workload as replay_workload
from .test_rebalance_search import ref_destination, scenario

SEEDS = 60


def changed_copy(rnd: random.Random, n: Any) -> Any:
    """A new state object of a node: some GPUs taken or freed, CPU taken or freed."""
    m = rb._copy(n)
    for g in rnd.sample(sorted(m.gpus), min(len(m.gpus), rnd.randint(1, 3))):
        m.gpus[g][1] = rnd.choice((0.0, 0.5, 1.0))
    m.cpu = max(0.0, m.cpu + rnd.choice((-16.0, -4.0, 0.0, 8.0, 32.0)))
    return m


def bases(rnd: random.Random, start: dict[str, Any]) -> list[dict[str, Any]]:
    """A sequence of bases: each the last with a few nodes replaced (a replay's capacity events),
    a step's copies then the base before again (a plan's steps, then the next plan), many nodes
    at once (over ``PATCH``), a node gone and back."""
    out = [dict(start)]
    ids = sorted(start)
    for _ in range(40):
        last = out[-1]
        kind = rnd.random()
        if kind < 0.5:
            nxt = dict(last)
            for nid in rnd.sample(ids, rnd.randint(1, 3)):
                nxt[nid] = changed_copy(rnd, last[nid])
            out.append(nxt)
        elif kind < 0.75:
            step = dict(last)
            for nid in rnd.sample(ids, 2):
                step[nid] = changed_copy(rnd, last[nid])
            out += [step, dict(last)]  # the step's copies, then the very objects of the base again
        elif kind < 0.85:
            out.append({nid: changed_copy(rnd, n) for nid, n in last.items()})  # all of them: ranked again
        else:
            gone = rnd.choice(ids)
            out += [{nid: n for nid, n in last.items() if nid != gone}, dict(last)]
    return out


def test_the_kept_destinations_are_the_plain_ones_over_changing_bases() -> None:
    asked = patched = 0
    for seed in range(SEEDS):
        data = scenario(seed)
        parsed = rb._parse(data, [rb.need_of(data["pending"][0])], None)
        insts, _ = parsed.movable_of(None)
        if not insts:
            continue
        rnd = random.Random(seed)
        c, cache = parsed.cluster(), rb.DestCache()
        for base in bases(rnd, parsed.nodes):
            gen = cache.gen
            dests = rd._Dests(c, base, cache)
            for i in rnd.sample(insts, min(len(insts), 6)):
                avoid = {i.node} if i.node in base else set()
                assert dests.find(base, i, avoid) == ref_destination(c, base, i, avoid), seed
                asked += 1
                # a subset's later instance: one node changed by an earlier one, measured again
                nid = rnd.choice(sorted(base))
                nodes = {**base, nid: changed_copy(rnd, base[nid])}
                assert dests.find(nodes, i, avoid, [nid]) == ref_destination(c, nodes, i, avoid), seed
            patched += cache.gen > gen and cache.log.get(gen) is not None
    # the sequences exercise what is compared: many answers, ranked lists patched (not ranked again)
    assert asked >= 5000 and patched >= 1000, (asked, patched)


class Fresh(orb.RebalanceSim):
    """The replay with a fresh destinations' cache per plan (the planner before)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        assert self.move_index is not None
        self.move_index.dest_cache = None  # type: ignore[assignment]


def run(cls: type[orb.RebalanceSim], seed: int) -> orb.RebalanceSim:
    rng = random.Random(seed)
    ns, timed = replay_nodes(rng), replay_workload(rng, rng.randint(40, 70))
    s = cls(ns, timed, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, seed, 0, online.HEAD, online.MIN_DELTA,
            "seeded", frag_threshold=0.02, frag_wait_s=5.0)
    asyncio.run(s.run())
    return s


def test_the_replay_with_the_cache_kept_across_plans_makes_the_same_moves() -> None:
    moves = 0
    for seed in range(10):
        kept, fresh = run(orb.RebalanceSim, seed), run(Fresh, seed)
        assert kept.move_index is not None and isinstance(kept.move_index.dest_cache, rb.DestCache)
        assert kept.move_log == fresh.move_log, seed
        assert kept.log == fresh.log, seed
        moves += len(kept.move_log)
    assert moves >= 10, moves
