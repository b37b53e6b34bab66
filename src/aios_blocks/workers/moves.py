"""The adapter of make-before-break moves (docs/rebalance.md): reads, calls the pure decisions of
``handlers/moves.py`` and commits their plans (the move's record with compare-and-set in
``state.moves``, then the effects through ``workers/effects.commit``).

* ``on_move_requested`` (the lifecycle consumer, ``block.move.requested``): checks the request,
  takes the cluster's rate and the block's budget (the claim), places the new instance through the
  allocation adapter (atomic reservation: never double-booked) and starts it;
* ``after_added`` / ``after_removed`` / ``on_new_fault`` (called by the lifecycle handlers of
  ``workers/controller.py``): the new instance ready -> the switch (the old one drains); the old
  one gone -> completed; the new one failed or gone before the switch -> failed;
* ``MoveSweeper`` (every controller process): moves whose time is up (a new instance never ready,
  a controller killed mid-move, an ``added`` handled before its move was recorded started).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import structlog

from .. import faults
from ..bus.router import Inbound
from ..bus.runner import Defer
from ..handlers import allocation as al
from ..handlers import moves as mv
from ..runtime.ticker import Ticker
from ..schemas.errors import PlacementFailed
from ..schemas.events import Decision, InstanceEvent
from ..schemas.lifecycle import LIVE, InstanceStatus
from ..schemas.moves import MovePhase, MoveRequested
from ..schemas.records import BlockRecord, InstanceRecord
from ..state.moves import MoveStore
from .allocate import allocate, start
from .base import Worker
from .effects import commit

log = structlog.get_logger("aios.moves")

_stores: dict[int, MoveStore] = {}


def store(w: Worker) -> MoveStore:
    """The worker's move store (its scripts registered once)."""
    ms = _stores.get(id(w))
    if ms is None or ms.r is not w.store.r:
        ms = _stores[id(w)] = MoveStore(w.store.r)
    return ms


async def apply(w: Worker, plan: mv.Plan, rec: dict[str, Any]) -> bool:
    """Commit a plan: its record if the stored phase allows, then its effects (also when the
    record is already in the plan's phase: a step redone after a crash or a redelivery). Returns
    whether the effects were committed."""
    ms = store(w)
    bid, mid = rec["block_id"], rec["move_id"]
    if plan.record is not None:
        written, now_rec = await ms.advance(plan.record, plan.expected)
        if not written and (now_rec is None or now_rec.get("phase") != plan.record["phase"]):
            return False
        if plan.record["phase"] == MovePhase.FAILED:
            await _release_unstarted(w, plan.record)
        log.info("move.step", block=bid, move=mid, phase=plan.record["phase"], why=plan.record.get("why", ""))
        faults.hit(f"move.{plan.record['phase']}")  # the chaos tests' SIGKILL: the phase written, its effects not
    await commit(w, plan.effects)
    if plan.due:
        await ms.due(bid, mid, plan.due)
    elif plan.record is not None and plan.record["phase"] not in mv.OPEN:
        await ms.undue(bid, mid)
    return True


async def _release_unstarted(w: Worker, rec: dict[str, Any]) -> None:
    """A failed move's new instance reserved but never recorded (its controller stopped between
    the reservation and the start): its reservation is given back here. A recorded one is removed
    by the plan's effects and released at its ``removed``."""
    cid, new = rec.get("cluster", ""), rec.get("new", "")
    if not cid or not new or (await w.store.instances(rec["block_id"])).get(new) is not None:
        return
    (held,) = await w.store.reservations_of(cid, [new])
    if held and held.get("node") and await w.store.release(cid, held["node"], new):
        await w.hint(cid, [held["node"]])


