"""Names of the short-lived consumers a reading client makes (ordered consumers of ``blocks watch``,
``timeline``, ``explain``, the console's feed, stream reads): a random one, except for an observer.

An observer (``schemas.roles.is_observer``: ``observer`` or ``observer-<name>``) may touch only the
consumers named after its own user, ``<user>_1`` .. ``<user>_<OBSERVER_CONSUMERS>`` (NATS
permissions list each name: docs/security.md "Observers: a user each"), so its clients take a free
one of those. The name is not looked up and then used (two clients of the same observer could
both see a name free, and the second create would then update the first's consumer: its
deliveries sent to the second): each name, in random order, is *created* with JetStream's
``"action": "create"`` (nats-server 2.10 on), which fails (``consumer already exists``, 10148)
when a consumer of that name exists with another config; the next name is tried then. Two
clients' configs always differ (each delivers to its own inbox), so one create of a name wins
and the other moves on: ``create_named``.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.js import JetStreamContext, JetStreamManager, api
from nats.js.errors import APIError

from ..schemas.roles import OBSERVER_CONSUMERS, is_observer, observer_consumers

T = TypeVar("T")

#: JetStream's error codes for a create under a name in use: ``consumer already exists``
#: (``action: create``, another config), ``consumer name already in use``, ``consumer already
#: exists and is still active``
TAKEN = (10148, 10013, 10105)


class NoConsumerName(RuntimeError):
    """Every consumer name of this observer is in use on the stream."""


def connected_user(nc: Any) -> str | None:
    """The user name the connection logged in with (``None``: none, or not connected)."""
    url = nc.connected_url
    return url.username if url is not None else None


class _CreateFirst(JetStreamManager):
    """nats-py's manager whose first ``add_consumer`` only creates (``"action": "create"``: fails
    if a consumer of that name exists with another config); later ones (an ordered consumer's
    reset re-creates its own consumer, under the same name) create or update, as nats-py does."""

    def __init__(self, nc: Any, prefix: str, timeout: float):
        super().__init__(nc, prefix=prefix, timeout=timeout)
        self.created = False

    async def add_consumer(self, stream: str, config: api.ConsumerConfig | None = None,
                           timeout: float | None = None, **params: Any) -> api.ConsumerInfo:
        if self.created:
            return await super().add_consumer(stream, config, timeout, **params)
        config = (config or api.ConsumerConfig()).evolve(**params)
        if not config.name:
            raise ValueError("a create-only consumer needs its name")
        # the subject nats-py uses (the filter in it where one, which observers' permissions allow)
        subject = f"{self._prefix}.CONSUMER.CREATE.{stream}.{config.name}"
        if config.filter_subject and config.filter_subject != ">":
            subject += f".{config.filter_subject}"
        body = json.dumps({"stream_name": stream, "config": config.as_dict(), "action": "create"}).encode()
        info = api.ConsumerInfo.from_response(await self._api_request(subject, body, timeout=timeout or self._timeout))
        self.created = True
        return info


class _CreateFirstContext(JetStreamContext):
    """A JetStream context for one consumer: its first create, by ``subscribe`` or ``add_consumer``,
    is create-only (``_CreateFirst``). nats-py makes a new manager for every ``_jsm`` use (which
    ``subscribe`` and an ordered consumer's reset call); this one keeps its own."""

    def __init__(self, nc: Any, timeout: float):
        super().__init__(nc, timeout=timeout)
        self._own = _CreateFirst(nc, self._prefix, timeout)

    @property
    def _jsm(self) -> JetStreamManager:
        return self._own

    async def add_consumer(self, stream: str, config: api.ConsumerConfig | None = None,
                           timeout: float | None = None, **params: Any) -> api.ConsumerInfo:
        return await self._own.add_consumer(stream, config, timeout, **params)  # (not the manager's own, inherited)


def taken(exc: BaseException) -> bool:
    """Whether a create failed because a consumer of that name exists."""
    return isinstance(exc, APIError) and exc.err_code in TAKEN


async def create_named(nc: Any, js: Any, stream: str, kind: str,
                       create: Callable[[Any, str], Awaitable[T]], timeout: float = 10.0) -> tuple[str, T]:
    """Make a consumer on ``stream`` with ``create(js, name)`` (it creates the consumer named
    ``name`` through ``js``: ``js.subscribe(..., config=ConsumerConfig(name=name))``,
    ``js.add_consumer``): (its name, what ``create`` returned).

    Not an observer: ``<kind>-<random>`` through ``js``. An observer: each of its own names in
    random order, through a context whose first create fails if the name is in use, until one is
    created; ``NoConsumerName`` when every one is in use on ``stream``. ``create`` must give the
    consumer a config of its own (a push consumer's own inbox): the server answers a create whose
    config equals the existing consumer's with that consumer (nats-server before 2.10 ignores
    ``action`` and updates a consumer in use, as a plain create does)."""
    user = connected_user(nc)
    if user is None or not is_observer(user):
        name = f"{kind}-{uuid.uuid4().hex[:16]}"
        return name, await create(js, name)
    names = list(observer_consumers(user))
    random.shuffle(names)
    for name in names:
        try:
            return name, await create(_CreateFirstContext(nc, timeout), name)
        except APIError as exc:
            if not taken(exc):
                raise
    raise NoConsumerName(f"the observer {user} has all its {OBSERVER_CONSUMERS} consumer names in use on {stream} "
                         f"({user}_1 .. {user}_{OBSERVER_CONSUMERS}): delete some, or wait for unused ones to expire")


async def subscribe_ordered(nc: Any, js: Any, subject: str, stream: str, kind: str, config: api.ConsumerConfig,
                            **kw: Any) -> tuple[str, Any]:
    """nats-py's ordered push consumer on ``subject`` of ``stream`` (``js.subscribe(...,
    ordered_consumer=True)``; ``kw``: its ``cb``, limits), under a name ``create_named`` gives:
    (the name, the subscription). ``config`` is copied for each try (nats-py fills it in)."""
    return await create_named(nc, js, stream, kind, lambda j, name: j.subscribe(
        subject, stream=stream, ordered_consumer=True, config=config.evolve(name=name), **kw))
