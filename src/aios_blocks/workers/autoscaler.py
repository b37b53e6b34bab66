"""The autoscaler (``blocks worker autoscaler``, started by ``blocks up``; docs/autoscaling.md).

Every ``AIOS_AUTOSCALE_TICK_S`` (2 s) it:

1. lists the blocks the metrics collector has a sample for (``state.metrics``), keeps the live
   ones whose IR names an ``autoscaler`` policy (IRs cached per generation), and takes or renews
   each one's **lease** in Redis (``state.autoscale``): with several copies running, each block is
   decided by exactly one of them per tick, and a copy that dies is replaced when its leases lapse
   (three ticks). The blocks are split among the live copies (``aios:meta:autoscalers``) by
   rendezvous hashing: each takes the free leases of its share; a block it holds from another's
   share is decided this tick and then handed over;
2. reads, for the blocks it holds, the framework's memory of the block, the instance records (the
   current count: starting or running) and the collector's samples, in one pipeline;
3. per block, calls the policy (``action: "autoscale"``) through the policy runtime (built-ins
   inline; Python with ``AIOS_AUTOSCALE_POLICY_TIMEOUT_S``) and lets the framework
   (``handlers.autoscale.decide``) shape its proposal: bounds, burst and stable windows, tolerance,
   delays, rate limits;
4. when the count changes, publishes ``block.autoscaled`` (inputs, proposal, rules, the policy's
   reason and its decision record) and then ``block.scale.target`` (source ``autoscaler``), which
   the controller reaches with scale / scale_down steps. A tick that changes nothing stores
   nothing. A tick whose policy raises, overruns or answers the wrong shape (or whose parameters
   are wrong) changes nothing either: it publishes ``block.autoscale.failed`` with the reason, at
   most once per ``AIOS_AUTOSCALE_FAILURE_RECORD_S`` per block unless the reason changes.

A Python policy call that overruns its time limit is stopped (its policy process killed and
replaced; with AIOS_PYTHON_POLICY_SANDBOX=thread it keeps its thread: Python cannot stop it): the
block's policy is then not called again for ``tick * 2^n`` from that failure (n consecutive
timeouts, at most 60 s), those ticks failing with the same reason, so a hung policy costs a time
limit (and a process, or a thread) a minute at most, not one per tick.

A target already asked for and not yet reached is not asked again for ``RETARGET_S`` (a controller
that cannot place more must not get a new event every tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from ..bus.catalog import E, Emit
from ..handlers import autoscale as a
from ..policies.runtime import PolicyRuntime, TrackingDict, stateless
from ..runtime.ticker import Ticker
from ..schemas.errors import PolicyFailed
from ..schemas.events import Autoscaled, AutoscaleFailed, ScaleTarget
from ..schemas.lifecycle import LIVE
from ..schemas.policy_io import AutoscaleInput, AutoscaleInstance, AutoscaleMetrics
from ..schemas.records import BlockIR, BlockSample, PolicyRule, wire
from ..state.autoscale import AutoscaleRead
from .base import Worker

log = structlog.get_logger("aios.autoscaler")

KIND = "autoscaler"
#: a target asked for and not reached is asked again after this long (a lost or refused target)
RETARGET_S = 60.0
#: blocks decided at once within one tick
CONCURRENCY = 64
_state_dec = msgspec.json.Decoder(a.State)


def owner(bid: str, copies: list[str]) -> str:
    """The copy a block belongs to (rendezvous hashing: the highest hash of block and copy; a copy
    that joins or leaves moves only its own share)."""
    if not copies:
        return ""
    return max(copies, key=lambda c: hashlib.blake2b(f"{c}|{bid}".encode(), digest_size=8).digest())


@dataclass
class TickResult:
    """What one tick did to one block (tests, ``bench/autoscale.py``)."""

    what: str  # changed | hold | failed | skipped
    outcome: a.Outcome | None = None
    reason: str = ""
    stored: bool = False


class Autoscaler:
    def __init__(self, w: Worker, cluster: str | None = None, holder: str | None = None):
        self.w, self.s = w, w.settings
        self.cluster = cluster
        self.holder = holder or f"autoscaler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # its own runtime: an autoscaler call's time limit is shorter than a placement's
        self.runtime = PolicyRuntime(lookup=w.store.policy_get, timeout_s=self.s.autoscale_policy_timeout_s,
                                     python_sandbox=self.s.python_policy_sandbox)
        self.defaults = a.Params.from_settings(self.s)
        self.irs: dict[str, tuple[int, BlockIR]] = {}
        self.held: list[str] = []
        self.ticks = 0
        self._sem = asyncio.Semaphore(CONCURRENCY)

    @property
    def lease_s(self) -> float:
        return max(3 * self.s.autoscale_tick_s, 1.0)

    @property
    def stale_s(self) -> float:
        """A block sample older than this is not acted on (the collector stopped, or lost its lease)."""
        return max(10 * self.s.metrics_interval_s, 3 * self.s.autoscale_tick_s)

    # -- one tick ---------------------------------------------------------------------------------
    async def tick(self, now: float | None = None) -> dict[str, TickResult]:
        """Decide every block this copy holds the lease of: its live blocks with an autoscaler
        policy, split among the copies."""
        now = time.time() if now is None else now
        begun = time.perf_counter()  # ``now``, on the clock a failure's time is read from
        samples, live = await self._live()
        candidates = [b for b in sorted(live) if b in self.irs and "autoscaler" in (self.irs[b][1].get("policies") or {})]
        held, handover = await self._lease(candidates, now)
        if not held:
            self.ticks += 1
            return {}
        store = self.w.store
        history = max(1, math.ceil(self.defaults.stable_window_s / self.s.metrics_interval_s))
        # the built-ins read no history: the block's window (most of the bytes) only for other policies
        windowed = {b for b in held if not stateless(str(self.irs[b][1]["policies"]["autoscaler"].get("policyRuleURI", "")))}
        data = await store.autoscale.read(held, history, windowed)

        async def one(bid: str) -> tuple[TickResult, a.State]:
            async with self._sem:
                return await self.decide(now, bid, live[bid], self.irs[bid][1], samples[bid], data[bid], begun)

        done = await asyncio.gather(*(one(b) for b in held), return_exceptions=True)
        out, states = _results(held, done)
        await store.autoscale.save(states, self.holder, 10 * self.defaults.stable_window_s + 600)
        if handover:
            await store.autoscale.release(handover, self.holder, leave=False)
            self.held = [b for b in held if b not in handover]
        self.ticks += 1
        return out

    async def _live(self) -> tuple[dict[str, BlockSample], dict[str, int]]:
        """The collector's block samples (this copy's cluster) and the live blocks among them
        (block -> gen), their IRs read once per generation (``self.irs``)."""
        store = self.w.store
        samples = await store.metrics.blocks()
        if self.cluster is not None:
            samples = {b: s for b, s in samples.items() if s.get("cluster") == self.cluster}
        heads = await store.autoscale.heads(sorted(samples))
        live = {bid: gen for bid, (status, gen) in heads.items() if status in LIVE}
        for bid in [b for b in self.irs if b not in live]:
            del self.irs[bid]
        for bid, gen in live.items():
            if self.irs.get(bid, (None, {}))[0] != gen:
                rec = await store.get_block(bid)
                if rec is None or int(rec.get("gen", -1)) != gen:
                    continue
                self.irs[bid] = (gen, rec.get("ir") or {})
        return samples, live

    async def _lease(self, candidates: list[str], now: float) -> tuple[list[str], list[str]]:
        """(blocks held this tick, those of them to hand over after it). Split among the live
        copies (rendezvous hashing): each takes the free leases of its share and keeps those it
        holds; a held block of another copy's share is decided this tick and then given back, so
        a copy that joins gets its share within a tick or two."""
        store = self.w.store
        copies = await store.autoscale.copies(self.holder, self.lease_s, now)
        mine = {b for b in candidates if owner(b, copies) == self.holder}
        was = set(self.held)
        held = await store.autoscale.lease([b for b in candidates if b in mine or b in was], self.holder, self.lease_s)
        self.held = held
        return held, [b for b in held if b not in mine]

    async def decide(self, now: float, bid: str, gen: int, ir: BlockIR, sample: BlockSample,
                     data: AutoscaleRead, begun: float | None = None) -> tuple[TickResult, a.State]:
        """One block's decision at ``now`` (the tick's time; ``begun``: ``time.perf_counter()`` then,
        so that a failure's own time is ``now`` plus what passed since, whatever the block waited
        for before its call: the tick's reads, the other blocks ahead of it in ``_sem``)."""
        state = _state_of(data.get("state"), gen)
        current = sum(1 for r in (data.get("instances") or {}).values() if r.get("status") != "removing")
        t = sample.get("t")
        if not isinstance(t, int | float) or now - float(t) > self.stale_s:
            state.latest = {"t": round(now, 3), "current": current, "skipped": "no fresh metrics"}
            return TickResult("skipped", reason="no fresh metrics"), state
        lo, hi = int(ir.get("minInstances", 0)), int(ir.get("maxInstances", 0))
        rule: PolicyRule = ir["policies"]["autoscaler"]
        insts: dict[str, AutoscaleInstance] = {
            iid: {"status": rec.get("status", ""), "node": rec.get("node", ""), **(data["samples"].get(iid) or {})}
            for iid, rec in sorted((data.get("instances") or {}).items()) if rec.get("status") != "removing"}
        block_metrics: AutoscaleMetrics = {**sample, "history": data.get("window") or []}
        input_data = a.policy_input(bid, insts, block_metrics, current, lo, hi, state)
        if now < state.backoff_until:  # its last call timed out: its thread may still be busy
            why = f"{state.failed_reason} (not called again for {state.backoff_until - now:.0f} s)"
            state.failed_quiet += 1
            state.latest = {"t": round(now, 3), "current": current, "failed": why}
            return TickResult("failed", None, why), state
        started = time.perf_counter()
        result: Any = None
        logs: list[list[str]] = []
        try:
            params = self.defaults.with_parameters(rule.get("parameters"))
            result, logs = await self._call(ir, rule, input_data)
            raw, reason = a.read_answer(result)
        except (PolicyFailed, a.BadParameters) as exc:
            why = f"autoscaler policy {rule.get('policyRuleURI', '?')} {exc.reason}" if isinstance(exc, PolicyFailed) else str(exc)
            if isinstance(exc, PolicyFailed) and exc.reason.startswith(("timed out", "loading timed out")):
                # from when it failed, not from the tick's start: loading it (a policy process
                # starting), the tick's reads and the blocks decided before it may have taken a while
                # (measured from its own call only, a loaded machine's next tick found the back-off
                # over and called the hung policy again)
                failed_at = now + time.perf_counter() - (started if begun is None else begun)
                state = a.timed_out(failed_at, state, self.s.autoscale_tick_s)
            return await self._failed(now, bid, gen, rule, input_data, why, current, state, time.perf_counter() - started, logs)
        seconds = time.perf_counter() - started
        state = a.recovered(state)
        outcome, state = a.decide(now, current, raw, lo, hi, params, state)
        latest: a.Latest = {"t": round(now, 3), "current": current, "raw": raw, "desired": outcome.desired, "stable": outcome.stable,
                  "burst": outcome.burst, "in_burst": outcome.in_burst, "rules": list(outcome.rules), "reason": reason}
        state.latest = latest
        if not outcome.changed or _waiting(now, current, outcome, state):
            return TickResult("hold", outcome, reason), state
        state.seq += 1
        request_id = f"as{state.seq}-{int(now * 1000)}"
        state.last[-1]["reason"] = reason
        state.last[-1]["request_id"] = request_id
        decision = await self.w.record(bid, KIND, wire(rule), wire(input_data), result, "", seconds, logs)
        ev = Autoscaled(bid, gen, request_id, current, outcome.desired, raw, list(outcome.rules), reason, outcome.stable,
                        outcome.burst, outcome.in_burst, a.summary(sample, insts), [decision])
        why = f"autoscaler: {current} -> {outcome.desired}" + (f" ({reason})" if reason else "")
        # published in this order on one connection (the stream keeps it), their acks awaited together
        await self.w.bus.emit_all([Emit(E.block_autoscaled, ev),
                                   Emit(E.block_scale_target, ScaleTarget(bid, request_id, outcome.desired, why, "autoscaler", gen))])
        log.info("autoscaler.scaled", block=bid, current=current, desired=outcome.desired, raw=raw, rules=list(outcome.rules))
        return TickResult("changed", outcome, reason, stored=True), state

    async def _call(self, ir: BlockIR, rule: PolicyRule, input_data: AutoscaleInput) -> tuple[Any, list[list[str]]]:
        rule_id = f"{ir['blockId']}.autoscaler"
        uri = str(rule.get("policyRuleURI", ""))
        ctx = TrackingDict({} if stateless(uri) else await self.w.store.context_load(rule_id))
        trace: dict[str, Any] = {}
        result = await self.runtime.invoke(wire(rule), rule_id, wire(input_data), ctx, trace)
        changed, deleted = ctx.changes()
        if changed or deleted:
            await self.w.store.context_save(rule_id, changed, deleted)
        return result, list(trace.get("logs") or [])

    async def _failed(self, now: float, bid: str, gen: int, rule: PolicyRule, input_data: AutoscaleInput, reason: str,
                      current: int, state: a.State, seconds: float, logs: list[list[str]]) -> tuple[TickResult, a.State]:
        quiet = state.failed_quiet
        store, state = a.failed(now, state, reason, self.s.autoscale_failure_record_s)
        state.latest = {"t": round(now, 3), "current": current, "failed": reason}
        if store:
            state.seq += 1
            request_id = f"asf{state.seq}-{int(now * 1000)}"
            decision = await self.w.record(bid, KIND, wire(rule), wire(input_data), None, reason, seconds, logs)
            await self.w.bus.emit(E.block_autoscale_failed, AutoscaleFailed(bid, gen, request_id, reason, current, quiet, [decision]))
            log.warning("autoscaler.tick_failed", block=bid, reason=reason)
        return TickResult("failed", None, reason, stored=store), state

    # -- the loop ---------------------------------------------------------------------------------
    async def loop(self, stop: asyncio.Event) -> None:
        await Ticker(self.s.autoscale_tick_s, "autoscaler.tick_failed_all", log).run(self.tick, stop)

    async def run(self, stop: asyncio.Event) -> None:
        log.info("autoscaler.started", holder=self.holder, tick_s=self.s.autoscale_tick_s, cluster=self.cluster or "all")
        try:
            await self.loop(stop)
        finally:
            with contextlib.suppress(Exception):  # a clean stop hands the blocks over at once
                await self.w.store.autoscale.release(self.held, self.holder)


