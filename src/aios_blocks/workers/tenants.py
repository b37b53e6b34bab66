"""The gateway's tenant desk (docs/security.md "Tenants"): what reaches the system from a tenant's
NATS account, and what goes back to it.

* **Requests.** A tenant's client asks ``aios.block.B.task|scale|delete`` in its own account; the
  server hands it to ``AIOS`` as ``aios.tenant.<t>.block.B.<request>`` (a service import: the
  tenant's name is the server's word, not the client's). The desk answers only when block B is the
  tenant's (its ``tenant`` label, set by the parser for the tenant's creates): the task goes on to
  the executors (``block.task``) and their answer back; a scale becomes ``block.scale.target`` (a
  ``{"target": n}`` body) or ``cluster.scale`` (one more instance), a delete ``block.delete``.
  Any other block, another tenant's or none, is answered ``Aios-Status: 404`` alike: a tenant
  cannot tell another's block from a missing one.
* **Creates.** A tenant's client publishes ``aios.block.B.create`` (JetStream) in its account; the
  server hands it here as ``aios.tenant.<t>.intake.B.create``, and the desk stores it in
  ``AIOS_INTAKE`` as ``aios.tenant.<t>.block.B.create`` with its ``Nats-Msg-Id`` scoped to the
  tenant (``tenant:<t>:<id>``), then answers the stream's PubAck. JetStream drops a message whose
  id another publisher used within the duplicate window: stored as sent, one tenant's guessed id
  suppressed another's create (and its ``duplicate`` PubAck said the id was used).
* **Events.** Every stored event of a block (``aios.block.B.…``) is relayed to
  ``aios.tenant.<owner>.event.B.…``, which only the owner's account imports (as
  ``aios.block.B.…``). A create's ``submitted`` and ``rejected`` go to the tenant that sent that
  create (the subject it came on), so a tenant that tries another's block id hears its own refusal
  and the owner hears nothing of it.

* **History.** ``aios.block.B.history`` (``aios.tenant.<t>.block.B.history`` here) answers a page
  of block B's stored events, read from ``AIOS`` (``bus.history``), oldest first: those the relay
  would have sent the tenant, i.e. of its own creates only (a generation's events go to the tenant
  whose create made it, ``HistoryOwners``), never an earlier owner's of the same id, never another
  tenant's refused create. Any other block is ``404`` as above.

The relay is core NATS (live); the history replays what the stream still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec
import nats.errors
import structlog

from ..bus import subjects
from ..bus.catalog import STREAM, E, Event
from ..bus.history import RELAYED, relayed, stored_from
from ..runtime import tenants as tn
from ..schemas.events import DeleteRequest, ScaleRequest, ScaleTarget
from .base import Worker

log = structlog.get_logger("aios.tenants")

#: queue groups: one gateway of several takes each request and relays each event once
DESK_QUEUE = "tenant-desk"
RELAY_QUEUE = "tenant-relay"
#: how long a tenant's task may take before the desk answers 504
TASK_TIMEOUT_S = 60.0
REQUESTS = (E.tenant_block_task, E.tenant_block_scale, E.tenant_block_delete, E.tenant_block_history)
#: a history page: events at most (``limit``, default), bytes of events at most (a reply stays far
#: below NATS's 1 MiB max_payload), stored messages read at most (other tenants' included)
HISTORY_LIMIT, HISTORY_DEFAULT, HISTORY_BYTES, HISTORY_SCAN = 500, 100, 512 * 1024, 5000


def tenant_of_create(subject: str) -> str | None:
    """The tenant a create came from: ``aios.tenant.<t>.block.B.create`` (``None``: the default)."""
    toks = E.tenant_block_create.match(subject)
    return toks["tenant"] if toks else None


def block_tenant(block: Any) -> str | None:
    """Whose a block is: its ``tenant`` label (the parser sets it for a tenant's create; quotas
    charge it too, docs/priority.md). ``None``: the default tenant's."""
    labels = ((block or {}).get("ir") or {}).get("labels") or {}
    tenant = labels.get("tenant") if isinstance(labels, dict) else None
    return str(tenant) if tenant else None


