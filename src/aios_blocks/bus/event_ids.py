"""Wire message ids no client can guess.

JetStream drops a message whose ``Nats-Msg-Id`` it has seen within the duplicate window, across
the whole stream. The system's logical event ids are predictable (``{bid}:{gen}:{step}:{key}``),
so if they went on the wire as they are, any client allowed to publish one message (an upstream
``create``) could carry a block's *future* step id and make the stream drop that step: the block
would freeze with no error anywhere.

So every id the system publishes is ``k1:`` + a keyed BLAKE2b of the logical id: deterministic
(a redelivered step publishes the same id, and the duplicate window still drops the second copy),
unguessable without the key. The logical id stays readable as the CloudEvent ``id``. The key:

* ``AIOS_EVENT_KEY`` (hex) when set (the embedded setup gives each worker the one in its secrets);
* else the JetStream KV bucket ``AIOS_KEYS`` (key ``event``), created once by whoever comes first,
  readable only by system roles (clients and observers have no right to it);
* a real node agent gets a key of its own (``agent_key``): its events dedup among themselves, and
  it can compute no one else's ids.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "k1:"
KV_BUCKET = "AIOS_KEYS"
KV_KEY = "event"


def new_key() -> str:
    """A fresh random key (hex)."""
    return secrets.token_hex(32)


def agent_key(system_key: str, node_id: str) -> str:
    """Node ``node_id``'s own key, derived from the system's (the node never sees the latter)."""
    return hmac.new(bytes.fromhex(system_key), f"agent:{node_id}".encode(), hashlib.sha256).hexdigest()


class EventIds:
    """Logical event id -> wire ``Nats-Msg-Id``."""

    def __init__(self, key: str) -> None:
        raw = bytes.fromhex(key)
        if len(raw) < 16:
            raise ValueError("event key: at least 16 bytes of hex")
        self._key = raw[:64]

    def wire(self, logical: str) -> str:
        digest = hashlib.blake2b(logical.encode(), key=self._key, digest_size=20).hexdigest()
        return PREFIX + digest