def _state_of(raw: Any, gen: int) -> a.State:
    """The block's saved autoscaler state, if it is of this generation (else a fresh one)."""
    if raw:
        with contextlib.suppress(msgspec.MsgspecError):
            got = _state_dec.decode(raw)
            if got.gen == gen:
                return got
    return a.State(gen=gen)


def _waiting(now: float, current: int, outcome: a.Outcome, state: a.State) -> bool:
    """Asked for this very step a moment ago and the count has not moved yet: wait for the
    controller (the step just recorded is dropped)."""
    asked = state.last[-2] if len(state.last) >= 2 else None
    if not (asked and asked.get("to") == outcome.desired and asked.get("from") == current and now - float(asked["t"]) < RETARGET_S):
        return False
    state.last = state.last[:-1]
    state.latest["waiting"] = f"target {outcome.desired} asked {now - float(asked['t']):.0f} s ago"
    return True


def _results(held: list[str], done: list[Any]) -> tuple[dict[str, TickResult], dict[str, str]]:
    """Each block's result and state to save; a block whose decision raised (Redis or NATS
    trouble for it) is logged and decided again next tick."""
    states: dict[str, str] = {}
    out: dict[str, TickResult] = {}
    for bid, item in zip(held, done, strict=True):
        if isinstance(item, BaseException):
            log.warning("autoscaler.block_failed", block=bid, error=repr(item))
            continue
        res, st = item
        out[bid] = res
        states[bid] = msgspec.json.encode(st).decode()
    return out, states


async def run(w: Worker, stop: asyncio.Event, cluster: str | None = None) -> None:
    await Autoscaler(w, cluster).run(stop)
