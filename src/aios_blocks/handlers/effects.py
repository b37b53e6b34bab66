"""Effects: what a decision asks for, as data. A handler takes an event and a snapshot and returns
a list of these; one adapter (``workers/effects.py``) commits them, in order. The decisions have no
I/O and are unit-tested without servers (``tests/unit/test_lifecycle_decisions.py``).

Some effects are *guarded*: they carry a condition the adapter checks against the store at commit
time, atomically with their write, because a snapshot taken before the write cannot see a
concurrent handler's write (two instances of a block reported running at once must still make the
block ready; two removals at once must still mark it deleted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schemas.catalog import Emit
from ..schemas.lifecycle import InstanceStatus, Step
from ..schemas.records import InstanceRecord


@dataclass(frozen=True)
class Publish:
    """Publish these catalog events (concurrently; all acked before the next effect)."""

    events: tuple[Emit, ...]


def publish(*events: Emit) -> Publish:
    return Publish(tuple(events))


@dataclass(frozen=True)
class Transition:
    """Compare-and-set the block's status by ``step``; ``then`` runs if it moved — or, with
    ``redo``, also if the block already holds the step's target (a redelivery after the CAS
    publishes again, deduplicated)."""

    block_id: str
    gen: int
    step: Step
    fields: tuple[tuple[str, str], ...] = ()
    then: tuple[Any, ...] = ()
    redo: bool = True


@dataclass(frozen=True)
class SetInstance:
    """Set an instance's status (and, when given, where it serves: ``endpoint``); the effects
    after it are dropped if the instance is gone."""

    block_id: str
    instance_id: str
    status: InstanceStatus
    endpoint: str | None = None


@dataclass(frozen=True)
class Release:
    """Give an instance's reservation back and forget it (idempotent); caches are told."""

    block_id: str
    instance_id: str
    instance: InstanceRecord = field(hash=False)


@dataclass(frozen=True)
class ReadyIfRunning:
    """Guarded: the block becomes ready (``step``) if at least ``min_instances`` of its instances
    run *now* (read at commit time), then its ``ready`` event is published."""

    block_id: str
    gen: int
    min_instances: int
    cluster_id: str
    step: Step = Step.READY


@dataclass(frozen=True)
class DeletedIfEmpty:
    """Guarded: a deleting block with no instance left *now* becomes ``deleted`` (and says so)."""

    block_id: str
    gen: int


@dataclass(frozen=True)
class RemoveAll:
    """Stop every instance the block has *now* (each goes ``removing``; its node is told)."""

    block_id: str
    gen: int
    reason: str


@dataclass(frozen=True)
class Replace:
    """Ask the block's resourceAllocator for a reassignment of a failed/lost instance; counted on
    the block (``replacements``) once per stored request."""

    block_id: str
    gen: int
    cluster_id: str
    instance_id: str
    reason: str
    request_id: str
    #: the node the replacement must not land on (the instance's own: it failed or died there)
    avoid_node: str = ""


Effect = Publish | Transition | SetInstance | Release | ReadyIfRunning | DeletedIfEmpty | RemoveAll | Replace