class _Gen(msgspec.Struct):
    gen: Any = None


class _GenOf(msgspec.Struct):
    """What ``_gen_of`` reads of an event: ``data.gen``; the rest (a ``parsed``'s IR, a step's
    decision records) is skipped by the decoder, not built."""

    data: _Gen | None = None


_GEN_OF = msgspec.json.Decoder(_GenOf)


def _gen_of(data: bytes) -> int | None:
    """The block generation an event names (``data.gen``), if any. The relay asks it of every
    block event: decoding the whole event was most of its CPU (the gateway's process)."""
    try:
        gen = (_GEN_OF.decode(data).data or _Gen()).gen
    except msgspec.ValidationError:  # not an object, or its data not one: read as before
        return _gen_of_any(data)
    except msgspec.DecodeError:
        return None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen > 0 else None


def _gen_of_any(data: bytes) -> int | None:
    """``_gen_of`` of an event whose shape the typed read refused (the whole event decoded)."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    gen = (body.get("data") or {}).get("gen") if isinstance(body, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen > 0 else None


#: the relayed events by the rest of their subject after the block id, an instance id as ``*``
#: (every relayed pattern is ``aios.block.{bid}.`` then literals, or ``instance.{iid}.`` and one)
_BY_REST: dict[str, Event[Any]] = {e.pattern.split(".", 3)[3].replace("{iid}", "*"): e for e in RELAYED}
assert len(_BY_REST) == len(RELAYED) and all("{" not in k for k in _BY_REST), "a relayed pattern of another shape"


def relayed_event(subject: str) -> Event[Any] | None:
    """``bus.history.relayed``: the catalog event of a stored block event, by one dict lookup on
    the subject's tokens after the block id (the relay asks it of every block event: matching each
    relayed kind's pattern in turn took a quarter of its CPU); any other subject as before."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[0] == subjects.ROOT and parts[1] == "block" and all(parts[2:]):
        rest = parts[3:]
        if len(rest) == 3 and rest[0] == "instance":
            rest = ["instance", "*", rest[2]]
        event = _BY_REST.get(".".join(rest))
        if event is not None:
            return event
    return relayed(subject)


class _Labelled(msgspec.Struct):
    labels: Any = None


#: what the relay reads of a block's IR: its labels (its ``tenant``)
_LABELS = msgspec.json.Decoder(_Labelled)


#: how long the desk waits for ``AIOS_INTAKE``'s PubAck of a tenant's create (a client's own
#: JetStream publish gives up sooner, 5 s by default in nats-py, 5 s in nats.js)
CREATE_TIMEOUT_S = 10.0
#: headers of a tenant's create that ask about the whole stream (another publisher's last message):
#: not passed on, so they cannot tell a tenant anything of another's creates
STREAM_WIDE = frozenset({"Nats-Expected-Last-Sequence", "Nats-Expected-Last-Msg-Id"})


def create_headers(tenant: str, headers: dict[str, str] | None) -> dict[str, str] | None:
    """A tenant's create's headers as stored: its ``Nats-Msg-Id`` scoped (``tn.scoped_msg_id``),
    the stream-wide expectations dropped, the rest as sent (``Content-Type``, a CloudEvent's)."""
    out = {k: v for k, v in (headers or {}).items() if k not in STREAM_WIDE}
    if out.get("Nats-Msg-Id"):
        out["Nats-Msg-Id"] = tn.scoped_msg_id(tenant, out["Nats-Msg-Id"])
    return out or None


def _stream_error(code: int, description: str) -> bytes:
    """An answer shaped as JetStream's own error reply (clients raise it as an API error)."""
    return msgspec.json.encode({"error": {"code": code, "description": description}})


