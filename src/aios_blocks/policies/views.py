"""What is derived from node views (the dicts built by ``state.store.node_view``), kept while a
view lives: figures memoised per view (:func:`derived`), each view's state (:func:`node_state`,
:func:`state_id`), the nodes of each state (:class:`States`) and the rank-ordered index of the
nodes that fit one instance of a shape (:class:`Ranked`, ``capacity.best_fit``). Views are
replaced, never edited in place, except by ``capacity.take`` (on copies), which drops what was
derived from the view it changes."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from ..schemas.records import NodeView

#: a GPU's compute, in thousandths: a view's ``share_free`` and a need's ``gpuShare`` x 1000
SHARE_UNITS = 1000

#: id(view) -> (the view, {what: value}): figures derived from a node view, kept while the view
#: lives; holding the view keeps its id from being reused while the entry exists.
_VIEWS: dict[int, tuple[NodeView, dict[Any, Any]]] = {}
_VIEWS_MAX = 200_000


def derived(node: NodeView, what: Any, compute: Any) -> Any:
    """``compute(node)``, memoised per view (by identity) and ``what``. Callers must not change
    what it returns."""
    hit = _VIEWS.get(id(node))
    if hit is None or hit[0] is not node:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        hit = _VIEWS[id(node)] = (node, {})
    memo = hit[1]
    value = memo.get(what, _MISSING)  # one look-up: a key is a tuple, hashed afresh at each one
    if value is _MISSING:
        value = memo[what] = compute(node)
    return value


_MISSING = object()


def node_state(node: NodeView) -> tuple[Any, ...]:
    """All that decides whether an instance fits a node view (``capacity.node_fits``) and all the
    built-in allocators' scores read: two views with the same state fit alike and score alike."""
    return (node.get("healthy", True), node["cpu_free"], node["memory_free"],
            tuple((g["exclusive"], g.get("share_free", SHARE_UNITS), g["instances"], g["memory_free"], g["memory"],
                   g.get("model")) for g in node["gpus"]))


#: node state -> its id (``state_id``). Ids are never reused: a memo keyed by one stays right
#: after this table is cleared (its states then get new ids).
_STATE_IDS: dict[tuple[Any, ...], int] = {}
_STATE_IDS_MAX = 200_000
_next_id = [0]


def _intern(node: NodeView) -> int:
    state = node_state(node)
    sid = _STATE_IDS.get(state)
    if sid is None:
        if len(_STATE_IDS) >= _STATE_IDS_MAX:
            _STATE_IDS.clear()
        sid = _STATE_IDS[state] = _next_id[0]
        _next_id[0] += 1
    return sid


def state_id(node: NodeView) -> int:
    """A small int per distinct :func:`node_state` (equal states, equal ids), memoised per view."""
    sid: int = derived(node, "state", _intern)
    return sid


