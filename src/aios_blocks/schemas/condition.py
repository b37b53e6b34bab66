"""A ``ready`` block's *short* condition (docs/reliability.md, "Reconciler": "Short blocks"): fewer
live instances than its ``minInstances``, and the reconciler's ask for the missing ones placed
nothing. A condition beside the status, as Kubernetes keeps ``Available=False`` beside a
Deployment's replicas, not a status of its own: a block with 1 of 2 instances serving still serves
(``ready``: its executors route, its autoscaler and health checker go on), and the lifecycle table
(``schemas.lifecycle``) stays as it is.

The reconciler keeps it in the block's record (field ``short``, this struct as JSON; gone when the
block is whole again or leaves ``ready``) and announces each transition once: ``block.degraded``
when it sets it, ``block.restored`` when it clears it (the same struct, ``episode`` naming the
spell in both ids). ``state.views.status_text`` is how ``blocks get``/``blocks list`` and the
console show it (with the standard library's JSON: ``blocks list`` loads no msgspec).
"""

from __future__ import annotations

import msgspec

#: the block record's field that holds the condition
FIELD = "short"


class BlockShort(msgspec.Struct, frozen=True):
    """A ready block short of its ``minInstances`` (``block.degraded``, the record's ``short``),
    or whole again (``block.restored``: ``live`` then, ``since`` when the spell began)."""

    block_id: str
    gen: int
    #: starting or running instances (``handlers.scaling.live``), and how many of them run
    live: int
    running: int
    min_instances: int
    #: when the reconciler first saw it short (epoch s)
    since: float
    #: why: the step that failed to replace the missing instances and its reason, or the
    #: reconciler's ask that placed nothing yet; for ``restored``, how it came back
    reason: str = ""
    #: the spell's id (``since`` in ms): both events' ids name it, so a pass redone publishes the
    #: same ids (deduplicated by the stream)
    episode: str = ""


_dec = msgspec.json.Decoder(BlockShort)


def encode(s: BlockShort) -> str:
    return msgspec.json.encode(s).decode()


def decode(raw: object) -> BlockShort | None:
    """The record's ``short`` field (``None``: absent or unreadable, as if whole)."""
    if not raw or not isinstance(raw, str | bytes):
        return None
    try:
        return _dec.decode(raw)
    except msgspec.DecodeError:
        return None
