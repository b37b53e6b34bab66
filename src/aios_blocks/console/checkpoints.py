"""Checkpoints of the console's live fold that share what did not change (issue 37: the past moment
at 1M events in <= 2 s).

A checkpoint used to be the whole fold pickled: restoring one at 170,000 blocks unpickled ~100 MB,
seconds on a loaded machine, whatever the moment asked. Here a checkpoint holds the fold's
entities (a block's record, its instances, a node, a reservation, ...) as plain Python objects,
and the entities that did not change since the previous checkpoint are the *same objects* in both:

* The live fold's dict fields are ``Tracked`` dicts: while ``Feed.apply`` folds an event (the
  ``Gate`` is open), every key the fold reads, writes or deletes is noted, and keys inserted are
  noted in their order. A rule can only change an entity it reached through its dict, so the
  noted keys are a superset of the entities that changed. The views read the live fold with the
  gate shut, and note nothing.
* A checkpoint copies only the noted entities (containers copied, strings and numbers shared with
  the live fold: ``thaw``). A field's entries are kept in *shards*, one per checkpoint that first
  held them (the order in which the live dict holds them: a dict keeps insertion order and moves a
  key deleted and inserted again to its end, and so do the shards), and a checkpoint shares every
  shard whose entries did not change with the checkpoint before it. Taking one costs the changed
  entities and the shards they are in, not the state.
* A past moment merges the checkpoint's shards into ``Cow`` dicts (dict-to-dict copies, in C: tens
  of ms at 170,000 blocks) and folds the events after it. A ``Cow`` dict copies an entity the
  first time the fold reaches it, so the checkpoint itself never changes; once folded, the dicts
  become ``Frozen`` (plain reads, at dict speed) for the views.

The fields that are not dicts (a set, a list, counters) are copied whole into each checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

from ..recovery.fold import Fold

#: values shared as they are (immutable)
_ATOMS = frozenset({str, int, float, bool, bytes, type(None)})
_MISSING = object()


def thaw(v: Any) -> Any:
    """A copy of ``v`` that shares nothing mutable with it (its strings and numbers are shared)."""
    t = type(v)
    if t in _ATOMS:
        return v
    if t is dict:
        out = dict(v)
        for k, x in v.items():
            if type(x) not in _ATOMS:
                out[k] = thaw(x)
        return out
    if t is list:
        return [x if type(x) in _ATOMS else thaw(x) for x in v]
    if t is tuple:
        return v if all(type(x) in _ATOMS for x in v) else tuple(thaw(x) for x in v)
    if t is set or t is frozenset:
        return t(v)  # (set members are hashable: tuples of atoms here)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        new = copy.copy(v)
        for f in dataclasses.fields(v):
            setattr(new, f.name, thaw(getattr(v, f.name)))
        return new
    return copy.deepcopy(v)


class Gate:
    """Open while the live fold folds an event: only then do ``Tracked`` dicts note keys."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False


class _ThroughItems(dict[Any, Any]):
    """``update`` and ``popitem`` through the subclass's own ``__setitem__`` and ``pop`` (``dict``'s
    would bypass what ``Tracked`` notes and what ``Cow`` copies)."""

    __slots__ = ()

    def update(self, *args: Any, **kw: Any) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def popitem(self) -> tuple[Any, Any]:
        k = next(reversed(self))
        return k, self.pop(k)


