"""The records the store keeps, as its callers see them, and the encodings its writes share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import msgspec

from ..schemas.records import BlockRecord

_json = msgspec.json


def _dumps(v: Any) -> str:
    return _json.encode(v).decode()


def _block(h: dict[str, str]) -> BlockRecord | None:
    """A block hash as callers see it: ``ir`` decoded, ``gen``, ``version`` and ``created`` (the
    create's stream sequence) as ints (`blocks get --json` showed ``"created": "11"``)."""
    if not h:
        return None
    out: dict[str, object] = dict(h)
    if "ir" in h:
        out["ir"] = _json.decode(h["ir"])
    for k in ("gen", "version", "desired", "desired_seq", "created"):
        if k in h:
            out[k] = int(h[k])
    return cast(BlockRecord, out)


def _strs(fields: Mapping[str, object]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else _dumps(v) for k, v in fields.items()}
