"""The autoscaler's decision, without I/O (docs/autoscaling.md): the block's ``autoscaler`` policy
proposes a raw ``desired`` count each tick; the framework, not the policy, turns the proposals into
the block's instance target. One tick is :func:`decide` ``(now, current, proposal, bounds, params,
state) -> (Outcome, new state)``; the worker (``workers/autoscaler.py``) loads the state, calls it
and commits the effects (a stored ``block.autoscaled`` event and a ``block.scale.target``).

The rules, in the order they apply:

1. **bounds**: the proposal is clamped to ``[minInstances, maxInstances]`` and remembered with its
   time (the history spans the stable window);
2. **burst window** (Knative's panic window, 6 s): when the mean proposal of the last
   ``burstWindowS`` reaches ``burstThreshold`` (2) times the current count, the block is in a
   burst: it grows at once (no up delay) to that mean (or the stable one, whichever is higher).
   No scale-down until the burst condition has been false for a whole stable window; meanwhile
   it grows, without delay, to the mean proposal since the burst began when that is beyond the
   tolerance band (the mean of many samples: noise does not ratchet the count up);
3. **stable window** (Knative's stable window, 60 s): otherwise the candidate is the mean proposal
   over the last ``stableWindowS`` (a steady load that wobbles gives a steady mean);
4. **tolerance band**: a stable mean within ``tolerance`` (10 %) of the current count changes
   nothing (compared before rounding, as Kubernetes' HPA compares its usage ratio); a block
   shrinks only to ``ceil(mean * (1 + tolerance))``, keeping the band as headroom, so a count at
   the band's edge is not taken down to come back up;
5. **up / down delay**: a change must be wanted on every tick for ``upscaleDelayS`` (2 s) to grow or
   ``downscaleDelayS`` (30 s) to shrink; a tick wanting the other way (or nothing) restarts the
   wait. Once it has held, each further tick in the same direction may act at once;
6. **rate limits**: one step grows at most to ``ceil(current * maxUpFactor)`` (at least +1) and
   shrinks at most to ``floor(current / maxDownFactor)`` (at least -1);
7. the result is clamped to the bounds again (a block outside them after a spec change comes back).

Every rule that changed or held the value is named in :attr:`Outcome.rules`, so a stored decision
says why a block grew or shrank, and why it did not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

import msgspec

from ..schemas.policy_io import (
    AutoscaleAnswer,
    AutoscaleInput,
    AutoscaleInstance,
    AutoscaleMetrics,
    LastDecision,
)
from ..schemas.records import JSONObject

#: per-block overrides read from the autoscaler rule's ``parameters`` -> field of :class:`Params`
PARAMETERS = {
    "tolerance": "tolerance",
    "upscaleDelayS": "upscale_delay_s",
    "downscaleDelayS": "downscale_delay_s",
    "stableWindowS": "stable_window_s",
    "burstWindowS": "burst_window_s",
    "burstThreshold": "burst_threshold",
    "maxUpFactor": "max_up_factor",
    "maxDownFactor": "max_down_factor",
}
#: decisions kept in the state and given to the policy as ``last_decisions``
LAST_DECISIONS = 5
_EPS = 1e-9


class BadParameters(ValueError):
    """An autoscaler rule parameter that cannot be used (the tick fails with this reason)."""


@dataclass(frozen=True)
class Params:
    tolerance: float = 0.1
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0
    stable_window_s: float = 60.0
    burst_window_s: float = 6.0
    burst_threshold: float = 2.0
    max_up_factor: float = 4.0
    max_down_factor: float = 2.0

    @classmethod
    def from_settings(cls, s: Any) -> Params:
        return cls(s.autoscale_tolerance, s.autoscale_upscale_delay_s, s.autoscale_downscale_delay_s, s.autoscale_stable_window_s,
                   s.autoscale_burst_window_s, s.autoscale_burst_threshold, s.autoscale_max_up_factor, s.autoscale_max_down_factor)

    def with_parameters(self, parameters: JSONObject | None) -> Params:
        """These defaults overridden by a rule's ``parameters`` (unknown keys are the policy's own)."""
        changes: dict[str, float] = {}
        for key, attr in PARAMETERS.items():
            if parameters and key in parameters:
                v = parameters[key]
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                    raise BadParameters(f"autoscaler parameter {key} must be a number, got {v!r}")
                changes[attr] = float(v)
        p = replace(self, **changes) if changes else self
        p.check()
        return p

    def check(self) -> None:
        problems = []
        if not 0 <= self.tolerance < 1:
            problems.append(f"tolerance must be in [0, 1), got {self.tolerance:g}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name):g}")
        if self.stable_window_s <= 0 or self.burst_window_s <= 0:
            problems.append("stable and burst windows must be > 0")
        elif self.burst_window_s > self.stable_window_s:
            problems.append(f"burst window ({self.burst_window_s:g} s) must not exceed the stable window ({self.stable_window_s:g} s)")
        if self.burst_threshold <= 1:
            problems.append(f"burstThreshold must be > 1, got {self.burst_threshold:g}")
        if self.max_up_factor <= 1 or self.max_down_factor <= 1:
            problems.append("maxUpFactor and maxDownFactor must be > 1")
        if problems:
            raise BadParameters("bad autoscaler parameters: " + "; ".join(problems))


class Latest(TypedDict, total=False):
    """An autoscaler's latest tick as its state keeps it (``State.latest``; ``blocks top`` shows it):
    skipped, failed, or what it decided (its proposal, the framework's rules, the policy's reason)."""

    t: float
    current: int
    skipped: str
    failed: str
    #: a step asked a moment ago that the count has not reached yet (``workers.autoscaler``)
    waiting: str
    raw: float
    desired: int
    stable: float
    burst: float
    in_burst: bool
    rules: list[str]
    reason: str


class State(msgspec.Struct, omit_defaults=True):
    """What the framework remembers of one block between ticks (kept in Redis by the lease holder;
    a copy taking the lease over continues from it)."""

    gen: int = 0
    #: [time, clamped proposal], oldest first, spanning the stable window
    history: list[tuple[float, float]] = []
    #: since when the ticks have wanted to grow / shrink (None: not now)
    up_since: float | None = None
    down_since: float | None = None
    #: the block is in a burst until then (no scale-down), which began then
    burst_until: float = 0.0
    burst_since: float = 0.0
    #: decisions stored so far (request ids and message ids count with it)
    seq: int = 0
    #: the last applied decisions, newest last: {"t", "from", "to", "reason"}
    last: list[LastDecision] = []
    #: failed ticks: when one was last stored, its reason, and how many were not stored since
    failed_at: float = 0.0
    failed_reason: str = ""
    failed_quiet: int = 0
    #: consecutive timed-out calls, and until when the policy is not called again (its thread
    #: may still be busy: a hung Python policy must not take a new thread every tick)
    timeouts: int = 0
    backoff_until: float = 0.0
    #: the latest tick, whatever it did (``blocks top`` / explain may show it; never an event)
    latest: Latest = {}


@dataclass(frozen=True)
class Outcome:
    current: int
    #: the policy's proposal as given, and clamped to the bounds
    raw: float
    proposal: float
    #: the count the block should have after this tick (== current when nothing changes)
    desired: int
    stable: float
    burst: float
    in_burst: bool
    rules: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


def _mean(history: list[tuple[float, float]], since: float) -> float | None:
    vals = [v for t, v in history if t >= since - _EPS]
    return sum(vals) / len(vals) if vals else None


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def decide(now: float, current: int, raw: float, lo: int, hi: int, p: Params, state: State) -> tuple[Outcome, State]:
    """One tick of one block. ``current``: the instances it has now (starting or running);
    ``raw``: the policy's ``desired``; ``lo``/``hi``: minInstances/maxInstances."""
    rules: list[str] = []
    proposal = min(max(float(raw), float(lo)), float(hi))
    if proposal != raw:
        rules.append(f"bounds: proposal {raw:g} clamped to {proposal:g} (min {lo}, max {hi})")
    keep = max(p.stable_window_s, p.burst_window_s)
    history = [(t, v) for t, v in state.history if t > now - keep - _EPS and t <= now] + [(now, proposal)]
    stable = _mean(history, now - p.stable_window_s)
    burst = _mean(history, now - p.burst_window_s)
    assert stable is not None and burst is not None  # both hold ``now``

    # -- burst window: grow at once, never shrink ------------------------------------------------------
    burst_now = burst >= p.burst_threshold * current - _EPS if current > 0 else burst > _EPS
    was_burst = now < state.burst_until
    burst_until = now + p.stable_window_s if burst_now else state.burst_until
    in_burst = burst_now or now < burst_until
    burst_since = (now if not was_burst else state.burst_since) if burst_now else state.burst_since
    up_since, down_since = state.up_since, state.down_since
    if burst_now:
        target = max(current, _ceil(max(burst, stable)))
        rules.append(f"burst: mean proposal {burst:.2f} over {p.burst_window_s:g} s >= {p.burst_threshold:g} x {current}: "
                     "no up delay, no scale-down")
        up_since = down_since = None
    elif in_burst and (since := _mean(history, burst_since)) is not None and _ceil(since) > current \
            and since - current > p.tolerance * max(current, 1) + _EPS:
        # after the burst's first ticks: grow to the mean since it began (many samples: no ratchet on noise)
        target = _ceil(since)
        rules.append(f"burst held for {burst_until - now:.0f} s more: mean proposal since it began {since:.2f}, no up delay")
        up_since = down_since = None
    else:
        target, up_since, down_since = _stable_step(now, current, lo, stable, p, (in_burst, burst_until), (up_since, down_since), rules)

    target = _limited(target, current, lo, hi, p, rules)
    out = Outcome(current, float(raw), proposal, target, round(stable, 4), round(burst, 4), in_burst, tuple(rules))
    new = msgspec.structs.replace(state, history=history, up_since=up_since, down_since=down_since, burst_until=burst_until,
                                  burst_since=burst_since)
    if out.changed:  # a step was taken: the next one waits its own delay unless the intent goes on
        step: LastDecision = {"t": round(now, 3), "from": current, "to": target}
        new.last = [*state.last, step][-LAST_DECISIONS:]
    return out, new


