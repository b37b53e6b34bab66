"""The seed-000 policy contract: what each action must return. A wrong shape fails the step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..schemas.lifecycle import InstanceStatus
from ..schemas.records import ScaleDownCandidate

CLUSTER_ACTIONS = ("selection", "post_dry_run")
RESOURCE_ACTIONS = ("dry_run", "allocation", "scale", "reassignment", "scale_down")
#: loadBalancer: ``route`` once per task (inline), ``weights`` periodically (Starlark, off the task path)
BALANCER_ACTIONS = ("route", "weights")
#: autoscaler: once per tick per block (``handlers/autoscale.py`` stabilises the answer)
AUTOSCALER_ACTIONS = ("autoscale",)
#: stabilityChecker: ``health_check`` once per block per health checker tick (docs/health.md)
HEALTH_ACTIONS = ("health_check",)
VERDICTS = ("healthy", "degrade", "unready", "restart", "replace")
#: preemption: ``preempt`` once per block that fits nowhere (docs/priority.md)
PREEMPTION_ACTIONS = ("preempt",)
#: rebalancer: ``rebalance`` per trigger (a pending block, fragmentation, ``blocks rebalance``; docs/rebalance.md)
REBALANCER_ACTIONS = ("rebalance",)


class WrongShape(ValueError):
    pass


class ChoiceRefused(ValueError):
    """The policy's ``scale_down`` answer names no instance this step may remove."""


def default_pick(cands: Sequence[ScaleDownCandidate]) -> str:
    """The framework's default: the least loaded instance (no sample counts as 0), the newest
    first among equals (a starting instance before a running one), then the greatest id."""
    if not cands:
        raise ChoiceRefused("no instance to remove")

    def key(c: ScaleDownCandidate) -> tuple[Any, ...]:
        starting = c.get("status") == InstanceStatus.STARTING
        return (float(c.get("load") or 0.0), not starting, -float(c.get("since") or 0.0))

    # min() keeps the first of equals: go through the ids greatest first
    return str(min(sorted(cands, key=lambda c: str(c["instance_id"]), reverse=True), key=key)["instance_id"])