def _answer(status: int, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    headers = {"Aios-Status": str(status), "Content-Type": "application/json"}
    if status >= 400:
        headers["Aios-Error"] = str(body.get("error", ""))
    return msgspec.json.encode(body), headers


class TenantDesk:
    """Tenants' requests and their blocks' events, for one gateway process."""

    def __init__(self, w: Worker, cache_size: int = 10_000, negative_s: float = 1.0, positive_s: float = 30.0):
        self.w = w
        #: block -> (its tenant or ``None``, when read, its gen)
        self._owner: OrderedDict[str, tuple[str | None, float, int | None]] = OrderedDict()
        #: (block, gen) of a create -> the tenant that sent it (its ``rejected`` goes there)
        self._creates: OrderedDict[tuple[str, int], str | None] = OrderedDict()
        self._size, self._negative_s, self._positive_s = cache_size, negative_s, positive_s

    # -- requests ----------------------------------------------------------------------------------
    async def _owned(self, tenant: str, bid: str) -> Any:
        block = await self.w.store.get_block(bid)
        if block is None or block_tenant(block) != tenant:
            return None
        return block

    async def _refused_own(self, tenant: str, bid: str) -> Any:
        """For a history request: block ``bid`` when no spec of it was ever parsed (no record, or
        one without its IR: every create of the id refused by the parser) and ``tenant`` sent a
        create of it. Its history is then the tenant's own creates' ``submitted`` and ``rejected``
        (``HistoryOwners``: by generation), which the tenant heard live; anything else: ``None``."""
        block = await self.w.store.get_block(bid)
        if block is not None and block.get("ir"):
            return None
        async for m in stored_from(self.w.bus.js, STREAM, E.block_submitted.subject(bid=bid), 1):
            body = msgspec.json.decode(m.data).get("data") or {}
            if tenant_of_create(str(body.get("subject", ""))) == tenant:
                return block or {}
        return None

    async def on_request(self, msg: Any) -> None:
        # a JetStream replay (``$JS.ACK`` reply) or a message without reply is no request
        if not msg.reply or msg.reply.startswith("$JS."):
            return
        for event in REQUESTS:
            if (toks := event.match(msg.subject)) is not None:
                break
        else:
            return
        tenant, bid = toks["tenant"], toks["bid"]
        try:
            block = await self._owned(tenant, bid)
            if block is None and event is E.tenant_block_history:
                block = await self._refused_own(tenant, bid)
            if block is None:
                body, headers = _answer(404, {"error": f"tenant {tenant} has no block {bid}"})
            elif event is E.tenant_block_task:
                body, headers = await self._task(bid, msg)
            elif event is E.tenant_block_history:
                body, headers = await self._history(tenant, bid, block, msg.data)
            elif event is E.tenant_block_scale:
                body, headers = await self._scale(bid, block, msg.data)
            else:
                body, headers = await self._delete(bid, block)
        except Exception as exc:  # an answer, always: the client would wait for its timeout else
            log.warning("tenant.request_failed", tenant=tenant, block=bid, request=event.name, error=repr(exc))
            body, headers = _answer(500, {"error": f"{type(exc).__name__}: {exc}"})
        log.info("tenant.request", tenant=tenant, block=bid, request=event.name, status=headers["Aios-Status"])
        await self.w.bus.nc.publish(msg.reply, body, headers=headers)

    async def on_create(self, msg: Any) -> None:
        """A tenant's create as its client sent it (``tenant.create.request``): stored in
        ``AIOS_INTAKE`` as ``tenant.block.create``, its ``Nats-Msg-Id`` scoped to the tenant
        (``create_headers``), and the stream's answer (its PubAck, or its error) sent back as the
        server would have. A core publish without a reply is stored all the same."""
        toks = E.tenant_create_request.match(msg.subject)
        if toks is None or (msg.reply or "").startswith("$JS."):
            return
        tenant, bid = toks["tenant"], toks["bid"]
        stored = tn.request_subject(tenant, "create", bid)
        try:
            ack = await self.w.bus.nc.request(stored, msg.data, timeout=CREATE_TIMEOUT_S,
                                              headers=create_headers(tenant, msg.headers))
            body = ack.data
        except nats.errors.NoRespondersError:
            body = _stream_error(503, f"no stream takes {stored}: the intake stream {subjects.STREAM_INTAKE} is missing")
        except nats.errors.TimeoutError:
            body = _stream_error(503, f"the intake stream {subjects.STREAM_INTAKE} did not answer in {CREATE_TIMEOUT_S:g} s")
        log.info("tenant.create", tenant=tenant, block=bid, stored=body[:120].decode(errors="replace"))
        if msg.reply:
            await self.w.bus.nc.publish(msg.reply, body)

    async def _task(self, bid: str, msg: Any) -> tuple[bytes, dict[str, str]]:
        try:
            reply = await self.w.bus.request(E.block_task, msg.data, dict(msg.headers or {}),
                                             TASK_TIMEOUT_S, bid=bid)
        except nats.errors.NoRespondersError:
            return _answer(503, {"error": "no executor is running"})
        except nats.errors.TimeoutError:
            return _answer(504, {"error": f"no answer from block {bid}"})
        return reply.data, dict(reply.headers or {})

    async def _scale(self, bid: str, block: dict[str, Any], data: bytes) -> tuple[bytes, dict[str, str]]:
        if not block.get("cluster") or block.get("status") not in ("ready", "placing"):
            return _answer(409, {"error": f"block {bid} is {block.get('status')}: it must be placed first"})
        try:
            asked = msgspec.json.decode(data) if data.strip() else {}
        except msgspec.DecodeError:
            asked = None
        target = asked.get("target") if isinstance(asked, dict) else None
        if not isinstance(asked, dict) or (target is not None and (isinstance(target, bool) or not isinstance(target, int)
                                                                   or target < 0)):
            return _answer(400, {"error": 'body: empty (one more instance) or {"target": n}, n >= 0'})
        rid = uuid.uuid4().hex[:12]
        gen = int(block["gen"])
        if target is None:
            ack = await self.w.bus.emit(E.cluster_scale, ScaleRequest(bid, block["cluster"], rid, gen=gen))
        else:
            ack = await self.w.bus.emit(E.block_scale_target, ScaleTarget(bid, rid, target, "tenant request", "tenant",
                                                                           gen=gen))
        return _answer(200, {"block_id": bid, "request_id": rid, "seq": ack.seq, **_clamped(target, block)})

    async def _delete(self, bid: str, block: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        if block.get("status") == "deleted":
            return _answer(409, {"error": f"block {bid} is already deleted"})
        rid = uuid.uuid4().hex[:12]
        ack = await self.w.bus.emit(E.block_delete, DeleteRequest(bid, rid))
        return _answer(200, {"block_id": bid, "request_id": rid, "seq": ack.seq})

    async def _history(self, tenant: str, bid: str, block: dict[str, Any], data: bytes) -> tuple[bytes, dict[str, str]]:
        try:
            asked = msgspec.json.decode(data) if data.strip() else {}
        except msgspec.DecodeError:
            asked = None
        start = asked.get("from", 1) if isinstance(asked, dict) else None
        limit = asked.get("limit", HISTORY_DEFAULT) if isinstance(asked, dict) else None
        if not (isinstance(start, int) and isinstance(limit, int) and not isinstance(start, bool)
                and not isinstance(limit, bool) and start >= 1 and 1 <= limit <= HISTORY_LIMIT):
            return _answer(400, {"error": f'body: empty or {{"from": seq >= 1, "limit": 1..{HISTORY_LIMIT}}}'})
        return _answer(200, await history_page(self.w.bus.js, tenant, bid, block, start, limit))

    # -- events ------------------------------------------------------------------------------------
    async def owner(self, bid: str, gen: int | None = None) -> str | None:
        tenant, known_gen = await self._owner_of(bid, gen)
        # an event of another generation than the block's now (a late one of a block deleted and
        # created again, maybe by another tenant): its owner is not known here, so it goes nowhere
        return None if gen is not None and known_gen is not None and gen != known_gen else tenant

    async def _owner_of(self, bid: str, gen: int | None) -> tuple[str | None, int | None]:
        """Whose block ``bid`` is, cached: a known owner for ``positive_s`` and while the event's
        ``gen`` is the one cached (an id deleted and created again by another tenant is a new gen:
        read again, so no event of the new block goes to the old owner even when another gateway
        relayed the ``submitted`` that would have dropped the entry), no owner for ``negative_s``."""
        now = time.monotonic()
        hit = self._owner.get(bid)
        if hit is not None:
            tenant, at, known_gen = hit
            fresh = now - at < (self._positive_s if tenant is not None else self._negative_s)
            if fresh and (gen is None or known_gen is None or gen == known_gen):
                return tenant, known_gen
        tenant, known = await self._read_owner(bid)
        self._remember(self._owner, bid, (tenant, now, known))
        return tenant, known

    async def _read_owner(self, bid: str) -> tuple[str | None, int | None]:
        """The block's tenant (``block_tenant``) and generation, from its record's ``gen`` and
        ``ir`` alone (not the whole record, ``Store.get_block``) and of the IR its labels alone
        (``_LABELS``: the rest, a policy's parameters, skipped by the decoder, not built)."""
        gen, ir = await self.w.store.block_gen_and_ir(bid)
        known = int(gen) if gen is not None else None  # a record's gen is an int (``records._block``)
        if known is not None and not str(known).isdigit():
            known = None
        if ir is None:
            return None, known
        try:
            labels = _LABELS.decode(ir).labels
        except msgspec.ValidationError:  # an IR that is no object: read whole, as before
            return block_tenant({"ir": msgspec.json.decode(ir)}), known
        tenant = labels.get("tenant") if isinstance(labels, dict) else None
        return (str(tenant) if tenant else None), known

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._size:
            cache.popitem(last=False)

    async def _create_tenant(self, bid: str, gen: int) -> str | None:
        """The tenant of one create: remembered from its ``submitted``, else read from the stream
        (another gateway relayed the ``submitted``): the block's last ``submitted`` of that gen."""
        if (bid, gen) in self._creates:
            return self._creates[(bid, gen)]
        with contextlib.suppress(Exception):
            m = await self.w.bus.js.get_last_msg(STREAM, E.block_submitted.subject(bid=bid))
            data = msgspec.json.decode(m.data or b"{}").get("data") or {}
            if int(data.get("gen", -1)) == gen:
                return tenant_of_create(str(data.get("subject", "")))
        return None

    async def tenant_of_event(self, event: Event[Any], bid: str, data: bytes) -> str | None:
        if event in (E.block_submitted, E.block_rejected):
            body = msgspec.json.decode(data).get("data") or {}
            create_gen = int(body.get("gen", 0))
            if event is E.block_submitted:
                tenant = tenant_of_create(str(body.get("subject", "")))
                self._remember(self._creates, (bid, create_gen), tenant)
                self._owner.pop(bid, None)  # a new create: the id may change hands
                return tenant
            return await self._create_tenant(bid, create_gen)
        gen = _gen_of(data)
        if event is E.block_deleted:
            tenant = await self.owner(bid, gen)
            self._owner.pop(bid, None)
            return tenant
        return await self.owner(bid, gen)

    async def on_event(self, msg: Any) -> None:
        event = relayed_event(msg.subject)
        if event is None:
            return
        bid = msg.subject.split(".")[2]
        try:
            tenant = await self.tenant_of_event(event, bid, msg.data)
        except Exception as exc:
            log.warning("tenant.relay_failed", subject=msg.subject, error=repr(exc))
            return
        if tenant:
            headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
            await self.w.bus.nc.publish(tn.event_subject(tenant, msg.subject), msg.data, headers=headers or None)

    # -- running -----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        subs = [await self.w.bus.subscribe(s, self.on_create if s == tn.import_subject("*", "create") else self.on_request,
                                           queue=DESK_QUEUE) for s in tn.REQUESTS_ALL]
        subs.append(await self.w.bus.subscribe(subjects.block_all(), self.on_event, queue=RELAY_QUEUE))
        try:
            await stop.wait()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


