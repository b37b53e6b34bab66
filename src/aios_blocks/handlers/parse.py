"""Parser step: a create message body + the component it names -> the block IR, or every error."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..policies.runtime import registry_name
from ..schemas.catalog import E, Emit
from ..schemas.errors import SpecError, SpecInvalid
from ..schemas.events import Rejected, Submitted
from ..schemas.ir import DEFAULT_MAX_SPEC_BYTES, KnownComponent, block_create_IR, decode_create
from ..schemas.policy_io import PolicySource
from ..schemas.records import BlockIR, BlockRecord
from ..schemas.spec import ID_RE
from ..schemas.uris import uri_problem
from ..settings import Settings
from ..settings import load as load_settings

#: (registry name, version or None for the latest) -> its record (``Store.policy_get``)
PolicyLookup = Callable[[str, int | None], Awaitable[PolicySource | None]]
#: (registry name, version) -> whether that version is stored (``Store.policy_has``)
VersionLookup = Callable[[str, int], Awaitable[bool]]


#: the subject token of the ``rejected`` answering a create whose subject names no valid block id
#: (``aios.block.*.create``, ``aios.block.a.b.create``, ``aios.block.{x}.create``): not a valid id
#: itself, so no block ever has it, and one subject a publisher can watch for every such answer
INVALID_ID = "_invalid"


def invalid_id(subject: str, bid: str | None, gen: int) -> Emit | None:
    """A create on a subject whose id token is not a valid block id (``None`` when it is): its
    ``rejected`` on ``aios.block._invalid.rejected`` (``gen``: the create's stream sequence, the
    publisher's PubAck ``seq``), the id and the reason in the error. A dead letter alone told
    only the operators, and the publisher had its PubAck."""
    if bid is not None and ID_RE.match(bid):
        return None
    given = subject.removeprefix("aios.block.").removesuffix(".create") if bid is None else bid
    why = "contains a dot" if "." in given else "is a wildcard" if given in ("*", ">") else "is not a valid id"
    error = SpecError("$.blockId", f"block id {given!r} in the subject {subject} {why}: a block id is the subject's "
                                   f"one token, {ID_RE.pattern}")
    return Emit(E.block_rejected, Rejected(given, gen, [error]), {"bid": INVALID_ID})


#: how much of a body that held no spec its ``submitted`` keeps, as text
BODY_EXCERPT = 1024
#: the create's headers its ``submitted`` keeps
HEADERS_OF_NOTE = ("Nats-Msg-Id", "Content-Type", "Content-Encoding")


def submitted(subject: str, bid: str | None, gen: int, raw: bytes, headers: dict[str, str] | None,
              max_bytes: int = DEFAULT_MAX_SPEC_BYTES) -> Emit:
    """The ``block.submitted`` CloudEvent that stores in ``AIOS`` a create taken from
    ``AIOS_INTAKE``, whatever its publisher sent (a bare spec, a CloudEvent, no JSON at all): the
    spec, gen, the subject and headers it came with. Its id derives from gen, so a redelivered
    create stores it once. A subject with no valid id puts it on ``aios.block._invalid.submitted``."""
    return intake(subject, bid, gen, raw, headers, max_bytes)[0]


def intake(subject: str, bid: str | None, gen: int, raw: bytes, headers: dict[str, str] | None,
           max_bytes: int = DEFAULT_MAX_SPEC_BYTES) -> tuple[Emit, ParseOutcome]:
    """:func:`submitted` and :func:`read` of one create, its body decoded once (the parser's turn
    decoded it three times: for the framing, for the submitted's spec and for the parse)."""
    valid = bid is not None and ID_RE.match(bid) is not None
    given = bid if bid is not None else subject.removeprefix("aios.block.").removesuffix(".create")
    out = Submitted(given, gen, subject, digest(raw),
                    headers={k: str(v) for k, v in (headers or {}).items() if k in HEADERS_OF_NOTE})
    doc: Any = None
    if len(raw) <= max_bytes:
        try:
            doc = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            doc = None
    if isinstance(doc, dict) and "specversion" in doc:
        out.framing = "cloudevent"
        out.attributes = {k: v for k, v in doc.items() if k not in ("data", "data_base64")}
    outcome = read(raw, max_bytes, doc)
    if outcome.doc is not None:
        out.spec = outcome.doc
    else:
        out.body = raw[:BODY_EXCERPT].decode(errors="replace")
    return Emit(E.block_submitted, out, {"bid": given if valid else INVALID_ID}, early=True), outcome


#: how a publisher retries a create without a second answer "in use" (docs/subjects.md)
RETRY_HINT = (
    "to retry a create, give it a Nats-Msg-Id of your own (the stream drops a repeat within its duplicate window) "
    "and read its PubAck, which needs your user's inbox prefix _INBOX.<user> (nats-py inbox_prefix=, nats.js "
    "inboxPrefix, nats CLI --inbox-prefix): a client without it gets a permissions violation for the create that "
    "was stored"
)


def in_use(what: str, existing: BlockRecord | None, ir: BlockIR) -> SpecError:
    """The error of a create whose id a live block holds. The same spec again is most likely a
    publisher's retry of a create whose PubAck it never got: say so, that the block is the one the
    first create made, and what to set so that a retry is deduplicated instead."""
    if existing is not None and existing.get("ir") == msgspec.json.decode(msgspec.json.encode(ir)):
        return SpecError("$.blockId", f"{what}, by a create of this same spec (gen {existing.get('gen')}): the block is "
                                      f"that create's and this one changes nothing; {RETRY_HINT}")
    return SpecError("$.blockId", what)


@dataclass
class ParseOutcome:
    """A create's IR, or its errors. ``read`` gives the spec (``doc``), with errors beside it when
    the CloudEvent that carried it has wrong attributes: the create is refused whatever its spec
    (``refused``), which is still checked, so one ``rejected`` lists every problem."""

    ir: BlockIR | None = None
    errors: list[SpecError] = field(default_factory=list)
    doc: dict[str, Any] | None = None


def read(raw: bytes, max_bytes: int = DEFAULT_MAX_SPEC_BYTES, decoded: Any = None) -> ParseOutcome:
    """First half: decode the body (bare spec or CloudEvent) so the worker can look up the component;
    ``max_bytes``: ``Settings.max_spec_bytes``; ``decoded``: the body's JSON if decoded already. A
    CloudEvent with wrong attributes: its spec and, as errors, the attributes' problems (``refused``)."""
    try:
        doc, envelope = decode_create(raw, max_bytes, decoded)
    except SpecInvalid as exc:
        return ParseOutcome(errors=exc.errors)
    return ParseOutcome(doc=doc, errors=envelope)


def envelope_errors(outcome: ParseOutcome) -> list[SpecError]:
    """The problems of the CloudEvent that carried ``read``'s spec (its errors beside a spec; none
    when no spec could be read: those errors are the whole answer already)."""
    return list(outcome.errors) if outcome.doc is not None else []


def refused(outcome: ParseOutcome, envelope: list[SpecError]) -> ParseOutcome:
    """The outcome of a create whose CloudEvent has wrong attributes (``envelope``:
    ``envelope_errors`` of its ``read``), after its spec was checked: no IR, whatever the spec; the
    attributes' problems first, then the spec's own, each once (every problem in one ``rejected``;
    before, the spec was checked only once the attributes were right: two rounds). No ``envelope``:
    ``outcome`` as it is."""
    if not envelope:
        return outcome
    return ParseOutcome(errors=[*envelope, *(e for e in outcome.errors if e not in envelope)], doc=outcome.doc)


def for_tenant(outcome: ParseOutcome, tenant: str) -> ParseOutcome:
    """A tenant's create (``aios.tenant.<t>.block.B.create``: the server wrote ``t`` from the
    account the client logged in to): the block is labelled ``tenant=<t>``, which makes it the
    tenant's (its requests, its events, its quota, docs/security.md "Tenants"). A spec that names
    another tenant in its label is refused, not relabelled: its sender meant something else."""
    assert outcome.doc is not None
    labels = outcome.doc.get("labels")
    if labels is not None and not isinstance(labels, dict):
        return outcome  # the spec's validation says what is wrong with it
    given = (labels or {}).get("tenant")
    if given is not None and given != tenant:
        return ParseOutcome(errors=[SpecError("$.labels.tenant", f"label tenant={given!r}, but this create comes from "
                                                                 f"tenant {tenant!r}: a tenant's blocks carry its own name")])
    return ParseOutcome(doc={**outcome.doc, "labels": {**(labels or {}), "tenant": tenant}})


#: the records of components the parser keeps validated (``ComponentCache``)
COMPONENT_CACHE = 256


class ComponentCache:
    """The components the parser has read, each stored record (its JSON text, as Redis holds it)
    decoded and validated once (``schemas.ir.KnownComponent``): a component's record is read for
    every create that names it, and validating it and dumping its models again was a third of
    the parser's turn on the GPU trace (docs/trace.md). Keyed by the whole record: a component
    registered again is another key, so nothing is ever stale; the least recently used goes
    beyond ``size``."""

    def __init__(self, size: int = COMPONENT_CACHE) -> None:
        self.size = size
        self._known: OrderedDict[str, KnownComponent] = OrderedDict()

    def get(self, raw: str | bytes | None) -> KnownComponent | None:
        """The record ``raw`` (None or empty: no such component) decoded and validated."""
        if not raw:
            return None
        key = raw if isinstance(raw, str) else raw.decode()
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = KnownComponent(msgspec.json.decode(key))
            if len(self._known) > self.size:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(key)
        return known


def record_of(component: dict[str, Any] | KnownComponent | None) -> dict[str, Any] | None:
    """A component's record (its JSON), given it or a ``KnownComponent`` of it."""
    return component.doc if isinstance(component, KnownComponent) else component


def component_uri(doc: dict[str, Any]) -> str | None:
    uri = doc.get("blockComponentURI")
    return uri if isinstance(uri, str) and uri else None


@dataclass(frozen=True)
class RegistryRef:
    """A registry policy a block is placed with (``registry:NAME[@V]``, ``NAME.py``, ``NAME.star``):
    its slot (``PolicyRule.name``), where the spec or its component names it, the URI as given,
    the registry name and the version it pins (None: the latest)."""

    slot: str
    path: str
    uri: str
    name: str
    version: int | None


def registry_refs(doc: dict[str, Any], component: dict[str, Any] | KnownComponent | None) -> list[RegistryRef]:
    """Every registry policy the block is placed with: the component's policies, overridden (same
    slot) by the block's ``policyRulesSpec``. ``component`` None: the block's own. A URI the spec's
    validation refuses (``uri_problem``, e.g. ``registry:x@abc``) is left to it."""
    rules: dict[str, tuple[str, str]] = {}
    for i, p in enumerate((record_of(component) or {}).get("policies", [])):
        if isinstance(p, dict) and isinstance(p.get("policyRuleURI"), str) and isinstance(p.get("name", ""), str):
            rules[p.get("name", "")] = (f"$.<component>.policies[{i}].policyRuleURI", p["policyRuleURI"])
    given = doc.get("policyRulesSpec")
    for i, e in enumerate(given if isinstance(given, list) else []):  # not a list: the spec's validation says so
        v = e.get("values", e) if isinstance(e, dict) else None
        if isinstance(v, dict) and isinstance(v.get("policyRuleURI"), str) and isinstance(v.get("name", ""), str):
            where = f"$.policyRulesSpec[{i}].values" if v is not e else f"$.policyRulesSpec[{i}]"
            rules[v.get("name", "")] = (f"{where}.policyRuleURI", v["policyRuleURI"])
    out = []
    for slot, (path, uri) in rules.items():
        reg = registry_name(uri) if uri_problem(uri) is None else None
        if reg is not None:
            out.append(RegistryRef(slot, path, uri, reg[0], reg[1]))
    return out


def registry_policies(doc: dict[str, Any], component: dict[str, Any] | KnownComponent | None) -> dict[str, str]:
    """Policy name -> registry name of every registry policy the block names at its latest version
    (``registry:NAME``, a ``.py``/``.star`` path; not ``registry:NAME@V``): the component's
    policies, overridden by the block's ``policyRulesSpec``. ``component`` None: the block's own."""
    return {r.slot: r.name for r in registry_refs(doc, component) if r.version is None}


def registry_pins(doc: dict[str, Any], component: dict[str, Any] | KnownComponent | None) -> list[tuple[str, int]]:
    """(registry name, version) of every ``registry:NAME@V`` the block is placed with."""
    return list(dict.fromkeys((r.name, r.version) for r in registry_refs(doc, component) if r.version is not None))


def unregistered(refs: Iterable[RegistryRef], heads: Mapping[str, PolicySource | None],
                 versions: Mapping[tuple[str, int], bool]) -> list[SpecError]:
    """One error for each registry policy in ``refs`` that the registry does not hold: ``heads``,
    each name's latest record (None: no such policy); ``versions``, whether each pinned
    (name, version) is stored. A block naming one was placed nowhere: its dry_run and allocation
    could only fail, round after round; refused here, with the spec's other problems."""
    errors = []
    for r in refs:
        head = heads.get(r.name)
        if head is None:
            file = r.uri if r.uri.endswith((".py", ".star")) else "FILE"
            stem = " (the registry entry named by the file's stem)" if file == r.uri else ""
            errors.append(SpecError(r.path, f"{r.slot} policy {r.uri!r}: no policy {r.name!r} is registered{stem}; "
                                            f"add it first (blocks policy add {r.name} {file}), or name another "
                                            f"(blocks policy list)"))
        elif r.version is not None and not versions.get((r.name, r.version)):
            errors.append(SpecError(r.path, f"{r.slot} policy {r.uri!r}: policy {r.name!r} has no version {r.version} "
                                            f"(its latest is version {head['version']}): pin a stored version, name "
                                            f"registry:{r.name} for the latest, or add a new version (blocks policy "
                                            f"add {r.name} FILE)"))
    return errors


async def registry_heads(lookup: PolicyLookup, names: Iterable[str]) -> dict[str, PolicySource | None]:
    """The current record of each registry policy in ``names``, looked up together (through one
    Redis connection: one exchange, ``state.autopipeline``)."""
    wanted = list(dict.fromkeys(names))
    return dict(zip(wanted, await asyncio.gather(*(lookup(n, None) for n in wanted)), strict=True))


async def pinned_versions(lookup: PolicyLookup, doc: dict[str, Any], component: dict[str, Any] | KnownComponent | None,
                          known: Mapping[str, PolicySource | None] | None = None) -> dict[str, int]:
    """Current registry version of every registry policy the block names (pinned into its IR by
    ``build``): the component's policies, overridden by the block's ``policyRulesSpec``. ``known``:
    records already read (``registry_heads`` of the block's own, read ahead with its component);
    the others are looked up together."""
    names = registry_policies(doc, component)
    heads = dict(known or {})
    heads.update(await registry_heads(lookup, [n for n in names.values() if n not in heads]))
    out = {}
    for name, reg in names.items():
        rec = heads.get(reg)
        if rec:
            out[name] = int(rec["version"])
    return out


async def registry_check(
    lookup: PolicyLookup, doc: dict[str, Any], component: dict[str, Any] | KnownComponent | None,
    known: Mapping[str, PolicySource | None] | None = None, has: VersionLookup | None = None,
    known_versions: Mapping[tuple[str, int], bool] | None = None,
) -> tuple[dict[str, int], list[SpecError]]:
    """``pinned_versions`` and the errors of the registry policies the registry does not hold
    (``unregistered``), from one look-up of what ``known`` / ``known_versions`` (read ahead with
    the component) do not hold: each name's latest record and whether each pinned version is
    stored (``has``; without it, ``lookup(name, version)``), all together (one exchange)."""
    refs = registry_refs(doc, component)
    heads, have = dict(known or {}), dict(known_versions or {})
    names = list(dict.fromkeys(r.name for r in refs if r.name not in heads))
    pins = list(dict.fromkeys((r.name, r.version) for r in refs if r.version is not None and (r.name, r.version) not in have))
    if names or pins:  # no look-up, no task
        got: list[Any] = await asyncio.gather(*(lookup(n, None) for n in names), *(_stored(lookup, has, n, v) for n, v in pins))
        heads.update(zip(names, got[:len(names)], strict=True))
        have.update(zip(pins, got[len(names):], strict=True))
    versions = {r.slot: int(rec["version"]) for r in refs if r.version is None and (rec := heads.get(r.name))}
    return versions, unregistered(refs, heads, have)


async def _stored(lookup: PolicyLookup, has: VersionLookup | None, name: str, version: int) -> bool:
    return await has(name, version) if has is not None else await lookup(name, version) is not None


def build(
    doc: dict[str, Any],
    component: dict[str, Any] | KnownComponent | None,
    block_id: str,
    policy_versions: dict[str, int] | None = None,
    settings: Settings | None = None,
    priority_classes: dict[str, dict[str, Any]] | None = None,
    unknown: list[SpecError] | None = None,
) -> ParseOutcome:
    """Second half: validate and enrich. ``policy_versions`` (policy name -> registry version) pins
    the versions of registry policies the block will be placed with; ``pin_defaults`` writes the
    process defaults the built-in rules would use into the rules, so a recorded decision does not
    depend on the environment of the worker that re-runs it. ``priority_classes``: the registered
    classes (docs/priority.md). ``component``: its record, or a ``KnownComponent`` of it (the same IR).
    ``unknown``: the registry policies it names that the registry does not hold (``registry_check``),
    listed with the spec's other problems."""
    try:
        ir = block_create_IR(doc, component, block_id, priority_classes)
    except SpecInvalid as exc:
        return ParseOutcome(errors=exc.errors + (unknown or []), doc=doc)
    if unknown:
        return ParseOutcome(errors=list(unknown), doc=doc)
    for name, version in (policy_versions or {}).items():
        if name in ir["policies"]:
            ir["policies"][name] = {**ir["policies"][name], "version": version}
    pin_defaults(ir, settings or load_settings())
    return ParseOutcome(ir=ir, doc=doc)


def pin_defaults(ir: BlockIR, settings: Settings) -> BlockIR:
    """Rule settings the placement reads, filled from the settings where the spec left them out:
    the resourceAllocator's ``settings.sampleNodes`` (node sampling) and ``builtin:cluster-rank``'s
    ``parameters.maxCandidates``. Values the spec gives are kept."""
    policies = ir.get("policies") or {}
    ra = policies.get("resourceAllocator")
    if isinstance(ra, dict):
        ra["settings"] = {"sampleNodes": settings.sample_nodes, **(ra.get("settings") or {})}
    ca = policies.get("clusterAllocator")
    if isinstance(ca, dict) and ca.get("policyRuleURI") == "builtin:cluster-rank":
        ca["parameters"] = {"maxCandidates": settings.max_candidates, **(ca.get("parameters") or {})}
    return ir


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]
