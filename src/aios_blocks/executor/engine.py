"""The executor's routing and admission engine: no I/O, so every rule is unit-tested.

One :class:`Route` per block holds its instances as the executor sees them (the mapper's map plus
this executor's own in-flight counts and the latest metrics), the block's loadBalancer policy
(:class:`Chooser`) and a bounded FIFO of tasks waiting for a free slot:

* a task is admitted to an instance that is ``ready`` and has fewer than ``maxOngoing`` tasks in
  flight (Ray Serve's ``max_ongoing_requests``); among those, the policy picks;
* with none free, the task waits in the block's queue (at most ``queueSize`` tasks, at most
  ``queue_timeout_s``); with the queue full, it is refused at once: 503 "overloaded, retry after
  N ms", N estimated from the queue length, the block's recent service time and its capacity;
* an instance leaving ``ready`` (``draining``) gets no new task; its tasks in flight finish, since
  the engine never cancels a dispatch;
* an instance whose dispatch failed at the transport is ejected from this route for a while
  (``executor.outlier``), and one the health checker marked ``unready`` gets no task; both stay
  live (tasks wait for them rather than being refused); ``weight`` and ``health`` from the map
  are in each candidate for the policy (docs/health.md);
* an instance its node's agent has not confirmed since it last started (the map's ``boots``:
  ``handlers.mapper``) gets no task either: it is live (tasks wait), and is either confirmed
  again or removed as lost (docs/executor.md "Agent restarts");
* a policy that raises, overruns its time limit or answers with something other than one of the
  given instances fails that task with a clear reason (:class:`Refused` 500); the executor and the
  other tasks go on;
* **activator** (scale-to-zero, a block of ``minInstances`` 0): with no ready instance, a task is
  *held* instead of refused (at most ``max_held`` per block: then 429; at most ``hold_s``: then
  503 with the reason), the route asks once per hold period for one instance (``on_activate``:
  the executor publishes ``block.scale.target`` with target 1), and the held tasks go, in order,
  as soon as a map with a ready instance is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..policies import contract
from ..schemas.lifecycle import InstanceState as InstanceState
from ..schemas.policy_io import RouteInput
from ..schemas.records import InstanceSample, JSONObject, MapEntry, RouteView, TaskInfo
from .outlier import Outliers
from .stats import Reject, RouteStats

#: view states that count as live: a task waits for them rather than being refused at once
LIVE = (InstanceState.READY, InstanceState.STARTING, InstanceState.EJECTED, InstanceState.UNREADY,
        InstanceState.UNCONFIRMED)


def confirmed(rec: MapEntry, boots: Mapping[str, str] | None) -> bool:
    """The map's instance was reported (``added``, ``node.inventory``) by its node's latest agent
    run, the map's ``boots``. No boot known for its node (maps written before boots): confirmed."""
    latest = (boots or {}).get(rec.get("node", ""))
    return not latest or rec.get("boot") == latest


class Refused(Exception):
    """A task the executor answers itself: ``status`` (HTTP-like), ``reason``, and for overload
    ``retry_after_ms``."""

    def __init__(self, status: int, reason: str, retry_after_ms: int | None = None):
        super().__init__(reason)
        self.status, self.reason, self.retry_after_ms = status, reason, retry_after_ms


class PolicyError(Exception):
    pass


class _Overrun(BaseException):
    """Raised into policy code by the inline time limit (a BaseException: a policy's own
    ``except Exception`` cannot swallow it)."""


_guard_active = False


def _on_alarm(signum: int, frame: Any) -> None:
    if _guard_active:
        raise _Overrun()


#: the wall-clock limit of an inline call is this many times its CPU limit (at least WALL_FLOOR_S)
WALL_FACTOR = 10
WALL_FLOOR_S = 0.05


@contextlib.contextmanager
def inline_deadline(seconds: float) -> Iterator[None]:
    """A time limit on synchronous Python code run inline (on the event loop's thread), enforced
    by signals between bytecodes: ``seconds`` of CPU time (``ITIMER_VIRTUAL``: a process that is
    merely preempted on a busy machine does not use up its budget), and ``WALL_FACTOR`` times that
    in wall-clock time (``ITIMER_REAL``: code that sleeps or waits). Only on the main thread;
    elsewhere, and for code stuck inside one C call, there is no limit. Another SIGALRM handler (a
    test runner's timeout) is put back afterwards."""
    global _guard_active
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = []
    for sig in (signal.SIGVTALRM, signal.SIGALRM):
        if signal.getsignal(sig) is not _on_alarm:
            prev.append((sig, signal.signal(sig, _on_alarm)))
    _guard_active = True
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    started = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds * WALL_FACTOR, WALL_FLOOR_S))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        _guard_active = False
        for sig, handler in prev:
            if handler is not None:
                signal.signal(sig, handler)
        if outer > 0:  # someone else's alarm (a test runner's timeout) goes on
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - started)))


