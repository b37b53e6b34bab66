"""Names of the short-lived consumers a reading client makes (ordered consumers of ``blocks watch``,
``timeline``, ``explain``, the console's feed, stream reads): a random one, except for an observer.

An observer (``schemas.roles.is_observer``: ``observer`` or ``observer-<name>``) may touch only the
consumers named after its own user, ``<user>_1`` .. ``<user>_<OBSERVER_CONSUMERS>`` (NATS
permissions list each name: docs/security.md "Observers: a user each"), so its clients take a free
one of those. Two clients of the same observer that pick the same free name at the same moment
share it (the second create updates the first's consumer): give each client its own observer user.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from nats.js.errors import NotFoundError

from ..schemas.roles import OBSERVER_CONSUMERS, is_observer, observer_consumers


class NoConsumerName(RuntimeError):
    """Every consumer name of this observer is in use on the stream."""


def connected_user(nc: Any) -> str | None:
    """The user name the connection logged in with (``None``: none, or not connected)."""
    url = nc.connected_url
    return url.username if url is not None else None


async def consumer_name(nc: Any, stream: str, kind: str) -> str:
    """A name for a new consumer on ``stream``: ``<kind>-<random>``; as an observer, one of its own
    names that no consumer of ``stream`` has now (tried in random order)."""
    user = connected_user(nc)
    if user is None or not is_observer(user):
        return f"{kind}-{uuid.uuid4().hex[:16]}"
    js = nc.jetstream(timeout=5)
    names = list(observer_consumers(user))
    random.shuffle(names)
    for name in names:
        try:
            await js.consumer_info(stream, name)
        except NotFoundError:
            return name
    raise NoConsumerName(f"the observer {user} has all its {OBSERVER_CONSUMERS} consumer names in use on {stream} "
                         f"({user}_1 .. {user}_{OBSERVER_CONSUMERS}): delete some, or wait for unused ones to expire")
