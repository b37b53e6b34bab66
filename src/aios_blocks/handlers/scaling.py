"""Scaling decisions: a block's desired instance count (``block.scale.target``) and the
``scale_down`` step's choice of instance. Pure functions; the controller worker
(``workers/controller.py``) reads the snapshot, calls them and commits (docs/policies.md,
"resourceAllocator: scale_down").

* A target is clamped to ``[minInstances, maxInstances]`` (:func:`clamp`, the clamp is said in
  the reason), stored on the block (``desired``, compare-and-set by the target event's stream
  sequence: the latest target wins) and reached with ``scale`` steps (one per missing instance)
  or one ``scale_down`` step (:func:`plan_target`).
* ``scale_down`` asks the resourceAllocator which instance to remove; a result without an
  ``instance_id`` (a seed-shaped policy that does not know the action returns nothing) takes the
  framework's default, :func:`default_pick` (in ``policies/contract.py``, the built-ins use it too):
  the least loaded instance, the newest first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..policies.contract import ChoiceRefused as ChoiceRefused
from ..policies.contract import default_pick as default_pick
from ..schemas.lifecycle import InstanceStatus
from ..schemas.records import InstanceRecord, InstanceSample, ScaleDownCandidate

#: the instance fields of a ``scale_down`` payload's ``instances`` entries, besides the load
LOAD_KEYS: tuple[Literal["inflight", "running", "waiting", "rate"], ...] = ("inflight", "running", "waiting", "rate")


def clamp(target: int, lo: int, hi: int) -> tuple[int, str]:
    """``target`` within ``[lo, hi]``, and what the clamp did ('' when nothing)."""
    if target < lo:
        return lo, f"{target} raised to minInstances {lo}"
    if target > hi:
        return hi, f"{target} lowered to maxInstances {hi}"
    return target, ""


def target_reason(source: str, reason: str, note: str) -> str:
    """The block's ``desired_reason``: who asked (and why), and the clamp if any."""
    return "; ".join(x for x in (f"{source}: {reason}" if reason else source, f"clamped: {note}" if note else "") if x)


def live(instances: Mapping[str, InstanceRecord]) -> dict[str, InstanceRecord]:
    """The instances that count towards the block's size: starting or running (not removing)."""
    return {iid: rec for iid, rec in instances.items() if rec.get("status") != InstanceStatus.REMOVING}


def running(instances: Mapping[str, InstanceRecord]) -> int:
    return sum(1 for rec in instances.values() if rec.get("status") == InstanceStatus.RUNNING)


@dataclass(frozen=True)
class TargetPlan:
    """What reaching a target takes now: ``up`` scale request ids (one instance each), or a
    scale-down of ``down`` instances (``down_request``)."""

    target: int
    up: list[str] = field(default_factory=list)
    down: int = 0
    down_request: str = ""


def plan_target(
    request_id: str, target: int, instances: Mapping[str, InstanceRecord], instance_id: Any,
) -> TargetPlan:
    """The steps from the block's instances now to ``target`` (already clamped). Scale-ups are
    named ``{request_id}:{k}`` and skip the k whose instance already exists, so a redelivered
    target asks again only for what is still missing (and the stream deduplicates the asks);
    ``instance_id(request id)`` is the controller's instance naming rule."""
    now = live(instances)
    if len(now) < target:
        up: list[str] = []
        k = 0
        while len(now) + len(up) < target:
            rid = f"{request_id}:{k}"
            if instance_id(rid) not in instances:
                up.append(rid)
            k += 1
        return TargetPlan(target, up=up)
    if len(now) > target:
        return TargetPlan(target, down=len(now) - target, down_request=f"{request_id}:down")
    return TargetPlan(target)


def candidates(
    instances: Mapping[str, InstanceRecord], metrics: Mapping[str, InstanceSample], now: float,
) -> list[ScaleDownCandidate]:
    """The ``instances`` of a ``scale_down`` payload: every live instance with its node, GPUs,
    status, when it was placed (``since``, epoch seconds; 0 when unknown) and ``age_s``, and the
    metrics collector's latest figures for it where known (``inflight``, ``running``,
    ``waiting``, ``rate``; ``load`` = inflight + waiting, ``None`` when there is no sample)."""
    out: list[ScaleDownCandidate] = []
    for iid in sorted(live(instances)):
        rec = instances[iid]
        since = float(rec.get("since") or 0.0)
        sample = metrics.get(iid)
        entry: ScaleDownCandidate = {
            "instance_id": iid, "node_id": rec.get("node", ""), "gpus": list(rec.get("gpus") or []),
            "status": rec.get("status", ""), "since": since, "age_s": round(max(now - since, 0.0), 3) if since else None,
            "inflight": None, "running": None, "waiting": None, "rate": None, "load": None,
        }
        for k in LOAD_KEYS:
            entry[k] = sample[k] if sample else None
        entry["load"] = load_of(sample) if sample else None
        out.append(entry)
    return out


def load_of(sample: InstanceSample) -> float:
    """An instance's load from its metrics sample: tasks at it (the executors' in-flight, else
    what the instance says it runs) plus tasks waiting in it."""
    inflight = sample.get("inflight")
    if inflight is None:
        inflight = sample.get("running")
    return float(inflight or 0.0) + float(sample.get("waiting") or 0.0)


def choice(result: Any, cands: list[ScaleDownCandidate]) -> tuple[str, str]:
    """(instance id, ``policy`` | ``default``) from a ``scale_down`` result. A dict with an
    ``instance_id`` names the instance, which must be one of ``cands`` (else ChoiceRefused); any
    other result (``None``, ``{}``, a placement) leaves the choice to :func:`default_pick`."""
    named = result.get("instance_id") if isinstance(result, dict) else None
    if named is None or named == "":
        return default_pick(cands), "default"
    if not isinstance(named, str):
        raise ChoiceRefused(f"scale_down must return {{\"instance_id\": str}}, got instance_id={named!r:.80}")
    if named not in {c["instance_id"] for c in cands}:
        raise ChoiceRefused(f"resourceAllocator scale_down named {named!r}, which is not a live instance of the block "
                            f"(live: {', '.join(c['instance_id'] for c in cands) or 'none'})")
    return named, "policy"
