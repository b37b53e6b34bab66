"""Reading Prometheus text pages fast (the collector reads a page per instance per second: 1,000
instances are 1,000 pages a second on one core, so this is a plain line scan, not
``prometheus_client.parser``'s full model), and what the collector takes from them.

* :func:`read_instance` - an instance's own ``/metrics`` (the instance SDK's ``aios_instance_*``
  names, vLLM's ``vllm:*`` names, or any engine whose names end the same way);
* :func:`read_executor` - an executor's ``/metrics`` (``executor.stats``), per block and instance.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """``(name, label text, value)`` of each sample line (comments and bad lines skipped; a
    timestamp after the value is ignored)."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                continue
            name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
        else:
            name, _, rest = line.partition(" ")
            labels = ""
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        yield name.strip(), labels, value


def labels_of(text: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text)}


def _le(labels: str) -> float | None:
    if labels.startswith('le="') and labels.count('"') == 2:  # the common case: le is the only label
        le: str | None = labels[4:-1]
    else:
        le = labels_of(labels).get("le")
    if le is None:
        return None
    try:
        return math.inf if le in ("+Inf", "Inf") else float(le)
    except ValueError:
        return None


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound, with sum and count."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0
    count: float = 0.0

    def add(self, other: Histogram) -> None:
        for le, n in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + n
        self.total += other.total
        self.count += other.count

    def minus(self, older: Histogram) -> Histogram:
        """What was observed since ``older`` (bucket by bucket; a bound only one side has counts as
        new)."""
        return Histogram({le: n - older.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.total - older.total, self.count - older.count)

    def quantile(self, q: float) -> float | None:
        """Like PromQL's ``histogram_quantile``: linear within the bucket; ``None`` with no
        observations; the largest finite bound when it falls in ``+Inf``."""
        if not self.buckets:
            return None
        bounds = sorted(self.buckets)
        total = self.buckets[bounds[-1]] if bounds[-1] == math.inf else max(self.count, self.buckets[bounds[-1]])
        if total <= 0:
            return None
        rank = q * total
        prev_le, prev_n = 0.0, 0.0
        for le in bounds:
            n = self.buckets[le]
            if n >= rank:
                if le == math.inf:
                    return prev_le
                if n == prev_n:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
            prev_le, prev_n = le, n
        return prev_le

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


# -- an instance's page ------------------------------------------------------------------------------
#: gauge name suffixes -> reading field (summed over label sets; KV use: the largest)
_GAUGES = {"requests_running": "running", "requests_waiting": "waiting", "kv_cache_usage_perc": "kv_cache_usage_perc"}
_GAUGE_ENDS = tuple(_GAUGES)
_HIST_ENDS = ("_bucket", "_sum", "_count")
#: counters of finished tasks and of failed ones, by engine
_REQUESTS = ("aios_instance_requests_total", "vllm:request_success_total")
_ERRORS = ("aios_instance_errors_total",)
_LATENCY = ("aios_instance_request_latency_seconds", "vllm:e2e_request_latency_seconds")


@dataclass
class InstanceReading:
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage_perc: float | None = None
    requests: float | None = None
    errors: float | None = None
    latency: Histogram | None = None


def read_instance(text: str) -> InstanceReading:
    r = InstanceReading()
    gauges: dict[str, dict[str, float]] = {}
    for name, labels, value in samples(text):
        if name in _REQUESTS:
            r.requests = (r.requests or 0.0) + value
            continue
        if name in _ERRORS:
            r.errors = (r.errors or 0.0) + value
            continue
        if name.endswith(_HIST_ENDS) and name.rsplit("_", 1)[0] in _LATENCY:
            h = r.latency = r.latency or Histogram()
            if name.endswith("_bucket"):
                le = _le(labels)
                if le is not None:
                    h.buckets[le] = h.buckets.get(le, 0.0) + value
            elif name.endswith("_sum"):
                h.total += value
            else:
                h.count += value
            continue
        if not name.endswith(_GAUGE_ENDS):
            continue
        for suffix, key in _GAUGES.items():
            if name.endswith(suffix):
                per = gauges.setdefault(key, {})
                if key == "kv_cache_usage_perc":
                    per[name] = max(per.get(name, 0.0), value)
                else:
                    per[name] = per.get(name, 0.0) + value
                break
    for key, per in gauges.items():  # a figure two metrics report (an SDK wrapping an engine) counts once
        setattr(r, key, max(per.values()))
    return r


# -- an executor's page -----------------------------------------------------------------------------
@dataclass
class ExecInstance:
    ok: float = 0.0
    errors: float = 0.0
    inflight: float = 0.0
    dispatch: Histogram = field(default_factory=Histogram)

    def add(self, o: ExecInstance) -> None:
        self.ok += o.ok
        self.errors += o.errors
        self.inflight += o.inflight
        self.dispatch.add(o.dispatch)


@dataclass
class ExecBlock:
    queue: float = 0.0
    queue_wait: Histogram = field(default_factory=Histogram)
    rejected: float = 0.0
    retries: float = 0.0
    policy: Histogram = field(default_factory=Histogram)
    instances: dict[str, ExecInstance] = field(default_factory=dict)

    def inst(self, iid: str) -> ExecInstance:
        e = self.instances.get(iid)
        if e is None:
            e = self.instances[iid] = ExecInstance()
        return e

    def add(self, o: ExecBlock) -> None:
        self.queue += o.queue
        self.queue_wait.add(o.queue_wait)
        self.rejected += o.rejected
        self.retries += o.retries
        self.policy.add(o.policy)
        for iid, e in o.instances.items():
            self.inst(iid).add(e)


def _into(h: Histogram, name: str, labels: dict[str, str], value: float) -> None:
    if name.endswith("_bucket"):
        le = labels.get("le")
        if le is not None:
            b = math.inf if le == "+Inf" else float(le)
            h.buckets[b] = h.buckets.get(b, 0.0) + value
    elif name.endswith("_sum"):
        h.total += value
    elif name.endswith("_count"):
        h.count += value


def read_executor(text: str, into: dict[str, ExecBlock] | None = None) -> dict[str, ExecBlock]:
    """The figures of one executor page, added to ``into`` (pages of several executors sum)."""
    out: dict[str, ExecBlock] = into if into is not None else {}
    for name, ltext, value in samples(text):
        if not name.startswith("aios_executor_"):
            continue
        labels = labels_of(ltext)
        bid = labels.get("block")
        if bid is None:
            continue
        b = out.get(bid)
        if b is None:
            b = out[bid] = ExecBlock()
        what = name[len("aios_executor_"):]
        iid = labels.get("instance")
        if what == "tasks_total" and iid is not None:
            e = b.inst(iid)
            if labels.get("outcome") == "ok":
                e.ok += value
            else:
                e.errors += value
        elif what == "inflight" and iid is not None:
            b.inst(iid).inflight += value
        elif what.startswith("dispatch_seconds") and iid is not None:
            _into(b.inst(iid).dispatch, name, labels, value)
        elif what == "queue_length":
            b.queue += value
        elif what.startswith("queue_wait_seconds"):
            _into(b.queue_wait, name, labels, value)
        elif what == "rejected_total":
            b.rejected += value
        elif what == "retries_total":
            b.retries += value
        elif what.startswith("policy_seconds"):
            _into(b.policy, name, labels, value)
    return out
