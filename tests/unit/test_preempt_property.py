"""Preemption without cascades (issue 36): 1,000 seeded random contention scenarios over the pure
planner (``builtin:preempt-min``), each checked against the rules by code independent of it:

* every victim is at least ``minDelta`` priority points below the preemptor, none is
  ``preemptible: false``;
* a victim block keeps its ``minInstances`` or loses every instance (gangs go whole);
* the whole preemptor (``minInstances``) fits once the victims are gone (checked by a first-fit of
  its own here), and nothing is evicted when it does not;
* the GPUs freed are at most what the preemptor needs plus one node's GPUs;
* **no cascade**: each victim, pending again right after, plans its own preemption under the same
  rules on the state the first one left; it must never evict the block that preempted it (nor any
  block within ``minDelta`` of its own priority): the loop of kueue#13662. The chains (a victim that
  evicts some block far enough below it) are counted and reported (docs/priority.md).

The mutants at the end break one rule each in the planner and show the checks catch it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from aios_blocks.policies.builtin import preempt

SCENARIOS = 1000
DELTA = 10
#: class values close to each other (within DELTA) as well as far apart
PRIORITIES = (0, 5, 100, 105, 1000, 1004, 10000)


@dataclass
class World:
    nodes: dict[str, list[str | None]]  # node -> per GPU: the instance holding it (None: free)
    models: dict[str, str]
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)  # bid -> priority, min, gpus, created, preemptible, insts
    clock: float = 0.0

    def place(self, bid: str, gpus: int, count: int, models: list[str] | None = None) -> dict[str, str] | None:
        """First fit of ``count`` instances of ``gpus`` GPUs each, or None (nothing changed)."""
        trial = {n: list(g) for n, g in self.nodes.items()}
        where: dict[str, str] = {}
        b = self.blocks[bid]
        for k in range(count):
            iid = f"{bid}-{len(b['insts']) + k}"
            for n, slots in trial.items():
                if models and self.models[n] not in models:
                    continue
                free = [i for i, s in enumerate(slots) if s is None]
                if len(free) >= gpus:
                    for i in free[:gpus]:
                        slots[i] = iid
                    where[iid] = n
                    break
            else:
                return None
        self.nodes = trial
        for iid, n in where.items():
            b["insts"][iid] = {"node": n, "created": self.clock}
            self.clock += 1
        return where

    def evict(self, iids: list[str]) -> None:
        for n, slots in self.nodes.items():
            self.nodes[n] = [None if s in iids else s for s in slots]
        for b in self.blocks.values():
            for iid in iids:
                b["insts"].pop(iid, None)

    def request(self, bid: str, count: int, delta: int, preempted_by: str = "") -> dict[str, Any]:
        b = self.blocks[bid]
        nodes = {n: {"cpu_free": 64, "mem_free": 1 << 20,
                     "gpus": {f"{n}-g{i}": {"model": self.models[n], "free": 1.0 if s is None else 0.0} for i, s in enumerate(slots)}}
                 for n, slots in self.nodes.items()}
        cands = []
        for cid, c in self.blocks.items():
            if cid == bid or not c["insts"]:
                continue
            insts = {iid: {"node_id": i["node"], "share": 1.0, "created": i["created"],
                           "gpus": [f"{i['node']}-g{k}" for k, s in enumerate(self.nodes[i["node"]]) if s == iid]}
                     for iid, i in c["insts"].items()}
            cands.append({"block_id": cid, "priority": c["priority"], "created": c["created"], "minInstances": c["min"],
                          "preemptible": c["preemptible"], "instances": insts})
        block = {"block_id": bid, "priority": b["priority"], "minInstances": count,
                 "resources": {"gpus": b["gpus"], "gpuModels": b["models"]}}
        if preempted_by:  # the controller marks a victim that waits (workers/queue.py): no cascades
            block["preemptedBy"] = preempted_by
        return {"action": "preempt", "minDelta": delta, "block": block,
                "cluster": {"cluster_id": "c", "nodes": nodes}, "candidates": cands}


def scenario(seed: int) -> tuple[World, str]:
    """A full cluster (every block that still fits placed) and one more block that does not fit."""
    rng = random.Random(seed)
    size = rng.choice((4, 8))
    world = World({f"n{i}": [None] * size for i in range(rng.randint(2, 6))}, {})
    world.models = {n: rng.choice(("A100", "A100", "H100")) for n in world.nodes}
    for k in range(rng.randint(6, 30)):
        bid = f"b{k}"
        mn = rng.randint(1, 3)
        world.blocks[bid] = {"priority": rng.choice(PRIORITIES), "min": mn, "gpus": rng.choice((1, 1, 2, 4, size)),
                             "created": float(k), "preemptible": rng.random() > 0.1, "insts": {},
                             "models": [rng.choice(("A100", "H100"))] if rng.random() < 0.2 else []}
        b = world.blocks[bid]
        if world.place(bid, b["gpus"], mn, b["models"]) is None:
            del world.blocks[bid]
            continue
        for _ in range(rng.randint(0, 2)):  # some surplus above minInstances
            world.place(bid, b["gpus"], 1, b["models"])
    pid = "p"
    world.blocks[pid] = {"priority": rng.choice(PRIORITIES), "min": rng.randint(1, 3), "gpus": rng.choice((1, 2, 4, size)),
                         "created": 1e6, "preemptible": True, "insts": {}, "models": []}
    return world, pid


def first_fit_count(world: World, gpus: int, models: list[str]) -> int:
    return sum(sum(1 for s in slots if s is None) // gpus for n, slots in world.nodes.items()
               if not models or world.models[n] in models)


@dataclass
class Tally:
    preemptions: int = 0
    waits: int = 0
    fits: int = 0
    victims: int = 0
    loops: int = 0
    chains: int = 0
    violations: list[str] = field(default_factory=list)


def check(seed: int, planner: Callable[[dict[str, Any]], dict[str, Any]], tally: Tally, delta: int = DELTA) -> None:
    world, pid = scenario(seed)
    p = world.blocks[pid]
    need = p["min"]
    bad = tally.violations.append
    if first_fit_count(world, p["gpus"], p["models"]) >= need:
        tally.fits += 1
        return
    out = planner(world.request(pid, need, delta))
    if not out["victims"]:
        tally.waits += 1
        return
    tally.preemptions += 1
    evicted = sorted(i for ids in out["victims"].values() for i in ids)
    tally.victims += len(evicted)
    owner = {iid: bid for bid, b in world.blocks.items() for iid in b["insts"]}
    hit: dict[str, list[str]] = {}
    for iid in evicted:
        hit.setdefault(owner[iid], []).append(iid)
    for vid, lost in hit.items():
        v = world.blocks[vid]
        if v["priority"] > p["priority"] - DELTA:
            bad(f"seed {seed}: victim {vid} at {v['priority']} is not {DELTA} below {p['priority']}")
        if not v["preemptible"]:
            bad(f"seed {seed}: victim {vid} is preemptible: false")
        if len(lost) != len(v["insts"]) and len(v["insts"]) - len(lost) < v["min"]:
            bad(f"seed {seed}: gang {vid} left with {len(v['insts']) - len(lost)} < min {v['min']}")
    freed = sum(sum(1 for s in slots if s in evicted) for slots in world.nodes.values())
    if freed > p["gpus"] * need + len(next(iter(world.nodes.values()))):
        bad(f"seed {seed}: freed {freed} GPUs for {p['gpus']} x {need}")
    world.evict(evicted)
    if world.place(pid, p["gpus"], need, p["models"]) is None:
        bad(f"seed {seed}: the preemptor does not fit after its victims went")
        return
    # each victim, pending again (marked preemptedBy, as the controller marks it), plans its own
    # preemption: ANY victim that preempts in turn is a cascade (issue 36: 0 of them); a loop is
    # the worst kind, one that evicts its preemptor or a block within minDelta of itself
    for vid, lost in hit.items():
        v = world.blocks[vid]
        back = v["min"] if not v["insts"] else len(lost)
        again = planner(world.request(vid, back, delta, preempted_by=pid))
        if not again["victims"]:
            continue
        tally.chains += 1
        bad(f"seed {seed}: victim {vid} ({v['priority']}) preempts in turn (a cascade)")
        owner = {iid: bid for bid, b in world.blocks.items() for iid in b["insts"]}
        for ids in again["victims"].values():
            for iid in ids:
                w = world.blocks[owner[iid]]
                if owner[iid] == pid or w["priority"] > v["priority"] - DELTA:
                    tally.loops += 1


def run_all(planner: Callable[[dict[str, Any]], dict[str, Any]], delta: int = DELTA, n: int = SCENARIOS) -> Tally:
    tally = Tally()
    for seed in range(n):
        check(seed, planner, tally, delta)
    return tally


def test_no_cascade_in_1000_seeded_contention_scenarios() -> None:
    tally = run_all(preempt.plan)
    print(f"\n{SCENARIOS} scenarios: {tally.preemptions} preemptions ({tally.victims} victim instances), "
          f"{tally.waits} waits, {tally.fits} fit without; loops {tally.loops}, chains {tally.chains}")
    assert tally.violations == []
    assert tally.chains == 0 and tally.loops == 0  # no victim preempts in turn: 0 cascades
    # the scenarios contend: most arrivals do not fit and many preempt
    assert tally.preemptions > SCENARIOS // 5 and tally.waits > 0


# -- the checks catch a planner that breaks a rule -------------------------------------------------
def test_a_planner_without_the_delta_rule_makes_cascades() -> None:
    def no_marker(i: dict[str, Any]) -> dict[str, Any]:
        return preempt.plan({**i, "block": {k: v for k, v in i["block"].items() if k != "preemptedBy"}}, min_delta=0)

    tally = run_all(no_marker, n=300)
    assert tally.loops > 0 and any("preempts" in v for v in tally.violations)


def test_a_planner_that_ignores_the_preempted_marker_makes_cascades() -> None:
    """Without the preemptedBy rule (the delta rule kept), victims preempt in turn: chains."""
    def no_marker(i: dict[str, Any]) -> dict[str, Any]:
        return preempt.plan({**i, "block": {k: v for k, v in i["block"].items() if k != "preemptedBy"}})

    tally = run_all(no_marker)
    assert tally.chains > 0 and any("a cascade" in v for v in tally.violations)


def test_a_planner_that_splits_gangs_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = preempt._blocks

    def split(candidates: Any, floor: int) -> list[preempt._Block]:
        return [preempt._Block(b.bid, b.priority, b.created, tuple(b.levels[-1][: k + 1] for k in range(len(b.levels[-1]))))
                for b in real(candidates, floor)]

    monkeypatch.setattr(preempt, "_blocks", split)
    tally = run_all(preempt.plan, n=300)
    assert any("gang" in v for v in tally.violations)


def test_a_planner_that_evicts_when_the_preemptor_cannot_fit_is_caught() -> None:
    def eager(i: dict[str, Any]) -> dict[str, Any]:
        out = preempt.plan(i)
        if out["victims"] or "fits without" in out["reason"]:
            return out
        low = [c for c in i["candidates"] if c["priority"] <= i["block"]["priority"] - DELTA and c.get("preemptible") is not False]
        victims: dict[str, list[str]] = {}
        for c in low[:1]:
            for iid, inst in c["instances"].items():
                victims.setdefault(inst["node_id"], []).append(iid)
        return {**out, "victims": victims}

    tally = run_all(eager, n=300)
    assert any("does not fit" in v or "freed" in v for v in tally.violations)
