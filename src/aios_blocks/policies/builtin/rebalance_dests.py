"""``builtin:rebalance-min``'s destinations (docs/rebalance.md "The planner's search"): where a
moved instance goes (``_entry``: a node as its destination, ``_Dests``: the nodes ranked per
instance shape), kept across the steps of a plan and, for a caller that keeps its input
(``rebalance.Prepared``), across plans (``DestCache``); and the pending block's count per node
(``_Counts``). Pure."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .frag import UNITS, Workload
from .preempt import Need, _Node, node_fits

if TYPE_CHECKING:
    from .rebalance import Cluster, Inst

#: a ranked list is patched for at most this many changed nodes (else ranked again)
PATCH = 16

_Entry = tuple[float, float, str, tuple[str, ...]]


def _left(n: _Node) -> tuple[int, ...]:
    return tuple(max(0, min(UNITS, round(v[1] * UNITS))) for v in n.gpus.values())


def _model(n: _Node) -> str:
    return str(next(iter(n.gpus.values()))[0]) if n.gpus else ""


def _on(nodes: Mapping[str, _Node], room: frozenset[str] | None) -> Mapping[str, _Node]:
    """The nodes a pending block may use (``room``: its targets; None: all)."""
    return nodes if room is None else {nid: n for nid, n in nodes.items() if nid in room}


def _count(nodes: Mapping[str, _Node], need: Need) -> int:
    """How many instances of ``need`` the cluster takes (at most its gang)."""
    got = 0
    for n in nodes.values():
        got += node_fits(n, need, need.count - got)
        if got >= need.count:
            break
    return got


#: where an instance goes: (node, its GPUs there, its fragmentation there after minus before)
_Dest = tuple[str, tuple[str, ...], float]


def _entry(c: Cluster, nid: str, n: _Node, i: Inst) -> tuple[float, float, str, tuple[str, ...]] | None:
    """Node ``nid`` (state ``n``) as a destination of ``i``: (its fragmentation there after minus
    before, minus its block's score there, the node, the GPUs it takes), None when it may not go
    there. Where it goes is the node of the least of these (``_Dests``)."""
    gpus = c.pick_on(nid, n, i)
    if gpus is None:
        return None
    if n.gpus:  # the node's fragmentation with the instance on it, without copying the node
        units = max(0, min(UNITS, round(i.share * UNITS)))
        left = _left(n)
        taken = set(gpus)
        after = tuple(max(0, x - units) if g in taken else x for g, x in zip(n.gpus, left, strict=True))
        d = c.wl.frag(_model(n), n.cpu - i.cpu, after) - c.wl.frag(_model(n), n.cpu, left)
    else:
        d = 0.0
    return (d, -i.score(nid), nid, gpus)


class DestCache:
    """Where instances go, kept while what it depends on is the same. ``_entry`` reads the node's
    state, the instance's ``Inst.dest_key``, the workload and the topology, nothing else:

    * ``table``: each node's entries per shape, for the last two state objects of the node (the
      planner copies a node it changes, and a caller that keeps its nodes, ``Prepared``, replaces
      the ones that change: a state object is never changed once measured);
    * ``ranked``: per shape, the nodes of the last base (``rebase``) ranked by their entries, kept
      from one base to the next and patched for the nodes whose state object changed (their
      entries taken out, the new ones put in at their rank: the rank is unique per node).

    A plan makes its own; a ``Prepared`` with a ``dest_cache`` hands one kept across plans. The
    same answers as measuring every node of the base (tests/unit/test_rebalance_search.py)."""

    def __init__(self) -> None:
        self.per: dict[str, list[tuple[_Node, dict[tuple[Any, ...], _Entry | None]]]] = {}
        self.wl: Workload | None = None
        self.topology: Mapping[str, Mapping[str, Any]] = {}
        #: the nodes the ranked lists are for, and its generation (bumped at each change)
        self.base: dict[str, _Node] = {}
        self.gen = 0
        #: generation g -> the nodes changed from g to g + 1 (None: too many, rank again)
        self.log: dict[int, frozenset[str] | None] = {}
        #: shape -> (the generation it was ranked at, its ranked entries)
        self.ranked: dict[tuple[Any, ...], tuple[int, list[_Entry]]] = {}

    def for_cluster(self, c: Cluster) -> DestCache:
        """This cache, emptied when ``c``'s workload or topology is not the one it was made on."""
        if self.wl is not c.wl or self.topology != c.topology:
            self.per.clear()
            self.ranked.clear()
            self.wl, self.topology = c.wl, c.topology
        return self

    def table(self, nid: str, n: _Node) -> dict[tuple[Any, ...], _Entry | None]:
        """Node ``nid``'s entries per shape for state ``n`` (empty for a state not seen lately)."""
        kept = self.per.setdefault(nid, [])
        for k, (m, t) in enumerate(kept):
            if m is n:
                if k:
                    kept.insert(0, kept.pop(k))
                return t
        t = {}
        kept.insert(0, (n, t))
        del kept[2:]
        return t

    def entry(self, c: Cluster, nid: str, n: _Node, i: Inst) -> _Entry | None:
        known = self.table(nid, n)
        key = i.dest_key
        if key in known:
            return known[key]
        e = known[key] = _entry(c, nid, n, i)
        return e

    def rebase(self, base: Mapping[str, _Node]) -> int:
        """Make ``base`` the nodes the ranked lists are for (the nodes whose state object is not
        the last base's, or that it had and ``base`` has not, logged as changed): its generation."""
        old = self.base
        changed = {nid for nid, n in base.items() if old.get(nid) is not n}
        if len(old) > len(base) - len(changed):
            changed |= old.keys() - base.keys()
        if changed:
            self.log[self.gen] = frozenset(changed) if len(changed) <= PATCH else None
            self.log.pop(self.gen - 64, None)
            self.gen += 1
            self.base = dict(base)
        return self.gen

    def ranked_for(self, c: Cluster, i: Inst) -> list[_Entry]:
        """The base's nodes ranked as destinations of ``i`` (``rebase`` first)."""
        key = i.dest_key
        got = self.ranked.get(key)
        if got is not None and got[0] == self.gen:
            return got[1]
        changed: set[str] | None = None
        if got is not None and self.gen - got[0] <= 64:
            changed = set()
            for g in range(got[0], self.gen):
                step = self.log.get(g)
                if step is None:
                    changed = None
                    break
                changed |= step
            if changed is not None and len(changed) > PATCH:
                changed = None
        if got is None or changed is None:
            out = [e for nid, n in self.base.items() if (e := self.entry(c, nid, n, i)) is not None]
            out.sort(key=_rank)
        else:
            out = [e for e in got[1] if e[2] not in changed]
            for nid in changed:
                n = self.base.get(nid)
                if n is not None and (e := self.entry(c, nid, n, i)) is not None:
                    bisect.insort(out, e, key=_rank)
        self.ranked[key] = (self.gen, out)
        return out


