"""Capacity arithmetic on node views (the dicts built by ``state.store.node_view``).

Used by the built-in allocators to choose, and by the controller to apply tentative placements to
its working snapshot between the allocation calls of one gang. The atomic reservation script in
``state/scripts.py`` applies the same rules at commit time; this is the optimistic half.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, insort
from typing import Any

import msgspec

from ..schemas.records import GpuView, NodeView, Totals
from ..schemas.records import Needs as Needs  # (re-exported: what one instance needs)
from .views import _VIEWS, Ranked, States
from .views import SHARE_UNITS as SHARE_UNITS  # (re-exported: a GPU's compute, in thousandths)
from .views import derived as derived  # (re-exported: figures memoised per view)
from .views import node_state as node_state  # (re-exported: all a score reads of a view)
from .views import state_id as state_id


def share_units(needs: Needs) -> int:
    """The thousandths of each GPU's compute one instance asks (``gpuShare`` x 1000; 0: none)."""
    return round(float(needs.get("gpuShare") or 0) * SHARE_UNITS)


def gpu_usable(gpu: GpuView, needs: Needs, share: bool) -> bool:
    if gpu["exclusive"]:
        return False
    models = needs.get("gpuModels")
    if models and gpu.get("model") not in models:
        return False
    if share:
        return (gpu["memory_free"] >= max(needs.get("gpuMemory", 0), 0) and gpu["memory"] >= needs.get("gpuMemory", 0)
                and gpu.get("share_free", SHARE_UNITS) >= share_units(needs))
    return gpu["instances"] == 0 and gpu["memory"] >= needs.get("gpuMemory", 0)


def node_fits(node: NodeView, needs: Needs, share: bool) -> list[GpuView] | None:
    """The node's usable GPUs if one instance fits on it, else None (callers must not change the
    list: it is memoised per view with :func:`usable_gpus`)."""
    if not node.get("healthy", True):
        return None
    if node["cpu_free"] + 1e-9 < needs.get("cpu", 0) or node["memory_free"] < needs.get("memory", 0):
        return None
    usable = usable_gpus(node, needs, share)
    if len(usable) < needs.get("gpus", 0):
        return None
    return usable


def usable_gpus(node: NodeView, needs: Needs, share: bool) -> list[GpuView]:
    """The node's GPUs one instance could use (``gpu_usable``, inlined), memoised per view by what
    decides it (GPU memory, sharing, share, models): a new task shape mostly differs from a known
    one in CPUs, memory or GPU count (89 shapes, 18 such keys in the trace's first 1,100 tasks),
    so ranking every node for it does not scan every GPU again. Callers must not change it."""
    mem = needs.get("gpuMemory", 0)
    units = share_units(needs) if share else 0
    models = needs.get("gpuModels")
    key = ("usable", mem, bool(share), units, tuple(models) if models else ())
    usable: list[GpuView] = derived(node, key, lambda n: _usable(n, mem, share, units, models))
    return usable


def _usable(node: NodeView, mem: int, share: bool, units: int, models: Any) -> list[GpuView]:
    if share:
        free = max(mem, 0)
        usable = [g for g in node["gpus"] if not g["exclusive"] and g["memory_free"] >= free and g["memory"] >= mem
                  and (not units or g.get("share_free", SHARE_UNITS) >= units)]
    else:
        usable = [g for g in node["gpus"] if not g["exclusive"] and g["instances"] == 0 and g["memory"] >= mem]
    if models and usable:
        usable = [g for g in usable if g.get("model") in models]
    return usable


