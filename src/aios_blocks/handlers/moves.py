"""Make-before-break moves of one instance, as pure decisions (docs/rebalance.md, issue 38 item 2).

A move goes ``claimed -> started -> switched -> completed``, or ends ``failed`` from any open
phase. Each function here takes what the adapter (``workers/moves.py``) read and returns a
:class:`Plan`: the move's record as it should be next (written with compare-and-set on its phase,
``state.moves``) and the effects that go with it (``handlers.effects``, committed by the lifecycle's
adapter, all idempotent). A step redone (a redelivery, a sweep after a controller died) finds the
record already in its phase and commits the same effects again: the stream drops the duplicates.

The invariants the decisions hold:

* the old instance is told to drain only once the new one runs (``switch``), and only while the
  block keeps ``minInstances`` ready without it;
* at most the block's budget (``maxMoving``, default 1) of its moves are open (the claim's script);
* a move that fails never touches the old instance: the new one (if any) is removed and released.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..schemas.catalog import E, Emit
from ..schemas.events import InstanceCommand
from ..schemas.lifecycle import BlockStatus, InstanceStatus
from ..schemas.moves import MovePhase, MoveRequested, MoveStep
from .effects import Effect, SetInstance, publish

#: the phases of a move still open (they count against the block's budget)
OPEN = (MovePhase.CLAIMED, MovePhase.STARTED, MovePhase.SWITCHED)
#: a finished move's record is kept this long: a request delivered again is still one move
KEEP_S = 3600.0
#: a claim whose placement never finished (its controller died and its message was dead-lettered)
#: is rolled back after this long
CLAIM_S = 60.0
#: one placement of a move at a time: the lease a placing delivery holds (shorter than the stream's
#: 30 s ack wait, so the redelivery of a request whose controller died finds it lapsed)
PLACE_LEASE_S = 20.0


def new_instance_id(bid: str, move_id: str) -> str:
    """The move's new instance: ``{bid}-mv`` and a digest of the move id (never a gang member's
    ``{bid}-N`` nor a scale step's ``{bid}-<8 hex>``)."""
    return f"{bid}-mv{hashlib.sha1(move_id.encode()).hexdigest()[:7]}"


def is_move_instance(bid: str, iid: str) -> bool:
    tail = iid[len(bid) + 1:] if iid.startswith(f"{bid}-") else ""
    return len(tail) == 9 and tail.startswith("mv") and all(c in "0123456789abcdef" for c in tail[2:])


def budget(ir: Mapping[str, Any]) -> int:
    """The block's disruption budget: ``maxMoving`` (default 1)."""
    return max(1, int(ir.get("maxMoving") or 1))