class Tracked(_ThroughItems):
    """A dict of the live fold that notes, while its gate is open, the keys reached (``dirty``) and
    the keys inserted, in order (``added``: a key deleted afterwards leaves it)."""

    __slots__ = ("added", "dirty", "gate")

    def __init__(self, data: dict[Any, Any], gate: Gate):
        super().__init__(data)
        self.dirty: set[Any] = set()
        self.added: dict[Any, None] = {}
        self.gate = gate

    def __getitem__(self, k: Any) -> Any:
        if self.gate.open:
            self.dirty.add(k)
        return dict.__getitem__(self, k)

    def get(self, k: Any, default: Any = None) -> Any:
        if self.gate.open:
            self.dirty.add(k)
        return dict.get(self, k, default)

    def __setitem__(self, k: Any, v: Any) -> None:
        if self.gate.open:
            self.dirty.add(k)
            if k not in self:
                self.added[k] = None
        dict.__setitem__(self, k, v)

    def setdefault(self, k: Any, default: Any = None) -> Any:
        if self.gate.open:
            self.dirty.add(k)
            if k not in self:
                self.added[k] = None
        return dict.setdefault(self, k, default)

    def __delitem__(self, k: Any) -> None:
        if self.gate.open:
            self.dirty.add(k)
            self.added.pop(k, None)
        dict.__delitem__(self, k)

    def pop(self, k: Any, *default: Any) -> Any:
        if self.gate.open:
            self.dirty.add(k)
            self.added.pop(k, None)
        return dict.pop(self, k, *default)

    def clear(self) -> None:
        for k in list(self):
            del self[k]


class Frozen(dict[Any, Any]):
    """A past fold's dict once folded: read at dict speed (``Cow`` with its copying taken off)."""

    __slots__ = ("owned",)
    owned: set[Any]


class Cow(_ThroughItems, Frozen):
    """A past fold's dict while it folds: an entry is the checkpoint's object until the fold first
    reaches it, then a copy of it (``thaw``), so the checkpoint is never changed."""

    __slots__ = ()

    def __getitem__(self, k: Any) -> Any:
        v = dict.__getitem__(self, k)
        if k not in self.owned:
            self.owned.add(k)
            if type(v) not in _ATOMS:
                v = thaw(v)
                dict.__setitem__(self, k, v)
        return v

    def get(self, k: Any, default: Any = None) -> Any:
        return self[k] if k in self else default

    def __setitem__(self, k: Any, v: Any) -> None:
        self.owned.add(k)
        dict.__setitem__(self, k, v)

    def setdefault(self, k: Any, default: Any = None) -> Any:
        if k in self:
            return self[k]
        self[k] = default
        return default

    def __delitem__(self, k: Any) -> None:
        self.owned.discard(k)
        dict.__delitem__(self, k)

    def pop(self, k: Any, *default: Any) -> Any:
        if k in self:
            v = self[k]
            del self[k]
            return v
        if default:
            return default[0]
        raise KeyError(k)

    def clear(self) -> None:
        self.owned.clear()
        dict.clear(self)


def _cost(v: Any) -> int:
    """Bytes an entity's copy holds, roughly: its containers (strings are shared with the fold)."""
    t = type(v)
    if t in _ATOMS:
        return 0
    if t is dict:
        return sys.getsizeof(v) + sum(_cost(x) for x in v.values() if type(x) not in _ATOMS)
    if t is list or t is tuple or t is set:
        return sys.getsizeof(v) + sum(_cost(x) for x in v if type(x) not in _ATOMS)
    if dataclasses.is_dataclass(v):
        return sys.getsizeof(v) + sum(_cost(getattr(v, f.name)) for f in dataclasses.fields(v))
    return sys.getsizeof(v)


@dataclasses.dataclass(eq=False)
class Shard:
    """Entries of one field first held by one checkpoint (``epoch``), and the bytes they hold."""

    epoch: int
    entries: dict[Any, Any]
    bytes: int


@dataclasses.dataclass(eq=False)
class Checkpoint:
    """The live fold at ``seq``: each dict field as its shards (oldest first), the other fields whole."""

    seq: int
    epoch: int
    shards: dict[str, list[Shard]]
    whole: dict[str, Any]