def best_fit(
    nodes: dict[str, NodeView], skip: Any, fits_key: Any, fits: Any, rank_key: Any, rank: Any, count: int,
    by_state: tuple[Any, Any] | None = None,
) -> tuple[str, list[GpuView]] | None:
    """The node with the lowest ``(rank(view), node id)`` among those not in ``skip`` whose
    ``fits(view)`` has at least ``count`` GPUs: ``(node id, its usable GPUs)``, or None. Both
    figures are memoised per view (:func:`derived`). For views without affinity annotations (every
    view of a block with no affinity entries): an inventory view (:class:`Nodes`) keeps its
    fitting nodes in rank order, caught up in O(changes) (``views.Ranked``), so the answer is the first
    one not skipped; a plain dict is scanned once.

    ``by_state``, ``(score, tie)``: ``rank(view)`` is ``(score(view), *tie(node id))`` and
    ``score`` reads nothing of a view but its :func:`node_state` (as ``fits`` does): the index
    then scores each distinct node state once per shape, not each node (1,213 nodes of the trace,
    a few hundred states), and ranks a node by its state's score and its id's ``tie``."""
    if isinstance(nodes, Nodes):
        key = (fits_key, rank_key)
        index = nodes._ranked.get(key)
        if index is None:
            if len(nodes._ranked) >= _SHAPES_PER_VIEW:
                nodes._ranked.pop(next(iter(nodes._ranked)))
            index = nodes._ranked[key] = Ranked(nodes, fits_key, fits, rank_key, rank, by_state)
        index.update()
        return index.first(skip, count)
    views = _VIEWS
    best_rank: Any = None
    best: tuple[str, list[GpuView]] | None = None
    for nid, node in nodes.items():
        if nid in skip:
            continue
        hit = views.get(id(node))
        if hit is None or hit[0] is not node:
            derived(node, fits_key, fits)
            hit = views[id(node)]
        memo = hit[1]
        usable = memo[fits_key] if fits_key in memo else derived(node, fits_key, fits)
        if usable is None or len(usable) < count:
            continue
        r = memo[rank_key] if rank_key in memo else derived(node, rank_key, rank)
        if best is None or r < best_rank or (r == best_rank and nid < best[0]):
            best_rank, best = r, (nid, usable)
    return best


def healthy_ids(nodes: dict[str, NodeView]) -> list[str]:
    """The ids of the healthy nodes, sorted (a placement input's ``healthy_nodes``): a new list
    each call. An inventory view keeps the sorted list and catches it up from its change log."""
    def rebuilt() -> list[str]:
        return sorted(nid for nid, n in nodes.items() if n["healthy"])

    if not isinstance(nodes, Nodes):
        return rebuilt()
    memo = nodes._healthy
    version = nodes.version
    if memo is not None and memo[0] == version:
        return list(memo[1])
    changed = nodes.changed_since(memo[0]) if memo is not None else None
    if memo is None or changed is None:
        ids = rebuilt()
        nodes._healthy, nodes._healthy_json = (version, ids, set(ids)), None
        return list(ids)
    _, ids, members = memo
    for nid in set(changed):
        view = nodes.get(nid)
        now = view is not None and bool(view["healthy"])
        if now and nid not in members:
            insort(ids, nid)
            members.add(nid)
            nodes._healthy_json = None
        elif not now and nid in members:
            del ids[bisect_left(ids, nid)]
            members.discard(nid)
            nodes._healthy_json = None
    nodes._healthy = (version, ids, members)
    return list(ids)


def healthy_set(nodes: dict[str, NodeView], ids: list[str]) -> set[str]:
    """``set(ids)`` for a policy input's ``healthy_nodes`` (``ids``): when they are the healthy
    nodes an inventory view keeps for ``nodes`` now (``healthy_ids``, equal item for item), that
    view's set, not a new one of every id (callers must not change it)."""
    if isinstance(nodes, Nodes):
        memo = nodes._healthy
        if memo is not None and memo[0] == nodes.version and memo[1] == ids:
            return memo[2]
    return set(ids)


def unhealthy(nodes: dict[str, NodeView], healthy: set[str]) -> set[str]:
    """``nodes.keys() - healthy``: empty at once when ``healthy`` is the set ``healthy_set`` gave
    for ``nodes`` now and holds every node (a new set each call)."""
    if isinstance(nodes, Nodes):
        memo = nodes._healthy
        if memo is not None and memo[2] is healthy and memo[0] == nodes.version and len(healthy) == len(nodes):
            return set()
    return set(nodes.keys() - healthy)


