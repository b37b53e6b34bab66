"""What users write: components and block specs (seed 000), as pydantic models.

Field names follow seed 000 exactly. Unknown fields are errors (``extra="forbid"``) so a typo in a
spec is reported instead of silently ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from .records import JSONObject, Wire
from .rule_params import rule_problems
from .sharing import sharing_problems
from .topology import GpuTopology
from .uris import uri_problem

#: Ids become NATS subject tokens and Redis key parts: no dots, wildcards, spaces or braces.
#: Block, cluster, node and instance ids and registry policy names all follow it.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
#: ``\Z``, not ``$``: Python's ``$`` also matches before a trailing newline ("b1\n" would pass).
ID_RE = re.compile(ID_PATTERN.removesuffix("$") + r"\Z")
#: Component URIs are Redis key parts (``aios:component:<uri>``), never subject tokens (subjects
#: use a digest): URI characters only - no whitespace or control characters, no glob (``*``,
#: ``[``, ``]``) or hash-tag (``{``, ``}``) characters, no quotes or backslashes.
URI_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._~:/?#@!$&()+,;=%-]{0,511}$"
#: Labels (Kubernetes style): the key an optional DNS-like prefix and a name, the value a short
#: word. They are JSON values today; these rules keep them safe should one become a token or key.
LABEL_KEY_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9._:/@+=-]{0,256}$"
#: GPU ids are hash field parts (``g:<gpu>:total``): NVML UUIDs and MIG ids fit.
GPU_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"

LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, StringConstraints(pattern=LABEL_VALUE_PATTERN)]
Labels = dict[LabelKey, LabelValue]


def check_id(value: object, what: str = "id") -> str:
    """``value`` if it is a valid id (a safe subject token and key part), else ValueError.
    For every user-supplied id that does not come through a model: CLI arguments, request fields."""
    if not isinstance(value, str) or not ID_RE.match(value):
        raise ValueError(f"{what} {value!r} is not a valid id: letters, digits, '-' and '_', at most 128, "
                         "starting with a letter or digit")
    return value


def instance_id(bid: str, key: str | int) -> str:
    """Gang members are ``{bid}-{n}``; later instances take a short digest of their request id."""
    if isinstance(key, int):
        return f"{bid}-{key}"
    return f"{bid}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


_NUMBERS = (int, float, int | None, float | None)
POLICY_KINDS = ("clusterAllocator", "resourceAllocator", "loadBalancer", "stabilityChecker", "autoscaler", "preemption", "rebalancer")
REQUIRED_POLICIES = ("clusterAllocator", "resourceAllocator")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 ("minInstances": true placed a block); "2" and 2.0
        # stay accepted (YAML and JSON writers differ on those)
        if isinstance(value, bool) and info.field_name and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError("must be a number, not true or false")
        return value


class PolicyRule(_Strict):
    """``{name, policyRuleURI, parameters, settings}``: one policy of a component or block."""

    name: str = Field(min_length=1)
    policyRuleURI: str = Field(min_length=1)
    parameters: Wire[JSONObject] = Field(default_factory=dict)
    settings: Wire[JSONObject] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _not_a_misspelt_kind(cls, name: str) -> str:
        # a new name extends the block's policies (seed 000), but nothing calls it: one a letter
        # or two from a kind is a typo that would silently leave the component's policy in charge
        if name not in POLICY_KINDS:
            close = difflib.get_close_matches(name, POLICY_KINDS, n=1, cutoff=0.8)
            if close or name.lower() in {k.lower() for k in POLICY_KINDS}:
                kind = close[0] if close else next(k for k in POLICY_KINDS if k.lower() == name.lower())
                raise ValueError(f"unknown policy kind {name!r}: did you mean {kind!r}? (the kinds: {', '.join(POLICY_KINDS)})")
        return name

    @field_validator("policyRuleURI")
    @classmethod
    def _known_uri(cls, uri: str, info: ValidationInfo) -> str:
        # refused here (component add, parse) instead of failing every block later at load time
        problem = uri_problem(uri, info.data.get("name"))
        if problem:
            raise ValueError(problem)
        return uri

    @model_validator(mode="after")
    def _usable_parameters(self) -> PolicyRule:
        # an autoscaler / stabilityChecker rule the framework or its built-in cannot read would fail
        # every tick of the block's autoscaler or checker, one reason at a time: refused here, all at once
        problems = rule_problems(self.name, self.policyRuleURI, self.parameters, self.settings)
        if problems:
            raise ValueError(f"{self.name} rule {self.policyRuleURI}: " + "; ".join(problems))
        return self


class PolicyRuleEntry(_Strict):
    """An entry of ``policyRulesSpec``: ``{"values": {...}}`` as the seed writes it."""

    values: PolicyRule

    @model_validator(mode="before")
    @classmethod
    def _accept_bare(cls, data: Any) -> Any:
        # The seed wraps each rule in "values"; the bare rule is accepted too.
        if isinstance(data, dict) and "values" not in data and "policyRuleURI" in data:
            return {"values": data}
        return data


#: a GPU model name (``gpuModels``): what a node's GPUs report (``V100M32``, ``NVIDIA A100-SXM4-80GB``)
GpuModel = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class ResourceNeeds(_Strict):
    """What one instance needs. Memory figures are MiB; ``gpuMemory`` is per GPU.

    ``gpuShare`` (with ``gpuSharing``): the fraction of each GPU's compute the instance takes, in
    thousandths (0.001 steps; the GPU trace's ``gpu_milli`` / 1000); the shares on one GPU sum to
    at most 1, beside ``gpuMemory``. ``gpuModels``: the GPU models the instance may use (a hard
    constraint; empty = any). Both are left out of the dump when unset, so a spec without them
    keeps its digest (docs/trace.md)."""

    gpus: int = Field(default=0, ge=0, le=64)
    gpuMemory: int = Field(default=0, ge=0)
    cpu: float = Field(default=0.0, ge=0)
    memory: int = Field(default=0, ge=0)
    gpuShare: float = Field(default=0.0, ge=0, le=1)
    gpuModels: list[GpuModel] = Field(default_factory=list, max_length=32)

    @field_validator("gpuShare")
    @classmethod
    def _thousandths(cls, value: float) -> float:
        if abs(value * 1000 - round(value * 1000)) > 1e-6:
            raise ValueError(f"gpuShare is counted in thousandths of a GPU (0.001 steps), got {value}")
        return round(value, 3)

    @model_serializer(mode="wrap")
    def _unset_left_out(self, handler: Any) -> Any:
        out = handler(self)
        if isinstance(out, dict):
            if not out.get("gpuShare"):
                out.pop("gpuShare", None)
            if not out.get("gpuModels"):
                out.pop("gpuModels", None)
        return out


class Probe(_Strict):
    """How a node agent checks an instance: ``http`` GET of ``path`` on the port named ``port``,
    ``tcp`` connect, or ``running`` (the runtime says it runs). ``none`` turns probing off."""

    type: str = Field(default="running", pattern="^(http|tcp|running|none)$")
    port: str = "http"
    path: str = "/"
    intervalS: float = Field(default=2.0, gt=0, le=3600)
    timeoutS: float = Field(default=1.0, gt=0, le=600)
    failureThreshold: int = Field(default=3, ge=1, le=100)
    startTimeoutS: float = Field(default=60.0, gt=0, le=3600)


class Launch(_Strict):
    """How a node agent runs an instance (an extension of seed 000's component): the command
    (Docker: overrides the image's CMD; process runtime: the argv), named host ports (exposed to
    the instance as ``AIOS_PORT_<NAME>``, the first also as ``AIOS_PORT``), the health probe and
    the stop grace period."""

    command: list[str] = Field(default_factory=list)
    ports: list[str] = Field(default_factory=list, max_length=16)
    probe: Probe = Field(default_factory=Probe)
    stopGraceS: float = Field(default=10.0, ge=0, le=600)


#: environment names a side-car may be given (``AIOS_*`` are the system's: ids, URLs, the spec)
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
#: side-car names are a consumer-name part (``sidecar-<bid>-<name>``): shorter than block ids
SIDECAR_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$"


class SidecarConsumes(_Strict):
    """What a side-car consumes: the block's task outputs (``"outputs"``), all of them or only
    those of one outcome (``ok``: the instance answered < 400; ``error``: anything else). The
    filter is a subject filter, applied by the server."""

    event: Literal["outputs"] = "outputs"
    status: Literal["any", "ok", "error"] = "any"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"event": data} if isinstance(data, str) else data


class Sidecar(_Strict):
    """A side-car (seed 000 "Side-cars"; an extension of the block table): a utility process run
    with the block on a node of its cluster that consumes the block's task outputs. ``image``
    and/or ``command`` as for an instance (Docker: the image, ``command`` overriding its CMD;
    process runtime: ``command`` is the argv). ``replicas`` copies share one durable consumer (a
    queue group). A handler failure is retried, and after ``maxDeliver`` deliveries the output is
    dead-lettered with the reason; ``ackWaitS`` is how long one delivery may take before the
    server sends it again. Side-cars reserve no GPU, CPU or memory (docs/sidecars.md)."""

    name: str = Field(pattern=SIDECAR_NAME_PATTERN)
    image: str = Field(default="", max_length=512)
    command: list[Annotated[str, StringConstraints(max_length=4096)]] = Field(default_factory=list, max_length=256)
    consumes: SidecarConsumes = Field(default_factory=SidecarConsumes)
    parameters: Wire[JSONObject] = Field(default_factory=dict)
    env: dict[str, Annotated[str, StringConstraints(max_length=65536)]] = Field(default_factory=dict)
    maxDeliver: int = Field(default=5, ge=1, le=100)
    ackWaitS: float = Field(default=30.0, ge=1, le=3600)
    replicas: int = Field(default=1, ge=1, le=16)
    stopGraceS: float = Field(default=10.0, ge=0, le=600)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        problems = []
        bad = [k for k in env if not ENV_NAME_RE.match(k)]
        if bad:
            problems.append(f"invalid environment variable name(s) {bad}: letters, digits and '_', not starting with a digit")
        reserved = [k for k in env if k.upper().startswith("AIOS_")]
        if reserved:
            problems.append(f"environment variable(s) {reserved} are reserved: AIOS_* names are set by the system")
        if problems:
            raise ValueError("; ".join(problems))
        return env

    @model_validator(mode="after")
    def _runnable(self) -> Sidecar:
        if not self.image and not self.command:
            raise ValueError(f"side-car {self.name!r} needs an image or a command (like an instance)")
        return self


def sidecar_problems(entries: Sequence[Sidecar | object]) -> list[tuple[int, str]]:
    """(index, problem) of a side-car list: names must be unique. ``entries``: the models, or the
    spec's own JSON (its entries that are no object or have no string name are skipped), so that a
    list with other problems still has its repeated names reported with them."""
    seen: dict[str, int] = {}
    out = []
    for i, sc in enumerate(entries):
        name = sc.name if isinstance(sc, Sidecar) else sc.get("name") if isinstance(sc, dict) else None
        if not isinstance(name, str):
            continue
        if name in seen:
            out.append((i, f"side-car name {name!r} is used twice (also at index {seen[name]})"))
        seen.setdefault(name, i)
    return out


class JobClusterSpec(_Strict):
    """A job cluster for the block (seed 003): carved from its divisible virtual cluster's
    undivided nodes when it is placed, destroyed when it is deleted. ``replicaSets``: node type
    -> count."""

    replicaSets: dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], Annotated[int, Field(ge=0, le=100_000)]]

    @field_validator("replicaSets")
    @classmethod
    def _some(cls, value: dict[str, int]) -> dict[str, int]:
        if not any(value.values()):
            raise ValueError("a job cluster needs at least one node: give a count > 0")
        return value


class Component(_Strict):
    """A registered, reusable definition a block is instantiated from."""

    componentURI: str = Field(min_length=1, max_length=512, pattern=URI_PATTERN)
    image: str = ""
    componentInitData: Wire[JSONObject] = Field(default_factory=dict)
    componentInitSettings: Wire[JSONObject] = Field(default_factory=dict)
    componentParameters: Wire[JSONObject] = Field(default_factory=dict)
    componentMetadata: Wire[JSONObject] = Field(default_factory=dict)
    componentInputProtocol: Wire[JSONObject] = Field(default_factory=dict)
    componentOutputProtocol: Wire[JSONObject] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)
    resources: ResourceNeeds = Field(default_factory=ResourceNeeds)
    policies: list[PolicyRule] = Field(default_factory=list)
    launch: Launch = Field(default_factory=Launch)
    #: default affinity of blocks made from this component (seed 002; see docs/affinity.md)
    affinity: list[Any] | None = None
    #: default virtual cluster / job cluster of its blocks (seed 003; docs/virtual-clusters.md)
    virtualClusterId: str | None = Field(default=None, pattern=ID_PATTERN)
    jobCluster: JobClusterSpec | None = None
    #: default side-cars of its blocks (docs/sidecars.md) and whether their task outputs are
    #: published even without a side-car
    sidecars: list[Sidecar] = Field(default_factory=list, max_length=16)
    outputs: bool = False

    @model_validator(mode="after")
    def _unique_sidecars(self) -> Component:
        problems = sidecar_problems(self.sidecars)
        if problems:
            raise ValueError("; ".join(f"sidecars[{i}]: {msg}" for i, msg in problems))
        return self

    @model_validator(mode="after")
    def _gpu_sharing_has_a_memory_figure(self) -> Component:
        rule = next((p for p in self.policies if p.name == "resourceAllocator"), None)
        problems = sharing_problems(rule.model_dump() if rule else None, self.resources.model_dump())
        if problems:
            raise ValueError("; ".join(msg for _, msg in problems))
        return self


class BlockSpec(_Strict):
    """A deployment request derived from a component (seed 000 "Block specification")."""

    blockComponentURI: str = Field(min_length=1, max_length=512, pattern=URI_PATTERN)
    blockId: str | None = Field(default=None, pattern=ID_PATTERN)
    minInstances: int = Field(ge=0, le=10_000)
    maxInstances: int = Field(ge=1, le=10_000)
    blockInitData: Wire[JSONObject] | None = None
    initSettings: Wire[JSONObject] | None = None
    parameters: Wire[JSONObject] | None = None
    policyRulesSpec: list[PolicyRuleEntry] | None = None
    #: Per-block override of the component's resource needs (an extension; absent = inherit).
    resources: ResourceNeeds | None = None
    #: Typed affinity (seed 002), its shorthand, or its TLV wire form as base64. Validated by
    #: ``schemas.affinity.normalize``; absent = the component's affinity.
    affinity: list[Any] | None = None
    affinityWith: str | None = None
    antiAffinityWith: str | None = None
    affinityTLV: str | None = None
    #: The virtual cluster the block is placed in (seed 003, an extension of seed 000's table);
    #: absent = the component's, else the primary's unassigned nodes.
    virtualClusterId: str | None = Field(default=None, pattern=ID_PATTERN)
    #: With a divisible ``virtualClusterId``: the block's own job cluster (absent = the component's).
    jobCluster: JobClusterSpec | None = None
    #: Side-cars (docs/sidecars.md; an extension of seed 000's table): merged with the
    #: component's by name, as policies are (same name: the block's replaces it; new: added).
    sidecars: list[Sidecar] | None = Field(default=None, max_length=16)
    #: Publish the block's task outputs (``aios.output.{bid}.*``) even without a side-car
    #: (absent = the component's ``outputs``; a block with side-cars always publishes them).
    outputs: bool | None = None
    #: The block's labels (an extension): key=value facts about it, kept in the IR's ``labels``
    #: (e.g. the GPU trace's QoS class, ``qos: LS``; docs/trace.md). Absent: none.
    labels: Labels | None = None
    #: The block's priority class (docs/priority.md; an extension): a registered class's name
    #: (``blocks priority-class add``). Absent: the default class, if one is registered.
    priorityClass: str | None = Field(default=None, pattern=ID_PATTERN)
    #: ``false``: the block is never a preemption victim (absent: it may be one).
    preemptible: bool | None = None
    #: ``false`` (``blocks submit --no-queue``): a block that fits nowhere fails at once, as before
    #: the pending queue (absent: it waits, docs/priority.md).
    queue: bool | None = None
    #: Seconds the block may wait in the pending queue before it fails with the reason (absent:
    #: ``AIOS_MAX_PENDING_S``; 0: forever).
    maxPendingS: float | None = Field(default=None, ge=0)
    #: The block's disruption budget for make-before-break moves (docs/rebalance.md; an extension,
    #: like Kubernetes' maxUnavailable): at most this many of its instances move at once (absent: 1).
    maxMoving: int | None = Field(default=None, ge=1, le=10_000)


class Cluster(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    labels: Labels = Field(default_factory=dict)


class Gpu(_Strict):
    id: str = Field(min_length=1, max_length=128, pattern=GPU_ID_PATTERN)
    model: str = "sim-gpu"
    memory: int = Field(default=81920, ge=0, description="MiB")


class Node(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    cluster: str = Field(pattern=ID_PATTERN)
    labels: Labels = Field(default_factory=dict)
    cpu: float = Field(default=64.0, ge=0)
    memory: int = Field(default=512 * 1024, ge=0, description="MiB")
    gpus: list[Gpu] = Field(default_factory=list)
    healthy: bool = True
    #: How its GPUs are connected, pair by pair (docs/topology.md; an extension). Absent: unknown.
    topology: GpuTopology | None = None
