"""Parser worker: ``aios.block.{bid}.create`` (stream ``AIOS_INTAKE``) -> ``submitted`` (the create as
a CloudEvent in ``AIOS``), then ``parsed`` (IR) or ``rejected`` (every error)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E
from ..bus.dlq import REPLAY_OF, REPLAY_SEQ, Letter, Refused, letter_body, stored_at
from ..bus.router import Inbound, Router
from ..bus.runner import Delivery
from ..handlers import parse
from ..schemas.errors import SpecError
from ..schemas.events import Parsed, Rejected
from ..schemas.ir import KnownComponent
from ..schemas.policy_io import PolicySource
from ..schemas.records import BlockIR, BlockRecord
from ..schemas.spec import ID_RE
from ..state.priority import classes_of
from ..state.registry import policy_head
from ..state.tenants import TenantStore
from .base import Worker, bound
from .tenants import block_tenant

log = structlog.get_logger("aios.parser")


def bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.PARSER)
    router.add(E.block_create, bound(on_create, w))
    router.add(E.tenant_block_create, bound(on_create, w))  # a tenant's (docs/security.md "Tenants")
    return [router.binding()]


#: the components this process has read, each record validated once (``parse.ComponentCache``)
COMPONENTS = parse.ComponentCache()


async def on_create(w: Worker, m: Inbound[bytes]) -> None:
    """A create as sent: stored in ``AIOS`` as ``submitted``, then parsed (IR) or rejected."""
    d = m.delivery
    # its AIOS_INTAKE sequence, the publisher's PubAck seq; a replayed create's, the create it copies
    gen, existing = await generation(w, d, m.tokens.get("bid"))
    # first the create itself, as a CloudEvent in AIOS (its publisher may have sent a bare spec);
    # its body decoded once for that and for the parse (``parse.intake``)
    sub, outcome = parse.intake(d.subject, m.tokens.get("bid"), gen, d.data, d.headers, w.settings.max_spec_bytes)
    # a CloudEvent's wrong attributes: refused whatever its spec, which is checked all the same
    envelope = parse.envelope_errors(outcome)
    await w.bus.emit_all([sub])
    # a subject token that is no block id (aios.block.*.create, a.b taken by an extra filter)
    if (refused := parse.invalid_id(d.subject, m.tokens.get("bid"), gen)) is not None:
        await w.bus.emit_all([refused])
        return
    bid = m.tokens["bid"]
    if done := replay_done(existing, gen, d.stream_seq):
        log.info("parser.replay_done", bid=bid, gen=gen, copy=d.stream_seq, why=done)
        return
    digest = sub.payload.digest  # the body's (``parse.digest``), which the block record keeps too
    tenant = m.tokens.get("tenant")  # the server put the tenant's name in the subject
    if outcome.doc is not None and tenant:
        outcome = parse.for_tenant(outcome, tenant)
    if outcome.doc is not None:
        doc = outcome.doc
        refs = parse.registry_refs(doc, None)
        own = list(dict.fromkeys(r.name for r in refs))
        pins = parse.registry_pins(doc, None)
        # in one Redis exchange, as no read depends on another: the component, the priority
        # classes (priorityClass / the default, docs/priority.md) and the registry policies the
        # block names itself (read ahead for registry_check: their latest versions, and whether
        # each version it pins is stored), as one pipeline (no task per read: ``reads``), and
        # the tenant check's first read, in a task started before it (so its
        # first command is queued in the same turn of the loop as the pipeline's)
        # (a create with no tenant label, on the system's subject, has no tenant check: no task for it)
        check = (asyncio.ensure_future(_within_pending(w, tenant, bid, outcome)) if tenant
                 else asyncio.ensure_future(_no_account_label(w, outcome)) if _label_tenant(doc) else None)
        try:
            component, classes, heads, stored = await reads(w, parse.component_uri(doc), own, pins)
        except BaseException:
            if check is not None and not check.cancel() and not check.cancelled():
                check.exception()  # done already: its outcome (or error) is not wanted now
            raise
        if check is not None:
            outcome = await check
        if outcome.doc is not None:
            # the component's registry policies the block does not override, in one more exchange;
            # one the registry does not hold is an error of the spec, listed with the others
            versions, unknown = await parse.registry_check(w.store.policy_get, outcome.doc, component, heads,
                                                           w.store.policy_has, stored)
            outcome = parse.build(outcome.doc, component, bid, versions, w.settings, classes, unknown)
    outcome = parse.refused(outcome, envelope)  # with the attributes' problems, the spec's in one rejected
    if outcome.ir is not None:
        # the IR's JSON once, for the block record (which keeps it as that text) and the parsed
        # event (the same bytes in its body: ``msgspec.Raw``)
        ir_json = msgspec.json.encode(outcome.ir)
        ok, what = await w.store.create_block(
            bid, gen, digest, {"status": "parsed", "ir": ir_json.decode(), "created": gen}
        )
        if ok:
            if tenant:
                await TenantStore(w.store.r).add_pending(tenant, bid)
            await w.bus.emit(E.block_parsed, Parsed(bid, gen, cast(BlockIR, msgspec.Raw(ir_json))))
            return
        existing = await w.store.get_block(bid)
        if tenant and block_tenant(existing) != tenant:
            # another tenant's (or the default tenant's) block: that the id is taken, nothing of it
            outcome.errors.append(SpecError("$.blockId", f"block id {bid} is taken by a block that is not tenant "
                                                         f"{tenant}'s: block ids are one namespace for every tenant, "
                                                         f"choose another (e.g. {tenant}-...)"))
        else:
            outcome.errors.append(parse.in_use(what, existing, outcome.ir))
    else:
        await w.store.create_block(
            bid, gen, digest, {"status": "rejected", "reason": _summary(outcome.errors)}
        )
    await w.bus.emit(E.block_rejected, Rejected(bid, gen, outcome.errors))


async def generation(w: Worker, d: Delivery, bid: str | None) -> tuple[int, BlockRecord | None]:
    """A create's gen (its ``AIOS_INTAKE`` sequence), and the block's record when it was read
    (only for a replay's copy). A copy ``blocks dlq replay`` put back (``Aios-Replay-Of``) is
    the create it copies, once more, as a redelivery is: its gen is that create's sequence
    (``Aios-Replay-Seq``), not the copy's, when that is shown to be this very create (a header
    alone proves nothing: any publisher may set one): the block's record holds that gen with
    this body's digest, or ``AIOS_INTAKE`` still holds this body on this subject at that
    sequence, or, once the stream's limits dropped it, the dead letter the copy names
    (``Aios-Replay-Of``; only the system writes letters) is of this create at that sequence with
    this body (``letter_vouches``). So a replayed create makes its block at the gen its publisher
    was told, once, and a create whose record was made before it failed goes on from that record
    (docs/dead-letters.md)."""
    claimed = str(d.headers.get(REPLAY_SEQ, ""))
    if REPLAY_OF not in d.headers or not claimed.isdigit() or bid is None or not ID_RE.match(bid):
        return d.stream_seq, None
    first = int(claimed)
    if not 0 < first < d.stream_seq:  # a copy is stored after what it copies
        return d.stream_seq, None
    digest = parse.digest(d.data)
    existing = await w.store.get_block(bid)
    if existing is not None and existing.get("gen") == first and existing.get("digest") == digest:
        return first, existing
    try:
        held = await stored_at(w.bus, subjects.STREAM_INTAKE, first, d.subject)
    except Exception as exc:  # not readable now: taken as a create of its own (its own gen), as before
        log.warning("parser.replay_unchecked", bid=bid, claimed=first, error=repr(exc))
        held = None
    if held is not None and parse.digest(held[0]) == digest:
        return first, existing
    if held is None and await letter_vouches(w, str(d.headers.get(REPLAY_OF, "")), first, d.subject, d.data):
        return first, existing
    return d.stream_seq, existing


async def letter_vouches(w: Worker, ref: str, first: int, subject: str, body: bytes) -> bool:
    """Whether the parser's dead letter at ``ref`` (``AIOS:SEQ``, a copy's ``Aios-Replay-Of``) is
    of the create on ``subject`` stored at ``first`` (or of a copy that carried ``first``) and
    kept this very body: the proof that a copy is that create once its original left
    ``AIOS_INTAKE``. A letter is on a subject only the system's roles publish, so a header
    naming one proves nothing until the letter is read and found to match."""
    stream, _, seq = ref.partition(":")
    if stream != subjects.STREAM or not seq.isdigit():
        return False
    where = subjects.dead_letter(subjects.PARSER.durable, subject)
    try:
        got = await stored_at(w.bus, stream, int(seq), where)
        if got is None:
            return False
        letter = Letter(stream, int(seq), "", where, msgspec.json.decode(got[0]))
        carried = str((letter.data.get("headers") or {}).get(REPLAY_SEQ, ""))
        return (letter.original_subject == subject and first in (letter.original_seq, int(carried) if carried.isdigit() else 0)
                and letter_body(letter) == body)
    except Refused:  # the letter kept only part of the body, or not its bytes: it cannot vouch
        return False
    except Exception as exc:  # not readable now: taken as a create of its own (its own gen), as before
        log.warning("parser.replay_unchecked", ref=ref, claimed=first, error=repr(exc))
        return False


def replay_done(existing: BlockRecord | None, gen: int, seq: int) -> str:
    """Why a replayed create of generation ``gen`` (stored again at ``seq``: a copy when they
    differ) has nothing left to do ("": it goes on): a later create made the block since, or this
    one made it and it moved on past what this create's own step writes (``parsed``,
    ``rejected``), so its events went out then. A record that stopped at that step (its event
    never sent: the handler failed after it) goes on, as a redelivery does."""
    if existing is None or gen == seq:
        return ""
    if existing.get("gen", 0) > gen:
        return f"superseded: the block is a later create's (gen {existing.get('gen')})"
    if existing.get("gen") == gen and existing.get("status") not in ("parsed", "rejected"):
        return f"made by this create already, now {existing.get('status')}"
    return ""


async def reads(w: Worker, uri: str | None, own: list[str], pins: list[tuple[str, int]] | None = None
                ) -> tuple[KnownComponent | None, dict[str, dict[str, Any]], dict[str, PolicySource | None],
                           dict[tuple[str, int], bool]]:
    """A create's reads before its parse, as one pipeline (one exchange; no task per read): the
    component's record (``Store.get_component``'s read; validated once per record,
    ``COMPONENTS``: the same for every create of it until it is registered again), the priority
    classes (``PriorityStore.classes``), the latest version of each registry policy in ``own``
    (``Store.policy_get(name)``) and whether each (name, version) in ``pins`` is stored
    (``Store.policy_has``)."""
    raw, classes, heads, stored = await w.store.parse_reads(uri, own, pins or [])
    return (COMPONENTS.get(raw) if uri else None, classes_of(classes),
            {name: policy_head(h) for name, h in zip(own, heads, strict=True)}, dict(zip(pins or [], stored, strict=True)))


async def _no_account_label(w: Worker, outcome: parse.ParseOutcome) -> parse.ParseOutcome:
    """A create on the system's subject (``aios.block.B.create``: the default tenant, i.e. the
    ``upstream`` user, the admin's ``blocks submit``) may carry a ``tenant`` label (a quota group of
    the default tenant, docs/priority.md) but not the name of a tenant with an account: that block
    would be charged to the tenant's quota and be its block (its requests, its events). Only the
    tenant's own users, or the admin on ``aios.tenant.T.block.B.create``, make a tenant's blocks
    (docs/security.md "Tenants")."""
    assert outcome.doc is not None
    given = _label_tenant(outcome.doc)
    if not given or not await TenantStore(w.store.r).is_account(given):
        return outcome
    why = (f"label tenant={given!r} names a tenant with an account of its own: its blocks are created by its users "
           f"(or by the admin on aios.tenant.{given}.block.<id>.create), not charged to it from the default tenant")
    return parse.ParseOutcome(errors=[SpecError("$.labels.tenant", why)])


def _label_tenant(doc: dict[str, Any]) -> str | None:
    """The spec's ``tenant`` label, when it is a non-empty string (what ``_no_account_label`` checks)."""
    labels = doc.get("labels")
    given = labels.get("tenant") if isinstance(labels, dict) else None
    return given if isinstance(given, str) and given else None


async def _within_pending(w: Worker, tenant: str, bid: str, outcome: parse.ParseOutcome) -> parse.ParseOutcome:
    """A tenant's create beyond its pending-create limit (``blocks tenant add --max-pending-creates``,
    docs/security.md "Tenants") is refused with the reason: its blocks placing or waiting for
    capacity are at the limit. Other tenants' creates are not affected."""
    if outcome.doc is None:
        return outcome
    store = TenantStore(w.store.r)
    limit = await store.limit(tenant)
    if limit is None:
        return outcome
    pending = await store.pending(tenant)
    if bid in pending or len(pending) < limit:
        return outcome
    why = (f"tenant {tenant} has {len(pending)} creates pending (placing or waiting for capacity), its limit: wait for "
           f"them to be placed, failed or deleted, or raise it (blocks tenant add {tenant} --max-pending-creates N)")
    return parse.ParseOutcome(errors=[SpecError("$", why)])


def _summary(errors: list[SpecError]) -> str:
    return msgspec.json.encode(errors).decode()[:2000]