# -- history -----------------------------------------------------------------------------------------
class HistoryOwners:
    """Whose each stored event of one block id is, from its creates' events: a ``submitted`` and its
    ``rejected`` are the tenant's that sent that create (the subject it came on); an event of
    generation g (``data.gen``) the tenant's whose create made g (the block's ``tenant`` label for
    the block's generation now, when its create came from the default tenant: a quota group made a
    tenant); an event without a generation (``block.delete``, ``block.decision``) the tenant's whose
    create was the last one parsed before it. Nothing known: nobody's (left out)."""

    def __init__(self, block: Any) -> None:
        self.block_gen = int(block["gen"]) if str((block or {}).get("gen", "")).isdigit() else None
        self.block_owner = block_tenant(block)
        #: generation -> the tenant that sent its create
        self.of_gen: dict[int, str | None] = {}
        #: (seq, tenant) of each parsed create, by seq
        self.parsed: list[tuple[int, str | None]] = []

    def created(self, seq: int, event: Event[Any], data: bytes) -> None:
        """Learn from a ``submitted`` or ``parsed`` (in stream order)."""
        gen = _gen_of(data)
        if gen is None:
            return
        if event is E.block_submitted:
            body = msgspec.json.decode(data).get("data") or {}
            self.of_gen[gen] = tenant_of_create(str(body.get("subject", "")))
        elif event is E.block_parsed:
            self.parsed.append((seq, self.gen_owner(gen)))

    def gen_owner(self, gen: int) -> str | None:
        tenant = self.of_gen.get(gen)
        if tenant is None and gen == self.block_gen:
            return self.block_owner
        return tenant

    def owner(self, seq: int, data: bytes) -> str | None:
        gen = _gen_of(data)
        if gen is not None:
            return self.gen_owner(gen)
        last = None
        for at, tenant in self.parsed:
            if at >= seq:
                break
            last = tenant
        return last