def ready(insts: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The instances that serve: running and not on their way out."""
    return {iid for iid, rec in insts.items() if rec.get("status") == InstanceStatus.RUNNING}


def record(req: MoveRequested, block: Mapping[str, Any] | None, old: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """A new move's record (phase ``claimed``)."""
    return {
        "move_id": req.move_id, "block_id": req.block_id, "gen": int(block["gen"]) if block else req.gen,
        "cluster": (old or {}).get("cluster") or (block or {}).get("cluster", ""), "old": req.instance_id,
        "from": (old or {}).get("node", ""), "new": new_instance_id(req.block_id, req.move_id), "to": req.to_node,
        "to_gpus": list(req.to_gpus),
        "node": "", "gpus": [], "phase": MovePhase.CLAIMED.value, "reason": req.reason, "requested_by": req.requested_by,
        "at": now, "due": now + CLAIM_S, "why": "", "finished_at": 0.0,
    }


def refusal(req: MoveRequested, block: Mapping[str, Any] | None, insts: Mapping[str, Mapping[str, Any]],
            nodes: Collection[str]) -> str:
    """Why the move must not start ('' if it may). ``nodes``: the block's cluster's node ids."""
    if block is None:
        return f"unknown block {req.block_id}"
    if req.gen and req.gen != int(block["gen"]):
        return f"block generation is {block['gen']}, the move was for {req.gen}"
    if block.get("status") != BlockStatus.READY:
        return f"block is {block.get('status')}: only a ready block's instances move"
    old = insts.get(req.instance_id)
    if old is None:
        return f"no such instance: {req.instance_id}"
    if old.get("status") != InstanceStatus.RUNNING:
        return f"instance {req.instance_id} is {old.get('status')}: only a running instance moves"
    if req.to_gpus and not req.to_node:
        return f"GPUs {list(req.to_gpus)} named without a to_node"
    if req.to_node and req.to_node not in nodes:
        return f"node {req.to_node} is not a node of cluster {old.get('cluster')}"
    if req.to_node and req.to_node == old.get("node"):
        return f"instance {req.instance_id} is already on node {req.to_node}"
    have, want = len(ready(insts)), int(block["ir"]["minInstances"])
    if have < want:
        return f"the block has {have} ready instance(s), fewer than minInstances {want}: it is made whole first"
    return ""


def claim_refusal(word: str, detail: str, budget_: int) -> str:
    """The claim script's refusal in words."""
    if word == "budget":
        return f"disruption budget: {detail} of the block's moves open, maxMoving {budget_}"
    if word == "moving":
        return f"the instance is already moving (move {detail})"
    return word


def rate_refusal(cid: str, limit: int, window_s: float) -> str:
    return f"rate limit: {limit} move(s) per {window_s:g} s in cluster {cid} (AIOS_MOVE_RATE_LIMIT)"


@dataclass(frozen=True)
class Plan:
    """What a move's step does: ``record`` written if the stored phase is one of ``expected``
    (``None``: no write), then ``effects`` (when the record now is ``record``'s phase)."""

    record: dict[str, Any] | None
    expected: tuple[str, ...] = ()
    effects: list[Effect] = field(default_factory=list)
    #: the sweep's next look at this move (0: none, the move is over)
    due: float = 0.0


def step(rec: Mapping[str, Any], reason: str = "", decisions: Any = (), **detail: Any) -> MoveStep:
    return MoveStep(rec["block_id"], int(rec["gen"]), rec["move_id"], rec["old"], rec.get("from", ""),
                    rec.get("new", "") if rec.get("node") else "", rec.get("node") or rec.get("to", ""),
                    list(rec.get("gpus") or []), reason or rec.get("reason", ""), rec.get("requested_by", ""),
                    rec.get("cluster", ""), list(decisions), dict(detail))


def started(rec: Mapping[str, Any], node: str, gpus: list[str], now: float, ready_timeout_s: float,
            decisions: Any = ()) -> Plan:
    """The new instance is reserved and its start committed: wait for it to be ready."""
    new = {**rec, "phase": MovePhase.STARTED.value, "node": node, "gpus": list(gpus), "due": now + ready_timeout_s}
    return Plan(new, (MovePhase.CLAIMED,), [publish(Emit(E.block_move_started, step(new, decisions=decisions)))], new["due"])


def failed(rec: Mapping[str, Any], why: str, now: float, insts: Mapping[str, Mapping[str, Any]],
           decisions: Any = ()) -> Plan:
    """The move fails: the old instance is left as it is; the new one, if recorded and not on its
    way out, is removed (its reservation goes with its ``removed``, as any instance's)."""
    new = {**rec, "phase": MovePhase.FAILED.value, "why": why, "finished_at": now, "due": 0.0}
    effects: list[Effect] = []
    inst = insts.get(rec.get("new", ""))
    if inst is not None and inst.get("status") != InstanceStatus.REMOVING:
        effects += [SetInstance(rec["block_id"], rec["new"], InstanceStatus.REMOVING),
                    publish(Emit(E.node_instance_remove, InstanceCommand(
                        rec["block_id"], int(rec["gen"]), inst.get("cluster", rec.get("cluster", "")), rec["new"], inst["node"], [],
                        reason=f"move {rec['move_id']} failed: {why}"[:500])))]
    effects.append(publish(Emit(E.block_move_failed, step(new, why, decisions))))
    return Plan(new, tuple(OPEN), effects)


def switch(rec: Mapping[str, Any], block: Mapping[str, Any] | None, insts: Mapping[str, Mapping[str, Any]],
           now: float, drain_s: float) -> Plan:
    """The new instance runs: the old one is told to drain and go (the mapper marks it draining at
    its remove command; the node agent lets its tasks in flight finish, ``drain_s``), unless the
    block would keep fewer than ``minInstances`` ready without it (then nothing yet: the sweep
    looks again). An old instance already gone or going completes the move at once or at its
    ``removed``."""
    if block is None or block.get("status") not in (BlockStatus.READY, BlockStatus.PLACING):
        return failed(rec, f"block is {block.get('status') if block else 'gone'}", now, insts)
    old = insts.get(rec["old"])
    new = {**rec, "phase": MovePhase.SWITCHED.value, "due": now + drain_s + CLAIM_S}
    serving = ready(insts)
    after = len(serving - {rec["old"]})
    want = int(block["ir"]["minInstances"])
    if old is None:
        return completed(new, now, "the old instance was already gone", expected=(MovePhase.STARTED, MovePhase.SWITCHED))
    switched = publish(Emit(E.block_move_switched, step(new, ready_without_old=after, minInstances=want)))
    if old.get("status") == InstanceStatus.REMOVING:  # going already (scaled down, replaced): its removed completes
        return Plan(new, (MovePhase.STARTED,), [switched], new["due"])
    if after < want:
        return Plan(None, due=now + 1.0)
    remove = Emit(E.node_instance_remove, InstanceCommand(
        rec["block_id"], int(rec["gen"]), old.get("cluster", rec.get("cluster", "")), rec["old"], old["node"], [],
        reason=f"moved to {rec['new']}@{rec.get('node', '')} (move {rec['move_id']})"[:500], drain_s=drain_s))
    return Plan(new, (MovePhase.STARTED,), [SetInstance(rec["block_id"], rec["old"], InstanceStatus.REMOVING), switched,
                                            publish(remove)], new["due"])


def completed(rec: Mapping[str, Any], now: float, why: str = "", expected: tuple[str, ...] = (MovePhase.SWITCHED,)) -> Plan:
    new = {**rec, "phase": MovePhase.COMPLETED.value, "finished_at": now, "due": 0.0}
    return Plan(new, expected, [publish(Emit(E.block_move_completed, step(new, why)))])


def on_new_added(rec: Mapping[str, Any], block: Mapping[str, Any] | None, insts: Mapping[str, Mapping[str, Any]],
                 now: float, drain_s: float) -> Plan:
    """The move's new instance reported running."""
    if rec["phase"] == MovePhase.STARTED:
        return switch(rec, block, insts, now, drain_s)
    if rec["phase"] == MovePhase.SWITCHED:
        return _redo_switch(rec, block, insts, now, drain_s)
    return Plan(None)


def _redo_switch(rec: Mapping[str, Any], block: Mapping[str, Any] | None, insts: Mapping[str, Mapping[str, Any]],
                 now: float, drain_s: float) -> Plan:
    """A switch seen again (redelivered, or the sweep): its effects once more (deduplicated)."""
    again = switch({**rec, "phase": MovePhase.STARTED.value}, block, insts, now, drain_s)
    if again.record is None:
        return again
    return Plan(again.record, (MovePhase.SWITCHED,), again.effects, again.due)


def on_new_gone(rec: Mapping[str, Any], insts: Mapping[str, Mapping[str, Any]], now: float, why: str) -> Plan:
    """The new instance failed, went unhealthy or was removed before the switch: the move fails."""
    if rec["phase"] in (MovePhase.CLAIMED, MovePhase.STARTED):
        return failed(rec, f"new instance {rec['new']} {why}", now, insts)
    return Plan(None)


def on_old_removed(rec: Mapping[str, Any], now: float) -> Plan:
    """The old instance is gone (drained and stopped, its reservation released): done."""
    if rec["phase"] == MovePhase.SWITCHED:
        return completed(rec, now)
    # before the switch (it failed, was lost): the new one keeps coming, and its ``added``
    # completes the move (``switch`` finds the old one gone)
    return Plan(None)


def on_due(rec: Mapping[str, Any], block: Mapping[str, Any] | None, insts: Mapping[str, Mapping[str, Any]],
           now: float, drain_s: float, ready_timeout_s: float) -> Plan:
    """The sweep's look at a move whose time is up: a claim whose controller died, a new instance
    not ready in time (or whose ``added`` was handled before the move was started), an old one
    whose ``removed`` came first."""
    phase = rec["phase"]
    if phase not in OPEN:
        return Plan(None)
    if block is None or int(block.get("gen", 0)) != int(rec["gen"]) or block.get("status") not in (BlockStatus.READY, BlockStatus.PLACING):
        return failed(rec, f"block is {block.get('status') if block else 'gone'}", now, insts)
    new_inst = insts.get(rec["new"])
    if phase == MovePhase.CLAIMED:
        if rec.get("due", 0) > now:
            return Plan(None, due=float(rec["due"]))
        return failed(rec, "the controller placing it stopped (the claim lapsed)", now, insts)
    if phase == MovePhase.STARTED:
        if new_inst is not None and new_inst.get("status") == InstanceStatus.RUNNING:
            return switch(rec, block, insts, now, drain_s)
        if new_inst is None:
            return failed(rec, f"new instance {rec['new']} is gone", now, insts)
        if rec.get("due", 0) > now:
            return Plan(None, due=float(rec["due"]))
        return failed(rec, f"new instance {rec['new']} not ready within {ready_timeout_s:g} s (AIOS_MOVE_READY_TIMEOUT_S)", now, insts)
    if rec["old"] not in insts:  # switched: the old one went
        return completed(rec, now)
    return _redo_switch(rec, block, insts, now, drain_s) if rec.get("due", 0) <= now else Plan(None, due=float(rec["due"]))
