"""The rebalancer (``blocks worker rebalancer``, started by ``blocks up``; docs/rebalance.md).

Every ``AIOS_REBALANCE_INTERVAL_S``, the copy that holds the lease (``state.rebalance``: one copy
acts at a time) looks at each cluster not rebalanced in the last ``AIOS_REBALANCE_COOLDOWN_S``
(the rate limit per cluster; the moves themselves are limited again by ``AIOS_MOVE_RATE_LIMIT``)
and runs the ``rebalancer`` policy (``AIOS_REBALANCE_POLICY``, default ``builtin:rebalance-min``)
when a pending block may go there, or when its FGD fragmentation is above
``AIOS_REBALANCE_FRAG_THRESHOLD``; each move of the answer is requested with
``block.move.requested`` (make-before-break: the controller carries it out). A pending block's
moves are held (``AIOS_REBALANCE_HOLD_S``) so neither a second round nor the queue walker asks
again while they run. The queue walker (``workers/queue.py``) asks the same policy for a pending
block before it preempts for it (``room_by_moves``).

``plan_rounds`` is the read side that ``blocks rebalance`` shares: it reads the state and returns
each cluster's input and the policy's answer; nothing is written.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..handlers import rebalance as hr
from ..runtime.ticker import Ticker
from ..schemas.catalog import Emit
from ..schemas.errors import PolicyFailed
from ..state.priority import PriorityStore
from ..state.queue import PendingQueue
from ..state.rebalance import RebalanceState, affinity_indexes
from .queue import nominate_moved_room

log = structlog.get_logger("aios.rebalancer")

#: invoke(rule, input) -> the policy's answer
Invoke = Callable[[dict[str, Any], dict[str, Any]], Awaitable[Any]]


@dataclass
class Round:
    """One cluster's call: the input, the answer (or the error), and why it ran (or was skipped)."""

    cluster: str
    trigger: hr.Trigger
    data: dict[str, Any]
    output: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "trigger": str(self.trigger), "skipped": self.skipped, "error": self.error,
                "fragmentation": {k: v for k, v in self.data.get("fragmentation", {}).items() if k != "nodes"},
                "moves": list(self.output.get("moves") or []), "reason": self.output.get("reason", ""),
                "for": self.output.get("for", "")}


async def pending_blocks(store: Any, window: int) -> list[dict[str, Any]]:
    """The head of every pending queue (``window`` per scope), queue order, blocks that still wait
    and hold no instance (a preemption's victim still draining is not placeable yet)."""
    q = PendingQueue(store.r)
    out = []
    for scope in await q.scopes():
        for bid in await q.head(scope, window):
            b = await store.get_block(bid)
            if b is None or b.get("status") != "pending" or await store.instances(bid):
                continue
            out.append(b)
    return out


async def plan_rounds(store: Any, invoke: Invoke, rule: dict[str, Any], max_moves: int, window: int,
                      clusters: list[str] | None = None, threshold: float = 0.0, trigger: hr.Trigger = hr.Trigger.MANUAL,
                      skip: Mapping[str, str] | None = None, idle: bool = False, wait_s: float = 0.0,
                      now: float | None = None) -> list[Round]:
    """Each cluster's rebalance: its input (the nodes, their fragmentation, the pending blocks that
    may go there, the movable instances) and the policy's answer. ``trigger`` MANUAL: every
    cluster is planned; else the periodic round: ``hr.round_trigger`` decides per cluster from its
    pending blocks (whether one has waited ``wait_s``: AIOS_REBALANCE_FRAG_WAIT_S), its
    fragmentation ratio, ``threshold`` and ``idle`` (AIOS_REBALANCE_FRAG_IDLE);
    ``skip``: clusters not to plan, with why (the cooldown)."""
    known = await store.clusters()
    wanted = sorted(known) if clusters is None else clusters
    if unknown := [cid for cid in wanted if cid not in known]:  # every one named, before any plan
        raise LookupError("no cluster " + ", ".join(repr(cid) for cid in unknown))
    placed, _models = await PriorityStore(store.r).placed()
    busy = hr.moving(placed)
    waiting = await pending_blocks(store, window)
    indexes = await affinity_indexes(store, [*placed, *waiting])
    rounds = []
    for cid in wanted:
        views = await store.read_nodes(cid, await store.node_ids(cid))
        mine = [b for b in waiting if hr.matches(b.get("ir") or {}, known[cid])]
        why = (skip or {}).get(cid, "")
        data = hr.rebalance_input(cid, views, placed, mine, max_moves, trigger, busy, indexes=indexes)
        kind: hr.Trigger | None = trigger
        if trigger is not hr.Trigger.MANUAL:
            at = time.time() if now is None else now
            waited = any(at - float(b.get("pending_since") or at) >= wait_s for b in mine)
            kind, not_now = hr.round_trigger(bool(mine), float(data["fragmentation"]["ratio"]), threshold, idle, waited)
            why = why or not_now
            data["trigger"] = str(kind or trigger)
        r = Round(cid, kind or trigger, data, skipped=why)
        if not r.skipped:
            try:
                r.output = await invoke(rule, data)
            except PolicyFailed as exc:
                r.error = str(exc)
        rounds.append(r)
    return rounds


