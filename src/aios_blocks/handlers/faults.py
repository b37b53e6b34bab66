"""What the controller does about instance faults and leftovers (pure rules, documented in
docs/agents.md):

* an instance ``failed`` (exited, could not start) or ``unhealthy`` (probe), when the block's
  stabilityChecker answers ``replace`` (the default's answer, and the rule when the policy fails;
  ``lifecycle.on_fault_verdict``) -> replace it through the block's resourceAllocator
  ``reassignment``, at most ``max_replacements`` times per block; past that a block that never
  became ready fails, a ready one keeps running degraded;
* a ``dangling`` instance (found on a node, labelled by us, not expected there) -> adopt it only if
  it is exactly what the state says should run there, else remove it;
* facts about an instance from a node that does not hold it are ignored (an agent can only speak
  for its own instances).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas import lifecycle as lc
from ..schemas.records import BlockRecord, InstanceRecord

LIVE = lc.LIVE


@dataclass(frozen=True)
class Verdict:
    action: str  # "reassign" | "fail_block" | "give_up" | "ignore" | "adopt" | "remove"
    why: str


def _not_live_here(block: BlockRecord | None, instance: InstanceRecord | None, node: str, gen: int) -> str:
    """Why the state does not hold this instance as live on ``node`` ('' when it does)."""
    if block is None:
        return "unknown block"
    if int(block.get("gen", -1)) != gen:
        return f"belongs to an older generation of the block ({gen} != {block.get('gen')})"
    if block.get("status") not in LIVE:
        return f"block is {block.get('status')}"
    if instance is None:
        return "instance not recorded (replaced, removed or never placed)"
    if instance.get("node") != node:
        return f"instance runs on {instance.get('node')} now (duplicate)"
    if instance.get("status") in ("removing", "replaced"):
        return f"instance is {instance['status']}"
    return ""


def on_fault(
    block: BlockRecord | None, instance: InstanceRecord | None, node: str, gen: int, replacements: int,
    max_replacements: int,
) -> Verdict:
    """An instance ``failed`` / went ``unhealthy`` on ``node``: what to do."""
    why = _not_live_here(block, instance, node, gen)
    if why:
        return Verdict("ignore", why)
    assert block is not None
    if replacements >= max_replacements:
        if block.get("status") == "placing":
            return Verdict("fail_block", f"{replacements} instance replacements failed too (limit {max_replacements})")
        return Verdict("give_up", f"replacement limit reached ({max_replacements}); block keeps running degraded")
    return Verdict("reassign", "replace it")


def on_dangling(block: BlockRecord | None, instance: InstanceRecord | None, node: str, gen: int) -> Verdict:
    """A labelled instance nobody expected on ``node``: adopt it only if it is exactly what the
    state says should run there, else remove it."""
    why = _not_live_here(block, instance, node, gen)
    if why:
        return Verdict("remove", why)
    return Verdict("adopt", "recorded on this node for this generation")
