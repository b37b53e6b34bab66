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


class PolicyFailed(Exception):
    """A policy raised, timed out or returned the wrong shape. Fails one step, never a worker."""

    def __init__(self, policy: str, action: str, reason: str):
        self.policy = policy
        self.action = action
        self.reason = reason
        super().__init__(f"policy {policy!r} ({action}) failed: {reason}")


class PlacementFailed(Exception):
    """A placement could not be made or committed; ``reason`` says why, for the failed event."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)