def _stable_step(
    now: float, current: int, lo: int, stable: float, p: Params, burst: tuple[bool, float],
    since: tuple[float | None, float | None], rules: list[str],
) -> tuple[int, float | None, float | None]:
    """Out of a burst: the stable window's mean, the tolerance band and the up/down delays.
    ``burst``: (in a burst's hold, until when); ``since``: (wanted up since, wanted down since).
    Returns (target, up since, down since)."""
    in_burst, burst_until = burst
    up_since, down_since = since
    band = p.tolerance * max(current, 1)
    # growing: to the mean; shrinking: to the mean plus the band's headroom (hysteresis: a count
    # at the band's edge does not go down and come back up)
    target = _ceil(stable) if stable >= current or stable <= lo + _EPS else _ceil(stable * (1 + p.tolerance))
    if abs(stable - current) <= band + _EPS or target == current:
        if _ceil(stable) != current:
            rules.append(f"tolerance: stable mean {stable:.2f} within {p.tolerance:.0%} of {current}")
        return current, None, None
    if target > current:
        up_since = now if up_since is None else up_since
        return _delayed(target, current, now - up_since, p.upscale_delay_s, "upscale", rules), up_since, None
    if in_burst:  # the burst is over, its hold is not: no scale-down yet
        rules.append(f"burst held for {burst_until - now:.0f} s more: no scale-down to {target}")
        return current, None, None
    down_since = now if down_since is None else down_since
    return _delayed(target, current, now - down_since, p.downscale_delay_s, "downscale", rules), None, down_since