class States:
    """Per inventory view (``capacity.Nodes``): each node's state id and the nodes of each state,
    caught up from the view's change log. On the trace's 1,213 nodes a few hundred states."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.of: dict[str, int] = {}
        #: state id -> its nodes (a dict as an ordered set)
        self.groups: dict[int, dict[str, None]] = {}
        self.seen = -1

    def _drop(self, nid: str) -> None:
        sid = self.of.pop(nid, None)
        if sid is not None:
            members = self.groups[sid]
            del members[nid]
            if not members:
                del self.groups[sid]

    def update(self) -> dict[int, dict[str, None]]:
        ref = self.ref
        changed = ref.changed_since(self.seen) if self.seen >= 0 else None
        self.seen = ref.version
        if changed is None:
            self.of, self.groups = {}, {}
            ids = ref.keys()
        else:
            ids = set(changed)
            for nid in ids:
                self._drop(nid)
        of, groups = self.of, self.groups
        for nid in ids:
            view = ref.get(nid)
            if view is not None:
                sid = of[nid] = state_id(view)
                groups.setdefault(sid, {})[nid] = None
        return groups


#: a state's entry in ``Ranked.by_state`` when one instance does not fit it
_NO_FIT = object()
_STATES_PER_INDEX = 50_000


class Ranked:
    """Per (inventory view, shape, rank): the ids of the nodes that fit one instance, in
    ``(rank(view), id)`` order, kept from the view's change log. With ``by_state`` (``score, tie``:
    ``capacity.best_fit``), whether a node fits and its score are kept per node state, each
    distinct state scored once, and a node's rank is its state's score and its id's tie: the
    nodes are then kept in buckets of equal score (``buckets``, the scores sorted in ``scores``),
    each bucket put in tie order only when a pick first walks it (:meth:`first`). A new shape's
    full pass thus costs O(states) plus a C-level extend per state, not a rank tuple and a sorted
    entry per node (~0.8 ms on the trace's 1,213 nodes, most of a new shape's plan), and its
    first pick sorts the one bucket it reads. Scores no bucket can key (unhashable, NaN), and
    ranks without ``by_state``: one sorted list of ``(rank, id)`` (``order``)."""

    def __init__(self, ref: Any, fits_key: Any, fits: Any, rank_key: Any, rank: Any,
                 by_state: tuple[Any, Any] | None = None) -> None:
        self.ref = ref
        self.fits_key, self.fits, self.rank_key, self.rank = fits_key, fits, rank_key, rank
        self.score: Any = by_state[0] if by_state is not None else None
        self.tie: Any = by_state[1] if by_state is not None else None
        #: state id -> its score, or ``_NO_FIT``
        self.by_state: dict[int, Any] = {}
        #: the list form: id -> (its view, its sort key or None when it does not fit); with
        #: ``by_state`` the nodes that did not fit at the last full pass may be absent
        self.entries: dict[str, tuple[NodeView, Any]] = {}
        self._order: list[tuple[Any, str]] = []
        #: the bucket form (None: the list form): score -> the ids of its nodes (in tie order
        #: unless the score is in ``loose``), the scores sorted, and each fitting id's score
        self.buckets: dict[Any, list[str]] | None = None
        self.scores: list[Any] = []
        self.loose: set[Any] = set()
        self.where: dict[str, Any] = {}
        self.seen = -1

    @property
    def order(self) -> list[tuple[Any, str]]:
        """Every fitting node's ``(rank, id)`` in rank order (the bucket form: a new list)."""
        if self.buckets is None:
            return self._order
        tie = self.tie
        return [((s, *tie(nid)), nid) for s in self.scores for nid in self._bucket(s)]

    def first(self, skip: Any, count: int) -> tuple[str, list[Any]] | None:
        """The first node in rank order not in ``skip`` with ``count`` usable GPUs at least:
        ``(id, its usable GPUs)``, or None (``capacity.best_fit``; call :meth:`update` first)."""
        fits_key, fits = self.fits_key, self.fits
        if self.buckets is None:
            entries = self.entries
            for _r, nid in self._order:
                if nid in skip:
                    continue
                usable = derived(entries[nid][0], fits_key, fits)
                if len(usable) >= count:
                    return nid, usable
            return None
        ref = self.ref
        for s in self.scores:
            for nid in self._bucket(s):
                if nid in skip:
                    continue
                usable = derived(ref[nid], fits_key, fits)
                if len(usable) >= count:
                    return nid, usable
        return None

    def _bucket(self, s: Any) -> list[str]:
        """The ids of score ``s``, put in tie order first if they are not yet."""
        assert self.buckets is not None
        members = self.buckets[s]
        if s in self.loose:
            members.sort(key=self.ref.tie_positions(self.tie).__getitem__)
            self.loose.discard(s)
        return members

    def _known(self, sid: int, view: NodeView) -> Any:
        """The score of the state ``sid`` (``view`` has it), or ``_NO_FIT``."""
        known = self.by_state.get(sid)
        if known is None:
            if len(self.by_state) >= _STATES_PER_INDEX:
                self.by_state.clear()
            fits = derived(view, self.fits_key, self.fits) is not None
            known = self.by_state[sid] = self.score(view) if fits else _NO_FIT
        return known

    def _key(self, nid: str, view: NodeView) -> Any:
        """The node's rank, or None when one instance does not fit it."""
        if self.score is None:
            usable = derived(view, self.fits_key, self.fits)
            return derived(view, self.rank_key, self.rank) if usable is not None else None
        known = self._known(state_id(view), view)
        return None if known is _NO_FIT else (known, *self.tie(nid))

    def _set(self, nid: str, view: NodeView | None) -> None:
        old = self.entries.get(nid)
        if old is not None:
            if old[0] is view:
                return
            del self.entries[nid]
            if old[1] is not None:
                i = bisect_left(self._order, (old[1], nid))
                del self._order[i]
        if view is None:
            return
        r = self._key(nid, view)
        self.entries[nid] = (view, r)
        if r is not None:
            insort(self._order, (r, nid))

    def update(self) -> None:
        ref = self.ref
        changed = ref.changed_since(self.seen) if self.seen >= 0 else None
        self.seen = ref.version
        if changed is not None:
            if self.buckets is None:
                for nid in set(changed):
                    self._set(nid, ref.get(nid))
                return
            if self._catch_up(set(changed)):
                return
        # every node: one sort, not an insertion each
        self.buckets = None
        entries: dict[str, tuple[NodeView, Any]] = {}
        order: list[tuple[Any, str]] = []
        if self.score is None:
            for nid, view in ref.items():
                r = self._key(nid, view)
                entries[nid] = (view, r)
                if r is not None:
                    order.append((r, nid))
        else:  # each state scored once, its nodes ranked by their ties
            tie = self.tie
            knowns: dict[int, Any] = {}
            for sid, members in ref.states().items():
                known = self._known(sid, ref[next(iter(members))])
                if known is not _NO_FIT:
                    knowns[sid] = known
            if self._by_buckets(ref, knowns):
                self.entries, self._order = {}, []
                return
            for sid, members in ref.states().items():
                known = knowns.get(sid, _NO_FIT)
                if known is _NO_FIT:
                    continue
                for nid in members:
                    r = (known, *tie(nid))
                    entries[nid] = (ref[nid], r)
                    order.append((r, nid))
        order.sort()
        self.entries, self._order = entries, order

    def _by_buckets(self, ref: Any, knowns: dict[int, Any]) -> bool:
        """A full pass in the bucket form: each state's nodes put in the bucket of its score (the
        few distinct scores sorted; each state's score hashed once, not each node's), each
        bucket left to be put in tie order (``Nodes.tie_positions``, kept while no id is added or
        removed: the same for every shape) when a pick first reads it. The same order as sorting
        ``((score, *tie(id)), id)``: a tie is unique per id (it ends with the id). False (nothing
        changed) when a score cannot key a bucket (unhashable, or not equal to itself: a NaN,
        which the sort orders its own way)."""
        groups: dict[Any, list[int]] = {}  # score -> its states
        try:
            for sid, known in knowns.items():
                group = groups.get(known)
                if group is None:
                    groups[known] = [sid]
                else:
                    group.append(sid)
        except TypeError:
            return False
        if any(k != k for k in groups):
            return False
        states = ref.states()
        buckets: dict[Any, list[str]] = {}
        where: dict[str, Any] = {}
        for known, sids in groups.items():
            members: list[str] = []
            for sid in sids:
                ids = states[sid]
                members.extend(ids)
                where.update(dict.fromkeys(ids, known))
            buckets[known] = members
        self.buckets, self.where, self.scores = buckets, where, sorted(groups)
        self.loose = {k for k, members in buckets.items() if len(members) > 1}
        return True

    def _catch_up(self, changed: set[str]) -> bool:
        """The bucket form brought to the view's version: each changed node moved to its new
        score's bucket (kept in tie order where it was). False when a new score cannot key a
        bucket (the caller makes a full pass)."""
        assert self.buckets is not None
        ref = self.ref
        moves: list[tuple[str, Any]] = []
        for nid in changed:
            view = ref.get(nid)
            known = _NO_FIT if view is None else self._known(state_id(view), view)
            if known is not _NO_FIT:
                try:
                    hash(known)
                except TypeError:
                    return False
                if known != known:
                    return False
            moves.append((nid, known))
        # the nodes removed from the view first: a bucket in tie order is searched by the view's
        # positions, which hold only its ids
        moves.sort(key=lambda m: m[0] in ref)
        for nid, known in moves:
            self._move(nid, known)
        return True

    def _move(self, nid: str, known: Any) -> None:
        assert self.buckets is not None
        buckets, where = self.buckets, self.where
        old = where.get(nid, _NO_FIT)
        if old is not _NO_FIT:
            if known is not _NO_FIT and (known is old or known == old):
                return  # the same score: the same bucket, the same place in it
            del where[nid]
            members = buckets[old]
            if len(members) == 1:
                del buckets[old]
                self.loose.discard(old)
                _remove_sorted(self.scores, old)
            elif old in self.loose or nid not in self.ref:
                members.remove(nid)
            else:
                pos = self.ref.tie_positions(self.tie)
                i = bisect_left(members, pos[nid], key=pos.__getitem__)
                if i < len(members) and members[i] == nid:
                    del members[i]
                else:
                    members.remove(nid)
        if known is _NO_FIT:
            return
        where[nid] = known
        into = buckets.get(known)
        if into is None:
            buckets[known] = [nid]
            insort(self.scores, known)
        elif known in self.loose:
            into.append(nid)
        else:
            insort(into, nid, key=self.ref.tie_positions(self.tie).__getitem__)


def _remove_sorted(items: list[Any], x: Any) -> None:
    """Remove ``x`` from the sorted list ``items`` (by bisection; by search if not found there)."""
    i = bisect_left(items, x)
    if i < len(items) and items[i] == x:
        del items[i]
    else:
        items.remove(x)
