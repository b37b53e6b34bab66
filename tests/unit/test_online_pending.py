"""The online replay's queue walk kept fast without changing a decision (issue 38, docs/rebalance.md
"Online replay"): ``trace.online.Pending`` keeps the waiting blocks per shape in the queue's order
(the walk's head without sorting every waiting block per capacity event), and ``capacity.Overlay``
lets the walk judge "some node fits" on the views with its releases' copies over them from the
views' own fit index. Each is compared with the computation it replaces on seeded cases: the head
with ``Sim.head_entries_sorted`` at every walk (in every mode, with preemptions and with moves),
and the overlay's ``any_fits`` with a scan of the merged views."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aios_blocks.handlers import queue
from aios_blocks.policies import capacity
from aios_blocks.schemas.records import Needs
from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.replay import views_of

from .test_online_incremental import nodes, workload

SEEDS = 8


class Checked(online.Sim):
    """Every head read from ``Pending`` is compared with the sorted scan of every waiting block."""

    heads = 0
    longest = 0

    def head_entries(self) -> list[queue.Entry]:
        new = super().head_entries()
        assert new == self.head_entries_sorted()
        assert set(self.pending.head(self.views, len(self.pending) + 1)) <= set(self.pending)
        assert self.pending.first(self.head) == sorted(self.pending.values(), key=self.qkey)[: self.head]
        Checked.heads += 1
        Checked.longest = max(Checked.longest, len(self.pending))
        return new


class CheckedMoves(Checked, orb.RebalanceSim):
    pass


def run(cls: type[online.Sim], seed: int, mode: online.Mode, head: int) -> online.Sim:
    rng = random.Random(seed)
    ns, timed = nodes(rng), workload(rng, rng.randint(40, 80))
    s = cls(ns, timed, mode, online.DEFAULT_POLICY, seed, 0, head, online.MIN_DELTA, "seeded")
    asyncio.run(s.run())
    return s


def test_the_kept_head_is_the_sorted_scan_at_every_walk() -> None:
    """A small head (3) so that the blocks past it, the groups left out and the ones of blocks
    preempted (waiting again with a new age) all count."""
    preempted = 0
    for seed in range(SEEDS):
        for mode in online.Mode:
            s = run(Checked, seed, mode, 3)
            preempted += s.res.victims
            assert not s.pending.groups or s.pending.groups.keys() == {
                (capacity.shape(j.needs or {}, j.timed.task.sharing), s.must_fit(j)) for j in s.pending.values()}
    assert Checked.heads > 500 and Checked.longest > 10 and preempted > 0, (Checked.heads, Checked.longest, preempted)


def test_the_kept_head_is_the_sorted_scan_with_moves() -> None:
    moves = 0
    for seed in range(SEEDS // 2):
        s = run(CheckedMoves, seed, online.Mode.NO_PREEMPTION, 4)
        assert isinstance(s, orb.RebalanceSim)
        moves += s.moves
    assert moves > 0


def test_pending_is_a_dict_of_the_waiting_blocks() -> None:
    rng = random.Random(1)
    s = online.Sim(nodes(rng), workload(rng, 30), online.Mode.PREEMPTION, online.DEFAULT_POLICY, 1, 0, 64,
                   online.MIN_DELTA, "seeded")
    jobs = list(s.jobs.items())
    for bid, j in jobs:
        s.pending[bid] = j
    s.pending[jobs[0][0]] = jobs[0][1]  # put in again: still once
    del s.pending[jobs[1][0]]
    assert s.pending.pop(jobs[2][0]) is jobs[2][1] and s.pending.pop("gone", None) is None
    assert len(s.pending) == len(jobs) - 2
    assert sum(len(k) for k in s.pending.groups.values()) == len(s.pending)
    assert [e.bid for e in s.head_entries()] == [e.bid for e in s.head_entries_sorted()]
    s.pending.clear()
    assert not s.pending.groups and s.head_entries() == []


def _views(rng: random.Random) -> capacity.Nodes:
    rng2 = random.Random(rng.random())
    return views_of(nodes(rng2) + nodes(rng2))


def _taken(rng: random.Random, view: Any) -> Any:
    """A copy of the view with a random instance taken (or the same when none fits)."""
    needs: Needs = {"gpus": rng.choice((1, 2)), "gpuMemory": 0, "cpu": rng.choice((1, 8, 40)), "memory": 1024}
    gpus = capacity.node_fits(view, needs, False)
    if gpus is None or len(gpus) < needs["gpus"]:
        return view
    out = capacity.copy_node(view)
    capacity.take(out, [g["id"] for g in gpus[: needs["gpus"]]], needs, False)
    return out


def test_the_overlay_judges_as_a_scan_of_the_merged_views() -> None:
    shapes: list[tuple[Needs, bool]] = [({"gpus": g, "gpuMemory": 0, "cpu": c, "memory": 2048, **({"gpuModels": ["T4"]} if t else {})}, False)
              for g in (1, 2, 4, 8) for c in (1, 16, 60) for t in (False, True)]
    shapes += [({"gpus": 1, "gpuMemory": 0, "gpuShare": 0.5, "cpu": 1, "memory": 1024}, True)]
    answers = {True: 0, False: 0}
    for seed in range(60):
        rng = random.Random(seed)
        base = _views(rng)
        for needs, share in shapes:  # the base's index, as the replay's head builds it
            capacity.fitting(base, needs, share)
        for _step in range(4):
            ids = list(base)
            for nid in rng.sample(ids, rng.randint(0, 3)):  # the base changes between walks
                base[nid] = _taken(rng, base[nid])
            over = {nid: _taken(rng, _taken(rng, base[nid])) for nid in rng.sample(ids, rng.randint(1, len(ids)))}
            merged = capacity.overlay(base, over)
            assert isinstance(merged, capacity.Overlay) and merged == {**base, **over}
            for needs, share in shapes:
                want = any(capacity.node_fits(v, needs, share) is not None for v in {**base, **over}.values())
                assert capacity.any_fits(merged, needs, share) is want, (seed, needs)
                answers[want] += 1
    assert min(answers.values()) > 200, answers
    assert capacity.overlay({"a": {}}, {"b": {}}) == {"a": {}, "b": {}}  # a plain dict stays plain
