"""What a starting node agent does about the instances it finds (documented in docs/agents.md):
a pure rule, in the agent's own package (the agent imports neither ``handlers/`` nor ``state/``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from ..schemas.records import InstanceRecord


class Found(TypedDict):
    """An instance the runtime has: its block generation and whether it runs."""

    gen: int
    running: bool


def reconcile(found: Mapping[str, Found], expected: Mapping[str, InstanceRecord]) -> dict[str, list[str]]:
    """Agent start: what the runtime has (``found``: iid -> {gen, running}) against what the state
    says should run here (``expected``: iid -> {gen, status}).

    Returns ``{"adopt": [...], "dangling": [...], "lost": [...]}``: found and expected (same gen)
    are re-adopted as they are; found but not expected are reported dangling (the controller
    decides); expected, once running, but not found are reported removed with reason ``lost``."""
    adopt, dangling, lost = [], [], []
    for iid in sorted(found):
        exp = expected.get(iid)
        if exp is not None and int(exp.get("gen", -1)) == int(found[iid].get("gen", -2)) and exp.get("status") not in ("removing", "replaced"):
            adopt.append(iid)
        else:
            dangling.append(iid)
    for iid in sorted(expected):
        # only a "running" instance was ever seen by this node's runtime; a "starting" one has its
        # create command waiting in the node's mailbox (placed while the agent was down)
        if iid not in found and expected[iid].get("status") == "running":
            lost.append(iid)
    return {"adopt": adopt, "dangling": dangling, "lost": lost}
