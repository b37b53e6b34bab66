"""Prices of GPU shares from the target workload, for packing shared GPUs (``builtin:fgd-plus``'s
``sharePacking``; docs/trace.md "Our policy", 5.).

A GPU that tasks share is a bin of ``UNITS`` thousandths; the shares are items. Given how often
each share size arrives (the target workload's weights: the task-type distribution FGD also
uses, never the actual future sequence), the cutting-stock LP "cover the expected shares with
the fewest GPUs" has a dual: a price ``y[s]`` per share size, at most 1 GPU for any set of
shares that fits on one GPU, as high as possible in total. ``y[s]`` is what a share of size ``s``
is worth in GPUs when the shares are packed as well as the distribution allows: 0.81 is worth a
whole GPU (nothing but a rare 0.16 completes it), 0.47 half of one (two fill a GPU), 0.32 a
third.

A GPU with ``h`` thousandths free is worth ``phi(h)``: the most the prices of shares that fit in
``h`` add up to (an unbounded knapsack), and an idle GPU 1 (a GPU). Placing a share ``s`` on it
*loses* ``phi(h) - phi(h - s) - y[s]`` (never negative): 0 when the share takes its part of one
of the best ways to fill the GPU, more when it spoils the GPU for the shares that would fill it
(a 0.32 on a GPU holding a 0.47 leaves 0.21, which only a 0.16 can use: it loses 1/6 of a GPU
where an idle GPU, filled by three 0.32s, loses nothing). Placing each share where it loses
least is the primal-dual rule of online stochastic bin packing (Gupta and Radovanović, "Interior
point based online stochastic bin packing", Operations Research 2020, use the same dual prices).

Pure Python (no LP library): the dual is solved by cutting planes, each LP a small dense
simplex (one variable per share size), each cut the best configuration for the current prices
(an unbounded knapsack over ``UNITS`` thousandths).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

UNITS = 1000
_EPS = 1e-9


def simplex_max(c: Sequence[float], rows: Sequence[Sequence[float]], b: Sequence[float]) -> list[float]:
    """max ``c . x`` subject to ``rows . x <= b``, ``x >= 0``, with every ``b >= 0`` (the origin is
    feasible: one phase). Dense tableau, Bland's rule (no cycling). Bounded problems only: the
    caller's rows bound every variable."""
    m, n = len(rows), len(c)
    # tableau: m rows of [x (n) | slacks (m) | rhs], objective row of reduced costs
    t = [[*map(float, rows[i]), *(1.0 if j == i else 0.0 for j in range(m)), float(b[i])] for i in range(m)]
    z = [*(-float(v) for v in c), *([0.0] * m), 0.0]
    basis = [n + i for i in range(m)]
    for _ in range(10_000):
        col = next((j for j in range(n + m) if z[j] < -_EPS), -1)  # Bland: the lowest index
        if col < 0:
            break
        best: tuple[float, int, int] | None = None
        for i in range(m):
            a = t[i][col]
            if a > _EPS:
                cand = (t[i][-1] / a, basis[i], i)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            raise ValueError("unbounded LP")
        r = best[2]
        pivot = t[r][col]
        t[r] = [v / pivot for v in t[r]]
        for i in range(m):
            if i != r and abs(t[i][col]) > _EPS:
                f = t[i][col]
                t[i] = [v - f * w for v, w in zip(t[i], t[r], strict=True)]
        f = z[col]
        z = [v - f * w for v, w in zip(z, t[r], strict=True)]
        basis[r] = col
    x = [0.0] * n
    for i, j in enumerate(basis):
        if j < n:
            x[j] = t[i][-1]
    return x


def best_fill(sizes: Sequence[int], prices: Sequence[float], room: int) -> tuple[list[float], list[list[int]]]:
    """Unbounded knapsack over ``0..room`` thousandths: ``value[h]``, the most the prices of shares
    fitting in ``h`` add up to, and ``take[h]``, how many of each size make it."""
    value = [0.0] * (room + 1)
    take: list[list[int]] = [[0] * len(sizes) for _ in range(room + 1)]
    for h in range(1, room + 1):
        best, arg = value[h - 1], -1  # leaving a thousandth empty is always possible
        for k, s in enumerate(sizes):
            if s <= h and value[h - s] + prices[k] > best + _EPS:
                best, arg = value[h - s] + prices[k], k
        value[h] = best
        if arg < 0:
            take[h] = take[h - 1]
        else:
            take[h] = list(take[h - sizes[arg]])
            take[h][arg] += 1
    return value, take


