"""The online replay's preemption kept fast without changing a decision (issue 36,
docs/priority.md "Online replay"): the planner's input kept by ``handlers.preemption.Index`` as
blocks come and go, its ``NO_FIT`` answers kept across capacity freed where the block still cannot
fit (``preempt.node_may_fit``), and ``_orders``' per-node plans from one pass. Old (rebuilt per
plan) and new run side by side on seeded workloads: the same inputs, the same victims, the same
figures."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from aios_blocks.handlers import preemption as pre
from aios_blocks.policies.builtin import preempt
from aios_blocks.trace import online
from aios_blocks.trace.inventory import node_from_row
from aios_blocks.trace.workload import Task

from .test_preempt_property import DELTA, scenario

#: seeded workloads compared (each run twice: kept short for make test)
SEEDS = 12


def nodes(rng: random.Random) -> list[Any]:
    return [node_from_row({"sn": f"n{i}", "cpu_milli": 64000, "memory_mib": 262144, "gpu": rng.choice((1, 2, 4, 8)),
                           "model": rng.choice(("V100M32", "V100M32", "T4"))}, "trace", "t") for i in range(rng.randint(3, 8))]


def workload(rng: random.Random, n: int) -> list[online.Timed]:
    out = []
    for i in range(n):
        gpus = rng.choice((1, 1, 1, 2, 4, 8))
        milli = 1000 if gpus > 1 or rng.random() < 0.7 else rng.choice((250, 500))
        spec = rng.choice(("", "", "T4"))
        out.append(online.Timed(Task(f"t{i:03d}", rng.choice((1000, 4000)), 2048, gpus, milli, spec,
                                     rng.choice(("LS", "BE", "Burstable", "Guaranteed"))),
                                rng.uniform(0, 200), rng.uniform(5, 80)))
    return out


class Checked(online.Sim):
    """The incremental sim that also builds each plan's input the old way and compares."""

    inputs = 0

    def plan_input(self, bid: str, j: online.Job) -> dict[str, Any]:
        new = super().plan_input(bid, j)
        floor = int(j.ir["priority"]) - self.min_delta
        placed = [self.row(b, r) for b, r in self.running.items() if r.place is not None and int(r.ir["priority"]) <= floor]
        assert new == pre.preempt_input(bid, j.ir, online.CLUSTER, self.views, placed, self.min_delta, j.preempted_by)
        Checked.inputs += 1
        return new


def run(sim_cls: type[online.Sim], seed: int, incremental: bool) -> online.Sim:
    rng = random.Random(seed)
    ns, timed = nodes(rng), workload(rng, rng.randint(25, 50))
    s = sim_cls(ns, timed, online.Mode.PREEMPTION, online.DEFAULT_POLICY, seed, 0, online.HEAD, online.MIN_DELTA, "seeded",
                incremental)
    asyncio.run(s.run())
    return s


def test_incremental_preemption_decides_as_the_rebuilt_one_on_seeded_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"plan": 0}
    real = preempt.plan

    def counted(data: dict[str, Any], min_delta: int | None = None) -> dict[str, Any]:
        calls["plan"] += 1
        return real(data, min_delta)

    monkeypatch.setattr(online.preempt, "plan", counted)
    preemptions = skipped = 0
    for seed in range(SEEDS):
        calls["plan"] = 0
        old = run(online.Sim, seed, incremental=False)
        old_calls = calls["plan"]
        calls["plan"] = 0
        new = run(Checked, seed, incremental=True)
        assert new.decisions == old.decisions, seed  # the same preemptors, the same victims, in order
        assert new.res.as_dict() == old.res.as_dict(), seed
        preemptions += len(new.decisions)
        skipped += old_calls - calls["plan"]
    # the workloads contend (preemptions), the kept NO_FIT answers spared planner calls, and every
    # call's input was compared with the rebuilt one
    assert preemptions > SEEDS and skipped > 0 and Checked.inputs > 0, (preemptions, skipped, Checked.inputs)


def _orders_before(allowed: list[Any], nodes: Any, insts: Any) -> list[list[Any]]:
    """``preempt._orders`` as it was (each node's plan by a scan of every block per node)."""
    orders = [sorted(allowed, key=lambda b: (b.priority, -b.created, b.bid)),
              sorted(allowed, key=lambda b: (b.priority, -len(b.levels[-1]), -b.created, b.bid))]
    for nid in nodes:
        on = [b for b in orders[0] if any(str(insts[i].get("node_id")) == nid for i in b.levels[-1])]
        if on:
            orders.append(on)
    return orders


def test_orders_in_one_pass_gives_the_same_plans_on_the_property_scenarios(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = []
    for seed in range(400):
        world, pid = scenario(seed)
        inputs.append(world.request(pid, world.blocks[pid]["min"], DELTA))
    new = [preempt.plan(i) for i in inputs]
    monkeypatch.setattr(preempt, "_orders", _orders_before)
    assert [preempt.plan(i) for i in inputs] == new
    assert sum(1 for o in new if o["victims"]) > 50


def test_node_may_fit_is_the_planner_on_one_node() -> None:
    """A node that fits once its evictable instances are gone says so; one whose only holder is
    too close in priority (or not preemptible) does not."""
    node = {"cpu_free": 8, "mem_free": 4096, "gpus": {"g0": {"model": "m", "free": 0.0}}}
    block = {"block_id": "hi", "priority": 1000, "minInstances": 1, "resources": {"gpus": 1, "cpu": 1, "memory": 1}}
    lo = {"block_id": "lo", "priority": 0, "created": 1, "preemptible": True, "minInstances": 1,
          "instances": {"lo-0": {"node_id": "n0", "gpus": ["g0"], "share": 1.0, "cpu": 1, "memory": 1, "created": 1}}}
    assert preempt.node_may_fit(block, "n0", node, [lo], DELTA)
    assert not preempt.node_may_fit(block, "n0", node, [{**lo, "priority": 995}], DELTA)
    assert not preempt.node_may_fit(block, "n0", node, [{**lo, "preemptible": False}], DELTA)
    assert not preempt.node_may_fit({**block, "resources": {"gpus": 2}}, "n0", node, [lo], DELTA)
