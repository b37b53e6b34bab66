"""GPU topology in placement (issue 38, docs/topology.md): random arrival orders of 1/2/4-GPU
instances, with departures, on each simulated profile; ours (``policies.topology.choose``)
against an arrival-order-blind first fit (the lowest free indexes), on the same orders.

Per profile and size: how often an instance got an NVLink set (a pair / an island: every pair
NVLink or NVSwitch) *when the node still had one free* (the target: 100 %), how often it got one
at all, and how often it got the best tier the node had free.

    .venv/bin/python -m bench.topology --orders 1000
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aios_blocks.policies import topology as tp
from aios_blocks.schemas.topology import NVLINK_TIERS, PROFILES, LinkTier

Chooser = Callable[[dict[str, Any], Sequence[int], int], tuple[int, ...]]
SIZES = (1, 2, 4)
WEIGHTS = (0.4, 0.35, 0.25)


def ours(topo: dict[str, Any], free: Sequence[int], count: int) -> tuple[int, ...]:
    return tp.choose(topo, free, count).gpus


def first_fit(topo: dict[str, Any], free: Sequence[int], count: int) -> tuple[int, ...]:
    return tp.first_fit(free, count)


@dataclass
class Tally:
    placed: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    nvlink_free: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    nvlink_got_when_free: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    nvlink_got: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    best_got: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    #: (order, step, size, free, chosen) of each miss: an NVLink set was free and not given
    misses: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


def one_order(topo: dict[str, Any], seed: int, choose: Chooser, tally: Tally, steps: int = 40) -> None:
    """One random arrival order: arrivals of 1/2/4 GPUs and departures (30 % of steps when any
    instance runs); an instance that does not fit is turned away (the same for every chooser)."""
    rng = random.Random(seed)
    n = int(topo["gpus"])
    free = set(range(n))
    live: list[tuple[int, ...]] = []
    for step in range(steps):
        if live and rng.random() < 0.3:
            free |= set(live.pop(rng.randrange(len(live))))
            continue
        size = rng.choices(SIZES, WEIGHTS)[0]
        if size > len(free):
            continue
        best = tp.best_tier(topo, sorted(free), size)
        got = tuple(sorted(choose(topo, sorted(free), size)))
        assert len(got) == size and set(got) <= free, (got, free)
        tier = tp.set_tier(topo, got) if size > 1 else LinkTier.NVSWITCH
        tally.placed[size] += 1
        tally.best_got[size] += int(tier == best)
        tally.nvlink_got[size] += int(size > 1 and tier in NVLINK_TIERS)
        if size > 1 and best in NVLINK_TIERS:
            tally.nvlink_free[size] += 1
            if tier in NVLINK_TIERS:
                tally.nvlink_got_when_free[size] += 1
            else:
                tally.misses.append((seed, step, size, tuple(sorted(free)), got))
        free -= set(got)
        live.append(got)


def measure(profile: str, orders: int, choose: Chooser, seed: int = 0) -> Tally:
    topo = PROFILES[profile].model_dump(mode="json")
    tally = Tally()
    for k in range(orders):
        one_order(topo, seed * 1_000_003 + k, choose, tally)
    return tally


def _pct(a: int, b: int) -> float | None:
    return None if b == 0 else round(100.0 * a / b, 1)


def summary(t: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in (2, 4):
        out[f"{s}gpu"] = {
            "placed": t.placed[s],
            "nvlink_when_free_pct": _pct(t.nvlink_got_when_free[s], t.nvlink_free[s]),
            "nvlink_free_at_arrival": t.nvlink_free[s],
            "nvlink_pct": _pct(t.nvlink_got[s], t.placed[s]),
            "best_tier_pct": _pct(t.best_got[s], t.placed[s]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--orders", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {p: {"ours": summary(measure(p, args.orders, ours, args.seed)),
                   "first_fit": summary(measure(p, args.orders, first_fit, args.seed))} for p in PROFILES}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{args.orders} random arrival orders per profile (40 steps each: 1/2/4-GPU arrivals 40/35/25 %, 30 % departures)")
    print(f"{'profile':<20} {'size':<5} {'chooser':<10} {'NVLink when free':>17} {'NVLink':>8} {'best tier':>10} {'placed':>7}")
    for p, r in results.items():
        for s in ("2gpu", "4gpu"):
            for who in ("ours", "first_fit"):
                x = r[who][s]

                def f(v: float | None) -> str:
                    return "-" if v is None else f"{v:.1f} %"

                print(f"{p:<20} {s:<5} {who:<10} {f(x['nvlink_when_free_pct']):>17} {f(x['nvlink_pct']):>8} "
                      f"{f(x['best_tier_pct']):>10} {x['placed']:>7}")


if __name__ == "__main__":
    main()
