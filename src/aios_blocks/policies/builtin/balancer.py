"""Built-in loadBalancer policies (seed-000 class shape), cheap enough to run once per task inline.

Input (``action: "route"``, docs/policies.md)::

    {"action": "route", "payload": {"block": BID, "task": {...metadata...},
                                    "instances": [{"id", "node", "endpoint", "state", "inflight",
                                                   "max_ongoing", "weight", "health", "metrics": {...}}, ...]}}

The executor passes only instances that may take a task now (``ready`` and under ``maxOngoing``),
so a built-in never has to filter; the answer is ``{"instance_id": ID}``. ``weight`` (0..1, default
1) is the health checker's: a ``degrade`` verdict lowers it (docs/health.md), and every built-in
gives a lower-weight instance less work.

* ``builtin:round-robin``: each instance in turn (a counter; the list order is the map's); an
  instance of weight w < 1 takes its turn with probability w (else the next one does).
* ``builtin:least-inflight`` (the default): power of two choices (Mitzenmacher; Ray Serve's
  request router): two instances at random, the one with fewer tasks in flight (ties: the first
  drawn; with weights, the smaller (in-flight + 1) / weight). O(1) per decision whatever the instance count, and no herd on one "best" instance
  when many executors decide on slightly stale views.
* ``builtin:least-queue``: the engine's own queue (``metrics.num_requests_waiting`` +
  ``metrics.num_requests_running``, vLLM's names, as scraped) plus this executor's in-flight
  tasks; when ``metrics.kv_cache_usage_perc`` is reported, an instance whose KV cache is nearly
  full (``settings.kvCacheHigh``, default 0.9) is scored as if ``settings.kvCachePenalty``
  (default 8) more tasks waited (llm-d's queue and KV-cache scorers, in one sum). Scans
  ``settings.sample`` instances at random (default 16; all when there are fewer). With weights
  the score is (score + 1) / weight.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from ...schemas.policy_io import RouteAnswer, RouteInput, as_float, as_int
from ...schemas.records import JSONObject, RouteView


def weight_of(inst: RouteView) -> float:
    """The health checker's routing weight of an instance (1 when none; never below 0.01)."""
    try:
        w = float(inst.get("weight", 1.0))
    except (TypeError, ValueError):
        return 1.0
    return min(1.0, max(0.01, w)) if w == w else 1.0


def _instances(input_data: RouteInput) -> list[RouteView]:
    insts = input_data["payload"]["instances"]
    if not insts:
        raise ValueError("no instance to route to")
    return insts


class RoundRobinPolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}
        self._next = 0

    def eval(self, parameters: JSONObject, input_data: RouteInput, context: JSONObject) -> RouteAnswer:
        insts = _instances(input_data)
        n = self._next % len(insts)
        for _ in range(len(insts)):  # a degraded instance may pass its turn to the next
            w = weight_of(insts[n])
            if w >= 1.0 or random.random() < w:
                break
            n = (n + 1) % len(insts)
        self._next = n + 1
        return {"instance_id": insts[n]["id"]}


class LeastInflightPolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}
        self._rand = random.Random()

    def eval(self, parameters: JSONObject, input_data: RouteInput, context: JSONObject) -> RouteAnswer:
        insts = _instances(input_data)
        if len(insts) == 1:
            return {"instance_id": insts[0]["id"]}
        a, b = self._rand.sample(insts, 2)
        wa, wb = a.get("weight", 1.0), b.get("weight", 1.0)
        if wa == wb:  # the common case: no degraded instance among the two
            return {"instance_id": (b if b["inflight"] < a["inflight"] else a)["id"]}
        sa, sb = (a["inflight"] + 1) / weight_of(a), (b["inflight"] + 1) / weight_of(b)
        return {"instance_id": (b if sb < sa else a)["id"]}


def queue_score(inst: RouteView, kv_high: float, kv_penalty: float) -> float:
    score = _queue_score(inst, kv_high, kv_penalty)
    w = inst.get("weight", 1.0)
    return score if w == 1.0 else (score + 1) / weight_of(inst)


def _queue_score(inst: RouteView, kv_high: float, kv_penalty: float) -> float:
    m: Mapping[str, object] = inst.get("metrics") or {}
    score = float(inst.get("inflight", 0))
    score += as_float(m.get("num_requests_waiting", 0) or 0) + as_float(m.get("num_requests_running", 0) or 0)
    kv = m.get("kv_cache_usage_perc")
    if kv is not None and as_float(kv) >= kv_high:
        score += kv_penalty
    return score


class LeastQueuePolicy:
    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}
        s = self.settings
        self.sample = as_int(s.get("sample", 16))
        self.kv_high = as_float(s.get("kvCacheHigh", 0.9))
        self.kv_penalty = as_float(s.get("kvCachePenalty", 8))
        self._rand = random.Random()

    def eval(self, parameters: JSONObject, input_data: RouteInput, context: JSONObject) -> RouteAnswer:
        insts = _instances(input_data)
        if len(insts) > self.sample:
            insts = self._rand.sample(insts, self.sample)
        else:  # a random start: ties do not all land on the first instance
            k = self._rand.randrange(len(insts))
            insts = insts[k:] + insts[:k]
        best, best_score = insts[0], queue_score(insts[0], self.kv_high, self.kv_penalty)
        for inst in insts[1:]:
            s = queue_score(inst, self.kv_high, self.kv_penalty)
            if s < best_score:
                best, best_score = inst, s
        return {"instance_id": best["id"]}


DEFAULT = "builtin:least-inflight"
