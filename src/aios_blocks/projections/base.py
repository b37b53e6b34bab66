"""One base for every reader of the stored stream, dispatched through the catalog.

A projection folds stored events into a view (the Redis image, a block's explanation, a CLI
line). Like ``bus.router.Router`` for live consumers, it never splits a subject or reads a
string-keyed payload: each message is recognised by its catalog event (``schemas.catalog``),
its body decoded straight into the event's payload struct, and handed to the method registered
for that event with ``@on(E.block_ready)``::

    class Count(Projection):
        ignores = frozenset({E.block_decision})

        @on(E.block_ready, E.block_failed)
        def ended(self, m: Fact[BlockStatusReport]) -> None: ...

Events a projection neither handles nor ``ignores`` are skipped too, but the completeness tests
(``tests/unit/test_projections.py``) require the fold to name every stored event one way or the
other, so a new event cannot be forgotten by it silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypedDict, TypeVar

import msgspec

from ..schemas.catalog import EVENTS, Body, Event
from ..schemas.records import JSON, JSONObject

P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
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


class EventDoc(TypedDict, total=False):
    """A stored event decoded to a JSON document (what the CLI's readers hold: ``cli.client``):
    a CloudEvent's fields (``schemas.events.Envelope``), ``data`` its payload as JSON. A stored
    body that is not a JSON object (or not JSON) is held under ``data``."""

    id: str
    source: str
    type: str
    subject: str
    time: str
    specversion: str
    datacontenttype: str
    data: JSON


#: what a reader of stored events takes: an ``EventDoc``, or a JSON object a reader decoded without
#: naming its fields (the console's feed)
StoredDoc = EventDoc | JSONObject


class _Envelope(msgspec.Struct, Generic[P]):
    """The CloudEvent fields a projection reads, ``data`` typed (decoded straight into ``P``)."""

    data: P
    time: str = ""


def _words(pattern: str) -> tuple[str | None, str | None]:
    """A pattern's second and last words where they are literal (``None``: a token)."""
    words = pattern.split(".")
    second, last = words[1] if len(words) > 2 else None, words[-1]
    return (None if second is None or second.startswith("{") else second), (None if last.startswith("{") else last)


class _Index:
    """``catalog.parse`` without trying every event: the events a subject can be, by its second
    and last words (each pattern's literal ones; events whose pattern ends with a token are tried
    for every last word of their second word), tried in catalog order, so the answer is ``parse``'s."""

    def __init__(self, events: Iterable[Event[Any]]):
        order = {e: n for n, e in enumerate(events)}
        exact: dict[tuple[str, str], list[Event[Any]]] = {}
        open_: dict[str, list[Event[Any]]] = {}
        self.anywhere: list[Event[Any]] = []  # second word a token: any subject may be one
        for e in order:
            second, last = _words(e.pattern)
            if second is None:
                self.anywhere.append(e)
            elif last is None:
                open_.setdefault(second, []).append(e)
            else:
                exact.setdefault((second, last), []).append(e)

        def merged(found: list[Event[Any]]) -> tuple[tuple[Event[Any], Callable[[str], re.Match[str] | None]], ...]:
            """The events in catalog order, each with its subject regex's ``match`` (``Event.match``
            without a call in between: this runs once per message read)."""
            return tuple((e, e._regex.match) for e in sorted(set(found) | set(self.anywhere), key=order.__getitem__))

        self.exact = {k: merged(v + open_.get(k[0], [])) for k, v in exact.items()}
        self.open = {k: merged(v) for k, v in open_.items()}
        self.rest = merged([])

    def parse(self, subject: str) -> tuple[Event[Any], dict[str, str]] | None:
        one = subject.find(".") + 1
        two = subject.find(".", one)
        second = subject[one:two] if one and two > 0 else ""
        found = self.exact.get((second, subject[subject.rfind(".") + 1:]))
        if found is None:
            found = self.open.get(second, self.rest)
        for e, match in found:
            m = match(subject)
            if m is not None:
                return e, m.groupdict()
        return None


#: the catalog, indexed for projections
INDEX = _Index(EVENTS)


def parse(subject: str) -> tuple[Event[Any], dict[str, str]] | None:
    """``catalog.parse``, through the index (the same answer; tested)."""
    return INDEX.parse(subject)


def _decoder(event: Event[Any]) -> msgspec.json.Decoder[Any] | None:
    """The event's envelope decoder (``None``: a raw body, handed over as it is)."""
    if event.payload is None or event.body is not Body.CLOUDEVENT:
        return None
    return _DECODERS.setdefault(event.name, msgspec.json.Decoder(_Envelope[event.payload]))  # type: ignore[name-defined]


#: event name -> its decoder (by name: an ``Event``'s dataclass hash reads every field)
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {}


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
        cls._routes = {e.name: (getattr(cls, name), _decoder(e)) for e, name in table.items()}

    #: event name -> (its method, its decoder): what ``feed_event`` looks up per message
    _routes: ClassVar[dict[str, tuple[Callable[[Any, Fact[Any]], None], msgspec.json.Decoder[Any] | None]]] = {}

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
        route = self._routes.get(event.name)
        if route is None:
            return False
        method, dec = route
        if dec is None:
            method(self, Fact(event, raw, tokens, seq, ts, "", subject))
            return True
        try:
            env = dec.decode(raw)
        except msgspec.DecodeError:
            self.undecodable += 1
            return False
        method(self, Fact(event, env.data, tokens, seq, ts, env.time, subject))
        return True

    def feed_doc(self, subject: str, env: StoredDoc, seq: int = 0, ts: float = 0.0) -> bool:
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
