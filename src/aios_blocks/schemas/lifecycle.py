"""The block lifecycle: statuses, and the one transition table every writer of a status follows.

The workers ask the store for a *step* (``store.transition(bid, gen, Step.SELECT)``); the store's
compare-and-set script receives the step's allowed source statuses from :data:`TRANSITIONS`; the
recovery fold applies the same steps to the stored events. Nobody else spells a status rule.

    parsed ──SELECT──▶ selecting ──CHOOSE──▶ allocating ──RESERVE──▶ placing ──READY──▶ ready
       ▲                   │                   │  │                    │
       └──────RESELECT─────┼───────────────────┘  └─READY (no gang)─▶  │
                           ▼                   ▼                       ▼
                        failed ◀──────────── failed ◀──────────────── failed
    any live status ──DELETE──▶ deleting ──DELETED──▶ deleted

    selecting / allocating ──WAIT──▶ pending ──RETRY──▶ parsed      (docs/priority.md, the queue)
    placing / ready ──PREEMPTED──▶ pending ──EXPIRE (maxPendingS)──▶ failed
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockStatus(enum.StrEnum):
    PARSED = "parsed"
    REJECTED = "rejected"
    SELECTING = "selecting"
    ALLOCATING = "allocating"
    PLACING = "placing"
    READY = "ready"
    FAILED = "failed"
    #: fits nowhere now: waits in the pending queue (docs/priority.md), placed when capacity appears
    PENDING = "pending"
    DELETING = "deleting"
    DELETED = "deleted"


class InstanceStatus(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    REMOVING = "removing"


class InstanceState(enum.StrEnum):
    """An instance in the executors' map (the mapper's states, then each executor's own view)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    #: not in the mapper's vocabulary: this executor's own view of a ``ready`` instance that it
    #: ejected after a failed dispatch (``executor.outlier``), or that the health checker marked
    #: ``unready`` (the map's ``health``); neither gets a task, both count as live (they come back)
    EJECTED = "ejected"
    UNREADY = "unready"
    #: also this executor's own: a ``ready`` instance of the map that its node's agent has not
    #: reported since it last started (``confirmed``)
    UNCONFIRMED = "unconfirmed"


S = BlockStatus

#: statuses in which a block id may be created again (a new generation)
REUSABLE = frozenset({S.DELETED, S.REJECTED, S.FAILED})
#: statuses whose block holds (or may hold) instances and takes scale / reassignment steps
LIVE = frozenset({S.PLACING, S.READY})


class Step(enum.StrEnum):
    """A status change a worker makes (and the recovery fold replays)."""

    SELECT = "select"  # gateway: a selection round starts
    CHOOSE = "choose"  # gateway: post_dry_run chose a cluster, the allocation is requested
    RESELECT = "reselect"  # controller: the chosen cluster could not take the gang
    RESERVE = "reserve"  # controller: the gang is reserved, its instances are starting
    READY = "ready"  # controller: minInstances are running
    READY_EMPTY = "ready_empty"  # controller: a block of minInstances 0 was allocated
    FAIL_SELECTION = "fail_selection"  # gateway: no cluster can take it
    FAIL_ALLOCATION = "fail_allocation"  # controller: out of selection rounds
    FAIL_PLACEMENT = "fail_placement"  # controller: an instance failed before the block was ready
    WAIT = "wait"  # gateway / controller: fits nowhere now, the block waits in the pending queue
    RETRY = "retry"  # queue walker: capacity appeared, the pending block goes through selection again
    EXPIRE = "expire"  # queue walker: pending longer than its maxPendingS
    PREEMPTED = "preempted"  # queue walker: a whole victim of a preemption waits again
    DELETE = "delete"  # controller: a delete request arrived
    DELETED = "deleted"  # controller: the last instance is gone


@dataclass(frozen=True)
class Transition:
    sources: frozenset[BlockStatus]
    target: BlockStatus

    def allows(self, status: str | None) -> bool:
        return status in self.sources

    def allowed(self) -> str:
        """The sources as the CAS script takes them (comma-separated, sorted)."""
        return ",".join(sorted(self.sources))


def _t(sources: set[BlockStatus], target: BlockStatus) -> Transition:
    return Transition(frozenset(sources), target)


TRANSITIONS: dict[Step, Transition] = {
    Step.SELECT: _t({S.PARSED, S.SELECTING}, S.SELECTING),
    Step.CHOOSE: _t({S.SELECTING, S.ALLOCATING}, S.ALLOCATING),
    Step.RESELECT: _t({S.ALLOCATING}, S.PARSED),
    Step.RESERVE: _t({S.ALLOCATING}, S.PLACING),
    Step.READY: _t({S.PLACING}, S.READY),
    Step.READY_EMPTY: _t({S.ALLOCATING}, S.READY),
    Step.FAIL_SELECTION: _t({S.SELECTING}, S.FAILED),
    Step.FAIL_ALLOCATION: _t({S.ALLOCATING}, S.FAILED),
    Step.FAIL_PLACEMENT: _t({S.PLACING}, S.FAILED),
    Step.WAIT: _t({S.SELECTING, S.ALLOCATING, S.PENDING}, S.PENDING),
    Step.RETRY: _t({S.PENDING}, S.PARSED),
    Step.EXPIRE: _t({S.PENDING}, S.FAILED),
    Step.PREEMPTED: _t({S.PLACING, S.READY}, S.PENDING),
    Step.DELETE: _t({S.PARSED, S.SELECTING, S.ALLOCATING, S.PLACING, S.READY, S.FAILED, S.DELETING, S.REJECTED, S.PENDING},
                    S.DELETING),
    Step.DELETED: _t({S.DELETING}, S.DELETED),
}


def into(target: BlockStatus) -> frozenset[BlockStatus]:
    """Every status some step moves to ``target`` from, and ``target`` itself: the recovery fold,
    given only the event that says the target was reached, accepts any of them (a step redone
    after its CAS publishes again, deduplicated, so the target may already hold)."""
    return frozenset({target, *(s for t in TRANSITIONS.values() if t.target == target for s in t.sources)})


def fail_step(status: str) -> Step:
    """The step that fails a block in ``status`` (the gateway and controller know which they hold)."""
    return {S.SELECTING: Step.FAIL_SELECTION, S.ALLOCATING: Step.FAIL_ALLOCATION, S.PLACING: Step.FAIL_PLACEMENT}[S(status)]
