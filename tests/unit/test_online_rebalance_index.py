"""The rebalancer's replay kept fast without changing a move (issue 38, docs/rebalance.md "Online
replay"): ``trace.online_rebalance.MoveIndex`` keeps the planner's parsed input (nodes, their
fragmentation, the running tasks' movable instances) as tasks are placed, leave and move, instead
of ``handlers.rebalance.rebalance_input`` rebuilt from every view and running task per plan. Old
and new run side by side on seeded workloads: at every plan the index equals the parse of the
rebuilt input, and the runs make the same moves, placements and figures."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aios_blocks.handlers import rebalance as hr
from aios_blocks.policies.builtin import preempt as bp
from aios_blocks.policies.builtin import rebalance as rb
from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import node_from_row
from aios_blocks.trace.workload import Task

SEEDS = 10


def nodes(rng: random.Random) -> list[Any]:
    return [node_from_row({"sn": f"n{i}", "cpu_milli": 64000, "memory_mib": 262144, "gpu": rng.choice((2, 4, 4, 8)),
                           "model": rng.choice(("V100M32", "V100M32", "T4"))}, "trace", "t") for i in range(rng.randint(3, 7))]


def workload(rng: random.Random, n: int) -> list[online.Timed]:
    """Many short 1-GPU tasks that leave holes, and multi-GPU tasks that need them whole."""
    out = []
    for i in range(n):
        gpus = rng.choice((1, 1, 1, 2, 2, 4))
        milli = 1000 if gpus > 1 or rng.random() < 0.7 else rng.choice((250, 500))
        out.append(online.Timed(Task(f"t{i:03d}", 1000, 2048, gpus, milli, rng.choice(("", "", "T4")),
                                     rng.choice(("LS", "BE", "Burstable"))), rng.uniform(0, 200), rng.uniform(5, 120)))
    return out


def snapshot(ix: orb.MoveIndex) -> tuple[Any, ...]:
    return (list(ix.nodes.items()), {n: f for n, (_, f) in ix.frags.items()}, ix.movable(None), ix.movable(0))


class Checked(orb.RebalanceSim):
    """The incremental sim that, before each plan and after each move, compares its index with
    the parse of the input rebuilt from every view and running task."""

    plans = 0

    def rebuilt(self, ceiling: int | None) -> tuple[Any, ...]:
        rows = [{**self.row(b, r), "status": "ready"} for b, r in self.running.items() if r.place is not None]
        data = hr.rebalance_input(online.CLUSTER, self.views, rows, [], 2, hr.Trigger.PENDING, workload=self.st.shapes,
                                  measure=False)
        nodes = bp._nodes(data["cluster"])
        c = rb.Cluster(nodes, rb.workload_of(data["workload"], [], []))
        return (list(nodes.items()), {n: c.frag(n) for n in nodes}, rb.movable(data, None), rb.movable(data, ceiling))

    def check(self) -> None:
        assert self.move_index is not None
        assert snapshot(self.move_index) == self.rebuilt(0)

    async def moves_for(self, j: online.Job, now: float) -> bool:
        self.check()
        Checked.plans += 1
        return await super().moves_for(j, now)

    def move(self, bid: str, to: str, gpus: list[str]) -> None:
        super().move(bid, to, gpus)
        self.check()


def run(cls: type[orb.RebalanceSim], seed: int, incremental: bool) -> orb.RebalanceSim:
    rng = random.Random(seed)
    ns, timed = nodes(rng), workload(rng, rng.randint(40, 70))
    s = cls(ns, timed, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, seed, 0, online.HEAD, online.MIN_DELTA, "seeded",
            incremental_moves=incremental)
    asyncio.run(s.run())
    return s


def test_the_index_gives_the_moves_of_the_rebuilt_input_on_seeded_workloads() -> None:
    moves = 0
    for seed in range(SEEDS):
        old = run(orb.RebalanceSim, seed, incremental=False)
        new = run(Checked, seed, incremental=True)
        assert new.move_log == old.move_log, seed  # the same moves, at the same times, in order
        assert orb.figures(new) == orb.figures(old), seed
        moves += len(new.move_log)
    # the workloads fragment (moves were made: the index was updated on them and checked after)
    assert moves >= SEEDS and Checked.plans > moves, (moves, Checked.plans)
