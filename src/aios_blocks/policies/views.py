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
    """Per (inventory view, shape, rank): the ids of the nodes that fit one instance, sorted by
    ``(rank(view), id)``, kept from the view's change log. With ``by_state`` (``score, tie``:
    ``capacity.best_fit``), whether a node fits and its score are kept per node state, each
    distinct state scored once, and a node's rank is its state's score and its id's tie."""

    def __init__(self, ref: Any, fits_key: Any, fits: Any, rank_key: Any, rank: Any,
                 by_state: tuple[Any, Any] | None = None) -> None:
        self.ref = ref
        self.fits_key, self.fits, self.rank_key, self.rank = fits_key, fits, rank_key, rank
        self.score: Any = by_state[0] if by_state is not None else None
        self.tie: Any = by_state[1] if by_state is not None else None
        #: state id -> its score, or ``_NO_FIT``
        self.by_state: dict[int, Any] = {}
        #: id -> (its view, its sort key or None when it does not fit); with ``by_state`` the
        #: nodes that did not fit at the last full pass may be absent
        self.entries: dict[str, tuple[NodeView, Any]] = {}
        self.order: list[tuple[Any, str]] = []
        self.seen = -1

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
                i = bisect_left(self.order, (old[1], nid))
                del self.order[i]
        if view is None:
            return
        r = self._key(nid, view)
        self.entries[nid] = (view, r)
        if r is not None:
            insort(self.order, (r, nid))

    def update(self) -> None:
        ref = self.ref
        changed = ref.changed_since(self.seen) if self.seen >= 0 else None
        self.seen = ref.version
        if changed is not None:
            for nid in set(changed):
                self._set(nid, ref.get(nid))
            return
        # every node: one sort, not an insertion each
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
            if self._by_buckets(ref, knowns, entries, order):
                self.entries, self.order = entries, order
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
        self.entries, self.order = entries, order

    def _by_buckets(self, ref: Any, knowns: dict[int, Any], entries: dict[str, tuple[NodeView, Any]],
                    order: list[tuple[Any, str]]) -> bool:
        """A full pass's ``order`` (and ``entries``) without sorting every node: the view's ids in
        tie order (``Nodes.tie_order``, kept while no id is added or removed: the same for every
        shape) put in buckets of equal state score, the few distinct scores sorted (each state's
        score hashed once, not each node's). The same list
        as sorting ``((score, *tie(id)), id)``: a tie is unique per id (it ends with the id).
        False (nothing filled) when a score cannot key a bucket (unhashable, or not equal to
        itself: a NaN, which the sort orders its own way)."""
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
        slot: dict[int, int] = {}  # state -> its score's place among the distinct scores
        ranked = sorted(groups)
        for i, k in enumerate(ranked):
            for sid in groups[k]:
                slot[sid] = i
        buckets: list[list[str]] = [[] for _ in ranked]
        of = ref.state_ids()
        for nid in ref.tie_order(self.tie):
            at = slot.get(of[nid])
            if at is not None:
                buckets[at].append(nid)
        tie = self.tie
        for bucket in buckets:
            for nid in bucket:
                r = (knowns[of[nid]], *tie(nid))
                entries[nid] = (ref[nid], r)
                order.append((r, nid))
        return True
