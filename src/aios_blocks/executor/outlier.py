"""Passive health in one executor (Envoy's outlier detection, local to this executor): no I/O.

Every dispatch ends in one outcome per instance: ``ok`` (an answer below 500), ``5xx``, or a
transport failure (``connect``: refused / unreachable, ``reset``: the connection broke, ``timeout``).

* a transport failure **ejects** the instance at once (a killed instance is refused on the next
  connect: it is out of this executor's routing right after its first failed dispatch);
  ``consecutive_5xx`` 5xx answers in a row eject it too;
* an ejection lasts ``base_s`` times the instance's ejection count (capped at ``max_s``): an
  instance that keeps failing stays out longer each time; a success resets the consecutive count;
* at most ``max(1, max_out_ratio x instances)`` of a block's instances are ejected at once (Envoy's
  max ejection percent): passive detection never empties a block because of a network blip;
* the counts (``snapshot``) are what the executor writes for the health checker (``state.health``).
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from ..handlers.stability import max_out as max_out  # the checker's rule, shared with the ejection cap
from ..schemas.records import PassiveCounts, RouteView

TRANSPORT = ("connect", "reset", "timeout")
OUTCOMES = ("ok", "5xx", *TRANSPORT)


@dataclass
class Counts:
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    consecutive_errors: int = 0
    ejections: int = 0
    last_error: str = ""
    #: monotonic time of the last answer (ok or 5xx) and of the moment in-flight went above 0
    last_done: float = 0.0
    busy_since: float = 0.0
    #: task latency EWMA of the answered tasks (seconds; 0 = none yet)
    latency_s: float = 0.0


@dataclass
class Outliers:
    base_s: float = 1.0
    max_s: float = 30.0
    consecutive_5xx: int = 5
    max_out_ratio: float = 0.1
    counts: dict[str, Counts] = field(default_factory=dict)
    #: iid -> monotonic time its ejection ends
    ejected: dict[str, float] = field(default_factory=dict)

    def get(self, iid: str) -> Counts:
        c = self.counts.get(iid)
        if c is None:
            c = self.counts[iid] = Counts()
        return c

    def record(self, iid: str, outcome: str, n_instances: int, now: float | None = None, error: str = "",
               seconds: float | None = None) -> float:
        """One dispatch's outcome; returns the ejection time in seconds when it ejects the instance
        now (0: not ejected)."""
        now = time.monotonic() if now is None else now
        c = self.get(iid)
        if outcome == "ok":
            if seconds is not None:
                c.latency_s = seconds if c.latency_s == 0 else c.latency_s + 0.2 * (seconds - c.latency_s)
            c.ok += 1
            c.consecutive_errors = 0
            c.last_done = now
            return 0.0
        c.errors += 1
        c.consecutive_errors += 1
        c.last_error = error[:200]
        if outcome == "timeout":
            c.timeouts += 1
        if outcome == "5xx":
            c.last_done = now
            if c.consecutive_errors < self.consecutive_5xx:
                return 0.0
        return self._eject(iid, c, n_instances, now)

    def _eject(self, iid: str, c: Counts, n_instances: int, now: float) -> float:
        self.expire(now)
        if iid in self.ejected:
            return 0.0
        if len(self.ejected) >= max_out(n_instances, self.max_out_ratio):
            return 0.0  # the cap: the others stay in routing
        c.ejections += 1
        seconds = min(self.max_s, self.base_s * c.ejections)
        self.ejected[iid] = now + seconds
        return seconds

    def expire(self, now: float | None = None) -> list[str]:
        """Ejections that have ended (their instances route again)."""
        now = time.monotonic() if now is None else now
        done = [i for i, until in self.ejected.items() if until <= now]
        for i in done:
            del self.ejected[i]
        return done

    def keep(self, iids: Container[str]) -> None:
        for i in [i for i in self.counts if i not in iids]:
            del self.counts[i]
        for i in [i for i in self.ejected if i not in iids]:
            del self.ejected[i]

    def snapshot(self, views: Mapping[str, RouteView], now: float | None = None) -> dict[str, PassiveCounts]:
        """Per instance of the route: the counts the health checker reads (``passive`` and
        ``progress`` of its policy's input)."""
        now = time.monotonic() if now is None else now
        out: dict[str, PassiveCounts] = {}
        for iid, v in views.items():
            c = self.counts.get(iid) or Counts()
            inflight = int(v.get("inflight", 0))
            stalled = now - max(c.last_done, c.busy_since) if inflight > 0 and c.busy_since else 0.0
            out[iid] = {
                "ok": c.ok, "errors": c.errors, "timeouts": c.timeouts, "consecutive_errors": c.consecutive_errors,
                "ejections": c.ejections, "ejected": iid in self.ejected, "last_error": c.last_error,
                "inflight": inflight, "latency_s": round(c.latency_s, 6), "stalled_s": round(max(0.0, stalled), 3),
                "since_done_s": round(now - c.last_done, 3) if c.last_done else -1.0,
            }
        return out
