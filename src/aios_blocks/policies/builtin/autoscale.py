"""Built-in autoscaler policies (seed-000 class shape), run inline by the autoscaler once per tick.

Input (``action: "autoscale"``, docs/policies.md)::

    {"action": "autoscale", "payload": {"block": BID, "instances": {iid: sample}, "block_metrics": {...},
                                        "current": N, "min": LO, "max": HI, "last_decisions": [...]}}

They answer ``{"desired": N, "reason": "..."}`` with the raw count the load asks for; bounds,
tolerance, delays, windows and rate limits are the framework's (``handlers/autoscale.py``).

* ``builtin:target-inflight`` (Ray Serve's ``target_ongoing_requests``): the tasks the block has
  in flight at its instances plus those waiting in the executors' queues, over
  ``parameters.target`` per instance (default 2, Ray's): ``desired = ceil(ongoing / target)``.
* ``builtin:queue-depth`` (LLM serving: the engine's waiting requests, as KEDA/HPA setups on
  vLLM's ``num_requests_waiting`` do): ``desired = max(ceil(waiting / target),
  ceil(running / runningTarget))`` where ``waiting`` is what the engines report waiting plus the
  executors' queue, ``running`` what they report running (else the tasks in flight);
  ``parameters.target`` waiting requests per instance (default 4), ``parameters.runningTarget``
  (default 8: a batch an engine runs comfortably). The running term keeps a busy block from
  shrinking just because nothing waits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ...schemas.policy_io import AutoscaleAnswer, AutoscaleInput
from ...schemas.records import JSONObject


def _positive(parameters: JSONObject, key: str, default: float) -> float:
    v = (parameters or {}).get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"parameter {key} must be a number > 0, got {v!r}")
    return float(v)


def _num(d: Mapping[str, object], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class TargetInflightPolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}

    def eval(self, parameters: JSONObject, input_data: AutoscaleInput, context: JSONObject) -> AutoscaleAnswer:
        target = _positive(parameters, "target", 2)
        bm = input_data["payload"]["block_metrics"] or {}
        inflight, queue = _num(bm, "inflight") or 0.0, _num(bm, "queue") or 0.0
        ongoing = inflight + queue
        desired = math.ceil(ongoing / target - 1e-9) if ongoing > 0 else 0
        return {"desired": desired, "reason": f"{ongoing:g} ongoing ({inflight:g} in flight + {queue:g} queued) / target {target:g} per instance"}


class QueueDepthPolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}

    def eval(self, parameters: JSONObject, input_data: AutoscaleInput, context: JSONObject) -> AutoscaleAnswer:
        target = _positive(parameters, "target", 4)
        running_target = _positive(parameters, "runningTarget", 8)
        bm = input_data["payload"]["block_metrics"] or {}
        waiting = (_num(bm, "waiting") or 0.0) + (_num(bm, "queue") or 0.0)
        running = _num(bm, "running")
        if running is None:
            running = _num(bm, "inflight") or 0.0
        by_wait = math.ceil(waiting / target - 1e-9) if waiting > 0 else 0
        by_run = math.ceil(running / running_target - 1e-9) if running > 0 else 0
        return {"desired": max(by_wait, by_run),
                "reason": f"{waiting:g} waiting / target {target:g} -> {by_wait}; {running:g} running / {running_target:g} -> {by_run}"}
