"""One base for every reader of the stored stream, dispatched through the catalog.

A projection folds stored events into a view (the Redis image, a block's explanation, a CLI
line). Like ``bus.router.Router`` for live consumers, it never splits a subject or reads a
string-keyed payload: each message is recognised by its catalog event (``schemas.catalog``),
its body decoded straight into the event's payload struct, and handed to the method registered
for that event with ``@on(E.block_ready)``::

    class Count(Projection):
        ignores = frozenset({E.block_decision})

        @on(E.block_ready, E.block_failed)
        def ended(self, m: Fact[BlockStatus]) -> None: ...

Events a projection neither handles nor ``ignores`` are skipped too, but the completeness tests
(``tests/unit/test_projections.py``) require the fold to name every stored event one way or the
other, so a new event cannot be forgotten by it silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from ..schemas.catalog import EVENTS, Body, Event

P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Fact(Generic[P]):
    """One stored message of a catalog event: its payload, its subject's tokens, where and when
    the stream stored it, and the event's own time (the CloudEvent's ``time``; "" for a raw body)."""

    event: Event[P]
    data: P
    tokens: dict[str, str]
    seq: int = 0
    ts: float = 0.0
    time: str = ""
    subject: str = ""


class _Envelope(msgspec.Struct, Generic[P]):
    """The CloudEvent fields a projection reads, ``data`` typed (decoded straight into ``P``)."""

    data: P
    time: str = ""


def _last_word(pattern: str) -> str | None:
    """The literal last word of a subject pattern (``None`` when it ends with a token)."""
    tail = pattern.rsplit(".", 1)[-1]
    return None if tail.startswith("{") else tail


class _Index:
    """``catalog.parse`` without trying every event: the events a subject can be, by its last
    word (each pattern's last literal word), and those ending with a token; tried in catalog order,
    so the answer is ``parse``'s."""

    def __init__(self, events: Iterable[Event[Any]]):
        self.order = {e: n for n, e in enumerate(events)}
        self.by_word: dict[str, list[Event[Any]]] = {}
        self.open: list[Event[Any]] = []
        for e in self.order:
            word = _last_word(e.pattern)
            (self.open if word is None else self.by_word.setdefault(word, [])).append(e)
        for word, found in self.by_word.items():
            self.by_word[word] = sorted(found + self.open, key=self.order.__getitem__)

    def parse(self, subject: str) -> tuple[Event[Any], dict[str, str]] | None:
        for e in self.by_word.get(subject.rpartition(".")[2], self.open):
            toks = e.match(subject)
            if toks is not None:
                return e, toks
        return None


#: the catalog, indexed for projections
INDEX = _Index(EVENTS)


def parse(subject: str) -> tuple[Event[Any], dict[str, str]] | None:
    """``catalog.parse``, through the index (the same answer; tested)."""
    return INDEX.parse(subject)


@functools.cache
def _decoder(event: Event[Any]) -> msgspec.json.Decoder[Any] | None:
    if event.payload is None or event.body is not Body.CLOUDEVENT:
        return None
    return msgspec.json.Decoder(_Envelope[event.payload])  # type: ignore[name-defined]


def on(*events: Event[Any]) -> Callable[[F], F]:
    """Register the method for these events (a projection's ``handlers`` are built from these)."""

    def mark(fn: F) -> F:
        fn.__projection_events__ = (*getattr(fn, "__projection_events__", ()), *events)  # type: ignore[attr-defined]
        return fn

    return mark


class Projection:
    """The stored stream read into a view, one catalog event at a time (see the module doc)."""

    #: event -> the name of its method (built from ``@on`` marks, the bases' included)
    handlers: ClassVar[dict[Event[Any], str]] = {}
    #: stored events this projection knowingly leaves out (the completeness test reads it)
    ignores: ClassVar[frozenset[Event[Any]]] = frozenset()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        table: dict[Event[Any], str] = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                for event in getattr(fn, "__projection_events__", ()):
                    table[event] = name
        both = set(table) & set(cls.ignores)
        if both:
            raise TypeError(f"{cls.__name__} both handles and ignores {sorted(e.name for e in both)}")
        cls.handlers = table

    #: messages of a handled event whose body did not decode into its payload (a live consumer
    #: dead-letters these, so no state came of them: the projection skips them too)
    undecodable: int = 0

    def feed(self, subject: str, raw: bytes, seq: int = 0, ts: float = 0.0) -> bool:
        """One stored message as it is in the stream; whether a handler took it."""
        found = INDEX.parse(subject)
        return found is not None and self.feed_event(found[0], found[1], subject, raw, seq, ts)

    def feed_event(self, event: Event[Any], tokens: dict[str, str], subject: str, raw: bytes, seq: int = 0,
                   ts: float = 0.0) -> bool:
        """``feed`` for a message whose event is known (undecoded unless a method takes it)."""
        name = self.handlers.get(event)
        if name is None:
            return False
        dec = _decoder(event)
        if dec is None:
            return self._call(name, Fact(event, raw, tokens, seq, ts, "", subject))
        try:
            env = dec.decode(raw)
        except msgspec.DecodeError:
            self.undecodable += 1
            return False
        return self._call(name, Fact(event, env.data, tokens, seq, ts, env.time, subject))

    def feed_doc(self, subject: str, env: dict[str, Any], seq: int = 0, ts: float = 0.0) -> bool:
        """One stored message already decoded to a JSON document (what the CLI's readers hold)."""
        found = INDEX.parse(subject)
        if found is None:
            return False
        event, tokens = found
        name = self.handlers.get(event)
        if name is None:
            return False
        time = str(env.get("time") or "")
        if _decoder(event) is None:
            return self._call(name, Fact(event, env, tokens, seq, ts, time, subject))
        try:
            data = msgspec.convert(env.get("data"), event.payload)
        except msgspec.ValidationError:
            self.undecodable += 1
            return False
        return self._call(name, Fact(event, data, tokens, seq, ts, time, subject))

    def _call(self, name: str, fact: Fact[Any]) -> bool:
        getattr(self, name)(fact)
        return True


def handled(projection: type[Projection]) -> frozenset[Event[Any]]:
    """The events a projection class has a method for."""
    return frozenset(projection.handlers)


def stored_events() -> list[Event[Any]]:
    """Every event a stream keeps (what a projection of the stored stream may meet)."""
    return [e for e in EVENTS if e.stored]