#: id(view) -> (the view, its compact JSON, ``"sha256:<the JSON's SHA-256>"``): a node view's encoding and digest,
#: kept while the view lives (bounded; views are replaced, never edited in place except by
#: ``take``, which drops it)
_ENCODED: dict[int, tuple[NodeView, bytes, str]] = {}
_ENCODED_MAX = 8192
_encode = msgspec.json.Encoder().encode


def _encoding(node: NodeView) -> tuple[NodeView, bytes, str]:
    if "affinity" in node:  # an annotated view is a per-call copy (and annotated in place): never kept
        raw = _encode(node)
        return node, raw, "sha256:" + hashlib.sha256(raw).hexdigest()
    hit = _ENCODED.get(id(node))
    if hit is None or hit[0] is not node:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        raw = _encode(node)
        hit = _ENCODED[id(node)] = (node, raw, "sha256:" + hashlib.sha256(raw).hexdigest())
    return hit


def encoded(node: NodeView) -> msgspec.Raw:
    """``msgspec.json.encode(node)``, memoised per view (by identity): a placement's input holds up
    to ``sampleNodes`` views, mostly the same objects from one call to the next."""
    return msgspec.Raw(_encoding(node)[1])


def node_ref(node: NodeView) -> str:
    """``"sha256:"`` + the SHA-256 (hex) of ``msgspec.json.encode(node)``, memoised per view like
    :func:`encoded`: what a placement input's digest is made of (``schemas.events.input_digest_of``)."""
    return _encoding(node)[2]


def node_fits_cached(node: NodeView, needs: Needs, share: bool) -> list[GpuView] | None:
    """``node_fits``, memoised per view and shape (a placement looks at every node of a small
    cluster, and only the nodes that changed since the last one are different views)."""
    return derived(node, ("fits", *shape(needs, share)), lambda n: node_fits(n, needs, share))


def why_not(node: NodeView, needs: Needs, share: bool) -> str:
    """Human reason a node cannot take one instance (for explain/failed events)."""
    if not node.get("healthy", True):
        return "unhealthy"
    if node["cpu_free"] + 1e-9 < needs.get("cpu", 0):
        return f"cpu {node['cpu_free']:g} free < {needs.get('cpu', 0):g}"
    if node["memory_free"] < needs.get("memory", 0):
        return f"memory {node['memory_free']} MiB free < {needs.get('memory', 0)}"
    usable = [g for g in node["gpus"] if gpu_usable(g, needs, share)]
    models = needs.get("gpuModels")
    if models and needs.get("gpus", 0) and not any(g.get("model") in models for g in node["gpus"]):
        return f"no GPU of model {'|'.join(models)} (gpuModels)"
    return f"{len(usable)} usable GPUs < {needs.get('gpus', 0)}"


def take(node: NodeView, gpu_ids: list[str], needs: Needs, share: bool) -> None:
    """Apply one placement to a node view in place (the optimistic twin of RESERVE_GANG)."""
    _VIEWS.pop(id(node), None)  # what was derived from it no longer holds
    _ENCODED.pop(id(node), None)
    node["cpu_free"] = round(node["cpu_free"] - needs.get("cpu", 0), 6)
    node["memory_free"] -= needs.get("memory", 0)
    wanted = set(gpu_ids)
    units = share_units(needs) if share else 0  # an exclusive GPU is marked so; its share is not counted
    for g in node["gpus"]:
        if g["id"] in wanted:
            used = g["memory"] if not share else needs.get("gpuMemory", 0)
            g["memory_used"] += used
            g["memory_free"] -= used
            g["instances"] += 1
            g["exclusive"] = g["exclusive"] or not share
            if units:
                g["share_free"] = g.get("share_free", SHARE_UNITS) - units


def free_gpus(node: NodeView) -> int:
    return sum(1 for g in node["gpus"] if g["instances"] == 0 and not g["exclusive"])


def copy_nodes(nodes: dict[str, NodeView]) -> dict[str, NodeView]:
    """A copy deep enough for ``take`` (node dicts and GPU dicts)."""
    return {nid: copy_node(n) for nid, n in nodes.items()}


