"""Parser step: a create message body + the component it names -> the block IR, or every error."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..schemas.errors import SpecError, SpecInvalid
from ..schemas.ir import block_create_IR, decode_spec


@dataclass
class ParseOutcome:
    ir: dict[str, Any] | None = None
    errors: list[SpecError] = field(default_factory=list)
    doc: dict[str, Any] | None = None


def read(raw: bytes) -> ParseOutcome:
    """First half: decode the body (bare spec or CloudEvent) so the worker can look up the component."""
    try:
        return ParseOutcome(doc=decode_spec(raw))
    except SpecInvalid as exc:
        return ParseOutcome(errors=exc.errors)


def component_uri(doc: dict[str, Any]) -> str | None:
    uri = doc.get("blockComponentURI")
    return uri if isinstance(uri, str) and uri else None


def build(
    doc: dict[str, Any],
    component: dict[str, Any] | None,
    block_id: str,
    policy_versions: dict[str, int] | None = None,
) -> ParseOutcome:
    """Second half: validate and enrich. ``policy_versions`` (policy name -> registry version) pins
    the versions of registry policies the block will be placed with."""
    try:
        ir = block_create_IR(doc, component, block_id)
    except SpecInvalid as exc:
        return ParseOutcome(errors=exc.errors, doc=doc)
    for name, version in (policy_versions or {}).items():
        if name in ir["policies"]:
            ir["policies"][name] = {**ir["policies"][name], "version": version}
    return ParseOutcome(ir=ir, doc=doc)


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]
