"""Errors of the project's language: invalid specs and failed policy steps."""

from __future__ import annotations

import msgspec


class SpecError(msgspec.Struct, frozen=True):
    """One problem in a spec, located by a JSON path such as ``$.policyRulesSpec[0].values.name``."""

    path: str
    message: str


class SpecInvalid(Exception):
    """A spec failed validation; ``errors`` lists every problem, not just the first."""

    def __init__(self, errors: list[SpecError]):
        self.errors = errors
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in errors))


#: ``PolicyFailed.kind`` of a call that gave no answer at all: it timed out, its result has the
#: wrong shape (or cannot be read), or its code could not be loaded
NO_ANSWER = ("timed_out", "wrong_shape", "load")


class PolicyFailed(Exception):
    """A policy raised, timed out or returned the wrong shape. Fails one step, never a worker.
    ``kind``: ``raised`` (the policy's own exception), ``timed_out``, ``wrong_shape``, ``load``
    (``NO_ANSWER``), ``unavailable`` (the registry could not be read, the code's loading timed out, or the call
    never started because other calls' overruns held every thread: may pass when asked again),
    ``wrong_input`` (its input could not be sent to its policy process: the call never ran, so it
    is no answer of the policy's and, like ``unavailable``, the step is asked again, not failed)
    or "" (not said: taken as ``raised``)."""

    def __init__(self, policy: str, action: str, reason: str, kind: str = ""):
        self.policy = policy
        self.action = action
        self.reason = reason
        self.kind = kind
        super().__init__(f"policy {policy!r} ({action}) failed: {reason}")

    @property
    def no_answer(self) -> bool:
        """The call gave no answer (``NO_ANSWER``): the same call fails again. A raise is an
        answer: a resourceAllocator's way, in the seed's contract, to say that nothing fits."""
        return self.kind in NO_ANSWER


class PlacementFailed(Exception):
    """A placement could not be made or committed; ``reason`` says why, for the failed event.
    ``policy``: the step's own policy gave no answer (timed out, returned the wrong shape, could
    not be loaded: ``PolicyFailed.no_answer``), or its choice was refused on the very snapshot it
    was given (``handlers.controller.refused``: a node not in the cluster, GPUs not there or not
    free, Required affinity), which says nothing of the cluster's room: the same call would fail
    again, so the step fails once, not retried as a lost race is (docs/architecture.md "Re-selection")."""

    def __init__(self, reason: str, policy: bool = False):
        self.reason = reason
        self.policy = policy
        super().__init__(reason)
