"""Contended clusters (issue 36): priority classes, tenants' quotas, and the events that record
them and the preemptions (docs/priority.md).

A priority class is a name with an integer value (Kubernetes' PriorityClass); a block names one
(``priorityClass``) or gets the default class. A quota is a tenant's nominal share of the GPUs (and
GPU shares, CPU, memory) per GPU model; tenants in a cohort may borrow what the others leave idle
(Kueue's ClusterQueues and cohorts). Both are registered like components: an event in the stream
(``blocks recover`` rebuilds them) and a record in Redis.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from .spec import ID_PATTERN

#: the most and least a class's value may be (Kubernetes' user range is about +-1e9)
PRIORITY_MAX = 1_000_000_000
#: a block with no class and no default class registered has this priority
NO_CLASS_PRIORITY = 0
#: the quota key that counts every GPU model (a tenant's usage on any model)
ANY_MODEL = "*"


class QuotaResource(enum.StrEnum):
    """What a quota limits, per GPU model: whole GPUs, GPU compute shares (in GPUs: 0.5 = half a
    GPU's compute), CPU cores, memory (MiB). A resource a quota leaves out is not limited."""

    GPUS = "gpus"
    GPU_SHARE = "gpuShare"
    CPU = "cpu"
    MEMORY = "memory"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PriorityClass(_Strict):
    """A named priority: higher preempts lower (by at least ``AIOS_PREEMPT_MIN_DELTA`` points)."""

    name: str = Field(pattern=ID_PATTERN)
    value: int = Field(ge=-PRIORITY_MAX, le=PRIORITY_MAX)
    #: the class of blocks that name none (one class at most is the default)
    default: bool = False
    description: str = Field(default="", max_length=1024)


ModelKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Amounts = dict[QuotaResource, float]


class Quota(_Strict):
    """A tenant's nominal quota: GPU model (or ``*``, any model) -> resource -> amount. Tenants
    with the same ``cohort`` lend each other what they leave idle; ``borrowingLimit`` (same shape)
    caps what this tenant may borrow above its nominal (absent: no cap)."""

    tenant: str = Field(pattern=ID_PATTERN)
    cohort: str | None = Field(default=None, pattern=ID_PATTERN)
    nominal: dict[ModelKey, Amounts] = Field(default_factory=dict)
    borrowingLimit: dict[ModelKey, Amounts] | None = None

    @field_validator("nominal", "borrowingLimit")
    @classmethod
    def _non_negative(cls, value: dict[str, dict[QuotaResource, float]] | None) -> Any:
        for model, amounts in (value or {}).items():
            for res, n in amounts.items():
                if not n >= 0 or n == math.inf:  # NaN too: stored, it broke every later read of the quotas
                    raise ValueError(f"{model}.{res} is {n}: a quota amount is a finite number >= 0")
        return value


# -- event payloads (schemas.catalog) --------------------------------------------------------------
class PriorityClassRegistered(msgspec.Struct):
    """A priority class registered (or replaced): the whole record, ``PriorityClass`` JSON."""

    name: str
    record: dict[str, Any]


class PriorityClassRemoved(msgspec.Struct):
    """A priority class removed (blocks already parsed keep the value their IR holds)."""

    name: str
    request_id: str = ""


class QuotaSet(msgspec.Struct):
    """A tenant's quota set (``record``: ``Quota`` JSON) or removed (``record`` None)."""

    name: str
    record: dict[str, Any] | None = None


class PreemptReason(enum.StrEnum):
    """Why a block was preempted (Kueue's reasons, in our words)."""

    #: a higher-priority block needed the room (``AIOS_PREEMPT_MIN_DELTA`` points higher at least)
    PRIORITY = "Priority"
    #: the tenant that owns the quota took back what a borrower of its cohort used
    IN_COHORT_RECLAMATION = "InCohortReclamation"


class Preempted(msgspec.Struct):
    """On each victim: the preemptor, the reason, the instances it loses (every one when it falls
    below its minInstances: a gang goes whole) and the node each was on. The block goes back to
    pending, not failed."""

    block_id: str
    gen: int
    preemptor: str
    preemptor_gen: int
    reason: str
    instances: dict[str, str] = {}
    priority: int = 0
    preemptor_priority: int = 0


class Preempting(msgspec.Struct):
    """On the preemptor: its victims (block -> instances), the reason and the plan that shows the
    whole gang (minInstances) fits once they are gone. ``short``: the preemptor is a ``ready``
    block short of that many instances (the reconciler's ask placed nothing), and the plan is for
    them (docs/priority.md "A short block preempts"); 0: a waiting block, for its whole gang."""

    block_id: str
    gen: int
    reason: str
    victims: dict[str, list[str]] = {}
    gpus_freed: int = 0
    request_id: str = ""
    short: int = 0


class Pending(msgspec.Struct):
    """A block that fits nowhere now waits (docs/priority.md, the pending queue): the reason, per
    cluster when selection said (cluster -> why), its priority, since when it waits (kept across
    retries: its place in the queue), when it fails if still waiting (0: never), and, for a victim
    of a preemption, the block that preempted it (a preempted block that waits never preempts:
    no cascades)."""

    block_id: str
    gen: int
    reason: str
    reasons: dict[str, str] = {}
    priority: int = 0
    since: float = 0.0
    deadline: float = 0.0
    attempt: int = 0
    preempted_by: str = ""