class Chooser:
    """Picks one instance id among candidates (all ``ready`` and under their limit)."""

    name = "?"

    def choose(self, bid: str, task: TaskInfo, candidates: list[RouteView]) -> str:
        raise NotImplementedError


class InlinePolicy(Chooser):
    """A seed-shaped policy object called once per task with ``action: "route"``. Built-ins are
    trusted and called as they are; other Python policies run under ``time_limit_s``."""

    def __init__(self, policy: Any, name: str, parameters: JSONObject | None = None,
                 time_limit_s: float = 0.0, context: JSONObject | None = None):
        self.policy, self.name = policy, name
        self.parameters = parameters or {}
        self.time_limit_s = time_limit_s
        self.context = context if context is not None else {}

    def choose(self, bid: str, task: TaskInfo, candidates: list[RouteView]) -> str:
        input_data: RouteInput = {"action": "route", "payload": {"block": bid, "task": task, "instances": candidates}}
        try:
            if self.time_limit_s > 0:
                with inline_deadline(self.time_limit_s):
                    result = self.policy.eval(self.parameters, input_data, self.context)
            else:
                result = self.policy.eval(self.parameters, input_data, self.context)
        except _Overrun:
            raise PolicyError(f"loadBalancer policy {self.name} timed out after {self.time_limit_s * 1000:g} ms")
        except Exception as exc:
            raise PolicyError(f"loadBalancer policy {self.name} raised {type(exc).__name__}: {exc}")
        except BaseException as exc:  # SystemExit & co: never out of the executor
            raise PolicyError(f"loadBalancer policy {self.name} raised {type(exc).__name__}: {exc}")
        try:
            contract.check("route", result)
        except Exception as exc:
            raise PolicyError(f"loadBalancer policy {self.name}: wrong return shape: {exc}")
        return str(result["instance_id"])  # the route checks it is one of the candidates (O(1))


class Weighted(Chooser):
    """Weighted random choice by weights a (Starlark) policy computes periodically, never per
    task. An instance without a weight gets the mean of the others (new instances take work at
    once); all weights zero: uniform."""

    def __init__(self, name: str):
        self.name = name
        self.weights: dict[str, float] = {}
        self.error = ""
        self._rand = random.Random()

    def set(self, weights: dict[str, float]) -> None:
        self.weights = {k: float(v) for k, v in weights.items()}

    def choose(self, bid: str, task: TaskInfo, candidates: list[RouteView]) -> str:
        known = [self.weights[c["id"]] for c in candidates if c["id"] in self.weights]
        mean = (sum(known) / len(known)) if known else 1.0
        ws = [self.weights.get(c["id"], mean) for c in candidates]
        total = sum(ws)
        if total <= 0:
            return str(self._rand.choice(candidates)["id"])
        x = self._rand.random() * total
        for c, w in zip(candidates, ws, strict=True):
            x -= w
            if x < 0:
                return str(c["id"])
        return str(candidates[-1]["id"])


@dataclass
class Limits:
    max_ongoing: int = 100
    queue_size: int = 1000
    queue_timeout_s: float = 10.0
    #: scale-to-zero blocks: how long a task is held while the first instance starts, and how many
    hold_s: float = 30.0
    max_held: int = 1000


