"""The collector's arithmetic, without I/O: cumulative readings (instance pages, executor pages) in,
one sample per block and per instance out (docs/metrics.md lists every field).

Rates and latency quantiles are taken over the last ``span_s`` seconds (the readings it keeps in
memory): a counter that went down (an instance or executor restarted) starts its span again.
Figures nobody reports are ``None``; a first reading has no rate yet.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from ..schemas.records import BlockSample, InstanceSample, MapEntry, TickSamples
from .scrape import ExecBlock, ExecInstance, Histogram, InstanceReading


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None or math.isnan(v) else round(v, nd)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


@dataclass
class _IPoint:
    t: float
    requests: float | None
    errors: float | None
    latency: Histogram | None
    ex_done: float
    ex_errors: float
    dispatch: Histogram

    def went_down(self, o: _IPoint) -> bool:
        return ((self.requests or 0) < (o.requests or 0) or (self.errors or 0) < (o.errors or 0)
                or self.ex_done < o.ex_done or self.ex_errors < o.ex_errors)


@dataclass
class _BPoint:
    t: float
    rejected: float
    retries: float
    queue_wait: Histogram
    policy: Histogram

    def went_down(self, o: _BPoint) -> bool:
        return self.rejected < o.rejected or self.retries < o.retries or self.policy.count < o.policy.count


@dataclass
class BlockInput:
    """What the collector knows of one block at a tick."""

    cluster: str
    #: the instance map's instances: iid -> {"state", "node", "endpoint"}
    instances: dict[str, MapEntry]
    #: iid -> the instance's page as read (None: it did not answer)
    pages: dict[str, InstanceReading | None] = field(default_factory=dict)
    #: the executors' figures for the block, summed over executors (None: no executor has it)
    executor: ExecBlock | None = None


def _span(hist: deque[Any], p: Any, now: float, span_s: float) -> Any:
    """Append ``p``; keep the newest reading at or before ``now - span_s`` as the base; a counter
    that went down restarts the span. Returns the base (``p`` itself on a first reading)."""
    if hist and p.went_down(hist[-1]):
        hist.clear()
    hist.append(p)
    while len(hist) > 1 and hist[1].t <= now - span_s:
        hist.popleft()
    return hist[0]


#: the instance figures a block's sample sums
_Summed = Literal["inflight", "running", "waiting", "rate", "error_rate"]


class Windows:
    def __init__(self, span_s: float = 10.0):
        self.span_s = span_s
        self._inst: dict[tuple[str, str], deque[_IPoint]] = {}
        self._block: dict[str, deque[_BPoint]] = {}

    def tick(self, now: float, blocks: dict[str, BlockInput]) -> TickSamples:
        out: TickSamples = {}
        seen: set[tuple[str, str]] = set()
        for bid, b in blocks.items():
            ex = b.executor or ExecBlock()
            insts: dict[str, InstanceSample] = {}
            merged = Histogram()  # the block's dispatch latency: every instance's, same bounds
            for iid in sorted(set(b.instances) | set(ex.instances)):
                seen.add((bid, iid))
                rec: MapEntry = b.instances.get(iid, {"state": "gone", "node": ""})
                s, d = self._instance(now, bid, iid, rec, b.pages.get(iid), ex.instances.get(iid) or ExecInstance())
                insts[iid] = s
                merged.add(d)
            out[bid] = (self._blocksample(now, bid, b, ex, insts, merged), insts)
        for key in [k for k in self._inst if k not in seen]:
            del self._inst[key]
        for bid in [k for k in self._block if k not in blocks]:
            del self._block[bid]
        return out

    def _instance(self, now: float, bid: str, iid: str, rec: MapEntry, page: InstanceReading | None,
                  ex: ExecInstance) -> tuple[InstanceSample, Histogram]:
        rd = page or InstanceReading()
        p = _IPoint(now, rd.requests, rd.errors, rd.latency, ex.ok + ex.errors, ex.errors, ex.dispatch)
        base = _span(self._inst.setdefault((bid, iid), deque()), p, now, self.span_s)
        dt = p.t - base.t
        rate = err = None
        latency: Histogram | None = None
        dispatch = Histogram()
        if dt > 0:
            if p.requests is not None and base.requests is not None:
                rate = (p.requests - base.requests) / dt
            else:
                rate = (p.ex_done - base.ex_done) / dt
            errs = [(p.ex_errors - base.ex_errors) / dt]
            if p.errors is not None and base.errors is not None:
                errs.append((p.errors - base.errors) / dt)
            err = max(errs)
            if p.latency is not None and base.latency is not None:
                latency = p.latency.minus(base.latency)
            dispatch = p.dispatch.minus(base.dispatch)
        sample: InstanceSample = {
            "t": round(now, 3), "state": rec.get("state", ""), "node": rec.get("node", ""), "up": page is not None,
            "inflight": ex.inflight, "running": rd.running, "waiting": rd.waiting,
            "rate": _r(rate), "error_rate": _r(err),
            "latency_p50_ms": _ms(latency.quantile(0.5)) if latency else None,
            "latency_p99_ms": _ms(latency.quantile(0.99)) if latency else None,
            "latency_mean_ms": _ms(latency.mean()) if latency else None,
            "dispatch_p50_ms": _ms(dispatch.quantile(0.5)), "dispatch_p99_ms": _ms(dispatch.quantile(0.99)),
        }
        if rd.kv_cache_usage_perc is not None:
            sample["kv_cache_usage_perc"] = rd.kv_cache_usage_perc
        return sample, dispatch

    def _blocksample(self, now: float, bid: str, b: BlockInput, ex: ExecBlock, insts: dict[str, InstanceSample],
                     dispatch: Histogram) -> BlockSample:
        p = _BPoint(now, ex.rejected, ex.retries, ex.queue_wait, ex.policy)
        base = _span(self._block.setdefault(bid, deque()), p, now, self.span_s)
        dt = p.t - base.t
        rejected = retries = None
        wait = policy = Histogram()
        if dt > 0:
            rejected, retries = (p.rejected - base.rejected) / dt, (p.retries - base.retries) / dt
            wait, policy = p.queue_wait.minus(base.queue_wait), p.policy.minus(base.policy)

        def total(key: _Summed) -> float | None:
            vals = [v for s in insts.values() if (v := s[key]) is not None]
            return round(sum(vals), 3) if vals else None

        rate = total("rate")
        weighted = [(m, r) for s in insts.values() if (m := s["latency_mean_ms"]) is not None and (r := s["rate"])]
        wsum = sum(r for _, r in weighted)
        policy_mean = policy.mean()
        return {
            "t": round(now, 3), "cluster": b.cluster,
            "instances": len(b.instances), "ready": sum(1 for r in b.instances.values() if r.get("state") == "ready"),
            "inflight": total("inflight") or 0.0, "running": total("running"), "waiting": total("waiting"),
            "queue": ex.queue, "queue_wait_p99_ms": _ms(wait.quantile(0.99)),
            "rate": rate, "error_rate": total("error_rate"), "rejected_rate": _r(rejected), "retry_rate": _r(retries),
            "latency_mean_ms": round(sum(m * r for m, r in weighted) / wsum, 3) if wsum > 0 else None,
            "dispatch_p50_ms": _ms(dispatch.quantile(0.5)), "dispatch_p99_ms": _ms(dispatch.quantile(0.99)),
            "policy_mean_us": None if policy_mean is None else round(policy_mean * 1e6, 2),
        }