def _is_number(v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def check(action: str, result: Any) -> None:
    """Raise :class:`WrongShape` with a precise message if ``result`` breaks the contract."""
    checker = _CHECKS.get(action)
    if checker is None:
        raise WrongShape(f"unknown action {action!r}")
    checker(result)


def _check_selection(result: Any) -> None:
    if not isinstance(result, dict) or not isinstance(result.get("clusters"), list):
        raise WrongShape(f'selection must return {{"clusters": [...]}}, got {_short(result)}')
    for i, c in enumerate(result["clusters"]):
        if not (isinstance(c, str) or (isinstance(c, dict) and isinstance(c.get("cluster_id", c.get("id")), str))):
            raise WrongShape(f"selection clusters[{i}] is neither a cluster entry nor a cluster id: {_short(c)}")


def _check_post_dry_run(result: Any) -> None:
    if isinstance(result, str):
        return
    if not isinstance(result, dict) or not isinstance(result.get("cluster_id", result.get("id")), str):
        raise WrongShape(f"post_dry_run must return one of the given cluster entries, got {_short(result)}")


def _check_dry_run(result: Any) -> None:
    ssd = result.get("selection_score_data") if isinstance(result, dict) else None
    if not isinstance(ssd, dict) or not _is_number(ssd.get("score")):
        raise WrongShape(f'dry_run must return {{"selection_score_data": {{"score": 0..1, ...}}}}, got {_short(result)}')
    if not 0.0 <= float(ssd["score"]) <= 1.0:
        raise WrongShape(f"dry_run score must be between 0 and 1, got {ssd['score']}")
    node_info = ssd.get("node_info", {})
    if not isinstance(node_info, dict):
        raise WrongShape(f"dry_run node_info must be an object, got {_short(node_info)}")
    placeable = ssd.get("placeable")
    if placeable is not None and (not isinstance(placeable, int) or isinstance(placeable, bool) or placeable < 0):
        raise WrongShape(f"dry_run placeable (optional) must be a count of instances >= 0, got {_short(placeable)}")


def _placement_check(action: str) -> Callable[[Any], None]:
    """``allocation``, ``scale`` and ``reassignment``: one node and its GPUs."""

    def checker(result: Any) -> None:
        if not isinstance(result, dict) or not isinstance(result.get("node_id"), str) or not result["node_id"]:
            raise WrongShape(f'{action} must return {{"node_id": str, "gpus": [...]}}, got {_short(result)}')
        gpus = result.get("gpus", [])
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            raise WrongShape(f"{action} gpus must be a list of GPU ids, got {_short(gpus)}")

    return checker


def _check_scale_down(result: Any) -> None:
    # {"instance_id": str} names the instance; None or an object without instance_id (a policy
    # that does not know the action) leaves the choice to the framework's default
    if result is None:
        return
    if not isinstance(result, dict):
        raise WrongShape(f'scale_down must return {{"instance_id": str}} (or nothing: the default), got {_short(result)}')
    named = result.get("instance_id")
    if named is not None and (not isinstance(named, str) or not named):
        raise WrongShape(f"scale_down instance_id must be an instance id (str), got {_short(named)}")


def _check_route(result: Any) -> None:
    if not isinstance(result, dict) or not isinstance(result.get("instance_id"), str) or not result["instance_id"]:
        raise WrongShape(f'route must return {{"instance_id": str}} (one of the given instances), got {_short(result)}')


def _check_weights(result: Any) -> None:
    w = result.get("weights") if isinstance(result, dict) else None
    if not isinstance(w, dict) or not all(isinstance(k, str) and _is_number(v) and v >= 0 for k, v in w.items()):
        raise WrongShape(f'weights must return {{"weights": {{instance_id: number >= 0}}}}, got {_short(result)}')


def _check_autoscale(result: Any) -> None:
    if not isinstance(result, dict) or "desired" not in result:
        raise WrongShape(f'autoscale must return {{"desired": N, "reason": "..."}}, got {_short(result)}')
    if not _is_number(result["desired"]) or result["desired"] < 0:
        raise WrongShape(f"autoscale desired must be a finite number >= 0, got {_short(result['desired'])}")
    if not isinstance(result.get("reason", ""), str):
        raise WrongShape(f"autoscale reason (optional) must be a string, got {_short(result.get('reason'))}")


def _check_health(result: Any) -> None:
    v = result.get("verdicts") if isinstance(result, dict) else None
    if not isinstance(v, dict):
        raise WrongShape(f'health_check must return {{"verdicts": {{instance_id: {{"verdict", "reason"}}}}}}, got {_short(result)}')
    for iid, d in v.items():
        _check_verdict(iid, d)


def _check_verdict(iid: Any, d: Any) -> None:
    if not isinstance(iid, str) or not isinstance(d, dict):
        raise WrongShape(f"health_check verdicts[{_short(iid)}] must be an object, got {_short(d)}")
    if d.get("verdict") not in VERDICTS:
        raise WrongShape(f"health_check verdicts[{iid!r}].verdict must be one of {', '.join(VERDICTS)}, got {_short(d.get('verdict'))}")
    if not isinstance(d.get("reason", ""), str):
        raise WrongShape(f"health_check verdicts[{iid!r}].reason must be a string, got {_short(d.get('reason'))}")
    w = d.get("weight")
    if w is not None and (not _is_number(w) or not 0 < w <= 1):
        raise WrongShape(f"health_check verdicts[{iid!r}].weight (optional) must be a number in (0, 1], got {_short(w)}")


def _check_preempt(result: Any) -> None:
    v = result.get("victims") if isinstance(result, dict) else None
    if not isinstance(v, dict) or not all(
        isinstance(n, str) and isinstance(ids, list) and all(isinstance(i, str) and i for i in ids) for n, ids in v.items()
    ):
        raise WrongShape(f'preempt must return {{"victims": {{node_id: [instance_id, ...]}}}} (empty: none), got {_short(result)}')


def _check_rebalance(result: Any) -> None:
    moves = result.get("moves") if isinstance(result, dict) else None
    if not isinstance(moves, list):
        raise WrongShape(f'rebalance must return {{"moves": [{{"instance_id", "from", "to", ...}}]}} (empty: none), got {_short(result)}')
    for i, m in enumerate(moves):
        if not isinstance(m, dict) or not all(isinstance(m.get(k), str) and m[k] for k in ("instance_id", "from", "to")):
            raise WrongShape(f"rebalance moves[{i}] must name instance_id, from and to (strings), got {_short(m)}")
        if m["from"] == m["to"]:
            raise WrongShape(f"rebalance moves[{i}] moves {m['instance_id']} from {m['from']} to the same node")
        if not isinstance(m.get("reason", ""), str):
            raise WrongShape(f"rebalance moves[{i}].reason (optional) must be a string, got {_short(m.get('reason'))}")


#: action -> the check of its answer (``check``)
_CHECKS: dict[str, Callable[[Any], None]] = {
    "selection": _check_selection,
    "post_dry_run": _check_post_dry_run,
    "dry_run": _check_dry_run,
    **{action: _placement_check(action) for action in ("allocation", "scale", "reassignment")},
    "scale_down": _check_scale_down,
    "route": _check_route,
    "weights": _check_weights,
    "autoscale": _check_autoscale,
    "health_check": _check_health,
    "preempt": _check_preempt,
    "rebalance": _check_rebalance,
}


def cluster_id_of(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    return str(entry.get("cluster_id", entry.get("id")))


def essential(action: str, output: Any) -> Any:
    """What of a well-formed output the flow acts on, for the decision record: the chosen
    cluster ids of a clusterAllocator's answer (which otherwise repeats the cluster entries of its
    input); other actions' outputs are small and kept whole (the same object)."""
    if action == "selection" and isinstance(output, dict) and isinstance(output.get("clusters"), list):
        return {"clusters": [{"cluster_id": cluster_id_of(c)} for c in output["clusters"]]}
    if action == "post_dry_run" and isinstance(output, (dict, str)):
        return {"cluster_id": cluster_id_of(output)}
    return output


def _short(v: Any, limit: int = 200) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."
