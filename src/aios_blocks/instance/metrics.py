"""The metrics module of seed 000, instance side: system metrics every instance reports, plus the
custom metrics a handler declares.

System metrics (vLLM-like names where one fits; label ``instance``... none: an instance's
``/metrics`` is about itself, the scraper adds ``block``/``instance``/``cluster``):

============================================  =========  ===========================================
name                                          type       meaning
============================================  =========  ===========================================
``aios_instance_requests_running``            gauge      tasks being handled now (vLLM ``num_requests_running``)
``aios_instance_requests_waiting``            gauge      tasks queued for a free slot (vLLM ``num_requests_waiting``)
``aios_instance_requests_total``              counter    tasks finished (any outcome)
``aios_instance_errors_total``                counter    tasks that failed (handler raised / returned an error status)
``aios_instance_request_latency_seconds``     histogram  time from arrival to the last byte of the answer
``aios_instance_ready``                       gauge      1 once the handler's init is done
``aios_instance_kv_cache_usage_perc``         gauge      0..1, only when the instance reports it (vLLM ``kv_cache_usage_perc``)
============================================  =========  ===========================================

:class:`SystemMetrics` is plain Python (a few ints and a bucket list) so the simulated runtime can
keep one per instance for 1,000 instances in one process; it renders Prometheus text itself.
Custom metrics are ``prometheus_client`` objects registered on :attr:`Metrics.registry` (one per
instance, not the process-wide default registry).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

PREFIX = "aios_instance_"
RUNNING = PREFIX + "requests_running"
WAITING = PREFIX + "requests_waiting"
REQUESTS = PREFIX + "requests_total"
ERRORS = PREFIX + "errors_total"
LATENCY = PREFIX + "request_latency_seconds"
READY = PREFIX + "ready"
KV_CACHE = PREFIX + "kv_cache_usage_perc"
#: seconds; like vLLM's e2e request latency buckets, finer at the low end for fast services
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class SystemMetrics:
    """In-flight, queue, outcomes and a latency histogram of one instance."""

    running: int = 0
    waiting: int = 0
    requests: int = 0
    errors: int = 0
    ready: bool = False
    #: share of the engine's KV cache in use (0..1); None: not reported (no line is rendered)
    kv_cache_usage: float | None = None
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float, error: bool = False) -> None:
        self.requests += 1
        if error:
            self.errors += 1
        self.latency_sum += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def render(self) -> str:
        lines = [
            f"# HELP {RUNNING} Tasks being handled now.", f"# TYPE {RUNNING} gauge", f"{RUNNING} {self.running}",
            f"# HELP {WAITING} Tasks waiting for a free slot.", f"# TYPE {WAITING} gauge", f"{WAITING} {self.waiting}",
            f"# HELP {REQUESTS} Tasks finished.", f"# TYPE {REQUESTS} counter", f"{REQUESTS} {self.requests}",
            f"# HELP {ERRORS} Tasks that failed.", f"# TYPE {ERRORS} counter", f"{ERRORS} {self.errors}",
            f"# HELP {READY} 1 once the instance takes tasks.", f"# TYPE {READY} gauge", f"{READY} {int(self.ready)}",
            f"# HELP {LATENCY} Task latency, arrival to last byte.", f"# TYPE {LATENCY} histogram",
        ]
        acc = 0
        for le, n in zip(LATENCY_BUCKETS, self.buckets, strict=False):
            acc += n
            lines.append(f'{LATENCY}_bucket{{le="{le}"}} {acc}')
        acc += self.buckets[-1]
        lines += [f'{LATENCY}_bucket{{le="+Inf"}} {acc}', f"{LATENCY}_count {acc}", f"{LATENCY}_sum {self.latency_sum:.6f}"]
        if self.kv_cache_usage is not None:
            lines += [f"# HELP {KV_CACHE} Share of the KV cache in use.", f"# TYPE {KV_CACHE} gauge",
                      f"{KV_CACHE} {self.kv_cache_usage:.4f}"]
        return "\n".join(lines) + "\n"


class Metrics:
    """An instance's metrics: the system ones and the custom ones its handler declares::

        tokens = metrics.counter("tokens_total", "Tokens generated")
        tokens.inc(42)

    Custom names are used as given (a handler may follow an engine's convention); labels are
    allowed but must stay bounded (never a task id).
    """

    def __init__(self) -> None:
        self.system = SystemMetrics()
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (), buckets: Any = None) -> Histogram:
        kwargs: dict[str, Any] = {"registry": self.registry}
        if buckets is not None:
            kwargs["buckets"] = buckets
        return Histogram(name, doc, list(labels), **kwargs)

    def render(self) -> bytes:
        return self.system.render().encode() + generate_latest(self.registry)


def parse_text(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page, ``name{labels}`` -> value (tests and small scrapers;
    the collector uses ``prometheus_client.parser``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out
