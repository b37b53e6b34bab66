"""The health checker's decisions (docs/health.md): pure functions, no I/O.

* :func:`instance_input` / :func:`payload`: the stabilityChecker policy's input from the
  instance map, the checker's probe record, the executors' passive counts and the progress they
  measure;
* :func:`validate`: the policy's answer against the contract (``policies.contract``) and the
  instances it was given; anything else fails the tick (nothing changes, the reason is recorded);
* :func:`decide`: what the framework carries out: only changes (a verdict equal to the
  instance's current health is no event), nothing inside the block's startup grace, at most
  ``max(1, ratio x instances)`` out of routing at once (the rest deferred, with the reason), no
  second restart/replace of an instance while the first is under way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from ..policies import contract
from ..schemas.policy_io import (
    HealthCheckInput,
    HealthInstance,
    Passive,
    ProbeInput,
    Progress,
    Verdict,
)
from ..schemas.records import InstanceSample, MapEntry, PassiveCounts

#: verdicts that take an instance out of routing (until ``healthy``)
OUT = ("unready", "restart", "replace")
#: the order verdicts are carried out in when the cap is short: the worst first
SEVERITY = {"replace": 0, "restart": 1, "unready": 2, "degrade": 3, "healthy": 4}
#: the routing weight of a ``degrade`` verdict that names none
DEFAULT_DEGRADED_WEIGHT = 0.5
#: map health after each verdict
HEALTH_AFTER = {"healthy": "ok", "degrade": "degraded", "unready": "unready", "restart": "unready", "replace": "unready"}


def max_out(n: int, ratio: float) -> int:
    """How many of ``n`` instances may be out of routing at once: max(1, ratio x n)."""
    return max(1, math.floor(n * ratio)) if n > 0 else 0


@dataclass
class ProbeRecord:
    """The checker's memory of one instance's active probes."""

    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ok: bool = True
    latency_s: float = 0.0
    status: int = 0
    error: str = ""
    probes: int = 0
    first_failure: float = 0.0

    def observe(self, ok: bool, latency_s: float, status: int, error: str, now: float) -> None:
        self.probes += 1
        self.ok, self.latency_s, self.status, self.error = ok, latency_s, status, error[:200]
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            self.first_failure = 0.0
        else:
            if not self.consecutive_failures:
                self.first_failure = now
            self.consecutive_failures += 1
            self.consecutive_successes = 0

    def as_input(self, now: float) -> ProbeInput:
        return {"ok": self.ok, "latency_s": round(self.latency_s, 6), "status": self.status, "error": self.error,
                "consecutive_failures": self.consecutive_failures, "consecutive_successes": self.consecutive_successes,
                "failing_for_s": round(now - self.first_failure, 3) if self.first_failure else 0.0, "probes": self.probes}


#: the passive counts summed over executors
_SUMMED: tuple[Literal["ok", "errors", "timeouts", "ejections"], ...] = ("ok", "errors", "timeouts", "ejections")


def merge_passive(counts: Sequence[PassiveCounts]) -> tuple[Passive, Progress]:
    """Several executors' counts of one instance -> (``passive``, ``progress``): sums of counts,
    the worst consecutive errors, ejected by any, latency the mean of those with one; in flight
    summed, stalled the longest, the most recent completion."""
    passive: Passive = {"ok": 0, "errors": 0, "timeouts": 0, "consecutive_errors": 0, "ejections": 0,
                               "ejected": False, "last_error": "", "latency_s": 0.0, "executors": len(counts)}
    progress: Progress = {"inflight": 0, "stalled_s": 0.0, "since_done_s": -1.0}
    lats = []
    for c in counts:
        for k in _SUMMED:
            passive[k] += int(c.get(k, 0) or 0)
        passive["consecutive_errors"] = max(passive["consecutive_errors"], int(c.get("consecutive_errors", 0) or 0))
        passive["ejected"] = passive["ejected"] or bool(c.get("ejected"))
        if c.get("last_error"):
            passive["last_error"] = str(c["last_error"])
        if float(c.get("latency_s", 0) or 0) > 0:
            lats.append(float(c["latency_s"]))
        progress["inflight"] += int(c.get("inflight", 0) or 0)
        progress["stalled_s"] = max(progress["stalled_s"], float(c.get("stalled_s", 0) or 0))
        raw = c.get("since_done_s")
        done = float(raw) if isinstance(raw, int | float) else -1.0
        if done >= 0 and (progress["since_done_s"] < 0 or done < progress["since_done_s"]):
            progress["since_done_s"] = done
    if lats:
        passive["latency_s"] = round(sum(lats) / len(lats), 6)
    # one executor stalled while another completes tasks at the same instance: it progresses
    if progress["stalled_s"] and 0 <= progress["since_done_s"] < progress["stalled_s"]:
        progress["stalled_s"] = progress["since_done_s"]
    return passive, progress


def instance_input(iid: str, rec: MapEntry, now: float, probe: ProbeRecord | None,
                   passive: Sequence[PassiveCounts], restarts: int, metrics: InstanceSample | None = None) -> HealthInstance:
    p, prog = merge_passive(passive)
    return {
        "instance_id": iid, "node_id": rec.get("node", ""), "endpoint": rec.get("endpoint", ""),
        "state": rec.get("state", ""), "health": rec.get("health", "ok"), "weight": float(rec.get("weight", 1.0)),
        "age_s": round(max(0.0, now - float(rec.get("ready_since", rec.get("since", now)))), 3),
        "probe": probe.as_input(now) if probe is not None else {"ok": True, "consecutive_failures": 0,
                                                                  "consecutive_successes": 0, "probes": 0},
        "passive": p, "progress": prog, "restarts": restarts, "metrics": metrics or {},
    }


def agent_input(iid: str, node: str, endpoint: str, report: str, reason: str, restarts: int = 0) -> HealthInstance:
    """The input entry of an instance its node agent reported ``failed`` (it exited or could not
    start) or ``unhealthy`` (its launch probe failed): the usual shape (no probe, passive or
    progress figures of the checker's: the controller has none) plus the ``agent`` signal
    ``{"report", "reason"}`` (docs/health.md, "Agent reports"). ``state`` is ``stopping``: the
    mapper gives it no task since the report."""
    passive, progress = merge_passive([])
    return {
        "instance_id": iid, "node_id": node, "endpoint": endpoint, "state": "stopping", "health": "unready",
        "weight": 1.0, "restarts": restarts,
        "probe": {"ok": False, "consecutive_failures": 0, "consecutive_successes": 0, "probes": 0},
        "passive": passive, "progress": progress, "metrics": {},
        "agent": {"report": report, "reason": reason[:500]},
    }


def payload(bid: str, instances: list[HealthInstance], grace_s: float, max_out_n: int) -> HealthCheckInput:
    return {"action": "health_check",
            "payload": {"block": bid, "instances": instances, "startup_grace_s": grace_s, "max_out_of_routing": max_out_n}}


class BadVerdicts(ValueError):
    pass


def validate(result: Any, instances: Sequence[HealthInstance]) -> dict[str, Verdict]:
    """The policy's verdicts, checked: the contract's shape, and only instances it was given."""
    try:
        contract.check("health_check", result)
    except contract.WrongShape as exc:
        raise BadVerdicts(f"wrong return shape: {exc}") from None
    known = {i["instance_id"] for i in instances}
    unknown = sorted(k for k in result["verdicts"] if k not in known)
    if unknown:
        raise BadVerdicts(f"verdicts name instances it was not given: {', '.join(unknown[:5])}")
    return {k: cast(Verdict, dict(v)) for k, v in result["verdicts"].items()}  # (its shape checked above)


@dataclass(frozen=True)
class Action:
    instance_id: str
    node_id: str
    verdict: str
    reason: str
    weight: float = 1.0


def decide(instances: list[HealthInstance], verdicts: dict[str, Verdict], grace_s: float, max_out_ratio: float,
           busy: dict[str, float], now: float, cooldown_s: float) -> tuple[list[Action], list[str]]:
    """The verdicts to carry out now (changes only) and why others are held back.

    ``instances``: the policy's input instances; ``busy``: iid -> when its last restart/replace was
    ordered (none again within ``cooldown_s``)."""
    by_id = {i["instance_id"]: i for i in instances}
    routed = [i for i in instances if i.get("state") == "ready"]
    cap = max_out(len(routed), max_out_ratio)
    out_now = sum(1 for i in routed if i.get("health") == "unready")
    actions: list[Action] = []
    held: list[str] = []
    order = sorted(verdicts.items(), key=lambda kv: (SEVERITY[kv[1]["verdict"]], kv[0]))
    for iid, d in order:
        inst = by_id[iid]
        verdict, reason = d["verdict"], str(d.get("reason", ""))[:500]
        health = inst.get("health", "ok")
        t = busy.get(iid)
        if _in_grace(inst, verdict, t, now, grace_s):
            continue
        weight = 1.0
        if verdict == "degrade":  # no weight given: the current one if degraded already, else half
            weight = float(d.get("weight", inst.get("weight", 1.0) if health == "degraded" else DEFAULT_DEGRADED_WEIGHT))
        if _no_change(inst, verdict, health, weight) or (verdict in ("restart", "replace") and t is not None and now - t < cooldown_s):
            continue
        if verdict in OUT and health != "unready":
            if out_now >= cap:
                held.append(f"{iid}: {verdict} held back: {out_now} of {len(routed)} instances already out of routing "
                            f"(at most {cap})")
                continue
            out_now += 1
        actions.append(Action(iid, str(inst.get("node_id", "")), verdict, reason, weight))
    return actions, held


def _in_grace(inst: HealthInstance, verdict: str, ordered: float | None, now: float, grace_s: float) -> bool:
    """No verdict carried out on an instance the lifecycle owns or inside a startup grace."""
    if inst.get("state") != "ready":
        return True  # starting, draining, stopping: the lifecycle owns it
    if verdict != "healthy" and inst.get("age_s", 0) < grace_s:
        return True  # inside the startup grace: no verdict
    # restarted (or being replaced) just now: the startup grace again
    return ordered is not None and now - ordered < grace_s


def _no_change(inst: HealthInstance, verdict: str, health: str, weight: float) -> bool:
    """The verdict is what the instance already is (a degraded weight within 20 %)."""
    if verdict == "healthy":
        return bool(health == "ok")
    if verdict == "degrade":
        return bool(health == "degraded" and abs(weight - float(inst.get("weight", 1.0))) < 0.2 * weight)
    return bool(verdict == "unready" and health == "unready")
