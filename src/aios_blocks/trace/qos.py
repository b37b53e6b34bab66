"""The GPU trace's QoS classes as priority classes (issue 36, docs/priority.md): Guaranteed and
LS (latency-sensitive) above Burstable above BE (best-effort), the values far enough apart (at
least ``AIOS_PREEMPT_MIN_DELTA``'s default, 10) that each class preempts the ones below it. The
replay registers ``CLASSES`` and gives each task's block ``priorityClass: class_of(task.qos)``
(``trace/workload.py`` keeps the QoS as the block's ``labels.qos``). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..schemas.priority import PriorityClass

LATENCY_SENSITIVE = "latency-sensitive"
BURSTABLE = "burstable"
BEST_EFFORT = "best-effort"

#: the classes the replay registers, highest first; the default is burstable (a task whose QoS
#: the trace does not give)
CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass(name=LATENCY_SENSITIVE, value=1000, description="trace QoS Guaranteed and LS"),
    PriorityClass(name=BURSTABLE, value=100, default=True, description="trace QoS Burstable (and tasks without one)"),
    PriorityClass(name=BEST_EFFORT, value=0, description="trace QoS BE"),
)

#: the trace's QoS (as it spells it, case-insensitive) -> class
QOS_CLASS: dict[str, str] = {
    "guaranteed": LATENCY_SENSITIVE,
    "ls": LATENCY_SENSITIVE,
    "burstable": BURSTABLE,
    "be": BEST_EFFORT,
    "besteffort": BEST_EFFORT,
}


def class_of(qos: str | None) -> str:
    """The priority class of a task's QoS (the default class when the trace gives none or another)."""
    return QOS_CLASS.get((qos or "").strip().lower().replace("-", ""), BURSTABLE)


def priority_of(qos: str | None) -> int:
    return next(c.value for c in CLASSES if c.name == class_of(qos))


def class_of_labels(labels: Mapping[str, Any] | None) -> str:
    """A block's class from its ``labels.qos`` (what ``trace/workload.py`` sets)."""
    return class_of(str((labels or {}).get("qos") or ""))


def records() -> list[dict[str, Any]]:
    """The classes as ``blocks priority-class add`` stores them."""
    return [c.model_dump(mode="json") for c in CLASSES]