class Checkpoints:
    """The checkpoints of one live fold (made ``track``ed by this), oldest first."""

    def __init__(self, fold: Fold):
        self.gate = Gate()
        self.fold = fold
        self.dicts = [f.name for f in dataclasses.fields(fold) if type(getattr(fold, f.name)) is dict]
        for name in self.dicts:
            setattr(fold, name, Tracked(getattr(fold, name), self.gate))
        self.items: list[Checkpoint] = []
        self._last: Checkpoint | None = None
        #: field -> key -> the epoch of the shard that holds it in the newest checkpoint
        self._where: dict[str, dict[Any, int]] = {name: {} for name in self.dicts}
        self._epoch = 0
        #: ``bytes()``, kept up to date: the shards a checkpoint makes are new, the rest shared
        self._bytes = 0

    def take(self) -> Checkpoint:
        """A checkpoint of the live fold now (kept in ``items``)."""
        self._epoch += 1
        epoch, live, last = self._epoch, self.fold, self._last
        shards: dict[str, list[Shard]] = {}
        for name in self.dicts:
            d: Tracked = getattr(live, name)
            where = self._where[name]
            prev = {s.epoch: s for s in last.shards[name]} if last else {}
            changed: dict[int, dict[Any, Any]] = {}
            for k in d.dirty:
                if k in d.added:
                    continue
                e = where.get(k)
                if e is None:
                    continue  # (reached, never held at a checkpoint: a miss, or inserted and deleted since)
                if k in d:
                    changed.setdefault(e, {})[k] = thaw(dict.__getitem__(d, k))
                else:
                    changed.setdefault(e, {})[k] = _MISSING
                    del where[k]
            new: dict[Any, Any] = {}
            for k in d.added:
                e = where.get(k)
                if e is not None:  # held before, deleted and inserted again: it moved to the end
                    changed.setdefault(e, {})[k] = _MISSING
                where[k] = epoch
                new[k] = thaw(dict.__getitem__(d, k))
            out = dict(prev)
            for e, upd in changed.items():
                old = prev[e]
                entries = dict(old.entries)
                cost = old.bytes
                for k, v in upd.items():
                    was = entries.pop(k, None) if v is _MISSING else entries.get(k)
                    cost -= _cost(was) if was is not None else 0
                    if v is not _MISSING:
                        entries[k] = v
                        cost += _cost(v)
                if entries:
                    out[e] = Shard(e, entries, max(cost, 0))
                    self._bytes += out[e].bytes + sys.getsizeof(entries)
                else:
                    del out[e]
            if new:
                out[epoch] = Shard(epoch, new, sum(_cost(v) for v in new.values()))
                self._bytes += out[epoch].bytes + sys.getsizeof(new)
            shards[name] = list(out.values())
            d.dirty, d.added = set(), {}
        whole = {f.name: thaw(getattr(live, f.name)) for f in dataclasses.fields(live) if f.name not in shards}
        cp = self._last = Checkpoint(live.last_seq, epoch, shards, whole)
        self.items.append(cp)
        return cp

    def bytes(self) -> int:
        """What the kept checkpoints hold, roughly: each distinct shard's table and copies counted
        once (strings are shared with the live fold and not counted)."""
        return self._bytes

    def thin(self) -> None:
        """Every other checkpoint dropped (the newest stays)."""
        self.items = self.items[::-1][::2][::-1]
        seen: dict[int, int] = {}
        for cp in self.items:
            for shards in cp.shards.values():
                for s in shards:
                    seen[id(s)] = s.bytes + sys.getsizeof(s.entries)
        self._bytes = sum(seen.values())


def restore(cp: Checkpoint) -> Fold:
    """A fold that starts as ``cp`` and can fold further without changing it (``Cow`` dicts; call
    ``freeze`` once folded)."""
    f = Fold()
    for name, shards in cp.shards.items():
        d = Cow()
        d.owned = set()
        for s in shards:
            dict.update(d, s.entries)
        setattr(f, name, d)
    for name, v in cp.whole.items():
        setattr(f, name, thaw(v))
    return f


def freeze(f: Fold) -> Fold:
    """``f``'s ``Cow`` dicts read at dict speed from now on (their copies stay theirs)."""
    for field in dataclasses.fields(f):
        d = getattr(f, field.name)
        if type(d) is Cow:
            d.__class__ = Frozen  # type: ignore[assignment]  # (the same layout: Cow's copying off)
            d.owned = set()
    return f