def best_value(sizes: Sequence[int], prices: Sequence[float], room: int) -> list[float]:
    """:func:`best_fill`'s ``value`` alone, the same floats (the same comparisons in the same
    order; a size above ``h`` is skipped there too), without its ``take`` (a list copied per
    thousandth), kept per (sizes, prices): ``phi`` and each CPU level's
    (:meth:`SharePrices.phi_at`, met on a live create's path the first time a node's CPUs reach
    a level: ~1.6 ms each with ``take``, half without; callers must not change the list)."""
    key = (tuple(sizes), tuple(prices), room)
    got = _VALUES.get(key)
    if got is not None:
        return got
    if len(_VALUES) >= 256:
        _VALUES.clear()
    got = _VALUES[key] = _best_value(sizes, prices, room)
    return got


#: (sizes, prices, room) -> :func:`best_value`'s list (shared: callers must not change it): the
#: policy instances of one workload (a rule with and one without ``gpuSharing``) share the prices
#: and so each level's table
_VALUES: dict[tuple[tuple[int, ...], tuple[float, ...], int], list[float]] = {}


def _best_value(sizes: Sequence[int], prices: Sequence[float], room: int) -> list[float]:
    order = sorted(range(len(sizes)), key=lambda k: sizes[k])
    if order != list(range(len(sizes))):  # not ascending: best_fill's own loop
        return best_fill(sizes, prices, room)[0]
    pairs = list(zip(sizes, prices, strict=True))
    value = [0.0] * (room + 1)
    for h in range(1, room + 1):
        best = value[h - 1]  # leaving a thousandth empty is always possible
        for s, p in pairs:
            if s > h:
                break
            v = value[h - s] + p
            if v > best + _EPS:
                best = v
        value[h] = best
    return value


