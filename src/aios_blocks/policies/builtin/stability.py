"""``builtin:probe-threshold``: the default stabilityChecker (seed-000 class shape), after
Kubernetes probes (``failureThreshold``, ``successThreshold``) and Envoy outlier detection.

Input (``action: "health_check"``, docs/health.md): per instance its active ``probe`` (consecutive
failures/successes, latency), its ``passive`` counts (the executors': errors, timeouts, ejections,
a latency EWMA), its ``progress`` (in-flight, seconds without a completion while in-flight > 0),
its ``restarts`` and its ``health`` now. Output: ``{"verdicts": {iid: {"verdict", "reason"[, "weight"]}}}``.

Rules, per instance (``settings``, defaults in brackets):

* **busy is not broken**: an instance that answered a task within ``stallS`` [10] s, its last
  dispatch not failed, is making progress; its probe failures (a probe queued behind real work,
  a slow answer at 100 % load) are not held against it;
* ``failureThreshold`` [3] failed probes in a row (or a dispatch refused/reset by the executors,
  with at least one failed probe) -> ``unready``; ``restartThreshold`` [6] in a row -> ``restart``,
  or ``replace`` once it was restarted ``maxRestarts`` [1] times;
* **progress**: tasks in flight and no completion for ``stallS`` seconds -> ``restart`` (a hang:
  its probe may still pass), ``replace`` past ``maxRestarts``;
* **slow**: its task latency (executors' EWMA) above ``slowFactor`` [5] x the median of the block's
  other instances -> ``degrade`` with weight median/latency (at least ``minWeight`` [0.05]); back
  to ``healthy`` below ``recoverFactor`` [2] x the median;
* **an agent's report** (the instance entry has ``agent: {"report": "failed" | "unhealthy",
  "reason"}``: its node agent saw it exit, fail to start or fail its launch probe) -> ``replace``
  (the old rule: what the framework did before it asked a policy);
* an ``unready`` or ``degraded`` instance that passes ``successThreshold`` [1] probes in a row and
  is neither stalled nor slow -> ``healthy``.

The framework adds the rest: no verdict inside a block's startup grace, at most max(1, 10 %) of
the instances out of routing at once, only changes carried out (handlers/stability.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from statistics import median

from ...schemas.policy_io import HealthAnswer, HealthCheckInput, HealthInstance, Verdict, as_float, as_int
from ...schemas.records import JSONObject


def _num(d: Mapping[str, object], key: str, default: float = 0.0) -> float:
    v = d.get(key, default)
    if not isinstance(v, int | float | str):  # float() of it would raise TypeError
        return default
    try:
        return float(v)
    except ValueError:
        return default


class ProbeThresholdPolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}
        s = self.settings
        self.failure_threshold = as_int(s.get("failureThreshold", 3))
        self.success_threshold = as_int(s.get("successThreshold", 1))
        self.restart_threshold = as_int(s.get("restartThreshold", 6))
        self.max_restarts = as_int(s.get("maxRestarts", 1))
        self.stall_s = as_float(s.get("stallS", 10.0))
        self.slow_factor = as_float(s.get("slowFactor", 5.0))
        self.recover_factor = as_float(s.get("recoverFactor", 2.0))
        self.min_weight = as_float(s.get("minWeight", 0.05))
        if self.failure_threshold < 1 or self.restart_threshold < self.failure_threshold:
            raise ValueError("probe-threshold: need 1 <= failureThreshold <= restartThreshold")

    def eval(self, parameters: JSONObject, input_data: HealthCheckInput, context: JSONObject) -> HealthAnswer:
        insts = input_data["payload"]["instances"]
        lat = {i["instance_id"]: _num(i.get("passive") or {}, "latency_s") for i in insts}
        out: dict[str, Verdict] = {}
        for inst in insts:
            iid = inst["instance_id"]
            others = [v for k, v in lat.items() if k != iid and v > 0]
            out[iid] = self.one(inst, median(others) if others else 0.0)
        return {"verdicts": out}

    def _fix(self, inst: HealthInstance, why: str) -> Verdict:
        if int(inst.get("restarts", 0)) < self.max_restarts:
            return {"verdict": "restart", "reason": why}
        return {"verdict": "replace", "reason": f"{why}; already restarted {inst.get('restarts', 0)} time(s)"}

    def one(self, inst: HealthInstance, block_median_s: float) -> Verdict:
        agent = inst.get("agent")
        if isinstance(agent, dict) and agent.get("report") in ("failed", "unhealthy"):
            return {"verdict": "replace", "reason": f"its node agent reported it {agent['report']}: {agent.get('reason') or '?'}"}
        return (self._liveness(inst) or self._speed(inst, block_median_s) or self._recovery(inst, block_median_s)
                or {"verdict": "healthy", "reason": "probes pass and tasks complete"})

    def _liveness(self, inst: HealthInstance) -> Verdict | None:
        """Stalled tasks, or probes failing while no task completes: restart, replace or unready."""
        probe, passive, prog = inst.get("probe") or {}, inst.get("passive") or {}, inst.get("progress") or {}
        fails = int(_num(probe, "consecutive_failures"))
        inflight = _num(prog, "inflight")
        stalled = _num(prog, "stalled_s")
        since_done = _num(prog, "since_done_s", -1.0)
        refused = bool(passive.get("ejected")) and int(_num(passive, "consecutive_errors")) > 0
        # answered a task within stallS and the last dispatch did not fail: alive, however its probe fares
        progressing = 0 <= since_done < self.stall_s and not int(_num(passive, "consecutive_errors"))
        if inflight > 0 and stalled >= self.stall_s:
            return self._fix(inst, f"no task completed in {stalled:.1f} s with {inflight:g} in flight (stallS {self.stall_s:g})")
        if not fails or progressing:
            return None
        if fails >= self.restart_threshold:
            return self._fix(inst, f"{fails} probes failed in a row (restartThreshold {self.restart_threshold}): "
                                   f"{probe.get('error') or 'failed'}")
        if fails >= self.failure_threshold or refused:
            what = f"{fails} probe(s) failed in a row" + (" and the executors' dispatches failed" if refused else "")
            return {"verdict": "unready", "reason": f"{what}: {probe.get('error') or passive.get('last_error') or 'failed'}"}
        return None

    def _speed(self, inst: HealthInstance, block_median_s: float) -> Verdict | None:
        """Slower than ``slowFactor`` x the block's median task latency: degraded, by weight."""
        mine = _num(inst.get("passive") or {}, "latency_s")
        if block_median_s > 0 and mine > self.slow_factor * block_median_s:
            w = max(self.min_weight, min(1.0, block_median_s / mine))
            return {"verdict": "degrade", "weight": round(w, 4),
                    "reason": f"task latency {mine * 1000:.0f} ms is {mine / block_median_s:.1f}x the block median "
                              f"({block_median_s * 1000:.0f} ms; slowFactor {self.slow_factor:g})"}
        return None

    def _recovery(self, inst: HealthInstance, block_median_s: float) -> Verdict | None:
        """A degraded or unready instance stays so until it recovers (``recoverFactor``,
        ``successThreshold``)."""
        mine = _num(inst.get("passive") or {}, "latency_s")
        health = inst.get("health", "ok")
        if health == "degraded" and block_median_s > 0 and mine > self.recover_factor * block_median_s:
            return {"verdict": "degrade", "reason": "still slow", "weight": float(inst.get("weight", 1.0))}
        oks = int(_num(inst.get("probe") or {}, "consecutive_successes"))
        if health == "unready" and oks < self.success_threshold:
            return {"verdict": "unready", "reason": f"{oks} probe(s) passed (successThreshold {self.success_threshold})"}
        return None
