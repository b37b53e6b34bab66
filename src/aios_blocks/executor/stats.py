"""The executor's own figures, kept as plain numbers on each :class:`~.engine.Route` (a task adds a
few integers and one bisect: no lock, no label lookup on the task path) and rendered for
Prometheus at scrape time by :class:`ExecutorCollector` (``prometheus_client`` custom collector).

Labels are bounded: ``block`` and ``instance`` of the routes this executor holds now (an instance
that leaves the map, and a deleted block, take their series with them), ``outcome`` and
``reason`` from closed vocabularies. Never a task id.

=======================================  =========  =============================  =====================================
name                                     type       labels                         meaning
=======================================  =========  =============================  =====================================
``aios_executor_tasks_total``            counter    block, instance, outcome       tasks answered by an instance (``ok``: status < 500; ``error``: 5xx, transport failure, timeout)
``aios_executor_inflight``               gauge      block, instance                tasks this executor has at the instance now
``aios_executor_dispatch_seconds``       histogram  block, instance                send to last byte of the instance's answer
``aios_executor_queue_length``           gauge      block                          tasks waiting for a free instance
``aios_executor_queue_wait_seconds``     histogram  block                          time a task waited for its instance (0 when one was free)
``aios_executor_held``                   gauge      block                          tasks held while a scale-to-zero block's first instance starts
``aios_executor_activations_total``      counter    block                          requests for a first instance (``block.scale.target`` from the activator)
``aios_executor_rejected_total``         counter    block, reason                  tasks the executor answered itself: ``overloaded``, ``no_instance``, ``queue_timeout``, ``policy_error``, ``hold_full``, ``hold_timeout``
``aios_executor_retries_total``          counter    block                          retries on another instance
``aios_executor_misdirected_total``       counter    block                          tries answered 421 Misdirected Request: another instance at the endpoint, nothing run
``aios_executor_policy_seconds``         histogram  block                          time of one loadBalancer decision
``aios_executor_unknown_block_total``    counter    (none)                         tasks for a block with no instance map
=======================================  =========  =============================  =====================================
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .engine import Route

#: seconds; fine at the low end (a local instance answers in about a millisecond)
DISPATCH_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_BUCKETS: tuple[float, ...] = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
POLICY_BUCKETS: tuple[float, ...] = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.001, 0.005, 0.025)


class Outcome(enum.StrEnum):
    OK = "ok"
    ERROR = "error"


class Reject(enum.StrEnum):
    OVERLOADED = "overloaded"
    NO_INSTANCE = "no_instance"
    QUEUE_TIMEOUT = "queue_timeout"
    POLICY_ERROR = "policy_error"
    #: scale-to-zero: the block already holds ``activator_max_held`` tasks (429)
    HOLD_FULL = "hold_full"
    #: scale-to-zero: no instance became ready within ``activator_hold_s`` or the task's limit (503)
    HOLD_TIMEOUT = "hold_timeout"


@dataclass
class Hist:
    """A cumulative histogram as plain numbers (``counts[i]``: observations in bucket ``i``, the
    last one ``+Inf``)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for le, n in zip(self.bounds, self.counts, strict=False):
            acc += n
            out.append((repr(float(le)), float(acc)))
        out.append(("+Inf", float(acc + self.counts[-1])))
        return out


@dataclass
class InstanceStats:
    ok: int = 0
    errors: int = 0
    dispatch: Hist = field(default_factory=lambda: Hist(DISPATCH_BUCKETS))