class Rebalancer:
    def __init__(self, w: Any):
        self.w, self.s = w, w.settings
        self.state = RebalanceState(w.store.r)
        self.holder = f"rebalancer-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.rule = {"name": "rebalancer", "policyRuleURI": self.s.rebalance_policy}
        self.rounds = 0
        #: the last round's per-cluster outcome (for tests and logs)
        self.last: list[Round] = []

    async def invoke(self, rule: dict[str, Any], data: dict[str, Any]) -> Any:
        """The cluster's policy call (no block's: no decision event; each move request carries the
        policy's reason)."""
        return await self.w.runtime.invoke(rule, "rebalancer", data, {})

    async def tick(self) -> int:
        """One round (when this copy holds the lease): the moves requested."""
        if not await self.state.lead(self.holder, max(3 * self.s.rebalance_interval_s, 10.0)):
            return 0
        now = time.time()
        last = await self.state.last()
        skip = {cid: f"moves requested {now - t:.0f} s ago (AIOS_REBALANCE_COOLDOWN_S {self.s.rebalance_cooldown_s:g})"
                for cid, t in last.items() if now - t < self.s.rebalance_cooldown_s}
        rounds = await plan_rounds(self.w.store, self.invoke, self.rule, self.s.rebalance_frag_moves, self.s.queue_window,
                                   threshold=self.s.rebalance_frag_threshold, trigger=hr.Trigger.FRAGMENTATION, skip=skip,
                                   idle=self.s.rebalance_frag_idle, wait_s=self.s.rebalance_frag_wait_s, now=now)
        self.last = rounds
        self.rounds += 1
        placed, _ = await PriorityStore(self.w.store.r).placed()
        asked = 0
        for r in rounds:
            if r.error:
                log.warning("rebalance.policy_failed", cluster=r.cluster, error=r.error)
            asked += await self.request(r, hr.gens(placed), now)
        return asked

    async def request(self, r: Round, known: dict[str, int], now: float) -> int:
        """Publish the round's moves (a pending block's: once, held while they run)."""
        events: list[Emit] = hr.requests(r.cluster, r.output, known, r.trigger, now)
        if not events:
            return 0
        target = str(r.output.get("for") or "")
        if target and not await self.state.hold(target, ",".join(e.payload.move_id for e in events), self.s.rebalance_hold_s):
            return 0  # moves for it are under way already
        if target:
            await nominate_moved_room(self.w, target, r.output, self.s.rebalance_hold_s)
        await self.state.mark(r.cluster, now)
        await self.w.bus.emit_all(events)
        log.info("rebalance.moves", cluster=r.cluster, trigger=str(r.trigger), moves=len(events), target=target,
                 reason=str(r.output.get("reason", ""))[:200])
        return len(events)

    async def run(self, stop: Any) -> None:
        await Ticker(self.s.rebalance_interval_s, "rebalance.tick_failed", log, wait_first=True).run(self.tick, stop)


async def run(w: Any, stop: Any, cluster: str | None = None) -> None:
    await Rebalancer(w).run(stop)
