"""The pending queue seen from the command line (docs/priority.md): ``blocks list --pending``'s
rows, what ``blocks explain`` adds for a waiting block, and ``submit --dry-run``'s forecast
("would wait behind N blocks / would preempt X")."""

from __future__ import annotations

import time
from typing import Any, TypedDict

from ..handlers import queue as hq
from ..handlers.preemption import preempt_input
from ..schemas.errors import PolicyFailed
from ..schemas.records import BlockIR
from ..state.priority import PriorityStore
from ..state.queue import PendingQueue, scope_of


class PendingRow(TypedDict):
    """One row of ``blocks list --pending`` (``rows``)."""

    id: str
    scope: str
    position: int
    priority: int
    priorityClass: str
    age_s: float
    reason: str
    preempted_by: str
    preempting: bool
    deadline: float


class Waiting(TypedDict):
    """Why a block waits, as ``blocks explain`` shows it (``why_waiting``)."""

    reason: str
    scope: str
    position: int
    length: int
    #: the blocks ahead of it in its scope's queue
    ahead: list[str]
    preempted_by: str
    preempting: str
    since: float
    deadline: float


def preempted_note(reason: str, preempted_by: str, note: str = "") -> str:
    """``; preempted by B`` (and ``note``) after a waiting block's reason, unless that reason says so
    already (a victim's reason is ``preempted by B``: the lists said it twice)."""
    if not preempted_by or f"preempted by {preempted_by}" in reason:
        return f" {note}" if preempted_by and note else ""
    return f"; preempted by {preempted_by}" + (f" {note}" if note else "")


async def rows(store: Any) -> list[PendingRow]:
    """Every waiting block, each scope's queue in order: id, scope, position, priority, age (s),
    the reason, who preempted it, whether its own preemption is under way."""
    now = time.time()
    out: list[PendingRow] = []
    for bid, scope, position in await PendingQueue(store.r).all():
        block = await store.get_block(bid)
        if block is None or block.get("status") != "pending":
            continue  # an entry the walker has not cleaned yet
        ir = block.get("ir") or {}
        since = float(block.get("pending_since") or now)
        out.append({"id": bid, "scope": scope, "position": position, "priority": int(ir.get("priority") or 0),
                    "priorityClass": ir.get("priorityClass", ""), "age_s": round(now - since, 1),
                    "reason": block.get("reason", ""), "preempted_by": block.get("preempted_by", ""),
                    "preempting": bool(block.get("preempting")),
                    "deadline": float(block.get("pending_deadline") or 0)})
    return out


async def why_waiting(store: Any, bid: str) -> Waiting | None:
    """For a waiting block: the reason, its place, and the blocks ahead of it (behind what)."""
    block = await store.get_block(bid)
    if block is None or block.get("status") != "pending":
        return None
    q = PendingQueue(store.r)
    pos = await q.position(bid)
    ahead = [] if pos is None else [b for b in await q.head(pos[0], pos[1] - 1)]
    return {"reason": block.get("reason", ""), "scope": pos[0] if pos else "", "position": pos[1] if pos else 0,
            "length": pos[2] if pos else 0, "ahead": ahead, "preempted_by": block.get("preempted_by", ""),
            "preempting": block.get("preempting", ""), "since": float(block.get("pending_since") or 0),
            "deadline": float(block.get("pending_deadline") or 0)}


async def forecast(store: Any, ir: BlockIR, cids: list[str], min_delta: int) -> list[str]:
    """What a block that would not place would do: wait behind N blocks, or preempt some."""
    if not hq.waits(ir):
        return ["queue: false: it would fail at once (--no-queue)"]
    from ..policies.runtime import PolicyRuntime
    from ..workers.queue import DEFAULT_POLICY as DEFAULT_PREEMPTION

    bid, priority = str(ir["blockId"]), int(ir.get("priority") or 0)
    notes = [f"would wait behind {await PendingQueue(store.r).ahead(scope_of(ir), priority)} block(s) in the pending queue"]
    if priority <= 0:
        return notes
    placed, _ = await PriorityStore(store.r).placed()
    # the rule the queue walker would call: the block's own (its spec's or component's), else the
    # default (workers/queue.py's with_rule); a registered one is read as the walker reads it
    rule = (ir.get("policies") or {}).get("preemption") or {"name": "preemption", "policyRuleURI": DEFAULT_PREEMPTION}
    for cid in cids:
        views = await store.read_nodes(cid, await store.node_ids(cid))
        data = preempt_input(bid, ir, cid, views, placed, min_delta)
        if not data["candidates"]:
            continue
        try:
            out = await PolicyRuntime(lookup=store.policy_get).invoke(rule, "cli.preempt", data, {})
        except PolicyFailed:
            continue
        if out.get("victims"):
            victims = ", ".join(f"{b} ({', '.join(i)})" for b, i in sorted((out.get("blocks") or {}).items()))
            notes.append(f"would preempt {victims} in {cid}")
            break
    return notes