@dataclass
class RouteStats:
    """One block's figures in one executor."""

    instances: dict[str, InstanceStats] = field(default_factory=dict)
    queue_wait: Hist = field(default_factory=lambda: Hist(QUEUE_BUCKETS))
    policy: Hist = field(default_factory=lambda: Hist(POLICY_BUCKETS))
    rejected: dict[Reject, int] = field(default_factory=lambda: dict.fromkeys(Reject, 0))
    retries: int = 0
    #: tries answered 421 by another instance at the endpoint (the map was behind; nothing ran)
    misdirected: int = 0

    def instance(self, iid: str) -> InstanceStats:
        st = self.instances.get(iid)
        if st is None:
            st = self.instances[iid] = InstanceStats()
        return st

    def answered(self, iid: str, seconds: float, ok: bool) -> None:
        st = self.instance(iid)
        if ok:
            st.ok += 1
        else:
            st.errors += 1
        st.dispatch.observe(seconds)

    def keep(self, iids: Iterable[str]) -> None:
        """Drop the figures of instances no longer in the map (bounded series)."""
        keep = set(iids)
        for iid in [i for i in self.instances if i not in keep]:
            del self.instances[iid]


def _hist(fam: HistogramMetricFamily, labels: list[str], h: Hist) -> None:
    fam.add_metric(labels, h.buckets(), h.total)


class ExecutorCollector(Collector):
    """Renders the routes of one executor (``routes()``: block id -> Route) at scrape time."""

    def __init__(self, routes: Callable[[], dict[str, Route]], unknown: Callable[[], int]):
        self.routes, self.unknown = routes, unknown

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no fixed series: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        tasks = CounterMetricFamily("aios_executor_tasks", "Tasks answered by an instance.", labels=["block", "instance", "outcome"])
        inflight = GaugeMetricFamily("aios_executor_inflight", "Tasks at the instance now (this executor's).", labels=["block", "instance"])
        dispatch = HistogramMetricFamily("aios_executor_dispatch_seconds", "Send to last byte of the instance's answer.",
                                         labels=["block", "instance"])
        queue = GaugeMetricFamily("aios_executor_queue_length", "Tasks waiting for a free instance.", labels=["block"])
        held = GaugeMetricFamily("aios_executor_held", "Tasks held while a scale-to-zero block's first instance starts.", labels=["block"])
        activations = CounterMetricFamily("aios_executor_activations", "Requests for a first instance of a block at zero.", labels=["block"])
        wait = HistogramMetricFamily("aios_executor_queue_wait_seconds", "Time a task waited for its instance.", labels=["block"])
        rejected = CounterMetricFamily("aios_executor_rejected", "Tasks the executor answered itself.", labels=["block", "reason"])
        retries = CounterMetricFamily("aios_executor_retries", "Retries on another instance.", labels=["block"])
        misdirected = CounterMetricFamily("aios_executor_misdirected", "Tries answered 421 by another instance at the endpoint.",
                                          labels=["block"])
        policy = HistogramMetricFamily("aios_executor_policy_seconds", "Time of one loadBalancer decision.", labels=["block"])
        for bid, route in list(self.routes().items()):
            st = route.stats
            for iid, v in list(route.views.items()):
                inflight.add_metric([bid, iid], float(v["inflight"]))
            for iid, ist in list(st.instances.items()):
                tasks.add_metric([bid, iid, Outcome.OK.value], float(ist.ok))
                tasks.add_metric([bid, iid, Outcome.ERROR.value], float(ist.errors))
                _hist(dispatch, [bid, iid], ist.dispatch)
            queue.add_metric([bid], float(max(0, len(route.waiting) - route.held)))
            if route.scale_to_zero:
                held.add_metric([bid], float(route.held))
                activations.add_metric([bid], float(route.activations))
            _hist(wait, [bid], st.queue_wait)
            for reason, n in st.rejected.items():
                rejected.add_metric([bid, reason.value], float(n))
            retries.add_metric([bid], float(st.retries))
            misdirected.add_metric([bid], float(st.misdirected))
            _hist(policy, [bid], st.policy)
        unknown = CounterMetricFamily("aios_executor_unknown_block", "Tasks for a block with no instance map.")
        unknown.add_metric([], float(self.unknown()))
        yield from (tasks, inflight, dispatch, queue, wait, held, activations, rejected, retries, misdirected, policy, unknown)
