"""Parser worker: ``aios.block.{bid}.create`` -> ``parsed`` (IR) or ``rejected`` (every error)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..bus import subjects
from ..bus.catalog import E
from ..bus.router import Inbound, Router
from ..bus.runner import Poison
from ..handlers import parse
from ..policies.runtime import registry_name
from ..schemas.errors import SpecError
from ..schemas.events import Parsed, Rejected
from ..schemas.spec import ID_RE
from .base import Worker


def bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.PARSER)

    @router.on(E.block_create)
    async def on_create(m: Inbound[bytes]) -> None:
        d = m.delivery
        gen = d.stream_seq
        if "bid" not in m.tokens:  # taken by an extra filter: aios.block.a.b.create
            bad = d.subject.removeprefix(f"{subjects.ROOT}.block.").removesuffix(".create")
            raise Poison(f"block id {bad!r} in the subject contains a dot")
        bid = m.tokens["bid"]
        if not ID_RE.match(bid):
            raise Poison(f"block id {bid!r} in the subject is not a valid id")
        outcome = parse.read(d.data)
        if outcome.doc is not None:
            uri = parse.component_uri(outcome.doc)
            component = await w.store.get_component(uri) if uri else None
            versions = await _pinned_versions(w, outcome.doc, component)
            outcome = parse.build(outcome.doc, component, bid, versions)
        if outcome.ir is not None:
            ok, what = await w.store.create_block(
                bid, gen, parse.digest(d.data), {"status": "parsed", "ir": outcome.ir, "created": d.stream_seq}
            )
            if ok:
                await w.bus.emit(E.block_parsed, Parsed(bid, gen, outcome.ir))
                return
            outcome.errors.append(SpecError("$.blockId", what))
        else:
            await w.store.create_block(
                bid, gen, parse.digest(d.data), {"status": "rejected", "reason": _summary(outcome.errors)}
            )
        await w.bus.emit(E.block_rejected, Rejected(bid, gen, outcome.errors))

    return [router.binding()]


async def _pinned_versions(w: Worker, doc: dict[str, Any], component: dict[str, Any] | None) -> dict[str, int]:
    """Current registry version of every registry policy the block names (pinned into its IR)."""
    rules: dict[str, str] = {}
    for p in (component or {}).get("policies", []):
        if isinstance(p, dict) and isinstance(p.get("policyRuleURI"), str):
            rules[p.get("name", "")] = p["policyRuleURI"]
    for e in doc.get("policyRulesSpec") or []:
        v = e.get("values", e) if isinstance(e, dict) else None
        if isinstance(v, dict) and isinstance(v.get("policyRuleURI"), str):
            rules[v.get("name", "")] = v["policyRuleURI"]
    out = {}
    for name, uri in rules.items():
        reg = registry_name(uri)
        if reg and reg[1] is None:
            rec = await w.store.policy_get(reg[0])
            if rec:
                out[name] = int(rec["version"])
    return out


def _summary(errors: list[SpecError]) -> str:
    return msgspec.json.encode(errors).decode()[:2000]
