"""``block_create_IR``: a block spec enriched by its component (seed 000), with every problem
reported at once, each with a JSON path.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal, cast

import msgspec
from pydantic import ValidationError

from .affinity import normalize
from .errors import SpecError, SpecInvalid
from .records import BlockIR, JobClusterRecord, JSONObject, LaunchRecord, Needs, PolicyRule, SidecarRecord
from .sharing import sharing_problems
from .spec import ID_RE, REQUIRED_POLICIES, BlockSpec, Component, Sidecar, sidecar_problems
from .spec import PolicyRule as PolicyRuleModel

#: block field <- component field, inherited when the block does not set it (seed 000 table).
#: the IR field a block inherits from its component when it does not set it -> the component's field
INHERITED: tuple[tuple[Literal["blockInitData", "initSettings", "parameters", "blockMetadata", "inputProtocol",
                            "outputProtocol", "tags"], str], ...] = (
    ("blockInitData", "componentInitData"),
    ("initSettings", "componentInitSettings"),
    ("parameters", "componentParameters"),
    ("blockMetadata", "componentMetadata"),
    ("inputProtocol", "componentInputProtocol"),
    ("outputProtocol", "componentOutputProtocol"),
    ("tags", "tags"),
)


def json_path(loc: tuple[Any, ...]) -> str:
    path = "$"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def pydantic_errors(exc: ValidationError, prefix: tuple[Any, ...] = ()) -> list[SpecError]:
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p not in ("function-before[_accept_bare()]",))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "value_error":  # our validators' own words, without pydantic's prefix
            msg = msg.removeprefix("Value error, ")
        out.append(SpecError(path=json_path(prefix + loc), message=msg))
    return out


#: A spec's body is republished inside the ``parsed`` event and every dry_run request: it must stay
#: well under the NATS max payload (1 MiB by default) once enriched and wrapped. The default of
#: ``AIOS_MAX_SPEC_BYTES`` (``Settings.max_spec_bytes``, which the parser passes in: no setting is
#: read at import).
DEFAULT_MAX_SPEC_BYTES = 256 * 1024
#: Deeper documents are rejected (msgspec and pydantic recurse; a hostile body must not crash).
MAX_SPEC_DEPTH = 64


def _too_deep(doc: Any, limit: int) -> bool:
    stack = [(doc, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return False


def decode_spec(raw: bytes, max_bytes: int = DEFAULT_MAX_SPEC_BYTES, decoded: Any = None) -> JSONObject:
    """Decode a create message body: a bare spec, or a CloudEvents envelope whose ``data`` is one.
    ``decoded``: the body's JSON already decoded (``msgspec.json.decode(raw)``, not changed
    since), so it is not decoded again; None: decode it here. A CloudEvent with wrong attributes
    raises too (:func:`decode_create` gives its spec beside them)."""
    doc, errors = decode_create(raw, max_bytes, decoded)
    if errors:
        raise SpecInvalid(errors)
    return doc


def decode_create(raw: bytes, max_bytes: int = DEFAULT_MAX_SPEC_BYTES, decoded: Any = None) -> tuple[JSONObject, list[SpecError]]:
    """A create message body's spec, and the problems of the CloudEvent that carried it (its
    attributes wrong or missing, :func:`cloudevent_problems`; none for a bare spec or a right
    CloudEvent). Such a create is refused whatever its spec, but the spec is still given, to be
    checked, so that one rejection lists the attributes' problems and the spec's own. Raises
    :class:`SpecInvalid` when the body holds no spec at all (too big, not JSON, too deep, not an
    object, a CloudEvent's ``data`` that is none), with the attributes' problems among its errors.
    ``decoded``: as for :func:`decode_spec`."""
    if len(raw) > max_bytes:
        raise SpecInvalid([SpecError("$", f"spec is {len(raw)} bytes; the limit is {max_bytes} (AIOS_MAX_SPEC_BYTES)")])
    try:
        doc = msgspec.json.decode(raw) if decoded is None else decoded
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise SpecInvalid([SpecError("$", f"body is not valid JSON: {exc}")]) from None
    except RecursionError:
        raise SpecInvalid([SpecError("$", f"body nests deeper than {MAX_SPEC_DEPTH} levels")]) from None
    if _too_deep(doc, MAX_SPEC_DEPTH + 2):  # +2: a CloudEvent wraps the spec in one more object
        raise SpecInvalid([SpecError("$", f"body nests deeper than {MAX_SPEC_DEPTH} levels")])
    if isinstance(doc, dict) and "specversion" in doc:  # a CloudEvent: its data is the spec
        errors = cloudevent_problems(doc)
        if "data_base64" in doc and "data" not in doc:
            try:
                doc = {**doc, "data": _base64_data(doc["data_base64"])}  # the CloudEvents JSON form for binary data
            except SpecInvalid as exc:
                raise SpecInvalid(errors + exc.errors) from None
        if not isinstance(doc.get("data"), dict):
            got = "nothing" if doc.get("data") is None else type(doc.get("data")).__name__
            raise SpecInvalid([*errors, SpecError("$.data", f"a CloudEvent's data must be the spec, a JSON object; got {got}")])
        return doc["data"], errors
    if not isinstance(doc, dict):
        raise SpecInvalid([SpecError("$", f"spec must be a JSON object, got {type(doc).__name__}")])
    return doc, []


#: the ``type`` of a create sent as a CloudEvent (``E.block_create.type``; a tenant's clients send it too)
CREATE_TYPE = "io.aios.block.create"


def cloudevent_problems(doc: Mapping[str, Any]) -> list[SpecError]:
    """The attributes CloudEvents 1.0 requires of a create, each one wrong or missing (docs/subjects.md,
    the AsyncAPI document's create envelope): ``specversion`` "1.0", ``id`` and ``source`` non-empty
    strings, ``type`` :data:`CREATE_TYPE`. A CloudEvent of another version or type is no create, so it
    is refused rather than placed as one."""
    out = []
    if doc.get("specversion") != "1.0":
        out.append(SpecError("$.specversion", f"must be \"1.0\" (CloudEvents 1.0); got {doc.get('specversion')!r}"))
    for name in ("id", "source"):
        if not isinstance(doc.get(name), str) or not doc[name]:
            got = "nothing" if doc.get(name) is None else repr(doc.get(name))
            out.append(SpecError(f"$.{name}", f"a CloudEvent needs {name}, a non-empty string; got {got}"))
    if doc.get("type") != CREATE_TYPE:
        out.append(SpecError("$.type", f"a create's type is {CREATE_TYPE!r}; got {doc.get('type')!r}"))
    return out


def _base64_data(value: Any) -> Any:
    """A CloudEvent's ``data_base64``: the spec as base64 of its JSON text."""
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise SpecInvalid([SpecError("$.data_base64", "not base64 text")])
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise SpecInvalid([SpecError("$.data_base64", f"does not hold JSON: {exc}")]) from None


class KnownComponent:
    """A registered component's record decoded and validated once, with the parts of it every
    IR built from it takes (``block_create_IR`` given one instead of the record): the parser keeps
    one per stored record (``handlers.parse.ComponentCache``) rather than validating the record
    and dumping its models again for every create. Read-only: an IR built from it holds its
    parts (``data``'s values) as they are; only the policy rules, which ``handlers.parse``
    changes, are copied per IR."""

    __slots__ = ("data", "doc", "errors", "model", "rules")

    def __init__(self, doc: JSONObject) -> None:
        #: the record as stored (its JSON)
        self.doc = doc
        #: the validated component (None: the record no longer passes, ``errors`` say why)
        self.model: Component | None = None
        self.errors: list[SpecError] = []
        try:
            self.model = Component.model_validate(doc)
        except ValidationError as exc:  # stored before a rule that now refuses it
            self.errors = pydantic_errors(exc, ("<component>",))
        #: the model's JSON (``Component.model_dump()``) and its policy rules as the IR keeps them
        self.data: dict[str, Any] = self.model.model_dump() if self.model is not None else {}
        self.rules: list[PolicyRule] = [rule_record(p) for p in self.model.policies] if self.model is not None else []


def rule_record(rule: PolicyRuleModel) -> PolicyRule:
    """A policy rule as the IR keeps it: the model's JSON (``PolicyRule`` names exactly its fields)."""
    return cast(PolicyRule, rule.model_dump())


def merge_policies(component: list[PolicyRule], block: list[PolicyRule] | None) -> dict[str, PolicyRule]:
    """Component policies overridden (same name) or extended (new name) by the block's."""
    merged = {p["name"]: p for p in component}
    for rule in block or []:
        merged[rule["name"]] = rule
    return merged


def merge_sidecars(component: list[Sidecar], block: list[Sidecar] | None) -> list[SidecarRecord]:
    """The component's side-cars, replaced (same name) or extended (new name) by the block's,
    in order: the component's first, then the block's new ones."""
    merged = {sc.name: sc for sc in component}
    for sc in block or []:
        merged[sc.name] = sc
    # the model's JSON: ``SidecarRecord`` names exactly its fields
    return [cast(SidecarRecord, sc.model_dump()) for sc in merged.values()]


def _sharing_errors(spec: BlockSpec, comp: Component, policies: dict[str, PolicyRule]) -> list[SpecError]:
    """GPU sharing of the merged resourceAllocator with the block's resources (see ``sharing``)."""
    resources = spec.resources or comp.resources
    rule = policies.get("resourceAllocator")
    rule_from_block = any(e.values.name == "resourceAllocator" for e in spec.policyRulesSpec or [])
    where = {
        "settings": "$.policyRulesSpec" if rule_from_block else "$.<component>.policies",
        "resources": "$.resources" if spec.resources is not None else "$.<component>.resources",
    }
    return [SpecError(where[w], msg) for w, msg in sharing_problems(rule, resources.model_dump())]


def priority_of(name: str | None, classes: Mapping[str, Mapping[str, Any]]) -> tuple[str, int] | SpecError | None:
    """A block's priority class and value: the one it names, else the default class (None: no
    class is named and none is the default). An unknown name is an error listing the classes."""
    if name is None:
        default = sorted(n for n, c in classes.items() if c.get("default"))
        return (default[0], int(classes[default[0]]["value"])) if default else None
    if name in classes:
        return name, int(classes[name]["value"])
    known = ", ".join(f"{n} ({classes[n].get('value')})" for n in sorted(classes, key=lambda n: -int(classes[n].get("value", 0))))
    return SpecError("$.priorityClass", f"unknown priority class {name!r}; " + (
        f"the classes: {known}" if known else "no priority class is registered (blocks priority-class add)"))


def block_create_IR(
    doc: JSONObject, component: JSONObject | KnownComponent | None, subject_block_id: str | None = None,
    priority_classes: Mapping[str, Mapping[str, Any]] | None = None,
) -> BlockIR:
    """Validate ``doc`` against the block spec and build the IR, or raise :class:`SpecInvalid`
    listing every problem found. ``priority_classes``: the registered classes by name
    (``schemas.priority.PriorityClass`` JSON), for ``priorityClass`` and the default class.
    ``component``: the record, or a :class:`KnownComponent` of it (validated once: the same IR)."""
    errors: list[SpecError] = []
    spec: BlockSpec | None = None
    try:
        spec = BlockSpec.model_validate(doc)
    except ValidationError as exc:
        errors.extend(pydantic_errors(exc))
    errors.extend(_count_errors(doc, spec))
    block_id = _block_id(doc, subject_block_id, errors)
    comp = _component(doc, component, errors)
    known = component if isinstance(component, KnownComponent) else None
    policies: dict[str, PolicyRule] = {}
    if spec is not None and comp is not None:
        block_rules = [rule_record(e.values) for e in spec.policyRulesSpec] if spec.policyRulesSpec is not None else None
        # a known component's rules copied (their values shared): ``handlers.parse`` sets keys of the IR's rules
        comp_rules = [cast(PolicyRule, dict(r)) for r in known.rules] if known is not None else [rule_record(p) for p in comp.policies]
        policies = merge_policies(comp_rules, block_rules)
        errors.extend(_policy_errors(spec, comp, policies))
    if isinstance(raw_sidecars := doc.get("sidecars"), list):  # the spec's own list: reported with its other problems
        errors.extend(SpecError(f"$.sidecars[{i}].name", msg) for i, msg in sidecar_problems(raw_sidecars))
    affinity = _affinity(doc, comp, errors)
    if spec is not None and comp is not None:
        errors.extend(_job_cluster_errors(spec, comp))

    priority = _priority(doc, spec, priority_classes, errors)

    if errors or spec is None or comp is None:
        if not errors:  # pragma: no cover - defensive: spec invalid always yields errors
            errors.append(SpecError("$", "invalid spec"))
        raise SpecInvalid(errors)
    ir = _ir(block_id, spec, comp, policies, affinity, known.data if known is not None else None)
    # docs/priority.md: set only with a class (named or the default) / when given: a spec without
    # them keeps its IR (and digest) while no default class is registered
    if priority is not None:
        ir["priorityClass"], ir["priority"] = priority
    if spec.preemptible is not None:
        ir["preemptible"] = spec.preemptible
    if spec.queue is not None:  # the pending queue (docs/priority.md): set only when given
        ir["queue"] = spec.queue
    if spec.maxPendingS is not None:
        ir["maxPendingS"] = spec.maxPendingS
    if spec.maxMoving is not None:  # the disruption budget of moves (docs/rebalance.md): set only when given
        ir["maxMoving"] = spec.maxMoving
    return ir


def _priority(
    doc: JSONObject, spec: BlockSpec | None, classes: Mapping[str, Mapping[str, Any]] | None, errors: list[SpecError]
) -> tuple[str, int] | None:
    """The block's (priority class, priority): its own class, else the default class; None when
    neither (or, with the error, an unknown class). A spec that failed validation elsewhere still
    gets an unknown class named among its errors (every problem in one ``rejected``)."""
    if spec is None:
        name = doc.get("priorityClass")
        if isinstance(name, str) and isinstance(found := priority_of(name, classes or {}), SpecError):
            errors.append(found)
        return None
    priority = priority_of(spec.priorityClass, classes or {})
    if isinstance(priority, SpecError):
        errors.append(priority)
        return None
    return priority


def _count_errors(doc: JSONObject, spec: BlockSpec | None) -> list[SpecError]:
    """minInstances above maxInstances: the validated numbers compared (pydantic accepts 5.0 and
    "5"); the raw ints when validation failed."""
    lo, hi = (spec.minInstances, spec.maxInstances) if spec else (doc.get("minInstances"), doc.get("maxInstances"))
    if isinstance(lo, int) and isinstance(hi, int) and not isinstance(lo, bool) and lo > hi:
        return [SpecError("$.minInstances", f"minInstances ({lo}) is greater than maxInstances ({hi})")]
    return []


def _block_id(doc: JSONObject, subject_block_id: str | None, errors: list[SpecError]) -> str | None:
    """The block id: the spec's ``blockId``, or the subject's (which must agree with it)."""
    given = doc.get("blockId")
    block_id = given if isinstance(given, str) else None
    if subject_block_id is not None:
        if block_id is not None and block_id != subject_block_id:
            errors.append(SpecError("$.blockId", f"blockId {block_id!r} differs from the subject's block id {subject_block_id!r}"))
        block_id = subject_block_id
    if block_id is None:
        errors.append(SpecError("$.blockId", "no block id: set blockId or publish on aios.block.{bid}.create"))
    elif not ID_RE.match(block_id):
        errors.append(SpecError("$.blockId", f"block id {block_id!r} is not a valid id ({ID_RE.pattern})"))
    return block_id


def _component(doc: JSONObject, component: JSONObject | KnownComponent | None, errors: list[SpecError]) -> Component | None:
    """The registered component the spec names (None, with the error, when it is unknown or no
    longer valid)."""
    uri = doc.get("blockComponentURI")
    if not isinstance(uri, str) or not uri:
        return None
    if component is None:
        errors.append(SpecError("$.blockComponentURI", f"unknown component {uri!r}: register it first (blocks component add)"))
        return None
    if isinstance(component, KnownComponent):
        errors.extend(component.errors)
        return component.model
    try:
        return Component.model_validate(component)
    except ValidationError as exc:  # stored before a rule that now refuses it
        errors.extend(pydantic_errors(exc, ("<component>",)))
        return None


def _policy_errors(spec: BlockSpec, comp: Component, policies: dict[str, PolicyRule]) -> list[SpecError]:
    """Every required policy present after the merge, and GPU sharing the merged allocator allows."""
    errors = [
        SpecError("$.policyRulesSpec", f"no {name} policy after merging the component's policies with policyRulesSpec")
        for name in REQUIRED_POLICIES
        if name not in policies
    ]
    return errors + _sharing_errors(spec, comp, policies)


def _affinity(doc: JSONObject, comp: Component | None, errors: list[SpecError]) -> list[Any]:
    """The block's affinity terms, normalised (else the component's)."""
    try:
        if any(doc.get(k) is not None for k in ("affinity", "affinityWith", "antiAffinityWith", "affinityTLV")):
            return normalize(doc.get("affinity"), doc.get("affinityWith"), doc.get("antiAffinityWith"), doc.get("affinityTLV"))
        if comp is not None and comp.affinity:
            return normalize(comp.affinity, path="$.<component>")
    except SpecInvalid as exc:
        errors.extend(exc.errors)
    return []


def _job_cluster_errors(spec: BlockSpec, comp: Component) -> list[SpecError]:
    vid = spec.virtualClusterId or comp.virtualClusterId
    if (spec.jobCluster or comp.jobCluster) is not None and not vid:
        where = "$.jobCluster" if spec.jobCluster is not None else "$.<component>.jobCluster"
        return [SpecError(where, "jobCluster needs virtualClusterId (the divisible virtual cluster to carve it from)")]
    return []


def _ir(block_id: str | None, spec: BlockSpec, comp: Component, policies: dict[str, PolicyRule], affinity: list[Any],
        comp_data: dict[str, Any] | None = None) -> BlockIR:
    """The IR of a valid spec and its component (the block's fields over the component's).
    ``comp_data``: ``comp.model_dump()`` made before (``KnownComponent.data``), its values taken as they are."""
    assert block_id is not None  # a spec without one has an error: no IR is built
    ir: BlockIR = {
        "blockId": block_id,
        "blockComponentURI": spec.blockComponentURI,
        "image": comp.image,
        "minInstances": spec.minInstances,
        "maxInstances": spec.maxInstances,
    }
    given = spec.model_dump(exclude_unset=True)
    dumped = comp_data is not None
    if comp_data is None:
        comp_data = comp.model_dump()
    for block_field, comp_field in INHERITED:
        value = given.get(block_field)
        ir[block_field] = value if value is not None else comp_data[comp_field]
    # the models' JSON: each record names exactly its model's fields (tests/unit/test_records*.py);
    # a component's dumped before: its parts of that dump (a nested model dumps as it does alone)
    if spec.resources is not None or not dumped:
        ir["resources"] = cast(Needs, (spec.resources or comp.resources).model_dump())
    else:
        ir["resources"] = cast(Needs, comp_data["resources"])
    ir["launch"] = cast(LaunchRecord, comp_data["launch"] if dumped else comp.launch.model_dump())
    ir["policies"] = policies
    ir["affinity"] = msgspec.to_builtins(affinity)
    ir["sidecars"] = merge_sidecars(comp.sidecars, spec.sidecars)
    ir["outputs"] = bool(ir["sidecars"]) or bool(spec.outputs if spec.outputs is not None else comp.outputs)
    if spec.labels:  # set only when given: a spec without labels keeps its IR (and digest)
        ir["labels"] = dict(spec.labels)
    # seed 003: set only when given (the block's, else the component's)
    vid = spec.virtualClusterId or comp.virtualClusterId
    if vid:
        ir["virtualClusterId"] = vid
        job = spec.jobCluster or comp.jobCluster
        if job is not None:
            ir["jobCluster"] = cast(JobClusterRecord, job.model_dump())
    return ir