def dual_prices(weights: dict[int, float], max_rounds: int = 500) -> dict[int, float]:
    """The cutting-stock dual for shares arriving with ``weights`` (size in thousandths ->
    frequency): the prices ``y`` maximising ``sum(weights[s] * y[s])`` with every set of shares
    that fits on one GPU priced at most 1 GPU. Cutting planes: the LP over the configurations met
    so far, then the best configuration at its prices; stop when none is priced over 1."""
    sizes = sorted(s for s, w in weights.items() if 0 < s < UNITS and w > 0)
    if not sizes:
        return {}
    c = [weights[s] for s in sizes]
    rows: list[list[float]] = [[float(UNITS // s) if j == i else 0.0 for j in range(len(sizes))] for i, s in enumerate(sizes)]
    y = [0.0] * len(sizes)
    for _ in range(max_rounds):
        y = simplex_max(c, rows, [1.0] * len(rows))
        value, take = best_fill(sizes, y, UNITS)
        if value[UNITS] <= 1 + 1e-7:
            break
        rows.append([float(k) for k in take[UNITS]])
    return {s: round(v, 9) for s, v in zip(sizes, y, strict=True)}


class SharePrices:
    """The prices of a workload's share sizes and each free amount's worth (``phi``): what
    placing a share on a GPU loses (:meth:`loss`, in GPUs).

    ``cpus`` (share size -> the fewest CPUs a shape of that size asks) makes the worth depend on
    the node's CPUs too: free compute on a node left with fewer CPUs than a size asks cannot
    take that size, so :meth:`loss` with ``cpu_after`` prices the free compute a share leaves by
    the sizes the node's CPUs can still take (``phi`` over those sizes only): a share leaving
    0.53 on a node with CPUs for no 0.47 leaves what only the smaller sizes fill."""

    def __init__(self, weights: dict[int, float], cpus: dict[int, float] | None = None):
        self.prices = dual_prices(weights)
        sizes = sorted(self.prices)
        self.phi = best_value(sizes, [self.prices[s] for s in sizes], UNITS)
        self._sizes = sizes
        #: (share, CPU levels after, before) -> (each free amount's loss, None until asked; phi after; phi before)
        self._losses: dict[Any, tuple[list[float | None], list[float], list[float]]] = {}
        #: each size's fewest CPUs (0: unknown, any node can take it)
        self.cpus = {s: float((cpus or {}).get(s, 0.0)) for s in sizes}
        #: the distinct CPU thresholds, ascending; level i: the sizes asking at most levels[i] CPUs
        self.levels = sorted(set(self.cpus.values()))
        self._phis: dict[int, list[float]] = {}

    def price(self, units: int) -> float:
        """A share's price; a size the workload does not have: the price of the largest size
        within it (what it can stand in for)."""
        got = self.prices.get(units)
        if got is not None:
            return got
        return max((self.prices[s] for s in self._sizes if s <= units), default=0.0)

    def loss(self, free: int, units: int, cpu_after: float | None = None, cpu_before: float | None = None) -> float:
        """GPUs lost by placing a share of ``units`` on a GPU with ``free`` thousandths free (an
        idle GPU is worth 1); with ``cpu_after`` (the node's CPUs once the share is placed) what
        it leaves is worth only what the sizes those CPUs can take fill; with ``cpu_before``
        (the node's CPUs before) what the GPU had free is worth only what the sizes those CPUs
        can take fill (an idle GPU still 1). A table per share size (and CPU levels), each free
        amount's entry computed on its first use: a node state new to a shape asks one or two of
        the 1,001 (filling them all at once cost ~1 ms per new table, on a live create's path)."""
        after, before = self.level(cpu_after), self.level(cpu_before)
        key = (units, after, before)
        table = self._losses.get(key)
        if table is None:
            table = self._losses[key] = ([None] * (UNITS + 1), self.phi_at(after), self.phi_at(before))
        h = min(free, UNITS)
        if h < 0:  # as the whole table's negative index read (never asked: a GPU's free share)
            h += UNITS + 1
        got = table[0][h]
        if got is None:
            got = table[0][h] = self._loss(h, units, table[1], table[2]) if h >= units else 0.0
        return got

    def stranded(self, left: Sequence[int], cpu_before: float, cpu_after: float, skip: int = -1) -> float:
        """GPUs' worth lost on a node's partly used GPUs (free thousandths ``left``, but the one at
        ``skip``) when its CPUs go from ``cpu_before`` to ``cpu_after``: free compute the sizes
        the remaining CPUs cannot take no longer fill."""
        before, after = self.level(cpu_before), self.level(cpu_after)
        if before == after:
            return 0.0
        had, phi = self.phi_at(before), self.phi_at(after)
        return round(sum(had[x] - phi[x] for i, x in enumerate(left) if 0 < x < UNITS and i != skip), 6)

    def level(self, cpu: float | None) -> int:
        """How many CPU thresholds ``cpu`` reaches (``len(levels)``: all of them, or no CPU given)."""
        if cpu is None or not self.levels or cpu + 1e-9 >= self.levels[-1]:
            return len(self.levels)
        return bisect.bisect_right(self.levels, cpu + 1e-9)

    def phi_at(self, level: int) -> list[float]:
        """``phi`` over the sizes whose fewest CPUs are within the first ``level`` thresholds."""
        if level >= len(self.levels):
            return self.phi
        got = self._phis.get(level)
        if got is None:
            within = [s for s in self._sizes if level and self.cpus[s] <= self.levels[level - 1]]
            got = self._phis[level] = best_value(within, [self.prices[s] for s in within], UNITS)
        return got

    def _loss(self, free: int, units: int, after: list[float], before: list[float]) -> float:
        worth = 1.0 if free >= UNITS else before[free]
        # rounded: equal losses must compare equal (the prices are LP floats)
        return max(0.0, round(worth - after[free - units] - self.price(units), 6))

    @classmethod
    def of_shapes(cls, shapes: Sequence[dict[str, Any]], with_cpus: bool = False,
                  quantile: float = 0.0) -> SharePrices | None:
        """The prices of a target workload's shares (shapes of one GPU with ``0 < gpuShare < 1``,
        whatever their models), None when it has none; ``with_cpus``: each size's CPUs too (see
        the class): the fewest its shapes ask, or with ``quantile`` q the fewest that q of the
        size's weight asks at most."""
        weights: dict[int, float] = {}
        asks: dict[int, list[tuple[float, float]]] = {}
        for s in shapes:
            share = round(float(s.get("gpuShare") or 0) * UNITS)
            if int(s.get("gpus", 0) or 0) == 1 and 0 < share < UNITS:
                w = float(s.get("weight", 0) or 0)
                weights[share] = weights.get(share, 0.0) + w
                asks.setdefault(share, []).append((float(s.get("cpu", 0) or 0), w))
        if not any(w > 0 for w in weights.values()):
            return None
        cpus: dict[int, float] = {}
        for share, items in asks.items():
            items.sort()
            total, acc = sum(w for _, w in items), 0.0
            cpus[share] = items[-1][0]
            for cpu, w in items:
                acc += w
                if acc >= quantile * total - 1e-12:
                    cpus[share] = cpu
                    break
        return cls(weights, cpus if with_cpus else None)
