"""The root of a placement input's node map (``schemas.events.chunked_root``), kept per inventory
view and caught up from its change log: what a worker's decision record hashes in place of the
map (``workers.base.Worker.record``).

A placement's input holds every node view of the cluster (``sampleNodes`` 0: the trace's 1,213),
and each placement changes one or two of them. The root of the form before hashed the whole
reference map (~110 KB for 1,213 nodes) once per inventory version, i.e. once per placement in a
burst: ~0.4 ms, ~7 % of the live controller's busy time (docs/trace.md "Live vs Ray"). The chunked
root hashes chunks of ``ROOT_CHUNK`` entries and then their digests, so here a change re-encodes
the changed entries, re-hashes their chunks and hashes the chunk digests (~20 of them): the same
value as ``chunked_root_of`` over the whole map (``tests/unit/test_node_digest.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.events import ROOT_CHUNK, chunk_digest, chunked_root, chunked_root_of, ref_entry
from ..schemas.records import NodeView
from . import capacity
from .capacity import Nodes, node_ref

#: inventory views kept (one per cluster a worker places on; an older view is dropped first)
KEPT = 32


@dataclass
class _Kept:
    """One inventory view's reference-map entries and chunk digests, as of ``version``."""

    ref: Nodes
    version: int
    #: the ``ids()`` list the entries follow (its identity changes when an id is added or removed)
    ids: list[str]
    entries: list[bytes]
    digests: list[bytes]
    root: str


#: id(inventory view) -> what is kept of it (checked by identity: an id may be reused)
_KEPT: dict[int, _Kept] = {}


def _entries(nodes: dict[str, NodeView]) -> list[bytes]:
    return [ref_entry(nid, node_ref(view)) for nid, view in nodes.items()]


def nodes_root(nodes: dict[str, NodeView]) -> str:
    """``chunked_root_of`` the node map's reference entries; for an inventory view (``Nodes``),
    caught up from its change log: the changed nodes' entries and chunks only. A map with an
    annotated view (``affinity``: a per-call copy, changed in place) is hashed whole and not kept."""
    if not isinstance(nodes, Nodes):
        return chunked_root_of(_entries(nodes))
    kept = _KEPT.get(id(nodes))
    if kept is not None and kept.ref is nodes:
        if kept.version == nodes.version:
            return kept.root
        if _catch_up(kept, nodes):
            return kept.root
    entries = _entries(nodes)
    root = chunked_root_of(entries)
    if not any("affinity" in view for view in nodes.values()):
        digests = [chunk_digest(entries[i:i + ROOT_CHUNK]) for i in range(0, len(entries), ROOT_CHUNK)]
        _KEPT.pop(id(nodes), None)
        while len(_KEPT) >= KEPT:
            del _KEPT[next(iter(_KEPT))]
        _KEPT[id(nodes)] = _Kept(nodes, nodes.version, nodes.ids(), entries, digests, root)
    return root


def _catch_up(kept: _Kept, nodes: Nodes) -> bool:
    """Bring ``kept`` to the view's version by its change log (False: rebuild it whole: the log
    was compacted, an id was added or removed, or a changed view is annotated)."""
    changed = nodes.changed_since(kept.version)
    if changed is None or kept.ids is not nodes.ids():
        return False
    pos = nodes.positions()
    dirty: set[int] = set()
    fresh: list[tuple[int, bytes]] = []
    for nid in set(changed):
        view = nodes[nid]
        if "affinity" in view:
            return False
        i = pos[nid]
        fresh.append((i, ref_entry(nid, node_ref(view))))
        dirty.add(i // ROOT_CHUNK)
    entries = kept.entries
    for i, entry in fresh:
        entries[i] = entry
    for c in dirty:
        kept.digests[c] = chunk_digest(entries[c * ROOT_CHUNK:(c + 1) * ROOT_CHUNK])
    kept.root = chunked_root(len(entries), kept.digests)
    kept.version = nodes.version
    return True


def settle(nodes: dict[str, NodeView]) -> None:
    """Catch up now, from the view's change log, what every placement's input and decision record
    read of an inventory view whatever the block: the node map's root (:func:`nodes_root`), the
    totals, the healthy ids and their JSON, the check that every view is a dict, and each node's
    state id. The controller calls it once a placement's events are stored (``Bus.after_commit``),
    so the next placement's call finds them current instead of catching up the last one's change
    on its own path. Values are the same either way (each is a function of the view's version)."""
    if not isinstance(nodes, Nodes):
        return
    done = _SETTLED.get(id(nodes))
    if done is not None and done[0] is nodes and done[1] == nodes.version:
        return  # (a burst's placements of one batch: the first one's settle did it)
    nodes_root(nodes)
    capacity.totals(nodes)
    nodes.healthy_json(capacity.healthy_ids(nodes))
    nodes.all_dicts()
    nodes.states()
    _SETTLED.pop(id(nodes), None)
    while len(_SETTLED) >= KEPT:
        del _SETTLED[next(iter(_SETTLED))]
    _SETTLED[id(nodes)] = (nodes, nodes.version)


#: id(inventory view) -> (the view, the version :func:`settle` last caught it up to)
_SETTLED: dict[int, tuple[Nodes, int]] = {}