# -- node views that say what changed -------------------------------------------------------------
class Nodes(dict[str, NodeView]):
    """A cluster's node views (node id -> view) that logs which ids were set or removed, so the
    memos below catch up in O(changes) instead of scanning every node for replaced views. Views are
    replaced, never edited in place (``copy_node`` before ``take``). The log is compacted when it
    grows past the dict's size; a memo older than the compaction rescans once."""

    __slots__ = ("_base", "_dicts", "_fits", "_healthy", "_healthy_json", "_ids", "_log", "_pos", "_ranked", "_states",
                 "_ties", "_totals", "_witness")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._base = 0
        self._log: list[str] = []
        self._ids: list[str] | None = None  # list(self), kept while no id is added or removed
        self._pos: dict[str, int] | None = None
        # this cluster's capacity index (below): totals and, per shape, which nodes fit one
        # instance; kept with the view itself, so any number of clusters keeps its own
        self._totals: _Totals | None = None
        self._fits: dict[tuple[Any, ...], _Fits] = {}
        # per shape not indexed: the id of a node that fitted one instance when last asked
        # (``any_fits`` checks it first; a hint, never trusted without checking its view)
        self._witness: dict[tuple[Any, ...], str] = {}
        # per (fits key, rank key): the fitting nodes in rank order (``best_fit``)
        self._ranked: dict[tuple[Any, Any], Ranked] = {}
        # each node's state id and the nodes of each state (``states``)
        self._states: States | None = None
        # (version, the healthy nodes' ids sorted, the same as a set): ``healthy_ids``
        self._healthy: tuple[int, list[str], set[str]] | None = None
        # that list's JSON (None: not encoded since it last changed): ``healthy_json``
        self._healthy_json: bytes | None = None
        # per tie function: [the ``ids()`` it was made from, the ids in tie order, each id's place
        # in that order or None until asked]: ``tie_order``, ``tie_positions``
        self._ties: dict[Any, list[Any]] = {}
        # (version, whether every view is a dict then): ``all_dicts``
        self._dicts: tuple[int, bool] | None = None

    def ids(self) -> list[str]:
        """``list(self)`` (insertion order), cached until an id is added or removed: replacing a
        view keeps its place, so a placement does not copy every id (callers must not change it)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = list(dict.keys(self))
            self._pos = None
        return ids

    def states(self) -> dict[int, dict[str, None]]:
        """State id (``views.state_id``) -> the ids of the nodes in that state, caught up (callers
        must not change it)."""
        if self._states is None:
            self._states = States(self)
        return self._states.update()

    def state_ids(self) -> dict[str, int]:
        """Each node's state id (``views.state_id``), caught up as :meth:`states` (callers must not
        change it)."""
        self.states()
        assert self._states is not None
        return self._states.of

    def tie_order(self, tie: Any) -> list[str]:
        """The ids sorted by ``(tie(id), id)``, made once per ``tie`` (a policy's ``_tie``: it
        reads the id alone) and kept until an id is added or removed: every shape's full pass of
        ``views.Ranked`` walks it instead of sorting every node again (callers must not change it)."""
        return self._tie_entry(tie)[1]

    def all_dicts(self) -> bool:
        """Whether every view is a ``dict`` (``schemas.events.node_map``: a decision record's
        check that an input's node map is one), caught up from the change log: the views changed
        since the last answer checked, not all of them (on a live controller the trace's 1,213
        views are out of the CPU's caches between two placements: ~0.1 ms a record to read each
        one's type)."""
        version, memo = self.version, self._dicts
        if memo is not None and memo[0] == version:
            return memo[1]
        changed = self.changed_since(memo[0]) if memo is not None and memo[1] else None
        if changed is None:
            ok = set(map(type, self.values())) <= {dict}
        else:
            ok = all(type(v) is dict for v in map(self.get, changed) if v is not None)
        self._dicts = (version, ok)
        return ok

    def tie_positions(self, tie: Any) -> dict[str, int]:
        """Each id's place in :meth:`tie_order` (kept with it): ``views.Ranked`` keeps a bucket of
        equal scores in tie order by it (callers must not change it)."""
        hit = self._tie_entry(tie)
        if hit[2] is None:
            hit[2] = {nid: i for i, nid in enumerate(hit[1])}
        return hit[2]

    def _tie_entry(self, tie: Any) -> list[Any]:
        ids = self.ids()
        hit = self._ties.get(tie)
        if hit is None or hit[0] is not ids:
            if hit is None and len(self._ties) >= 8:
                self._ties.clear()
            hit = self._ties[tie] = [ids, sorted(ids, key=lambda nid: (tie(nid), nid)), None]
        return hit

    def healthy_json(self, ids: list[str]) -> bytes | None:
        """``msgspec.json.encode(ids)`` when ``ids`` are the healthy nodes this view keeps now
        (``healthy_ids``, equal item for item), encoded once until that list changes; else None.
        A decision record's digest (``schemas.events.input_digest_of``) encodes a placement
        input's ``healthy_nodes`` (the trace's 1,213 ids, ~22 KB) at every call otherwise."""
        memo = self._healthy
        if memo is None or memo[0] != self.version or memo[1] != ids:
            return None
        raw = self._healthy_json
        if raw is None:
            raw = self._healthy_json = _encode(memo[1])
        return raw

    def positions(self) -> dict[str, int]:
        """Each id's index in ``ids()``, cached the same way."""
        pos = self._pos
        if pos is None or self._ids is None:
            pos = self._pos = {nid: i for i, nid in enumerate(self.ids())}
        return pos

    def _members_changed(self) -> None:
        self._ids = None
        self._pos = None

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (a sandboxed policy's input) and copied as its items: the log stays here
        return (Nodes, (dict(self),))

    @property
    def version(self) -> int:
        return self._base + len(self._log)

    def _touch(self, nid: str) -> None:
        self._log.append(nid)
        if len(self._log) > max(1024, 2 * len(self)):
            self._base += len(self._log)
            self._log = []

    def changed_since(self, version: int) -> list[str] | None:
        """Ids set or removed since ``version`` (``None``: too old, rescan)."""
        if version < self._base:
            return None
        return self._log[version - self._base:]

    def __setitem__(self, nid: str, view: NodeView) -> None:
        if self._ids is not None and not dict.__contains__(self, nid):
            self._members_changed()
        super().__setitem__(nid, view)
        self._touch(nid)

    def __delitem__(self, nid: str) -> None:
        super().__delitem__(nid)
        self._members_changed()
        self._touch(nid)

    def pop(self, nid: str, *default: Any) -> Any:
        had = nid in self
        out = super().pop(nid, *default)
        if had:
            self._members_changed()
            self._touch(nid)
        return out

    def __ior__(self, other: Any) -> Nodes:  # type: ignore[override,misc]
        self.update(other)
        return self

    def update(self, *args: Any, **kwargs: Any) -> None:
        for nid, view in dict(*args, **kwargs).items():
            self[nid] = view

    def setdefault(self, nid: str, view: NodeView) -> NodeView:
        if nid not in self:
            self[nid] = view
        return self[nid]

    def clear(self) -> None:
        super().clear()
        self._members_changed()
        self._base += len(self._log) + 1
        self._log = []

    def popitem(self) -> tuple[str, NodeView]:
        nid, view = super().popitem()
        self._members_changed()
        self._touch(nid)
        return nid, view


def node_ids(nodes: dict[str, NodeView]) -> list[str]:
    """``list(nodes)``: cached by an inventory view (``Nodes.ids``), copied from a plain dict."""
    return nodes.ids() if isinstance(nodes, Nodes) else list(nodes)


# -- cluster totals, kept incrementally ------------------------------------------------------------
TOTAL_KEYS = ("gpus", "gpus_free", "gpu_memory_free", "cpu_free", "memory_free", "healthy_node_count")


def node_totals(node: NodeView) -> tuple[float, ...]:
    """One node's share of the cluster totals (free figures count only when healthy)."""
    if not node["healthy"]:
        return (len(node["gpus"]), 0, 0, 0.0, 0, 0)
    mem = sum(g["memory_free"] for g in node["gpus"])
    return (len(node["gpus"]), free_gpus(node), mem, node["cpu_free"], node["memory_free"], 1)


class _Totals:
    """Per nodes-dict memo: each node view's contribution, by identity, and their running sum.

    Node views are replaced (never edited) when the inventory refreshes, so a view that is the
    same object contributes the same; only replaced views are recomputed. The check is an identity
    scan (a few tens of ns per node) instead of re-summing every GPU of every node.
    """

    def __init__(self, nodes: dict[str, NodeView]):
        self.ref = nodes  # keeps id(nodes) from being reused while cached
        self.parts: dict[str, tuple[NodeView, tuple[float, ...]]] = {}
        self.sum = [0.0] * len(TOTAL_KEYS)
        self.seen = -1  # the Nodes version last caught up with (-1: never)

    def update(self) -> list[float]:
        parts, total = self.parts, self.sum
        ref = self.ref
        if isinstance(ref, Nodes):
            changed = ref.changed_since(self.seen) if self.seen >= 0 else None
            self.seen = ref.version
            if changed is not None:
                for nid in set(changed):
                    old = parts.pop(nid, None)
                    if old is not None:
                        total[:] = [a - c for a, c in zip(total, old[1], strict=True)]
                    view = ref.get(nid)
                    if view is not None:
                        new = node_totals(view)
                        parts[nid] = (view, new)
                        total[:] = [a + b for a, b in zip(total, new, strict=True)]
                return total
        for nid, view in ref.items():
            old = parts.get(nid)
            if old is not None and old[0] is view:
                continue
            new = node_totals(view)
            parts[nid] = (view, new)
            if old is None:
                total[:] = [a + b for a, b in zip(total, new, strict=True)]
            else:
                total[:] = [a + b - c for a, b, c in zip(total, new, old[1], strict=True)]
        if len(parts) != len(self.ref):  # nodes removed from the dict
            for nid in [nid for nid in parts if nid not in self.ref]:
                total[:] = [a - c for a, c in zip(total, parts.pop(nid)[1], strict=True)]
        return total


_TOTALS: dict[int, _Totals] = {}
_TOTALS_MAX = 64


# -- which nodes fit one instance of a shape, kept incrementally ----------------------------------
def shape(needs: Needs, share: bool) -> tuple[Any, ...]:
    """What decides whether one instance fits a node: its needs and whether it shares GPUs."""
    out: tuple[Any, ...] = (needs.get("gpus", 0), needs.get("gpuMemory", 0), needs.get("cpu", 0), needs.get("memory", 0), bool(share))
    if needs.get("gpuShare") or needs.get("gpuModels"):  # only then: a shape without them keeps its key
        out += (share_units(needs), tuple(sorted(needs.get("gpuModels") or ())))
    return out


class _Fits:
    """Per (nodes dict, shape) memo: whether each node view fits one instance, by identity, which
    ones do and how many. Blocks of one component share a shape, so a cluster is judged by a count
    kept as node views are replaced, not by re-checking every GPU of every node per block; a
    sample reads the flags (``fits``) instead of the views."""

    def __init__(self, nodes: dict[str, NodeView], needs: Needs, share: bool):
        self.ref = nodes
        self.needs, self.share = needs.copy(), share
        self.parts: dict[str, tuple[NodeView, bool]] = {}
        #: the ids whose view fits one instance (len = count)
        self.ids: set[str] = set()
        self.count = 0
        self.seen = -1

    def _set(self, nid: str, view: NodeView | None) -> None:
        old = self.parts.pop(nid, None) if view is None else self.parts.get(nid)
        if old is not None and old[1]:
            self.count -= 1
            self.ids.discard(nid)
        if view is None:
            return
        fits = node_fits(view, self.needs, self.share) is not None
        self.parts[nid] = (view, fits)
        if fits:
            self.count += 1
            self.ids.add(nid)

    def update(self) -> int:
        parts = self.parts
        ref = self.ref
        if isinstance(ref, Nodes):
            changed = ref.changed_since(self.seen) if self.seen >= 0 else None
            self.seen = ref.version
            if changed is not None:
                for nid in set(changed):
                    self._set(nid, ref.get(nid))
                return self.count
        for nid, view in ref.items():
            old = parts.get(nid)
            if old is None or old[0] is not view:
                self._set(nid, view)
        if len(parts) != len(self.ref):
            for nid in [nid for nid in parts if nid not in self.ref]:
                self._set(nid, None)
        return self.count

    def fits(self, nid: str) -> bool:
        """Whether node ``nid`` fits one instance (after ``update``)."""
        part = self.parts.get(nid)
        return part is not None and part[1]


_FITS: dict[tuple[int, tuple[Any, ...]], _Fits] = {}
#: shapes indexed per inventory view (a component each); the oldest is dropped past this
_SHAPES_PER_VIEW = 128  # a production trace has ~90 task shapes (docs/trace.md)


def fit_index(nodes: dict[str, NodeView], needs: Needs, share: bool) -> _Fits:
    """The capacity index of ``nodes`` for one shape, caught up: kept on an inventory view
    (``Nodes``) for as long as it lives, else in a bounded memo by the dict's identity."""
    key = shape(needs, share)
    if isinstance(nodes, Nodes):
        memo = nodes._fits.get(key)
        if memo is None:
            if len(nodes._fits) >= _SHAPES_PER_VIEW:
                nodes._fits.pop(next(iter(nodes._fits)))
            memo = nodes._fits[key] = _Fits(nodes, needs, share)
    else:
        gkey = (id(nodes), key)
        memo = _FITS.get(gkey)
        if memo is None or memo.ref is not nodes:
            if len(_FITS) >= 4 * _TOTALS_MAX:
                _FITS.clear()
            memo = _FITS[gkey] = _Fits(nodes, needs, share)
    memo.update()
    return memo


def fitting(nodes: dict[str, NodeView], needs: Needs, share: bool) -> int:
    """How many of ``nodes`` can take one instance (healthy, CPU, memory, usable GPUs): the
    filter's capacity check, kept incrementally per nodes dict and shape."""
    return fit_index(nodes, needs, share).count


class Overlay(dict[str, NodeView]):
    """``{**base, **over}``: a cluster's views (``base``, an inventory view) with some replaced by
    copies (``over``: what a queue walk's releases took), remembering both parts, so ``any_fits``
    judges it from ``base``'s per-shape index and the replaced views alone (O(replaced)) instead of
    every node of a dict it has never seen. Read-only by contract (built per walk step)."""

    __slots__ = ("base", "over")

    def __init__(self, base: Nodes, over: dict[str, NodeView]):
        super().__init__(base)
        dict.update(self, over)
        self.base, self.over = base, over


def overlay(base: dict[str, NodeView], over: dict[str, NodeView]) -> dict[str, NodeView]:
    """``{**base, **over}``, as an ``Overlay`` when ``base`` is an inventory view."""
    return Overlay(base, over) if isinstance(base, Nodes) else {**base, **over}


def any_fits(nodes: dict[str, NodeView], needs: Needs, share: bool) -> bool:
    """``fitting(nodes, needs, share) > 0``, without indexing a shape not indexed yet: the
    gateway's filter only asks whether some node fits, and a new block shape would otherwise
    judge every node to build the index. An inventory view with the shape indexed reads its count
    (O(changes)); else the node that fitted last time (its witness, kept on the view per shape)
    is checked first, then the nodes from it on until one fits, each judged once per view
    (``node_fits_cached``). A scan that finds none leaves the index it has just built (every node
    judged: none fits), so a full cluster is then judged in O(changes) per block, not O(nodes)."""
    key = shape(needs, share)
    if isinstance(nodes, Overlay):
        base = nodes.base._fits.get(key)
        if base is not None:  # the nodes not replaced: the base's index; the replaced: judged here
            base.update()
            over = nodes.over
            if any(node_fits_cached(v, needs, share) is not None for v in over.values()):
                return True
            return any(nid not in over for nid in base.ids)
    if not isinstance(nodes, Nodes):
        memo = _FITS.get((id(nodes), key))
        if memo is not None and memo.ref is nodes:
            return memo.update() > 0
        return any(node_fits_cached(v, needs, share) is not None for v in nodes.values()) or fitting(nodes, needs, share) > 0
    index = nodes._fits.get(key)
    if index is not None:
        return index.update() > 0
    ids = nodes.ids()
    n = len(ids)
    witness = nodes._witness
    start = nodes.positions().get(witness.get(key, ""), 0)
    for j in range(n):
        nid = ids[(start + j) % n]
        if node_fits_cached(nodes[nid], needs, share) is not None:
            if key not in witness and len(witness) >= _SHAPES_PER_VIEW:
                witness.pop(next(iter(witness)))
            witness[key] = nid
            return True
    witness.pop(key, None)
    if len(nodes._fits) >= _SHAPES_PER_VIEW:
        nodes._fits.pop(next(iter(nodes._fits)))
    index = nodes._fits[key] = _Fits(nodes, needs, share)
    index.parts = {nid: (nodes[nid], False) for nid in ids}
    index.seen = nodes.version
    return False


def _totals_memo(nodes: dict[str, NodeView]) -> _Totals:
    if isinstance(nodes, Nodes):
        if nodes._totals is None:
            nodes._totals = _Totals(nodes)
        return nodes._totals
    memo = _TOTALS.get(id(nodes))
    if memo is None or memo.ref is not nodes:
        if len(_TOTALS) >= _TOTALS_MAX:
            _TOTALS.clear()
        memo = _TOTALS[id(nodes)] = _Totals(nodes)
    return memo


def totals(nodes: dict[str, NodeView]) -> Totals:
    """``gpus, gpus_free, gpu_memory_free, cpu_free, memory_free, healthy_node_count`` over all nodes.

    Memoised per dict (the inventory keeps one ``Nodes`` per cluster, which holds its own): the
    second call on the same dict only recomputes the nodes whose view was replaced.
    """
    gpus, gpus_free, gpu_memory_free, cpu_free, memory_free, healthy = _totals_memo(nodes).update()
    return {"gpus": int(gpus), "gpus_free": int(gpus_free), "gpu_memory_free": int(gpu_memory_free),
            "cpu_free": round(cpu_free, 3), "memory_free": int(memory_free), "healthy_node_count": int(healthy)}


def fork(nodes: dict[str, NodeView], needs: Needs | None = None, share: bool = False) -> dict[str, NodeView]:
    """A working copy for tentative placements: shares the node views (replace one with
    ``copy_node`` before changing it) and the totals memo, so totals stay cheap on the copy; an
    inventory view's copy also starts from its capacity index (of ``needs``' shape too, built on
    the source first, where it stays for the next placement)."""
    if needs is not None and isinstance(nodes, Nodes):
        fit_index(nodes, needs, share)
    work = Nodes(nodes)
    memo = _totals_memo(nodes)
    memo.update()  # make sure the source's memo is current before it is shared
    twin = _totals_memo(work)
    twin.parts, twin.sum, twin.seen = dict(memo.parts), list(memo.sum), work.version
    if isinstance(nodes, Nodes):
        # the same ids in the same order, and the capacity index of each shape: a sample on the
        # copy reads them instead of re-judging every node
        work._ids, work._pos = nodes.ids(), nodes._pos
        for key, fits in nodes._fits.items():
            fits.update()
            copy = work._fits[key] = _Fits(work, fits.needs, fits.share)
            copy.parts, copy.ids, copy.count, copy.seen = dict(fits.parts), set(fits.ids), fits.count, work.version
    return work


def copy_node(node: NodeView) -> NodeView:
    """A copy of one node view deep enough for ``take``."""
    return {**node, "gpus": [g.copy() for g in node["gpus"]]}