def _delayed(target: int, current: int, held: float, delay_s: float, what: str, rules: list[str]) -> int:
    """``target`` once it has been wanted for ``delay_s``, else ``current``."""
    if held + _EPS < delay_s:
        rules.append(f"{what} delay: {target} wanted for {held:.1f} of {delay_s:g} s")
        return current
    if delay_s > 0:
        rules.append(f"{what} delay: {target} wanted for {held:.1f} s (>= {delay_s:g} s)")
    return target


def _limited(target: int, current: int, lo: int, hi: int, p: Params, rules: list[str]) -> int:
    """The rate limits of one step (x maxUpFactor, / maxDownFactor), then the block's bounds."""
    if target > current:
        limit = max(current + 1, math.ceil(current * p.max_up_factor - _EPS))
        if target > limit:
            rules.append(f"rate limit up: {target} -> {limit} (x{p.max_up_factor:g} per step)")
            target = limit
    elif target < current:
        limit = min(current - 1, math.floor(current / p.max_down_factor + _EPS))
        if target < limit:
            rules.append(f"rate limit down: {target} -> {limit} (/{p.max_down_factor:g} per step)")
            target = limit
    bounded = min(max(target, lo), hi)
    if bounded != target:
        rules.append(f"bounds: {target} -> {bounded}")
    return bounded