def _rank(e: _Entry) -> tuple[float, float, str]:
    return e[:3]


class _Dests:
    """Where instances go from the nodes of one planning step (``base``, never changed while it is
    used), ranked once per ``Inst.dest_key`` instead of every node tried per instance: the answer
    for a subset's later instance, once earlier ones took room on a few nodes (``changed``), is
    the best ranked node not changed, or one of the changed ones measured again. ``entries``
    (shared by the steps of one plan, or by the plans on one ``Prepared``) keeps the entries and
    the ranked lists (``DestCache``)."""

    def __init__(self, c: Cluster, base: Mapping[str, _Node], entries: DestCache):
        self.c, self.base, self.entries = c, base, entries.for_cluster(c)
        self.gen = entries.rebase(base)
        self.ranked: dict[tuple[Any, ...], list[_Entry]] = {}

    def _ranked(self, i: Inst) -> list[_Entry]:
        got = self.ranked.get(i.dest_key)
        if got is None:
            if self.entries.gen != self.gen:  # another step's base since: this one's again
                self.gen = self.entries.rebase(self.base)
            got = self.ranked[i.dest_key] = self.entries.ranked_for(self.c, i)
        return got

    def find(self, nodes: Mapping[str, _Node], i: Inst, avoid: set[str], changed: Iterable[str] = ()) -> _Dest | None:
        """The node of ``nodes`` (not in ``avoid``, not the instance's own) where the instance
        fragments least: (node, GPUs, its fragmentation there after minus before), or None when it
        fits nowhere else; ``nodes`` is ``base`` but for the nodes ``changed``. The same answer as
        measuring every node (tests/unit/test_rebalance_search.py)."""
        changed = set(changed)
        skip = avoid | changed | {i.node}
        best = next((e for e in self._ranked(i) if e[2] not in skip), None)
        for nid in changed:
            if nid in avoid or nid == i.node:
                continue
            e = _entry(self.c, nid, nodes[nid], i)
            if e is not None and (best is None or e[:3] < best[:3]):
                best = e
        return None if best is None else (best[2], best[3], best[0])


class _Counts:
    """``_count(_on(nodes, room), need)`` where ``nodes`` is ``base`` but for a few nodes: the
    base's count per node made once per planning step."""

    def __init__(self, base: Mapping[str, _Node], room: frozenset[str] | None, need: Need):
        self.base, self.room, self.need = base, room, need
        self.per = {nid: node_fits(n, need, need.count) for nid, n in _on(base, room).items()}
        self.total = sum(self.per.values())

    def count(self, nodes: Mapping[str, _Node], changed: Iterable[str]) -> int:
        got = self.total
        for nid in set(changed):
            if nid in self.per:
                got += node_fits(nodes[nid], self.need, self.need.count) - self.per[nid]
        return min(self.need.count, got)