# -- the request --------------------------------------------------------------------------------------
async def on_move_requested(w: Worker, m: Inbound[MoveRequested]) -> None:
    req = m.data
    ms, now = store(w), time.time()
    rec = await ms.get(req.block_id, req.move_id)
    if rec is not None:  # this move id was taken before: one move per id
        if rec["phase"] == MovePhase.CLAIMED:
            await _place_once(w, rec, m.deliveries)  # a redelivery of a request whose controller stopped mid-placement
        elif rec["phase"] == MovePhase.STARTED:  # its controller may have stopped before saying so (deduplicated)
            await commit(w, mv.started(rec, rec["node"], list(rec.get("gpus") or []), now, 0.0).effects)
        elif rec["phase"] == MovePhase.FAILED and not rec.get("node"):
            await apply(w, mv.failed(rec, rec.get("why", ""), now, {}), rec)  # its failure said again (deduplicated)
        return
    block, insts = await w.store.block_view(req.block_id)
    old = insts.get(req.instance_id) if block is not None else None
    rec = mv.record(req, block, old, now)
    cid = rec["cluster"]
    why = mv.refusal(req, block, insts if block is not None else {}, await w.inventory.nodes(cid) if cid else {})
    if why:
        await _refuse(w, rec, why)
        return
    assert block is not None
    s = w.settings
    if not await ms.take_rate(cid, req.move_id, now, s.move_rate_window_s, s.move_rate_limit):
        await _refuse(w, rec, mv.rate_refusal(cid, s.move_rate_limit, s.move_rate_window_s))
        return
    word, detail = await ms.claim(rec, mv.budget(block["ir"]), now, mv.KEEP_S)
    if word == "exists":  # a concurrent delivery of the same request claimed it first
        return
    if word != "ok":
        await ms.give_rate(cid, req.move_id)
        await _refuse(w, rec, mv.claim_refusal(word, detail, mv.budget(block["ir"])))
        return
    await ms.due(req.block_id, req.move_id, rec["due"])
    log.info("move.claimed", block=req.block_id, move=req.move_id, instance=req.instance_id, to=req.to_node or "any",
             by=req.requested_by)
    await _place_once(w, rec, m.deliveries)


async def _refuse(w: Worker, rec: dict[str, Any], why: str) -> None:
    """A move refused before its claim: recorded finished (a redelivery is the same answer)."""
    done = {**rec, "phase": MovePhase.FAILED.value, "why": why, "finished_at": time.time(), "due": 0.0}
    stored = await store(w).tombstone(done)
    if stored.get("phase") == MovePhase.FAILED:
        log.info("move.refused", block=rec["block_id"], move=rec["move_id"], why=stored.get("why"))
        await commit(w, mv.failed(stored, str(stored.get("why", why)), time.time(), {}).effects)


async def _place_once(w: Worker, rec: dict[str, Any], deliveries: int) -> None:
    """One placement of a move at a time, on any copy: two deliveries of one request handled at
    once (a redelivery in the same batch) could each plan the new instance on another node. The
    lease is the reassignment's (keyed by the new instance); a delivery that finds it held waits
    for it, and gives up after its attempts (the holder places it, or the sweep fails the move
    once its claim lapses)."""
    token, bid = uuid.uuid4().hex, rec["block_id"]
    if await w.store.claim_replacement(bid, rec["new"], token, mv.PLACE_LEASE_S) != token:
        if deliveries < w.settings.reassign_attempts:
            raise Defer(min(2.0 ** deliveries, 15.0))
        return
    try:
        await _place(w, rec)
    finally:
        await w.store.release_replacement(bid, rec["new"], token)


async def _place(w: Worker, rec: dict[str, Any]) -> None:
    """Reserve and start the new instance (off the old one's node, or on the node asked for)."""
    bid = rec["block_id"]
    block, insts = await w.store.block_view(bid)
    if block is None or block.get("status") not in LIVE or int(block["gen"]) != int(rec["gen"]):
        await apply(w, mv.failed(rec, f"block is {block.get('status') if block else 'gone'}", time.time(), insts), rec)
        return
    ir, cid = block["ir"], rec["cluster"]
    trace: list[Decision] = []
    extra = {"instance_id": rec["old"], "pod_name": rec["old"], "reason": rec.get("reason", "")}
    req = al.Request(ir, cid, "reassignment", (rec["new"],), avoid="" if rec.get("to") else rec.get("from", ""), extra=extra,
                     only=rec.get("to", ""), gpus=tuple(rec.get("to_gpus") or ()))
    try:
        placements, attempts = await allocate(w, req, insts, trace=trace)
        faults.hit("move.reserved")  # the chaos tests' SIGKILL: reserved, not started
    except PlacementFailed as exc:
        await store(w).give_rate(cid, rec["move_id"])  # nothing moved: it does not count
        await apply(w, mv.failed(rec, f"no room for the new instance: {exc.reason}", time.time(), insts, trace), rec)
        return
    await start(w, ir, int(block["gen"]), cid, "reassignment", placements, attempts, key=f"move-{rec['move_id']}",
                replaces=rec["old"], trace=trace)
    (p,) = placements
    plan = mv.started(rec, p["node"], list(p["gpus"]), time.time(), w.settings.move_ready_timeout_s, trace)
    if await apply(w, plan, rec):
        # its ``added`` may have been handled before the move said started (a fast agent): the
        # switch is made now rather than at the sweep's next look
        block, insts = await w.store.block_view(bid)
        if plan.record is not None and (insts.get(rec["new"]) or {}).get("status") == InstanceStatus.RUNNING:
            await apply(w, mv.on_new_added(plan.record, block, insts, time.time(), w.settings.scale_down_grace_s), plan.record)
    else:
        # the move was failed meanwhile (the sweep found its claim lapsed): the instance this
        # step started goes again
        now_rec = await store(w).get(bid, rec["move_id"])
        if now_rec is not None and now_rec["phase"] == MovePhase.FAILED:
            _, insts = await w.store.block_view(bid)
            await apply(w, mv.failed(now_rec, str(now_rec.get("why", "")), time.time(), insts), now_rec)


