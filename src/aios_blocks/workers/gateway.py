"""Cluster-controller gateway: selection, dry_run fan-out, gather (all answers or a deadline),
post_dry_run and the allocation request to the chosen cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import structlog

from .. import faults
from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.router import Inbound, Router
from ..handlers import gateway as h
from ..handlers import queue as h_queue
from ..policies.quota import Verdict
from ..runtime.ticker import Ticker
from ..schemas.events import (
    AllocationRequest,
    Decision,
    DryRunRequest,
    DryRunResult,
    Parsed,
    PostDryRun,
    Selection,
)
from ..schemas.lifecycle import Step
from ..schemas.records import BlockIR, BlockRecord, GatherRecord, ir_of
from ..state.store import transition_args
from . import queue
from .base import Worker, bound

log = structlog.get_logger("aios.gateway")


async def _snapshot(w: Worker) -> tuple[dict[str, Any], dict[str, Any]]:
    clusters = await w.inventory.clusters()
    return clusters, await w.inventory.views(list(clusters))


def bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    router = Router(subjects.GATEWAY)
    router.add(E.block_parsed, bound(on_parsed, w))
    router.add(E.block_dry_run_result, bound(on_result, w))
    return [router.binding()]


async def on_parsed(w: Worker, m: Inbound[Parsed]) -> None:
    """A parsed block (or one sent back to selection): select candidates, open the gather, ask each."""
    ev = m.data
    bid, gen, ir, n = ev.block_id, ev.gen, ir_of(ev.ir), ev.attempt
    # the step's CAS, the quotas and the inventory in one Redis exchange: the reads depend on no
    # block's status (the quota usage is the capacity scripts' counters), only go unused when
    # the CAS does not take
    (ok, status), quota, (clusters, nodes) = await asyncio.gather(
        w.store.transition(bid, gen, Step.SELECT, in_round=n), queue.quota_view(w), _snapshot(w))
    if not ok:
        if status == "allocating":  # this round chose already: its decision may not be stored yet
            await _redo_skipped(w, bid, gen, n)
        return  # superseded (a later selection round, deleted, re-created) or already past this step
    if await _quota_holds(w, bid, gen, ir, n, quota[0]):
        return
    trace: list[Decision] = []
    sel = await h.select(ir, clusters, nodes, w.invoker(ir, "clusterAllocator", trace), await w.affinity_index(ir))
    rule = ir["policies"]["clusterAllocator"]["policyRuleURI"]
    event = Selection(bid, gen, sel.candidates, sel.filtered, rule, attempt=n, decisions=trace)
    if sel.failure:
        await w.bus.emit(E.block_selection, event)
        if sel.waitable:  # fits nowhere now: the pending queue (docs/priority.md), unless --no-queue
            await queue.wait_or_fail(w, bid, gen, ir, sel.failure, Step.FAIL_SELECTION, sel.filtered)
        else:
            await w.fail_block(bid, gen, sel.failure, Step.FAIL_SELECTION)
        return
    deadline = time.time() + w.settings.dry_run_deadline_s
    event.deadline = deadline
    skip = skip_reason(ir, sel.candidates, n, rule, w.settings.dry_run_single)
    if skip and await _decide_now(w, m.stream_seq, event, ir, sel.entries, skip):
        return  # decided here, its three events in this handler's commit
    # Nothing of the round may happen before its selection is stored (the handler's events are
    # committed with its batch's, after every handler of the batch is done): its timer waits for
    # that (``_arm``, after the commit), set until then only as the net for an arming that failed
    await w.store.gather_open(bid, gen, n, sel.candidates, deadline, at=m.stream_seq, due=_net(w, deadline))
    if skip:  # not decided in the handler (``_decide_now``: its choice failed here): after the commit
        # the round's answer is recorded in its gather (not asked) and decided, by the path a
        # complete round takes, once the selection is stored: a round decided before that was
        # taken by its timer for a decider that had stopped, and its post_dry_run and allocation
        # (then the placement) were stored before the selection
        await w.bus.emit(E.block_selection, event)
        await w.bus.after_commit(lambda: _decide_skipped(w, bid, gen, n, sel.candidates[0], skip, deadline))
        return
    # the queries (core NATS) go out once the selection is stored (the runner's ``Outbox.after``)
    out = [Emit(E.block_selection, event)]
    out += [Emit(E.cluster_dry_run, DryRunRequest(bid, gen, cid, attempt=n, at=m.stream_seq)) for cid in sel.candidates]
    await w.bus.emit_all(out)
    await w.bus.after_commit(lambda: _arm(w, bid, gen, n, deadline))


#: how long past the deadline (at least) a round's timer is first set, until its selection is
#: stored and ``_arm`` sets it to the deadline
TIMER_NET_S = 30.0


def _net(w: Worker, deadline: float) -> float:
    """When the timer of a round whose selection is not yet stored is due: only if arming it
    after the commit failed (a handler's batch is committed long before)."""
    return deadline + max(w.settings.dry_run_patience_s, TIMER_NET_S)


async def _arm(w: Worker, bid: str, gen: int, n: int, deadline: float) -> None:
    """The round's selection is stored: its timer is due at the deadline (if the round is still on)."""
    await w.store.gather_timer(bid, gen, n, deadline, if_set=True)


async def _decide_now(w: Worker, at: int, event: Selection, ir: BlockIR, entries: dict[str, dict[str, Any]],
                      why: str) -> bool:
    """A round that asks no dry_run, decided in its ``parsed`` handler: the selection, the
    post_dry_run and the allocation go out in the handler's outbox, one commit, in that order.
    False (nothing done but the gather's writes): the block goes on as a round decided after
    its selection is stored (``_decide_skipped``).

    Redis first, in one exchange (``Store.gather_skip``): the gather with its timer (at the net,
    ``_net``), the round's selection, the skipped answer, the decision, its outcome and the
    block's CHOOSE step. A crash after it and before the commit leaves the block ``allocating``
    with nothing stored: the ``parsed`` delivery comes back, its SELECT finds the round chosen
    and ``_redo_skipped`` stores what the gather recorded, the selection first (as the timer
    does if that delivery never comes: ``_decide``). Only the first delivery (its selection not
    recorded before) publishes what it computed: any later one publishes the recorded round.

    ``entries``: the selection's (``SelectionDecision.entries``): the cluster's entry the filter
    made over this snapshot is the one ``h.scoped_entry`` would make again (a skipped round has
    no affinity entries, so no score of its own), not made a second time."""
    bid, gen, n, cid = event.block_id, event.gen, event.attempt, event.candidates[0]
    answer = skipped_answer(why)
    g: GatherRecord = {"expected": [cid], "results": {cid: answer}}
    trace: list[Decision] = []
    decision = await h.choose([cid], g["results"], {cid: entries[cid]} if cid in entries else {},
                              w.invoker(ir, "clusterAllocator", trace), int(ir.get("minInstances") or 1))
    if decision.failure or decision.cluster_id != cid:
        return False
    opened, outcome, chosen = await w.store.gather_skip(
        bid, gen, n, cid, answer, msgspec.json.encode(event), event.deadline, _net(w, event.deadline),
        transition_args(gen, Step.CHOOSE, None, {"cluster": cid}), at=at)
    faults.hit("gateway.skip.chosen")  # the chaos tests' SIGKILL: chosen in Redis, nothing stored
    if not (opened and chosen and outcome == cid):
        await _decide(w, bid, gen, n, "skipped")  # what the gather recorded, the selection first
        return True
    post = PostDryRun(bid, gen, cid, decision.scores, decision.missing, decision.errors, n, trace,
                      answers=_answers(bid, gen, n, g))
    await w.bus.emit_all([Emit(E.block_selection, event), Emit(E.block_post_dry_run, post),
                          Emit(E.cluster_allocation, AllocationRequest(bid, gen, cid, n))])
    # the timer (at the net) and the gather go once the three are stored
    await w.bus.after_commit(lambda: w.store.gather_finish(bid, gen, n))
    return True


async def _redo_skipped(w: Worker, bid: str, gen: int, n: int) -> None:
    """A ``parsed`` delivered again to a round that chose (the block ``allocating``): a round
    decided in its handler (``_decide_now``) whose gather is still there may have stored nothing
    (its process stopped before the commit): its decision again, the recorded selection first
    (what was stored already is dropped as a duplicate)."""
    g = await w.store.gather_read(bid, gen, n)
    if g.get("selection") and g.get("decided"):
        await _decide(w, bid, gen, n, str(g["decided"]))


async def _decide_skipped(w: Worker, bid: str, gen: int, n: int, cid: str, why: str, deadline: float) -> None:
    """A round that asks no dry_run, decided once its selection is stored (outside the handler's
    outbox: the post_dry_run, then the allocation, each stored before the next step). A decider
    that stops on the way is finished by the round's timer, armed first: the timer and the answer
    go to Redis in one exchange (the timer first; neither reads the other), and the decision reads
    the gather once both are written."""
    await asyncio.gather(_arm(w, bid, gen, n, deadline), w.store.gather_add_state(bid, gen, n, cid, skipped_answer(why)))
    await _decide(w, bid, gen, n, "skipped")


#: the clusterAllocator whose post_dry_run, given one candidate with a positive score, chooses it
SKIPPABLE_RULES = frozenset({"builtin:cluster-rank"})


def skip_reason(ir: BlockIR, candidates: list[str], attempt: int, rule: str, ask_single: bool) -> str:
    """Why this round needs no dry_run ('' when it does): its only candidate is the cluster the
    built-in clusterAllocator will choose whatever the answer says, and the allocation plans (and
    checks) the same placement the dry run would have. First rounds only: a block whose allocation
    failed comes back (round 1) through a dry run, which counts the gang and says, per node, why
    it does not fit. Not with affinity entries (their dry run carries the per-node reasons and
    the adapt table explain shows) nor with ``AIOS_DRY_RUN_SINGLE`` on."""
    if ask_single or len(candidates) != 1 or attempt != 0 or ir.get("affinity") or rule not in SKIPPABLE_RULES:
        return ""
    return f"dry run skipped: {candidates[0]} is the only candidate"


def skipped_answer(why: str) -> dict[str, Any]:
    """The gather's answer of a skipped dry run: usable (a positive score, no error), the gang
    count not said (the allocation checks it)."""
    return {"score": 1.0, "node_info": {}, "error": "", "placeable": -1, "shortfall": 0, "skipped": why}


async def _quota_holds(w: Worker, bid: str, gen: int, ir: BlockIR, n: int, view: h_queue.QuotaView | None) -> bool:
    """The tenant's quota before placement (docs/priority.md): ``admit`` / ``admit-borrowing`` go
    on to selection; ``wait`` waits in the pending queue with the quota's reason; ``reclaim`` waits
    too, and the queue walker preempts the borrowers (InCohortReclamation), then places it.
    ``view``: ``queue.quota_view``'s (from the counters)."""
    verdict = h_queue.gate(ir, view)
    if verdict is not None and view is not None and view.exact_needed(verdict[0]):
        view, _placed = await queue.quota_view(w, exact=True)  # a reclamation: decided on the blocks
        verdict = h_queue.gate(ir, view)
    if verdict is None or verdict[0].verdict in (Verdict.ADMIT, Verdict.ADMIT_BORROWING):
        if verdict is not None:
            log.info("gateway.quota", block=bid, verdict=str(verdict[0].verdict), reason=verdict[1][:200])
        return False
    # the round is recorded (no candidate: the quota holds it) so the stream folds to the same state
    await w.bus.emit(E.block_selection, Selection(bid, gen, [], {}, "quota", attempt=n))
    # its block.pending wakes the controllers' queue walker (controller.on_pending): a reclamation is its to carry out
    await queue.wait_or_fail(w, bid, gen, ir, verdict[1], Step.FAIL_SELECTION, {})
    return True


async def on_result(w: Worker, m: Inbound[DryRunResult]) -> None:
    """One cluster's dry_run answer: kept in the gather; the round is decided once all answered
    (or a late usable answer comes after the deadline)."""
    # an answer comes over core NATS (not stored): the whole of it is kept in the gather, so
    # whichever gateway copy decides stores it in the round's post_dry_run
    ev = m.data
    answered, expected, decided, deadline = await w.store.gather_add_state(
        ev.block_id, ev.gen, ev.attempt, ev.cluster_id, msgspec.structs.asdict(ev)
    )
    if not expected:
        return  # no open round: decided and gone (a late answer decides nothing), or never opened
    if expected and answered >= expected:
        await _decide(w, ev.block_id, ev.gen, ev.attempt, "complete")
    elif h.usable({"score": ev.score, "error": ev.error, "shortfall": ev.shortfall}):
        # a late usable answer ends a round that is past its deadline and still waiting
        if not decided and time.time() >= deadline:
            await _decide(w, ev.block_id, ev.gen, ev.attempt, f"late:{ev.cluster_id}")


async def on_due(w: Worker, bid: str, gen: int, n: int) -> float | None:
    """A gather's timer fired: decide with what it has, or say when to look again (``None``: done)."""
    g = await w.store.gather_read(bid, gen, n)
    if g["decided"] and g["decided"] != "deadline":
        # decided, yet its timer is still here: the timer goes only once the decision's events
        # are stored, so the decider stopped before that (answers are not stored: nothing else
        # would finish it). Deciding again publishes what was recorded (``gather_settle``), once.
        await _decide(w, bid, gen, n, g["decided"])
        return None
    if not g["expected"]:
        return None  # expired or never opened here: nothing to decide
    if not g["decided"]:
        now = time.time()
        wait = h.gather_wait(g["expected"], g["results"], now, g["deadline"], w.settings.dry_run_patience_s)
        if wait > 0:
            if now >= g["deadline"]:
                # nothing usable yet: a query is not stored, so one lost with a controller that
                # stopped is asked again now, and again every deadline while the patience lasts
                await ask_again(w, bid, gen, n, g)
                wait = min(wait, max(1.0, w.settings.dry_run_deadline_s))
            return time.time() + wait  # a late usable answer decides earlier (on_result)
    await _decide(w, bid, gen, n, "deadline")
    return None


async def ask_again(w: Worker, bid: str, gen: int, n: int, g: GatherRecord) -> list[str]:
    """Send the dry_run query again to every expected cluster that has not answered (the same
    request: an answer that was only late is deduplicated by its message id)."""
    missing = [c for c in g["expected"] if c not in g["results"]]
    if missing:
        log.info("gather.asked_again", block=bid, gen=gen, attempt=n, clusters=missing)
        await w.bus.emit_all([Emit(E.cluster_dry_run, DryRunRequest(bid, gen, cid, attempt=n, at=g.get("at", 0)))
                              for cid in missing])
    return missing


async def fire_due(w: Worker, now: float | None = None) -> tuple[int, float | None]:
    """Claim and handle every gather timer that is due; returns how many, and when the next is due.
    A timer whose handling fails comes back after a second."""
    claimed, nxt = await w.store.gather_claim_due(time.time() if now is None else now)
    for bid, gen, n in claimed:
        try:
            at = await on_due(w, bid, gen, n)
        except Exception as exc:  # never lose a timer to one failure: look again shortly
            log.warning("gather.timer_failed", block=bid, gen=gen, attempt=n, error=repr(exc))
            at = time.time() + 1.0
        await w.store.gather_timer(bid, gen, n, at)
        if at is not None:
            nxt = at if nxt is None else min(nxt, at)
    return len(claimed), nxt


async def run_timers(w: Worker, stop: asyncio.Event, guard: Any, idle_s: float = 0.1) -> None:
    """The gateway's deadline timers (Redis, not the stream): every copy polls; claims are atomic,
    so each due timer is handled by one of them."""

    def next_in(fired: tuple[int, float | None] | None) -> float:
        nxt = None if fired is None else fired[1]  # None: nothing due (or the tick failed)
        return max(idle_s if nxt is None else min(idle_s, max(0.0, nxt - time.time())), 0.005)

    # no valid state (flushed, recover under way): the guard holds the timers
    await Ticker(idle_s, "gather.timers_paused", log, next_in=next_in, guard=guard).run(lambda: fire_due(w), stop)


def _deciding(block: BlockRecord, gen: int, n: int) -> bool:
    """The block still waits for this round's choice (same generation, selecting, attempt ``n``)."""
    if block.get("gen") != gen or block.get("status") not in ("selecting", "allocating"):
        return False
    return int(block.get("attempt", 0)) == n


async def _choose(w: Worker, ir: BlockIR, g: GatherRecord, trace: list[Decision]) -> h.FinalDecision:
    """The clusterAllocator's choice among the round's answers."""
    clusters = await w.inventory.clusters()
    asked = [cid for cid in g["expected"] if cid in clusters]
    nodes = await w.inventory.views(asked)  # the round's clusters only: the others' views need no refresh here
    index = await w.affinity_index(ir) if ir.get("affinity") else None
    entries = {cid: h.scoped_entry(ir, clusters[cid], nodes[cid], index) for cid in asked}
    return await h.choose(g["expected"], g["results"], entries, w.invoker(ir, "clusterAllocator", trace),
                          int(ir.get("minInstances") or 1))


async def _decide(w: Worker, bid: str, gen: int, n: int, token: str) -> None:
    won, block, g = await w.store.gather_decide_read(bid, gen, n, token)
    if not won or block is None or not _deciding(block, gen, n):
        return
    ir = block["ir"]
    trace: list[Decision] = []
    decision = await _choose(w, ir, g, trace)
    # one outcome per round, even if this decider runs again on more answers than the first time
    # a failure is "!why", or "?why" when the block may wait for capacity (the pending queue)
    mark = "?" if decision.waitable else "!"
    outcome = await w.store.gather_settle(bid, gen, n, f"{mark}{decision.failure}" if decision.failure else decision.cluster_id)
    failure, cid = (outcome[1:], "") if outcome[:1] in ("!", "?") else ("", outcome)
    post = PostDryRun(bid, gen, cid, decision.scores, decision.missing, decision.errors, n, trace,
                      answers=_answers(bid, gen, n, g))
    if g.get("selection"):  # a round decided in its handler (``_decide_now``): its selection may not be stored
        await w.bus.emit(E.block_selection, msgspec.json.decode(g["selection"], type=Selection))
    await w.bus.emit(E.block_post_dry_run, post)
    if failure and outcome.startswith("?"):
        reasons = {c: decision.errors.get(c) or ("no answer in time" if c in decision.missing else failure)
                   for c in g["expected"]}
        await queue.wait_or_fail(w, bid, gen, ir, failure, Step.FAIL_SELECTION, reasons)
    elif failure:
        await w.fail_block(bid, gen, failure, Step.FAIL_SELECTION)
    else:
        ok, _ = await w.store.transition(bid, gen, Step.CHOOSE, cluster=cid)
        if ok:
            await w.bus.emit(E.cluster_allocation, AllocationRequest(bid, gen, cid, n))
    # the timer (and the gather) go once the decision is stored: until then the timer is what
    # finishes a decider that stopped
    await w.bus.after_commit(lambda: w.store.gather_finish(bid, gen, n))


def _answers(bid: str, gen: int, n: int, g: GatherRecord) -> list[DryRunResult]:
    """The round's answers as the gather holds them (a gather rebuilt by ``blocks recover`` from
    an older stream holds only their scores)."""
    out = []
    for cid in g["expected"]:
        r = g["results"].get(cid)
        if isinstance(r, dict):
            with contextlib.suppress(msgspec.ValidationError, TypeError):
                out.append(msgspec.convert({**r, "block_id": bid, "gen": gen, "cluster_id": cid, "attempt": n}, DryRunResult))
    return out
