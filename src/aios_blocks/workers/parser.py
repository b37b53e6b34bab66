"""Parser worker: ``aios.block.{bid}.create`` -> ``parsed`` (IR) or ``rejected`` (every error)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..bus import subjects
from ..bus.catalog import E
from ..bus.router import Inbound, Router
from ..bus.runner import Poison
from ..handlers import parse
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
            versions = await parse.pinned_versions(w.store.policy_get, outcome.doc, component)
            outcome = parse.build(outcome.doc, component, bid, versions, w.settings)
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


def _summary(errors: list[SpecError]) -> str:
    return msgspec.json.encode(errors).decode()[:2000]