async def history_page(js: Any, tenant: str, bid: str, block: Any, start: int, limit: int) -> dict[str, Any]:
    """A page of block ``bid``'s stored events that are ``tenant``'s, from stream sequence
    ``start``: ``{"block_id", "events": [{"seq", "subject", "event"}], "next", "more"}``; ask
    again from ``next`` while ``more``. The caller has checked the block is ``tenant``'s."""
    owners = HistoryOwners(block)
    for creates in (E.block_submitted, E.block_parsed):
        async for m in stored_from(js, STREAM, creates.subject(bid=bid), 1):
            owners.created(m.seq, creates, m.data)
    events: list[dict[str, Any]] = []
    size = scanned = 0
    nxt, more = start, False
    async for m in stored_from(js, STREAM, subjects.block_all(bid), start):
        if len(events) >= limit or scanned >= HISTORY_SCAN or (events and size + len(m.data) > HISTORY_BYTES):
            nxt, more = m.seq, True
            break
        scanned += 1
        nxt = m.seq + 1
        event = relayed(m.subject)
        if event is None or owners.owner(m.seq, m.data) != tenant:
            continue
        events.append({"seq": m.seq, "subject": m.subject, "event": msgspec.json.decode(m.data)})
        size += len(m.data)
    return {"block_id": bid, "events": events, "next": nxt, "more": more}


def _clamped(target: int | None, block: dict[str, Any]) -> dict[str, Any]:
    """What a scale answer says of its target: as asked, what the controller will reach (clamped to
    ``[minInstances, maxInstances]``, as ``blocks scale --to`` says it) and how (``note``); nothing for
    a request of one more instance. It echoed a target of 1000 for a block of at most 4 alone."""
    if target is None:
        return {}
    from ..handlers import scaling

    ir = block.get("ir") or {}
    clamped, note = scaling.clamp(target, int(ir.get("minInstances", 0)), int(ir.get("maxInstances", target)))
    return {"target": target, "clamped": clamped, **({"note": note} if note else {})}