# -- the instances' facts ----------------------------------------------------------------------------
async def _move_of(w: Worker, bid: str, field: str, iid: str, phases: tuple[str, ...]) -> dict[str, Any] | None:
    for rec in (await store(w).of_block(bid)).values():
        if rec.get(field) == iid and rec.get("phase") in phases:
            return rec
    return None


async def after_added(w: Worker, ev: InstanceEvent) -> None:
    """The lifecycle's ``added`` handled: a move's new instance that runs switches its move."""
    if not mv.is_move_instance(ev.block_id, ev.instance_id):
        return
    rec = await _move_of(w, ev.block_id, "new", ev.instance_id, (MovePhase.STARTED, MovePhase.SWITCHED))
    if rec is None:
        return  # claimed, not yet recorded started: the sweep switches it once it is
    block, insts = await w.store.block_view(ev.block_id)
    await apply(w, mv.on_new_added(rec, block, insts, time.time(), w.settings.scale_down_grace_s), rec)


async def after_removed(w: Worker, ev: InstanceEvent, before: InstanceRecord | None, block: BlockRecord | None) -> None:
    """The lifecycle's ``removed`` handled (``before``: the instance's record before it): a move's
    new instance gone before its switch fails the move; a moved instance gone completes it."""
    if before is None or before.get("node") != ev.node_id or block is None or int(block["gen"]) != ev.gen:
        return
    now = time.time()
    if mv.is_move_instance(ev.block_id, ev.instance_id):
        rec = await _move_of(w, ev.block_id, "new", ev.instance_id, (MovePhase.CLAIMED, MovePhase.STARTED))
        if rec is not None:
            _, insts = await w.store.block_view(ev.block_id)
            await apply(w, mv.on_new_gone(rec, insts, now, f"removed ({ev.reason or 'stopped'})"), rec)
    if before.get("status") in (InstanceStatus.REMOVING, InstanceStatus.RUNNING):
        rec = await _move_of(w, ev.block_id, "old", ev.instance_id, (MovePhase.SWITCHED,))
        if rec is not None:
            await apply(w, mv.on_old_removed(rec, now), rec)


async def on_new_fault(w: Worker, ev: InstanceEvent, kind: str) -> bool:
    """A move's new instance failed or went unhealthy before its switch: the move fails (the new
    one is removed, the old one keeps serving) instead of the instance being replaced. Whether
    the fact was the move's."""
    if not mv.is_move_instance(ev.block_id, ev.instance_id):
        return False
    rec = await _move_of(w, ev.block_id, "new", ev.instance_id, (MovePhase.CLAIMED, MovePhase.STARTED))
    if rec is None or (rec.get("node") and rec["node"] != ev.node_id):  # (claimed: its node not yet recorded)
        return False
    _, insts = await w.store.block_view(ev.block_id)
    await apply(w, mv.on_new_gone(rec, insts, time.time(), f"{kind}: {ev.reason}"), rec)
    return True


# -- the sweep --------------------------------------------------------------------------------------
class MoveSweeper:
    """Every controller process looks at the moves whose time is up, every ``AIOS_MOVE_SWEEP_S``;
    copies may look at one move at once (each step is a compare-and-set, its effects idempotent)."""

    def __init__(self, w: Worker):
        self.w = w
        self.swept = 0

    async def tick(self) -> int:
        w, ms, now = self.w, store(self.w), time.time()
        done = 0
        for bid, mid in await ms.overdue(now):
            rec = await ms.get(bid, mid)
            if rec is None or rec.get("phase") not in mv.OPEN:
                await ms.undue(bid, mid)
                continue
            block, insts = await w.store.block_view(bid)
            plan = mv.on_due(rec, block, insts, now, w.settings.scale_down_grace_s, w.settings.move_ready_timeout_s)
            if plan.record is None:
                await ms.due(bid, mid, plan.due or now + w.settings.move_sweep_s)
                continue
            await apply(w, plan, rec)
            done += 1
        self.swept += done
        return done

    async def run(self, stop: asyncio.Event) -> None:
        await Ticker(self.w.settings.move_sweep_s, "moves.sweep_failed", log, wait_first=True).run(self.tick, stop)
