"""Declarative routing: a handler registers for a catalog event; the router builds the durable
consumer's filters from what is registered, recognises each delivery's event by its subject,
decodes the body into the event's payload struct (one pass, no intermediate dict) and calls the
handler with an :class:`Inbound`. No handler splits a subject or decodes an envelope.

    router = Router(subjects.LIFECYCLE)     # the consumer: its events and filters, from the catalog

    @router.on(E.instance_added)
    async def on_added(m: Inbound[InstanceEvent]) -> None: ...

    spec, handler = router.binding()
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from .catalog import Body, Event
from .runner import Delivery, Poison
from .subjects import ConsumerSpec, matches

P = TypeVar("P")

#: the stream sequence of the message whose handler is running (0 outside one, e.g. a timer): the
#: state version a policy call made by that handler is recorded with (``schemas.events.Decision.at``)
TRIGGER_SEQ: ContextVar[int] = ContextVar("aios_trigger_seq", default=0)


class _Envelope(msgspec.Struct, Generic[P]):
    """The CloudEvents fields a handler needs, with ``data`` typed (decoded straight into ``P``)."""

    id: str
    type: str
    data: P
    source: str = ""
    subject: str = ""
    time: str = ""


@dataclass(frozen=True)
class Inbound(Generic[P]):
    """One delivery of a catalog event: its payload, its subject's tokens, and delivery facts."""

    event: Event[P]
    data: P
    tokens: dict[str, str]
    delivery: Delivery

    @property
    def deliveries(self) -> int:
        return self.delivery.deliveries

    @property
    def stream_seq(self) -> int:
        return self.delivery.stream_seq


Handler = Callable[[Inbound[Any]], Awaitable[None]]


@dataclass
class _Route:
    event: Event[Any]
    handler: Handler
    scope: dict[str, str]
    decoder: Any


class Router:
    """Handlers of one durable consumer (``subjects.ConsumerSpec``), by event: every event the
    consumer takes must have its handler, and no handler may be for an event it does not take."""

    def __init__(self, consumer: ConsumerSpec):
        self.consumer = consumer
        self.durable = consumer.durable
        self.scope = dict(consumer.scope)
        self.routes: list[_Route] = []

    def on(self, event: Event[P], **scope: str) -> Callable[[Callable[[Inbound[P]], Awaitable[None]]], Callable[[Inbound[P]], Awaitable[None]]]:
        """Register a handler for ``event``; ``scope`` fixes subject tokens (``cid="c1"``)."""

        def register(fn: Callable[[Inbound[P]], Awaitable[None]]) -> Callable[[Inbound[P]], Awaitable[None]]:
            self.add(event, fn, **scope)
            return fn

        return register

    def add(self, event: Event[P], fn: Callable[[Inbound[P]], Awaitable[None]], **scope: str) -> None:
        if event not in self.consumer.events:
            raise ValueError(f"consumer {self.durable} does not take {event.name}; add it to its spec in bus/subjects.py")
        scope = {**self.scope, **scope}
        if event.payload is None or event.body is Body.RAW:
            decoder = None
        else:
            decoder = msgspec.json.Decoder(_Envelope[event.payload])  # type: ignore[name-defined]
        self.routes.append(_Route(event, fn, scope, decoder))

    def spec(self) -> ConsumerSpec:
        missing = [e.name for e in self.consumer.events if all(r.event is not e for r in self.routes)]
        if missing:
            raise ValueError(f"consumer {self.durable}: no handler for {', '.join(missing)}")
        return self.consumer

    async def __call__(self, d: Delivery) -> None:
        for r in self.routes:
            tokens = r.event.match(d.subject)
            if tokens is None or any(tokens.get(k) != v for k, v in r.scope.items()):
                continue
            data: Any = d.data if r.decoder is None else r.decoder.decode(d.data).data
            token = TRIGGER_SEQ.set(d.stream_seq)
            try:
                await r.handler(Inbound(r.event, data, tokens, d))
            finally:
                TRIGGER_SEQ.reset(token)
            return
        for r in self.routes:  # a subject only an extra filter takes (a malformed id): the handler decides
            if any(matches(f, d.subject) for f in r.event.extra_filters):
                await r.handler(Inbound(r.event, d.data, {}, d))
                return
        raise Poison(f"no handler of consumer {self.durable} takes subject {d.subject}")

    def binding(self) -> tuple[ConsumerSpec, Callable[[Delivery], Awaitable[None]]]:
        return self.spec(), self
