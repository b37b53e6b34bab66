"""What users write: components and block specs (seed 000), as pydantic models.

Field names follow seed 000 exactly. Unknown fields are errors (``extra="forbid"``) so a typo in a
spec is reported instead of silently ignored.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Ids become NATS subject tokens and Redis key parts: no dots, wildcards, spaces or braces.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
ID_RE = re.compile(ID_PATTERN)

POLICY_KINDS = ("clusterAllocator", "resourceAllocator", "loadBalancer", "stabilityChecker", "autoscaler")
REQUIRED_POLICIES = ("clusterAllocator", "resourceAllocator")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PolicyRule(_Strict):
    """``{name, policyRuleURI, parameters, settings}``: one policy of a component or block."""

    name: str = Field(min_length=1)
    policyRuleURI: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)
    settings: dict[str, Any] = Field(default_factory=dict)


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


class ResourceNeeds(_Strict):
    """What one instance needs. Memory figures are MiB; ``gpuMemory`` is per GPU."""

    gpus: int = Field(default=0, ge=0, le=64)
    gpuMemory: int = Field(default=0, ge=0)
    cpu: float = Field(default=0.0, ge=0)
    memory: int = Field(default=0, ge=0)


class Component(_Strict):
    """A registered, reusable definition a block is instantiated from."""

    componentURI: str = Field(min_length=1, max_length=512)
    image: str = ""
    componentInitData: dict[str, Any] = Field(default_factory=dict)
    componentInitSettings: dict[str, Any] = Field(default_factory=dict)
    componentParameters: dict[str, Any] = Field(default_factory=dict)
    componentMetadata: dict[str, Any] = Field(default_factory=dict)
    componentInputProtocol: dict[str, Any] = Field(default_factory=dict)
    componentOutputProtocol: dict[str, Any] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)
    resources: ResourceNeeds = Field(default_factory=ResourceNeeds)
    policies: list[PolicyRule] = Field(default_factory=list)
    #: default affinity of blocks made from this component (seed 002; see docs/affinity.md)
    affinity: list[Any] | None = None


class BlockSpec(_Strict):
    """A deployment request derived from a component (seed 000 "Block specification")."""

    blockComponentURI: str = Field(min_length=1, max_length=512)
    blockId: str | None = Field(default=None, pattern=ID_PATTERN)
    minInstances: int = Field(ge=0, le=10_000)
    maxInstances: int = Field(ge=1, le=10_000)
    blockInitData: dict[str, Any] | None = None
    initSettings: dict[str, Any] | None = None
    parameters: dict[str, Any] | None = None
    policyRulesSpec: list[PolicyRuleEntry] | None = None
    #: Per-block override of the component's resource needs (an extension; absent = inherit).
    resources: ResourceNeeds | None = None
    #: Typed affinity (seed 002), its shorthand, or its TLV wire form as base64. Validated by
    #: ``schemas.affinity.normalize``; absent = the component's affinity.
    affinity: list[Any] | None = None
    affinityWith: str | None = None
    antiAffinityWith: str | None = None
    affinityTLV: str | None = None


class Cluster(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)


class Gpu(_Strict):
    id: str = Field(min_length=1, max_length=128)
    model: str = "sim-gpu"
    memory: int = Field(default=81920, ge=0, description="MiB")


class Node(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    cluster: str = Field(pattern=ID_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)
    cpu: float = Field(default=64.0, ge=0)
    memory: int = Field(default=512 * 1024, ge=0, description="MiB")
    gpus: list[Gpu] = Field(default_factory=list)
    healthy: bool = True