def failed(now: float, state: State, reason: str, every_s: float) -> tuple[bool, State]:
    """A tick whose policy failed: the count stays; returns (store this failure now, new state).
    A failure is stored when its reason differs from the last stored one or ``every_s`` has passed
    (a broken policy must not flood the stream); the ticks in between are counted."""
    store = reason != state.failed_reason or now - state.failed_at >= every_s
    if store:
        return True, msgspec.structs.replace(state, failed_at=now, failed_reason=reason, failed_quiet=0)
    return False, msgspec.structs.replace(state, failed_quiet=state.failed_quiet + 1)


def timed_out(now: float, state: State, tick_s: float, cap_s: float = 60.0) -> State:
    """A call that overran its time limit: the next call waits ``tick * 2^n`` (n consecutive
    timeouts, at most ``cap_s``), since a Python call that never returns keeps its thread."""
    n = state.timeouts + 1
    return msgspec.structs.replace(state, timeouts=n, backoff_until=now + min(cap_s, tick_s * 2 ** n))


def recovered(state: State) -> State:
    """A tick that worked after failures: the next failure is stored whatever its reason."""
    if not state.failed_reason and not state.timeouts:
        return state
    return msgspec.structs.replace(state, failed_reason="", failed_quiet=0, timeouts=0, backoff_until=0.0)


# -- the policy's input and answer -------------------------------------------------------------------
def policy_input(bid: str, instances: dict[str, AutoscaleInstance], block_metrics: AutoscaleMetrics, current: int, lo: int,
                 hi: int, state: State) -> AutoscaleInput:
    """The ``autoscale`` call's input (docs/policies.md)."""
    return {"action": "autoscale", "payload": {
        "block": bid, "instances": instances, "block_metrics": block_metrics, "current": current, "min": lo, "max": hi,
        "last_decisions": list(state.last),
    }}


def read_answer(result: AutoscaleAnswer) -> tuple[float, str]:
    """(desired, reason) of a policy answer already checked by ``policies.contract``."""
    return float(result["desired"]), str(result.get("reason") or "")


def summary(block_metrics: Mapping[str, object], instances: dict[str, AutoscaleInstance]) -> dict[str, object]:
    """The inputs that matter, small enough for every stored decision (the whole input is in the
    decision record, by digest when large)."""
    keys = ("t", "instances", "ready", "inflight", "queue", "running", "waiting", "rate", "latency_mean_ms", "dispatch_p99_ms",
            "rejected_rate")
    out = {k: block_metrics.get(k) for k in keys if k in block_metrics}
    out["per_instance_inflight"] = {iid: s.get("inflight") for iid, s in sorted(instances.items())[:32]}
    return out
