"""The mark of a dead letter put back (catalog ``dlq.replayed``; ``bus.dlq``)."""

from __future__ import annotations

import msgspec


class DlqReplayed(msgspec.Struct):
    """A dead letter put back (``blocks dlq replay``, docs/dead-letters.md): which letter (its stream and
    sequence, its event id), what was republished where (the original subject, the sequence the
    stream stored the copy at), whose bytes (``source``: ``stream``, the original message as the
    stream still holds it, or ``letter``, the copy the letter kept), who did it and when. The
    ``attempt``-th replay of that letter (2 and up: with ``--force``)."""

    stream: str
    seq: int
    letter_id: str
    subject: str
    consumer: str
    original_seq: int
    replay_stream: str
    replay_seq: int
    source: str
    by: str
    at: float
    attempt: int = 1
