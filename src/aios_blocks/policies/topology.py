"""Which GPUs of a node an instance gets, by GPU topology (docs/topology.md). Pure.

A set's tier is its worst pair's (one GPU: NVSWITCH). Among the free GPUs :func:`choose` takes
the set with the best tier, then the one that leaves the best free
sets behind: for each size 8, 4, 2 (largest first) the best tier the remaining free GPUs still
give, then how many NVLink pairs remain; then the most NVLink links. So the node keeps its NVLink islands and pairs for the
multi-GPU instances that come later, whatever order they arrive in.

Small nodes (the usual 4-16 GPUs) are searched exhaustively, memoised per (topology, free set,
count); a node where that would take over ``EXHAUSTIVE_MAX`` candidate sets is chosen greedily.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..schemas.records import NodeView, TopologyRecord
from ..schemas.topology import NVLINK_TIERS, TIER_RANK, LinkTier

EXHAUSTIVE_MAX = 5000
#: the sizes whose best free set a choice tries to keep, largest first
KEEP_SIZES = (8, 4, 2)
_WORST = len(TIER_RANK)  # no set of that size is free


@dataclass(frozen=True)
class Choice:
    gpus: tuple[int, ...]  # GPU indexes, ascending
    tier: LinkTier  # the tier the chosen set achieves
    best: LinkTier  # the best tier any set of that size had among the node's free GPUs


class Compiled:
    """A topology as a rank matrix (rank[a][b]: TIER_RANK of the pair) and NVLink counts."""

    def __init__(self, n: int, rank: tuple[tuple[int, ...], ...], links: tuple[tuple[int, ...], ...]):
        self.n, self.rank, self.links = n, rank, links

    def set_rank(self, s: Sequence[int]) -> int:
        return max((self.rank[a][b] for a, b in itertools.combinations(s, 2)), default=0)

    def set_links(self, s: Sequence[int]) -> int:
        return sum(self.links[a][b] for a, b in itertools.combinations(s, 2))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - compiled topologies are few and kept (compile_topology's cache)
    def best_rank(self, free: frozenset[int], k: int) -> int:
        """The best tier rank a k-set of ``free`` has (``_WORST``: none of that size)."""
        if k > len(free):
            return _WORST
        if k <= 1:
            return 0
        cands = sorted(free)
        if _count(len(cands), k) > EXHAUSTIVE_MAX:
            return self.set_rank(_greedy(self, cands, k))
        best = _WORST
        for s in itertools.combinations(cands, k):
            r = self.set_rank(s)
            if r < best:
                best = r
                if r == 0:
                    break
        return best

    def leftover(self, free: frozenset[int]) -> tuple[int, ...]:
        """What a free set is worth to later instances (lower is better)."""
        nv = sum(1 for a, b in itertools.combinations(sorted(free), 2) if self.rank[a][b] <= _NVLINK_RANK)
        return (*(self.best_rank(free, k) for k in KEEP_SIZES if k <= self.n), -nv)


_NVLINK_RANK = max(TIER_RANK[t] for t in NVLINK_TIERS)


def _count(n: int, k: int) -> int:
    import math

    return math.comb(n, k)


def _greedy(c: Compiled, cands: list[int], k: int) -> tuple[int, ...]:
    """From each start GPU, add the GPU joining best (rank, then links); the best set found."""
    best: tuple[tuple[int, int], tuple[int, ...]] | None = None
    for start in cands:
        s = [start]
        rest = [g for g in cands if g != start]
        while len(s) < k:
            g = min(rest, key=lambda x: (max(c.rank[x][y] for y in s), -sum(c.links[x][y] for y in s), x))
            s.append(g)
            rest.remove(g)
        key = (c.set_rank(s), -c.set_links(s))
        if best is None or key < best[0]:
            best = (key, tuple(sorted(s)))
    assert best is not None
    return best[1]


@functools.lru_cache(maxsize=256)
def _compile(key: str, n: int, pairs: tuple[tuple[int, int, str, int], ...]) -> Compiled:
    rank = [[0] * n for _ in range(n)]
    links = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a != b:
                rank[a][b] = TIER_RANK[LinkTier.SYSTEM]
    for a, b, tier, k in pairs:
        if a < n and b < n:
            rank[a][b] = rank[b][a] = TIER_RANK[LinkTier(tier)]
            links[a][b] = links[b][a] = k
    return Compiled(n, tuple(map(tuple, rank)), tuple(map(tuple, links)))


def compile_topology(topology: TopologyRecord) -> Compiled:
    """A node view's ``topology`` (the schema's JSON form) -> its compiled form (cached)."""
    pairs = tuple((int(x["a"]), int(x["b"]), str(x["tier"]), int(x.get("nvlinks", 0))) for x in topology.get("links", []))
    return _compile(str(topology.get("profile", "")), int(topology.get("gpus", 0)), pairs)


def choose(topology: TopologyRecord, free: Sequence[int], count: int) -> Choice:
    """The best-connected ``count`` GPUs among ``free`` (indexes) that keep the best sets free."""
    c = compile_topology(topology)
    cands = sorted(g for g in set(free) if 0 <= g < c.n)
    if count > len(cands):
        raise ValueError(f"{count} GPUs asked, {len(cands)} free")
    all_free = frozenset(cands)
    best_possible = c.best_rank(all_free, count)
    if _count(len(cands), count) > EXHAUSTIVE_MAX:
        chosen = _greedy(c, cands, count)
    else:
        chosen = min(
            itertools.combinations(cands, count),
            key=lambda s: (c.set_rank(s), c.leftover(all_free - set(s)), -c.set_links(s), s),
        )
    return Choice(tuple(chosen), _tier(c.set_rank(chosen)), _tier(best_possible))


def set_tier(topology: TopologyRecord, gpus: Sequence[int]) -> LinkTier:
    """The tier a set of GPU indexes achieves (its worst pair)."""
    return _tier(compile_topology(topology).set_rank(sorted(gpus)))


def best_tier(topology: TopologyRecord, free: Sequence[int], count: int) -> LinkTier | None:
    """The best tier ``count`` of ``free`` could have (None: fewer free)."""
    c = compile_topology(topology)
    r = c.best_rank(frozenset(g for g in free if 0 <= g < c.n), count)
    return None if r >= _WORST else _tier(r)


def _tier(rank: int) -> LinkTier:
    return list(TIER_RANK)[rank]


def first_fit(free: Sequence[int], count: int) -> tuple[int, ...]:
    """The arrival-order-blind baseline: the lowest free indexes."""
    return tuple(sorted(free)[:count])


def choose_ids(node: NodeView, usable_ids: Sequence[str], count: int) -> tuple[list[str], Choice] | None:
    """``choose`` on a node view: GPU ids in, ids out (None: the node reports no topology, or one
    that does not cover its GPUs)."""
    topo = node.get("topology")
    if not topo or count < 1:
        return None
    index = {g["id"]: i for i, g in enumerate(node["gpus"])}
    if int(topo.get("gpus", 0)) != len(node["gpus"]):
        return None
    free = [index[g] for g in usable_ids if g in index]
    if len(free) < count:
        return None
    pick = choose(topo, free, count)
    ids = [node["gpus"][i]["id"] for i in pick.gpus]
    return ids, pick


def _pins_gpus(entries: Sequence[Any]) -> bool:
    """Affinity toward or away from a resource (a GPU by its id) decides GPUs itself."""
    for e in entries or ():
        tt = e.get("target_type") if isinstance(e, dict) else getattr(e, "target_type", "")
        if tt == "ResourceId":
            return True
    return False


def refine(
    node: NodeView, chosen: list[str], usable_ids: Sequence[str], share: bool, entries: Sequence[Any] = ()
) -> tuple[list[str], dict[str, str]]:
    """The GPUs an instance gets on the node a policy chose: the topology's pick among the usable
    ones when the node reports a topology, the instance takes whole GPUs and no affinity entry
    names GPUs; else the policy's own ``chosen``. Also what explain records: ``{"tier", "best"}``
    (the tier achieved, the best the node had free) for a multi-GPU instance on a node with a
    topology (``{}`` otherwise)."""
    count = len(chosen)
    topo = node.get("topology")
    if not topo or count < 1 or int(topo.get("gpus", 0)) != len(node["gpus"]):  # none, or not of these GPUs
        return chosen, {}
    index = {g["id"]: i for i, g in enumerate(node["gpus"])}
    if share or _pins_gpus(entries):
        if count < 2 or any(g not in index for g in chosen):
            return chosen, {}
        free = [index[g] for g in usable_ids if g in index]
        best = best_tier(topo, free, count)
        return chosen, {"tier": set_tier(topo, [index[g] for g in chosen]).value, "best": (best or LinkTier.SYSTEM).value}
    picked = choose_ids(node, usable_ids, count)
    if picked is None:
        return chosen, {}
    ids, pick = picked
    return ids, ({"tier": pick.tier.value, "best": pick.best.value} if count >= 2 else {})
