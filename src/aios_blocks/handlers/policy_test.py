"""``blocks policy test``: what a candidate policy version would have decided differently on
recorded traffic (like ``nomad job plan``, for policies). Pure: recorded decisions in, a report out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypedDict

import msgspec

from ..policies import contract
from ..schemas.records import DecisionRecord, JSONObject

#: run(input_data) -> output of the candidate policy (raises on failure)
Run = Callable[[JSONObject], Awaitable[Any]]


def summarize(action: str, output: Any) -> str:
    """The part of an output that matters for a placement decision."""
    if action == "scale_down":  # {"instance_id"}, or nothing / no instance_id: the framework's default pick
        named = output.get("instance_id") if isinstance(output, dict) else None
        return str(named) if named else "default pick"
    if output is None:
        return "-"
    if action == "preempt":  # the victims, by block (what the preemption acts on)
        victims = sorted(i for ids in (output.get("victims") or {}).values() for i in ids)
        return ",".join(victims) or "no preemption"
    if action == "rebalance":  # the moves (what the rebalancer acts on)
        return ",".join(f"{m.get('instance_id')}:{m.get('from')}->{m.get('to')}" for m in output.get("moves") or []) or "no move"
    if action == "selection":
        return ",".join(contract.cluster_id_of(c) for c in output.get("clusters", []))
    if action == "post_dry_run":
        return contract.cluster_id_of(output)
    if action == "dry_run":
        ssd = output.get("selection_score_data", {})
        node = (ssd.get("node_info") or {}).get("node_id", "")
        return f"{ssd.get('score', 0):g}@{node}" if node else f"{ssd.get('score', 0):g}"
    return f"{output.get('node_id')}{output.get('gpus', [])}"


#: actions whose whole output is recorded (``contract.essential`` keeps it whole) and compared byte
#: for byte, not by summary: a preemption replayed from its block's story gives the same bytes
EXACT_ACTIONS = frozenset({"preempt"})


def refused(action: str, input_data: Any, output: Any) -> str:
    """Why the gateway would refuse a clusterAllocator's (well-shaped) answer to this input, as its
    ``select`` / ``choose`` do: a cluster that is not a candidate, or none; ``""`` when it would act on it."""
    if action == "selection":
        candidates = [contract.cluster_id_of(c) for c in input_data.get("filter_result") or []]
        chosen = [contract.cluster_id_of(c) for c in output.get("clusters", [])]
        outside = [c for c in dict.fromkeys(chosen) if c not in candidates]
        if outside:
            return f"clusterAllocator selected cluster(s) that are not candidates: {outside}; candidates: {candidates}"
        if not chosen:
            return "clusterAllocator selected no cluster"
    elif action == "post_dry_run":
        candidates = [contract.cluster_id_of(c) for c in input_data.get("clusters") or []]
        cid = contract.cluster_id_of(output)
        if cid not in candidates:
            return f"clusterAllocator chose {cid!r}, which was not a candidate"
    return ""


def output_bytes(output: Any) -> bytes:
    """An output as the decision record stores it (``workers.base``: ``msgspec.json.encode``)."""
    return msgspec.json.encode(output)


class ExactReplay(TypedDict):
    """One exact replay (``EXACT_ACTIONS``): the recorded output's bytes against the candidate's."""

    block_id: str
    action: str
    identical: bool
    recorded_sha256: str
    replayed_sha256: str
    bytes: int


class Change(TypedDict):
    """A recorded decision the candidate decides differently: both summaries and the verdict."""

    block_id: str
    action: str
    before: str
    after: str
    verdict: str


class Report(TypedDict):
    """``compare``'s report (``blocks policy test --json``)."""

    #: decisions by verdict: same, changed, newly_failing, newly_feasible, skipped (no input)
    counts: dict[str, int]
    changes: list[Change]
    total: int
    replays: list[ExactReplay]
    identical: int


def _replay(d: DecisionRecord, out: Any) -> ExactReplay:
    """One exact replay: the recorded output's bytes against the candidate's."""
    before, after = output_bytes(d.get("output")), output_bytes(out)
    return {"block_id": d["block_id"], "action": d["action"], "identical": before == after,
            "recorded_sha256": hashlib.sha256(before).hexdigest()[:16], "replayed_sha256": hashlib.sha256(after).hexdigest()[:16],
            "bytes": len(after)}


def _recorded(d: DecisionRecord) -> tuple[str, bool]:
    """What the decision recorded, summarized, and whether that step failed: an error, or an
    answer the gateway refused (the policy answered, the flow's checks failed the step)."""
    action = d["action"]
    if d.get("error"):
        return "error: " + d["error"], True
    why = "" if d.get("output") is None else refused(action, d["input"], d["output"])
    return ("error: " + why, True) if why else (summarize(action, d.get("output")), False)


async def _rerun(d: DecisionRecord, run: Run, before: str) -> tuple[str, bool, ExactReplay | None]:
    """The candidate's answer to the recorded input, summarized; whether it fails (raises, the
    wrong shape, an answer the flow refuses); an exact action's byte-for-byte replay."""
    action = d["action"]
    try:
        out = await run(d["input"])
        contract.check(action, out)
        why = refused(action, d["input"], out)  # the flow's own checks, not only the shape's
        if why:
            raise ValueError(why)
    except Exception as exc:
        return f"error: {exc}", True, None
    after = summarize(action, out)
    replay = _replay(d, out) if action in EXACT_ACTIONS and not d.get("error") else None
    if replay is not None and after == before and not replay["identical"]:
        after += " (output differs)"
    return after, False, replay


def _verdict(before: str, after: str, failed_before: bool, failed_now: bool) -> str:
    if after == before:
        return "same"
    if failed_now and not failed_before:
        return "newly_failing"
    if failed_before and not failed_now:
        return "newly_feasible"
    return "changed"


async def compare(decisions: Sequence[DecisionRecord], run: Run) -> Report:
    """Re-run each recorded decision (whose input is available) and classify the difference. A
    ``preempt`` decision (``EXACT_ACTIONS``) is the same only when the candidate's whole output is
    byte for byte the recorded one (``replays``: each with both digests); a difference outside its
    victims shows as ``changed`` with ``(output differs)``."""
    rows: list[Change] = []
    replays: list[ExactReplay] = []
    counts = {"same": 0, "changed": 0, "newly_failing": 0, "newly_feasible": 0, "skipped": 0}
    for d in decisions:
        if d.get("input") is None:
            counts["skipped"] += 1
            continue
        before, failed_before = _recorded(d)
        after, failed_now, replay = await _rerun(d, run, before)
        if replay is not None:
            replays.append(replay)
        verdict = _verdict(before, after, failed_before, failed_now)
        counts[verdict] += 1
        if verdict != "same":
            rows.append({"block_id": d["block_id"], "action": d["action"], "before": before, "after": after, "verdict": verdict})
    return {"counts": counts, "changes": rows, "total": len(decisions), "replays": replays,
            "identical": sum(1 for r in replays if r["identical"])}