@dataclass
class Route:
    """One block as one executor routes it."""

    block_id: str
    chooser: Chooser
    limits: Limits = field(default_factory=Limits)
    #: the map this route was built from (mapper revision), its generation and input path
    version: int = 0
    gen: int = 0
    path: str = "/infer"
    method: str = "POST"
    #: the block's tenant (its map's ``tenant``; None: the default tenant's): whose users may send it
    #: tasks over HTTP (``executor.task_auth``)
    tenant: str | None = None
    rule: dict[str, Any] = field(default_factory=dict)
    views: dict[str, RouteView] = field(default_factory=dict)
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)
    #: recent service time (EWMA, seconds): the retry-after estimate
    ewma_s: float = 0.01
    #: counters (the executor's metrics)
    dispatched: int = 0
    rejected: int = 0
    retried: int = 0
    policy_errors: int = 0
    policy_s: float = 0.0
    #: the figures exported for Prometheus and the metrics collector (``executor.stats``)
    stats: RouteStats = field(default_factory=RouteStats)
    _ready: list[RouteView] = field(default_factory=list)
    #: ready instances at their in-flight limit (0: every ready instance is a candidate)
    _full: int = 0
    #: the instances' metrics by source (their union is each view's ``metrics``)
    _scraped: dict[str, dict[str, float]] = field(default_factory=dict)
    _collected: dict[str, InstanceSample] = field(default_factory=dict)
    #: passive health: per-instance outcomes and local ejections (``executor.outlier``)
    outliers: Outliers = field(default_factory=Outliers)
    #: the block may run no instance at all (its ``minInstances`` is 0): tasks that find no ready
    #: instance are held while one starts (the activator) instead of refused
    scale_to_zero: bool = False
    #: called (synchronously, with the route) when held tasks need an instance: at most once per
    #: ``hold_s`` while none is ready, and again after one was ready
    on_activate: Callable[[Route], None] | None = None
    #: tasks held now (waiting for a first ready instance)
    held: int = 0
    #: loop time of the last activation (None: none since an instance was last ready)
    activated_at: float | None = None
    #: activations asked for (figures)
    activations: int = 0
    #: a route replaced (a new generation) or deleted: its held tasks are answered at once
    closed: bool = False
    #: the one timer that ends the next ejection (and when it fires)
    _timer: asyncio.TimerHandle | None = None
    _timer_at: float = 0.0

    # -- the instance map ----------------------------------------------------------------------
    def apply(self, instances: Mapping[str, MapEntry], version: int, gen: int | None = None,
              boots: Mapping[str, str] | None = None) -> None:
        """Take a new map (mapper's ``instances`` and ``boots``): views keep their in-flight counts
        and metrics."""
        self.version = version
        if gen is not None:
            self.gen = gen
        old = self.views
        new: dict[str, RouteView] = {}
        for iid, rec in instances.items():
            v: RouteView | None = old.get(iid)
            if v is None:
                v = {"id": iid, "inflight": 0, "metrics": {}}
            v["node"] = rec.get("node", "")
            v["endpoint"] = rec.get("endpoint", "")
            v["map_state"] = rec.get("state", InstanceState.STARTING)
            v["health"] = rec.get("health", "ok")
            v["weight"] = float(rec.get("weight", 1.0))
            v["confirmed"] = confirmed(rec, boots)
            v["max_ongoing"] = self.limits.max_ongoing
            new[iid] = v
        for iid, v in old.items():  # gone from the map: no new task; in-flight ones finish
            if iid not in new:
                v["state"] = v["map_state"] = InstanceState.STOPPING
        self.views = new
        self.stats.keep(new)
        self.outliers.keep(new)
        for src in (self._scraped, self._collected):
            for iid in [i for i in src if i not in new]:
                del src[iid]
        self._rebuild()

    def _rebuild(self) -> None:
        """Each view's routing state (the map's, less this executor's ejections and the health
        checker's ``unready``) and the list of instances that may take a task."""
        for iid, v in self.views.items():
            st = v.get("map_state", v.get("state", InstanceState.STARTING))
            if st == InstanceState.READY:
                if not v.get("confirmed", True):
                    st = InstanceState.UNCONFIRMED
                elif v.get("health") == "unready":
                    st = InstanceState.UNREADY
                elif iid in self.outliers.ejected:
                    st = InstanceState.EJECTED
            v["state"] = st
        self._ready = [v for v in self.views.values() if v["state"] == InstanceState.READY and v["endpoint"]]
        self._full = sum(1 for v in self._ready if v["inflight"] >= self.limits.max_ongoing)
        if self._ready:
            self.activated_at = None  # the next time the block is at zero asks again
        self._wake(len(self.waiting))

    def record(self, v: RouteView, outcome: str, error: str = "", seconds: float | None = None) -> float:
        """One dispatch's outcome at ``v`` (``executor.outlier``): a transport failure (or too
        many 5xx in a row) ejects the instance from this executor's routing at once, until its
        ejection time ends. Returns the ejection time (0: not ejected)."""
        iid = v["id"]
        if iid not in self.views:
            return 0.0
        out = self.outliers.record(iid, outcome, len(self.views), error=error, seconds=seconds)
        if out > 0:
            self._rebuild()
            self._arm()
        return out

    def _arm(self) -> None:
        """One timer per route, for the ejection that ends first."""
        if not self.outliers.ejected:
            return
        nxt = min(self.outliers.ejected.values())
        if self._timer is not None and self._timer_at <= nxt:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test): ends at the next change
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = nxt
        self._timer = loop.call_later(max(0.0, nxt - time.monotonic()) + 0.002, self._unexpire)

    def _unexpire(self) -> None:
        # a timer may fire a little early (the loop's clock resolution): a few ms of slack, and
        # the next ejection's timer armed again whatever happened
        self._timer = None
        if self.outliers.expire(time.monotonic() + 0.005):
            self._rebuild()
        self._arm()

    def close(self, version: int) -> None:
        """This route is replaced (a new generation) or its block deleted: no instance, and held
        tasks are answered now rather than at their deadline."""
        self.closed = True
        self.apply({}, version)

    def holding(self) -> bool:
        """Tasks are held rather than refused or queued: a scale-to-zero block with no ready
        instance (starting ones are not ready yet)."""
        return self.scale_to_zero and not self._ready and not self.closed

    def _activate(self, now: float) -> None:
        if self.activated_at is not None and now - self.activated_at < self.limits.hold_s:
            return
        self.activated_at = now
        self.activations += 1
        if self.on_activate is not None:
            try:
                self.on_activate(self)
            except Exception:  # the hook only schedules a publish; a failure there is not the task's
                pass

    def set_metrics(self, iid: str, metrics: dict[str, float]) -> None:
        """The engine's queue figures as this executor just scraped them (builtin:least-queue):
        they win over the collector's older ones of the same name."""
        v = self.views.get(iid)
        if v is not None:
            self._scraped[iid] = metrics
            v["metrics"] = {**self._collected.get(iid, {}), **metrics}

    def set_collected(self, iid: str, sample: InstanceSample) -> None:
        """The metrics collector's latest sample of the instance (docs/metrics.md)."""
        v = self.views.get(iid)
        if v is not None:
            self._collected[iid] = sample
            v["metrics"] = {**sample, **self._scraped.get(iid, {})}

    def live(self) -> int:
        return sum(1 for v in self.views.values() if v["state"] in LIVE)

    # -- admission ----------------------------------------------------------------------------
    def candidates(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[RouteView]:
        """Instances that may take a task now. With none at its limit and nothing excluded this
        is the route's own list (no copy: policies must not change it; custom ones get a copy)."""
        if not self._full and not exclude:
            return self._ready
        cap = self.limits.max_ongoing
        return [v for v in self._ready if v["inflight"] < cap and v["id"] not in exclude]

    def retry_after_ms(self) -> int:
        capacity = max(1, len(self._ready) * self.limits.max_ongoing)
        est = (len(self.waiting) + 1) * self.ewma_s / capacity * 1000
        return int(min(5000, max(5, math.ceil(est))))

    def try_pick(self, task: TaskInfo, exclude: frozenset[str] | set[str] = frozenset()) -> RouteView | None:
        """The instance for this task now (its in-flight count taken), or None when none is free.
        Raises :class:`Refused` (500) when the policy fails."""
        cands = self.candidates(exclude)
        if not cands:
            return None
        builtin = isinstance(self.chooser, InlinePolicy) and self.chooser.name.startswith("builtin:")
        if len(cands) == 1 and builtin:
            v = cands[0]  # a built-in has nothing to decide
        else:
            t0 = time.perf_counter()
            try:
                iid = self.chooser.choose(self.block_id, task, cands if builtin else list(cands))
            except PolicyError as exc:
                self.policy_errors += 1
                self.stats.rejected[Reject.POLICY_ERROR] += 1
                raise Refused(500, str(exc))
            finally:
                dt = time.perf_counter() - t0
                self.policy_s += dt
                self.stats.policy.observe(dt)
            v = self.views.get(iid)  # type: ignore[assignment]
            if (v is None or v["state"] != InstanceState.READY or not v["endpoint"] or iid in exclude
                    or v["inflight"] >= self.limits.max_ongoing):
                self.policy_errors += 1
                self.stats.rejected[Reject.POLICY_ERROR] += 1
                raise Refused(500, f"loadBalancer policy {self.chooser.name} chose {iid!r}, which is not one of the "
                                   f"{len(cands)} instances it was given")
        v["inflight"] += 1
        if v["inflight"] == self.limits.max_ongoing and v["state"] == InstanceState.READY and v["endpoint"]:
            self._full += 1
        self.dispatched += 1
        return v

    async def acquire(self, task: TaskInfo, exclude: frozenset[str] | set[str] = frozenset(),
                      deadline: float | None = None) -> RouteView:
        """An instance for the task, waiting in the block's queue while none is free (at most
        ``queue_timeout_s``) or, for a scale-to-zero block with no ready instance, held while one
        starts (at most ``hold_s``). ``deadline`` (loop time): the task's own limit on both."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        task_end = deadline if deadline is not None else math.inf
        first = True
        held_since: float | None = None
        try:
            while True:
                # FIFO: a newcomer does not overtake the queue; a woken task tries first
                if not first or not self.waiting or exclude:
                    v = self.try_pick(task, exclude)
                    if v is not None:
                        self.stats.queue_wait.observe(loop.time() - start)
                        return v
                first = False
                now = loop.time()
                if self.holding():
                    if held_since is None:
                        held_since = self._hold(now)
                    end = self._hold_end(held_since, task_end, now)
                    self._activate(now)
                    await self._wait(loop, end - now)
                    continue
                if held_since is not None:  # an instance is ready: from now on a task of the queue
                    self.held -= 1
                    held_since, start = None, now
                await self._wait(loop, self._queue_wait(exclude, start, task_end, now))
        finally:
            if held_since is not None:
                self.held -= 1

    def _refuse(self, why: Reject, status: int, reason: str, retry_after_ms: int | None = None) -> Refused:
        """A task refused (counted by why), to raise."""
        self.rejected += 1
        self.stats.rejected[why] += 1
        return Refused(status, reason, retry_after_ms)

    def _hold(self, now: float) -> float:
        """A task held while the block starts from zero: when its hold began (refused if too many)."""
        if self.held >= self.limits.max_held:
            ms = 1000
            raise self._refuse(Reject.HOLD_FULL, 429, f"block {self.block_id} is starting from zero instances and already holds "
                                                      f"{self.held} tasks (the most it holds), retry after {ms} ms", ms)
        self.held += 1
        return now

    def _hold_end(self, held_since: float, task_end: float, now: float) -> float:
        """When a held task's wait ends (refused when it has)."""
        end = min(task_end, held_since + self.limits.hold_s)
        if end - now <= 0:
            why = (f"within the task's time limit ({(task_end - held_since) * 1000:g} ms)" if task_end < held_since + self.limits.hold_s
                   else f"within {self.limits.hold_s:g} s (activator_hold_s)")
            raise self._refuse(Reject.HOLD_TIMEOUT, 503, f"block {self.block_id} is scaled to zero and no instance became ready {why}", 1000)
        return end

    def _queue_wait(self, exclude: frozenset[str] | set[str], start: float, task_end: float, now: float) -> float:
        """How long a task may wait in the queue now; refused when the block has no instance left,
        the queue is full, or its wait has ended."""
        if self.closed and self.scale_to_zero:
            raise self._refuse(Reject.NO_INSTANCE, 503, f"block {self.block_id} was redeployed or deleted while the task waited", 1000)
        if self.live() - sum(1 for i in exclude if i in self.views) <= 0:
            raise self._refuse(Reject.NO_INSTANCE, 503, f"block {self.block_id} has no ready instance", 1000)
        if len(self.waiting) >= self.limits.queue_size:
            ms = self.retry_after_ms()
            raise self._refuse(Reject.OVERLOADED, 503,
                               f"block {self.block_id} overloaded ({len(self.waiting)} tasks queued), retry after {ms} ms", ms)
        remaining = min(task_end, start + self.limits.queue_timeout_s) - now
        if remaining <= 0:
            # say which limit ended the wait: the task's own (Aios-Timeout-Ms) or the queue's
            why = ("within the task's time limit" if task_end < start + self.limits.queue_timeout_s
                   else f"within {self.limits.queue_timeout_s:g} s (queueTimeoutS)")
            raise self._refuse(Reject.QUEUE_TIMEOUT, 503, f"block {self.block_id}: no instance free {why}", self.retry_after_ms())
        return remaining

    async def _wait(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Wait in the block's FIFO until woken (a slot freed, a map applied) or ``timeout``."""
        fut: asyncio.Future[None] = loop.create_future()
        self.waiting.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            pass
        finally:
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):
                self.waiting.remove(fut)

    def release(self, v: RouteView, seconds: float | None = None, ok: bool | None = None) -> None:
        """The task at ``v`` is done (``ok``: the instance answered below 500; None: not known,
        e.g. a test's own release)."""
        if v["inflight"] == self.limits.max_ongoing and v["state"] == InstanceState.READY and v["endpoint"]:
            self._full -= 1
        v["inflight"] -= 1
        if seconds is not None:
            self.ewma_s += 0.1 * (seconds - self.ewma_s)
            if ok is not None and v["id"] in self.views:
                self.stats.answered(v["id"], seconds, ok)
        self._wake(1)

    def _wake(self, n: int) -> None:
        while n > 0 and self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1
