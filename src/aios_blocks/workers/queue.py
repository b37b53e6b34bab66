"""The pending queue's adapter (docs/priority.md): a block that fits nowhere waits (``wait_or_fail``),
and the queue walker, run by every controller process next to its reconciler, sends waiting
blocks back through selection when capacity appears (``handlers.queue.walk``), preempts for the
first one that may (the ``preemption`` policy, default ``builtin:preempt-min``) and fails those
waiting longer than their ``maxPendingS``.

Event-driven: a capacity event this process handles (an instance removed, a node registered or
reporting its inventory) ``poke``\\ s the walker, which reads the head of each scope's queue (a
sorted set, ``state.queue``): O(window) per event, never the whole queue. One copy walks at a time
(a lease in Redis); a pass every ``AIOS_QUEUE_RESYNC_S`` covers expiry and capacity events another
process saw. Every step is a compare-and-set on the block (``Step.RETRY``/``EXPIRE``/``PREEMPTED``)
and every event has a deterministic id: a walk redone after a crash changes nothing twice.

A ``ready`` block the reconciler marked short (its ask for the missing instances placed nothing:
``degraded`` in its memory) is walked with the waiting blocks, its missing instances as a pending
placement of its priority (``short_entries``): it preempts lower blocks for them as a waiting block
would, and once they fit the walker asks for them (``ask``: a ``block.scale.target``, source
``queue``) and holds their room for them (a nomination) until it is whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import structlog

from .. import faults
from ..bus.catalog import E, Emit
from ..bus.runner import Defer
from ..handlers import preemption as pre
from ..handlers import queue as hq
from ..handlers import rebalance as hr
from ..handlers import scaling
from ..policies import quota as qp
from ..schemas.errors import PolicyFailed
from ..schemas.events import BlockStatusReport, InstanceCommand, Parsed, ScaleTarget
from ..schemas.lifecycle import InstanceStatus, Step
from ..schemas.priority import Pending, PreemptReason, Quota
from ..schemas.records import BlockIR, wire_ir
from ..state.priority import PriorityStore
from ..state.queue import Nominations, PendingQueue, PreemptPlans, Wakeups, scope_of
from ..state.rebalance import RebalanceState, affinity_indexes
from ..state.reconcile import ReconcileStore
from . import announce
from .base import EpochGuard, Worker

log = structlog.get_logger("aios.queue")

#: id(worker) -> its walker (``poke``)
_running: dict[int, QueueWalker] = {}
DEBOUNCE_S = 0.005
DEFAULT_POLICY = "builtin:preempt-min"

__all__ = ["PendingQueue", "QueueWalker", "nominees", "poke", "quota_view", "short_entries", "wait_or_fail"]
#: who asks for a short block's missing instances once they fit (``ScaleTarget.source``)
SOURCE = "queue"


def poke(w: Worker) -> None:
    """Capacity appeared (or may have): ask this process's walker for a pass soon; when this copy
    does not hold the walker's lease, its walker wakes the leader's (``state.queue.Wakeups``)."""
    q = _running.get(id(w))
    if q is not None:
        q.poked = True
        q.wake.set()


async def wait_or_fail(w: Worker, bid: str, gen: int, ir: BlockIR, reason: str, step: Step,
                       reasons: dict[str, str] | None = None, cluster: str = "") -> None:
    """The block fits nowhere now: it waits in the pending queue (``block.pending`` with the reason
    per cluster), or, with ``queue: false`` (``submit --no-queue``), fails as before."""
    if not hq.waits(ir):
        await w.fail_block(bid, gen, reason, step, cluster)
        return
    block = await w.store.get_block(bid) or {}
    since = round(float(block.get("pending_since") or time.time()), 3)  # kept across retries: its place
    deadline = hq.deadline(ir, since, w.settings.max_pending_s)
    by = str(block.get("preempted_by") or "")
    fields = {"reason": reason[:2000], "pending_since": f"{since:.3f}", "pending_deadline": f"{deadline:.3f}"}
    pending = Emit(E.block_pending, Pending(bid, gen, reason[:2000], dict(reasons or {}), int(ir.get("priority") or 0), since,
                                            deadline, int(block.get("attempt") or 0), by))
    # marked before the CAS: a publish that fails after it, whose redelivery finds the block
    # pending and acts no more (the allocation request's), is published by the reconciler (announce)
    key = await announce.mark(w, bid, gen, Step.WAIT, [pending])
    ok, info = await w.store.transition(bid, gen, Step.WAIT, reason=fields["reason"], pending_since=fields["pending_since"],
                                        pending_deadline=fields["pending_deadline"])
    moved = ok or info == "pending"
    if moved:  # else it moved on (deleted, re-created)
        await Nominations(w.store.r).drop(bid)  # a preemptor that did not get its room waits at its place again
        await PendingQueue(w.store.r).add(bid, scope_of(ir), int(ir.get("priority") or 0), since, deadline)
        await w.bus.emit_all([pending])
        log.info("queue.pending", block=bid, gen=gen, reason=reason[:200])
    await announce.settle(w, key, moved)


async def quota_view(w: Worker, exact: bool = False) -> tuple[hq.QuotaView | None, list[dict[str, Any]]]:
    """The quotas and the holdings the quota gate reads (None: no quota set). By default each
    tenant's usage from the counters the capacity scripts keep (``PriorityStore.usage_counters``:
    one read per cluster, no scan of the placed blocks; ``QuotaView.counted``); ``exact``: every
    running block's holding and the placed rows a reclamation picks its victims in (a scan: only
    when a verdict is ``reclaim``)."""
    store = PriorityStore(w.store.r)
    records = await store.quotas()
    if not records:
        return None, []
    quotas = {t: Quota.model_validate(q) for t, q in records.items()}
    if not exact:
        usage = qp.from_fields(await store.usage_counters())
        return hq.QuotaView(quotas, [qp.Holding(f"{qp.TOTAL}{t}", t, u) for t, u in sorted(usage.items())], counted=True), []
    placed, models = await store.placed()
    return hq.QuotaView(quotas, qp.holdings_of(placed, models)), placed


#: a nominee's statuses: on its way through selection (retried, not reserved yet)
IN_FLIGHT = ("parsed", "selecting", "allocating")
#: ... and one whose room moves make: also while it still waits for them
MOVED_FOR = ("pending", *IN_FLIGHT)
#: ... and a ready block short of instances whose lost or failed one's room, or the room freed
#: for its missing ones, is held for it (``Nominations.nominate(replaces=..., short=True)``)
SHORT = ("ready",)


async def nominate_moved_room(w: Worker, bid: str, output: Mapping[str, Any], hold_s: float) -> None:
    """The room the moves requested for waiting block ``bid`` free (their source nodes) is held for
    it, as a preemption's room is for its preemptor (``Nominations``): a block of its priority or
    lower (a direct submit's allocation, a walker pass) does not take it between a move's old
    instance going and the walker's pass that places ``bid``. Until it is placed, waits no more, or
    ``hold_s`` (the moves' hold) ends."""
    block = await w.store.get_block(bid)
    nodes = {str(m.get("from") or "") for m in output.get("moves") or ()} - {""}
    if block is not None and nodes:
        # a short ready block's: held while it is ready and short (``_still_held``)
        await Nominations(w.store.r).nominate(bid, int(block["gen"]), nodes, time.time() + hold_s, moves=True,
                                              short=block["status"] == "ready")


async def nominees(w: Worker, scope: str | None = None, drop: bool = False, read: Mapping[str, str] | None = None
                   ) -> list[hq.Nominee]:
    """The preemptors retried and not placed yet (of ``scope``; None: all), whose room is held for
    them (``handlers.queue.Nominee``), and the ready blocks short of the instances whose room is
    held for them (a lost one's, or the room its preemption freed: ``_short_of``). ``drop`` (the walker): a nomination whose block was
    placed, waits again, is whole again, is gone or whose hold ended is dropped. One read when none is held; ``read``:
    the nominations' hash as the caller read it (``Nominations.all``'s), else read here."""
    noms = Nominations(w.store.r)
    out = []
    now = time.time()
    for bid, n in sorted((await noms.all() if read is None else Nominations.decode(read)).items()):
        block = await w.store.get_block(bid)
        ir = block["ir"] if block is not None else {}
        short = _short(n)
        if block is not None and short and block["status"] == "ready":
            ir = await _short_of(w, bid, ir, str(n.get("replaces") or ""))
        if block is None or not _still_held(block, ir, n, now):
            if drop:
                await noms.drop(bid)
        elif scope is None or scope_of(block["ir"]) == scope:
            out.append(hq.Nominee(bid, ir, tuple(n.get("nodes") or ()), str(block.get("cluster") or "") if short else ""))
    return out


def _short(n: Mapping[str, Any]) -> bool:
    """Whether nomination ``n`` holds room for a short ready block's missing instances."""
    return bool(n.get("replaces") or n.get("short"))


def _still_held(block: Mapping[str, Any], ir: BlockIR, n: Mapping[str, Any], now: float) -> bool:
    """Whether nomination ``n`` still holds room for ``block`` (``ir``: its nominee's IR)."""
    statuses = SHORT if _short(n) else MOVED_FOR if n.get("moves") else IN_FLIGHT
    return (int(block["gen"]) == int(n.get("gen") or 0) and float(n.get("until") or 0) >= now
            and block["status"] in statuses and (not _short(n) or int(ir.get("minInstances") or 0) > 0))


async def _short_of(w: Worker, bid: str, ir: BlockIR, replaced: str) -> BlockIR:
    """A short block's nominee: its IR with ``minInstances`` the instances it is short of (those
    not on their way out, the replaced one left out: it runs nowhere); 0 once it is whole again."""
    return hq.short_of(ir, await w.store.instances(bid), replaced)


async def short_entries(w: Worker) -> list[hq.Entry]:
    """The ready blocks the reconciler marked short (``degraded`` in its memory: its ask for their
    missing instances placed nothing), as the walk reads them (``hq.Entry.short``): the record with
    ``minInstances`` the instances it is short of, its preemption under way (``preempting``: its
    claimed plan's request) and no ``preempted_by`` (placed again, a former victim no longer waits
    as one). One read when none is short."""
    out = []
    for bid, m in sorted((await ReconcileStore(w.store.r).memory()).items()):
        block = await w.store.get_block(bid) if m.get("degraded") else None
        if block is None or block["status"] != "ready" or not block.get("cluster"):
            continue
        ir = await _short_of(w, bid, block["ir"], "")
        if int(ir.get("minInstances") or 0) <= 0:
            continue
        plan = await PreemptPlans(w.store.r).get(bid)
        mark = str(plan["request_id"]) if plan and plan.get("short") and int(plan.get("gen") or 0) == int(block["gen"]) else ""
        out.append(hq.Entry(bid, {**block, "ir": ir, "preempting": mark, "preempted_by": ""}, short=True))
    return out


def _block_of(entries: list[hq.Entry], bid: str) -> Mapping[str, Any] | None:
    """The block of the entry ``bid`` (it is one of ``entries``)."""
    return next(e.block for e in entries if e.bid == bid)


def with_rule(ir: BlockIR, kind: str, default_uri: str) -> BlockIR:
    """The block's IR with a ``kind`` policy rule: its own when its spec names one, else ``default_uri``."""
    rule = (ir.get("policies") or {}).get(kind) or {"name": kind, "policyRuleURI": default_uri}
    return {**ir, "policies": {**(ir.get("policies") or {}), kind: rule}}

class QueueWalker:
    def __init__(self, w: Worker):
        self.w, self.s = w, w.settings
        self.q = PendingQueue(w.store.r)
        self.holder = f"queue-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.wake = asyncio.Event()
        #: a capacity event this process handled (``poke``), not a notice from another copy
        self.poked = False
        self.wakeups = Wakeups(w.store.r)
        self.passes = 0
        #: no valid state (flushed, ``blocks recover`` under way): no pass; a new epoch: fresh views
        self.guard = EpochGuard(w)

    async def run(self, stop: asyncio.Event) -> None:
        _running[id(self.w)] = self
        listener = asyncio.create_task(self._listen(stop))
        stopped = asyncio.ensure_future(stop.wait())  # a stop ends the wait for the next pass at once
        try:
            while not stop.is_set():
                woken = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait((woken, stopped), timeout=self.s.queue_resync_s, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if stop.is_set():
                    break
                await asyncio.sleep(DEBOUNCE_S)  # a burst of removals is one pass
                self.wake.clear()
                poked, self.poked = self.poked, False
                try:
                    if not await self.tick() and poked:
                        # another copy holds the lease: its walker passes now, not at its periodic pass
                        await self.wakeups.notify(self.holder)
                except Exception as exc:  # never stop the walker: the next pass looks again
                    log.warning("queue.pass_failed", error=repr(exc))
        finally:
            _running.pop(id(self.w), None)
            stopped.cancel()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener

    async def _listen(self, stop: asyncio.Event) -> None:
        """Notices from the other copies (``state.queue.Wakeups``); reconnects after an error."""
        while not stop.is_set():
            try:
                await self.wakeups.listen(self.holder, self.wake.set, stop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the periodic pass covers the gap
                log.warning("queue.wakeups_failed", error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    async def tick(self) -> bool:
        try:
            epoch = await self.guard.current()
        except Defer:
            return False
        if not await self.q.lead(self.holder, max(3 * self.s.queue_resync_s, 10.0)):
            return False
        await self.expire(time.time())
        short = await short_entries(self.w)
        for scope in sorted({*await self.q.scopes(), *(scope_of((e.block or {})["ir"]) for e in short)}):
            if not await self.guard.still(epoch):  # the state was rebuilt under the pass: look again
                self.wake.set()
                return False
            await self.walk(scope, [e for e in short if scope_of((e.block or {})["ir"]) == scope])
        self.passes += 1
        return True

    async def expire(self, now: float) -> None:
        for bid in await self.q.due(now):
            block = await self.w.store.get_block(bid)
            if block is None or block["status"] != "pending":
                await self.q.remove(bid)
                continue
            reason = f"waited longer than maxPendingS in the pending queue: {block.get('reason', '')}"[:2000]
            ok, _ = await self.w.store.transition(bid, block["gen"], Step.EXPIRE, reason=reason)
            # out of the queue before the event: whoever sees block.failed no longer finds it waiting
            await self.q.remove(bid)
            if ok:
                await self.w.bus.emit(E.block_failed, BlockStatusReport(block_id=bid, gen=block["gen"], status="failed",
                                                                  reason=reason))

    async def walk(self, scope: str, short: list[hq.Entry] | None = None) -> hq.Walk:
        """One pass over the scope's head and its short ready blocks (``short``; None: read here)."""
        head = await asyncio.gather(*(self._entry(bid) for bid in await self.q.head(scope, self.s.queue_window)))
        if short is None:
            short = [e for e in await short_entries(self.w) if scope_of((e.block or {})["ir"]) == scope]
        entries = hq.with_short(head, short)
        clusters = await self.w.inventory.clusters()
        views = await self.w.inventory.views(list(clusters))
        nominated = await self.nominees(scope)
        out = await self._act(entries, clusters, views, nominated)
        for bid in out.drop:
            await self._drop(bid, _block_of(entries, bid))
        for bid, gen, cid in out.retry:
            await self.retry(bid, gen, cid)
        for bid, gen, cid in out.ask:
            await self.ask(bid, gen, cid, any(n.bid == bid for n in nominated))
        return out

    async def nominees(self, scope: str) -> list[hq.Nominee]:
        return await nominees(self.w, scope, drop=True)

    async def _act(self, entries: list[hq.Entry], clusters: dict[str, Any], views: dict[str, Any],
                   nominated: list[hq.Nominee] | None = None) -> hq.Walk:
        """The pure walk and the one action it calls for (a quota reclamation, a plan cut short
        resumed, a preemption); an entry whose action does nothing is left out and the walk done
        again. Returns the last walk (its drops and retries are the caller's)."""
        tried: frozenset[str] = frozenset()
        view, placed = await quota_view(self.w)
        while True:
            out = hq.walk(entries, clusters, views, tried, time.time(),
                          None if view is None else hq.QuotaView(view.quotas, list(view.holdings), view.counted),
                          nominated or ())
            if out.reclaim and view is not None and view.counted:  # the victims are blocks: decided on them
                view, placed = await quota_view(self.w, exact=True)
                continue
            if out.reclaim:
                bid, victims = out.reclaim[0]
                if await self.reclaim(_block_of(entries, bid), victims, placed):
                    return out
                tried |= {bid}
                continue
            if out.blocked_by:
                held = [e.block for e in entries if e.bid == out.blocked_by and e.block is not None]
                await self.resume(out.blocked_by, held[0] if held else {})
                return out
            if not out.preempt:
                return out
            # the room the blocks released ahead of it take is not there for it: moves and
            # victims are chosen on the views those blocks leave (docs/priority.md)
            after = out.after(views)
            block = _block_of(entries, out.preempt[0])
            # a short block's missing instances go to its own cluster: room elsewhere is for nothing
            where = hq.own(block, clusters) if block is not None and block.get("status") == "ready" else clusters
            # moves before preemption: room made by moving instances costs nobody their work
            if await self.room_by_moves(block, where, after):
                return out
            if await self.preempt(block, where, after):
                return out
            tried |= {out.preempt[0]}

    async def _entry(self, bid: str) -> hq.Entry:
        block = await self.w.store.get_block(bid)
        holds = len(await self.w.store.instances(bid)) if block is not None and block.get("status") == "pending" else 0
        return hq.Entry(bid, block, holds)

    async def _drop(self, bid: str, block: Mapping[str, Any] | None) -> None:
        """An entry whose block no longer waits; one retried whose Parsed may not have gone out
        (a walker stopped in between) is announced again (the stream deduplicates)."""
        if block is not None and block.get("status") == "parsed" and int(block.get("attempt") or 0) > 0:
            await self.w.bus.emit(E.block_parsed, Parsed(bid, block["gen"], block["ir"], int(block["attempt"])))
        await self.q.remove(bid)

    async def retry(self, bid: str, gen: int, cid: str) -> None:
        block = await self.w.store.get_block(bid)
        if block is None or block["gen"] != gen:
            return
        try:  # its wait said on the stream first: a handler's outbox (or a crash) may still hold it
            await announce.say_first(self.w, bid, gen, Step.WAIT)
        except Exception as exc:  # the next pass tries again; the block keeps its place
            log.warning("queue.retry_deferred", block=bid, gen=gen, error=repr(exc))
            return
        n = int(block.get("attempt") or 0) + 1
        plan = await PreemptPlans(self.w.store.r).get(bid) if block.get("preempting") else None
        if plan is not None and int(plan.get("gen") or 0) == gen:
            # the room its victims freed is its own until it is placed: a pass meanwhile (the next
            # victim's removal) must not give it to the victims or the blocks behind it
            await Nominations(self.w.store.r).nominate(bid, gen, (plan.get("output") or {}).get("victims") or {},
                                                       time.time() + hq.NOMINATION_S)
        # its waiting reason goes with the wait (``blocks list``/``get`` showed a placed block's old
        # "no cluster passed ..."); a wait again sets its own
        ok, info = await self.w.store.transition(bid, gen, Step.RETRY, attempt=str(n), preempting="", reason="")
        if ok:
            await PreemptPlans(self.w.store.r).drop(bid)  # its preemption is over: a later one is a new plan
            log.info("queue.retry", block=bid, gen=gen, attempt=n, fits=cid)
            await self.w.bus.emit(E.block_parsed, Parsed(bid, gen, wire_ir(block["ir"]), n))
        elif plan is not None:
            await Nominations(self.w.store.r).drop(bid)
        if ok or info != "pending":
            await self.q.remove(bid)

    async def ask(self, bid: str, gen: int, cid: str, held: bool) -> None:
        """A short ready block's missing instances fit (in ``cid``, its cluster): the room is held for
        them (a nomination, on its preemption's victims' nodes if it preempted, ``NOMINATION_S``) and
        they are asked for now (a ``block.scale.target``, source ``queue``), not at the reconciler's
        next ask (its backoff may be a minute), so a lower block does not take the room meanwhile.
        ``held``: its room is held already (an ask of this walker's, or its lost instance's): the
        step under way places it; one ask per hold. Its preemption, if any, is over (its plan dropped)."""
        block = await self.w.store.get_block(bid)
        plans = PreemptPlans(self.w.store.r)
        plan = await plans.get(bid)
        mine = plan is not None and bool(plan.get("short")) and int(plan.get("gen") or 0) == gen
        if block is None or block["status"] != "ready" or int(block["gen"]) != gen or (held and not mine):
            return
        nodes = (plan.get("output") or {}).get("victims") or {} if plan is not None and mine else {}
        await Nominations(self.w.store.r).nominate(bid, gen, nodes, time.time() + hq.NOMINATION_S, short=True)
        ir = block["ir"]
        lo, hi = int(ir.get("minInstances") or 0), int(ir.get("maxInstances") or 0)
        target, _ = scaling.clamp(max(lo, int(block.get("desired") or 0)), lo, hi)
        live = len(scaling.live(await self.w.store.instances(bid)))
        why = (f"{live} live < minInstances {lo}: the missing instances fit in {cid}"
               + (f" once its preemption's victims are gone ({plan['request_id']})" if plan is not None and mine else ""))
        await self.w.bus.emit(E.block_scale_target, ScaleTarget(bid, f"queue-{gen}-{int(time.time() * 1000)}", target, why,
                                                                source=SOURCE, gen=gen))
        if mine:
            await plans.drop(bid)  # its preemption is over: a later one is a new plan
        log.info("queue.ask", block=bid, gen=gen, target=target, cluster=cid, preempted=mine)

    async def reclaim(self, block: Mapping[str, Any] | None, victims: list[str], placed: list[dict[str, Any]]) -> bool:
        """The owner takes back its quota: the borrowers' blocks are preempted (reason
        ``InCohortReclamation``) through the same path as a priority preemption."""
        if block is None or not victims:
            return False
        ir, gen = block["ir"], block["gen"]
        bid = str(ir["blockId"])
        data, output = pre.reclaim_plan(bid, ir, victims, placed)
        if not output["victims"]:
            return False
        await self._carry_out(bid, gen, ir, data, output, "", PreemptReason.IN_COHORT_RECLAMATION,
                              short=block.get("status") == "ready")
        return True

    # -- moves before preemption (issue 38, docs/rebalance.md) ----------------------------------
    async def room_by_moves(self, block: Mapping[str, Any] | None, clusters: dict[str, Any], views: dict[str, Any]) -> bool:
        """Ask the rebalancer policy (the block's own, else ``AIOS_REBALANCE_POLICY``), cluster by
        cluster, for at most ``AIOS_REBALANCE_MAX_MOVES`` moves after which the whole block fits;
        the first answer's moves are requested (``block.move.requested``) and held for
        ``AIOS_REBALANCE_HOLD_S``. True while moves for it are asked or under way: the block is
        not preempted for meanwhile (the moves' removals are capacity events: it is placed then)."""
        if block is None or self.s.rebalance_max_moves <= 0:
            return False
        ir = block["ir"]
        bid = str(ir["blockId"])
        state = RebalanceState(self.w.store.r)
        if await state.held(bid):
            return True
        placed, _models = await PriorityStore(self.w.store.r).placed()
        busy = hr.moving(placed)
        pir = with_rule(ir, "rebalancer", self.s.rebalance_policy)
        # the waiting block's own index too: with affinity and none, its room would be on no node
        indexes = await affinity_indexes(self.w.store, [*placed, block])
        for cid in sorted(clusters):
            if not hr.matches(ir, clusters[cid]):
                continue
            data = hr.rebalance_input(cid, views.get(cid) or {}, placed, [block], self.s.rebalance_max_moves,
                                      hr.Trigger.PENDING, busy, indexes=indexes)
            if not data["movable"]:
                continue
            try:
                output = await self.w.invoke(pir, "rebalancer", data)
            except PolicyFailed as exc:
                log.warning("queue.rebalance_failed", block=bid, cluster=cid, error=str(exc))
                continue
            events = hr.requests(cid, output, hr.gens(placed), hr.Trigger.PENDING, time.time())
            if not events:
                continue
            if await state.hold(bid, ",".join(e.payload.move_id for e in events), self.s.rebalance_hold_s):
                await nominate_moved_room(self.w, bid, output, self.s.rebalance_hold_s)
                await self.w.bus.emit_all(events)
                log.info("queue.moves", block=bid, cluster=cid, moves=len(events), reason=str(output.get("reason", ""))[:200])
            return True
        return False

    # -- preemption --------------------------------------------------------------------------------
    async def preempt(self, block: Mapping[str, Any] | None, clusters: dict[str, Any], views: dict[str, Any]) -> bool:
        """Ask the preemption policy, cluster by cluster, for victims that let the whole block fit;
        the first plan is carried out. False when no cluster has one (the block just waits)."""
        if block is None:
            return False
        ir, gen = block["ir"], block["gen"]
        bid = str(ir["blockId"])
        placed, _models = await PriorityStore(self.w.store.r).placed()
        pir = with_rule(ir, "preemption", DEFAULT_POLICY)
        index = (await affinity_indexes(self.w.store, [block])).get(bid)
        for cid in sorted(clusters):
            # victims only on the nodes the block's placement may use (its virtual cluster's, those
            # its Required affinity admits): room elsewhere is evicted for nothing
            nodes = views.get(cid) or {}
            where = hr.targets(ir, nodes, index)
            if where is not None:
                keep = set(where)
                nodes = {nid: v for nid, v in nodes.items() if nid in keep}
            data = pre.preempt_input(bid, ir, cid, nodes, placed, self.s.preempt_min_delta,
                                     str(block.get("preempted_by") or ""))
            if not data["candidates"]:
                continue
            try:
                output = await self.w.invoke(pir, "preemption", data)
            except PolicyFailed as exc:
                log.warning("queue.preempt_failed", block=bid, cluster=cid, error=str(exc))
                continue
            if output.get("victims"):
                await self._carry_out(bid, gen, ir, data, output, cid, short=block.get("status") == "ready")
                return True
        return False

    async def _carry_out(self, bid: str, gen: int, ir: BlockIR, data: dict[str, Any], output: dict[str, Any],
                         cid: str, reason: PreemptReason = PreemptReason.PRIORITY, short: bool = False) -> None:
        """Mark the preemptor (one preemption at a time), publish ``block.preempted`` on each
        victim and ``block.preempting`` on it, then drain the victims: a victim that loses all
        its instances goes back to ``pending`` (marked: it never preempts); its instances are
        removed through the nodes' remove path (drained within the grace), and each removal frees
        capacity (a capacity event: the preemptor is placed). ``short``: the preemptor is a short
        ready block (``ir``'s ``minInstances`` its missing instances): it stays ``ready``, its
        claimed plan is its mark (``short_entries``), and the walker asks for them once they fit."""
        request_id = f"{bid}:{gen}:{int(data.get('block', {}).get('priority') or 0)}:{time.time():.3f}"
        plans = PreemptPlans(self.w.store.r)
        plan: dict[str, Any] | None = {"request_id": request_id, "gen": gen, "cluster": cid, "reason": str(reason),
                                       "data": data, "output": output, "done": False}
        if short:
            plan = {**(plan or {}), "short": int(ir.get("minInstances") or 0)}
        if not await plans.claim(bid, plan or {}, hq.PREEMPT_HOLD_S):
            # another copy (or this one before a crash) claimed a plan for this block: that plan, not a second one
            plan = await plans.get(bid)
            if plan is None or int(plan["gen"]) != gen or plan.get("done"):
                return
        await self._execute(bid, plan or {})

    async def resume(self, bid: str, block: Mapping[str, Any]) -> bool:
        """A preemptor marked but whose plan is not carried out to the end (its walker was killed
        between choosing the victims and evicting them): carry the same plan out now."""
        plan = await PreemptPlans(self.w.store.r).get(bid)
        if plan is None or plan.get("done") or int(plan["gen"]) != int(block.get("gen") or 0):
            return False
        if str(block.get("preempting") or "") not in ("", plan["request_id"]):
            return False
        log.warning("queue.preempt_resumed", block=bid, request=plan["request_id"])
        await self._execute(bid, plan)
        return True

    async def _execute(self, bid: str, plan: dict[str, Any]) -> None:
        """Carry out a claimed plan; every step is idempotent (a compare-and-set, or an event with
        a deterministic id), so a plan carried out again after a crash changes nothing twice."""
        gen, request_id, cid = int(plan["gen"]), str(plan["request_id"]), str(plan.get("cluster") or "")
        data, output, reason = plan["data"], plan["output"], PreemptReason(plan["reason"])
        short = int(plan.get("short") or 0)
        if short:  # a short ready block stays ready: its claimed plan is its mark
            block = await self.w.store.get_block(bid)
            ok = block is not None and block["status"] == "ready" and int(block["gen"]) == gen
        else:
            ok, _ = await self.w.store.transition(bid, gen, Step.WAIT, preempting=request_id)
        if not ok:
            return
        events = pre.events(data, output, gen, request_id, reason, short)
        await self.w.bus.emit_all(events)
        faults.hit("queue.preempt.after_events")  # the chaos test's SIGKILL: victims chosen, none evicted
        by_block = {str(c["block_id"]): c for c in data["candidates"]}
        # one time for the plan's victims: they wait in the queue in one place, by id among
        # themselves (not by which of them this loop reached first)
        since = round(time.time(), 3)
        for ev in events:
            if ev.event is not E.block_preempted:
                continue
            v = ev.payload
            await self._evict(v.block_id, v.gen, by_block[v.block_id], list(v.instances), bid, cid, reason, since)
        await PreemptPlans(self.w.store.r).finish(bid, {**plan, "done": True})
        log.warning("queue.preempting", block=bid, cluster=cid, victims=sorted(by_block.keys() & set(output.get("blocks") or {})))

    async def _evict(self, vid: str, vgen: int, cand: dict[str, Any], iids: list[str], preemptor: str, cid: str,
                     why: PreemptReason = PreemptReason.PRIORITY, since: float = 0.0) -> None:
        block, insts = await self.w.store.block_view(vid)
        if block is None or block["gen"] != vgen:
            return
        whole = set(iids) >= {i for i, r in insts.items() if r.get("status") != InstanceStatus.REMOVING}
        cid = cid or str(block.get("cluster") or "")
        if whole:
            vir = block["ir"]
            since = since or round(time.time(), 3)
            deadline = hq.deadline(vir, since, self.s.max_pending_s)
            reason = f"preempted by {preemptor}" + ("" if why is PreemptReason.PRIORITY else f" ({why})")
            ok, _ = await self.w.store.transition(vid, vgen, Step.PREEMPTED, reason=reason, pending_since=f"{since:.3f}",
                                                  pending_deadline=f"{deadline:.3f}", preempted_by=preemptor)
            if ok:
                await self.q.add(vid, scope_of(vir), int(vir.get("priority") or 0), since, deadline)
                await self.w.bus.emit(E.block_pending, Pending(vid, vgen, reason, {cid: reason}, int(vir.get("priority") or 0),
                                                               since, deadline, int(block.get("attempt") or 0), preemptor))
        grace = float(self.s.scale_down_grace_s)
        out = []
        for iid in iids:
            rec = insts.get(iid)
            if rec is None:
                continue
            await self.w.store.set_instance_status(vid, iid, "removing")
            out.append(Emit(E.node_instance_remove, InstanceCommand(vid, vgen, rec["cluster"], iid, rec["node"], [],
                                                                   reason=f"preempted by {preemptor}", drain_s=grace)))
        await self.w.bus.emit_all(out)
