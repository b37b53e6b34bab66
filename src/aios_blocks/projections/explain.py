"""``blocks explain``: a block's recorded events (from the stream alone) folded into the why of its
placement - candidates and why others were filtered, each cluster's dry_run score and node/GPUs,
why the final cluster won, each instance's node and GPUs, every failure with its reason - and of
its size: each instance target asked for (by whom), each autoscaler decision (from, to, the
policy's proposal and reason, the framework's rules) and failed autoscaler tick - and of its
health: the health checker's verdicts on each instance (with their reasons) and failed ticks;
for Adaptive affinity entries, the adapt stage's table (per node p50 and weight multiplier) and
each instance's base and adapted weights with why.

A projection (``projections.base``): one method per catalog event, each reading its payload struct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NotRequired, TypedDict

import msgspec

from ..schemas import condition as cond
from ..schemas import events as ev
from ..schemas import moves as mvs
from ..schemas import priority as pr
from ..schemas.catalog import E, Event
from .base import Fact, Projection, StoredDoc, on, parse

if TYPE_CHECKING:
    from ..cli.pending import Waiting

_builtins = msgspec.to_builtins

#: the block's status after each event that ends a step of its story
_STATUS = {E.block_submitted: "submitted", E.block_create: "submitted", E.block_parsed: "parsed",
           E.block_ready: "ready", E.block_deleted: "deleted"}
#: an instance's status after an agent's report
_INSTANCE_STATUS = {E.instance_added: "running", E.instance_removed: "removed", E.instance_failed: "failed",
                    E.instance_unhealthy: "unhealthy"}
#: the step a failed step's event names when its payload names none
_FAILED_STEP = {E.block_scale_failed: "scale", E.block_reassignment_failed: "reassignment"}


class DryRunAnswer(TypedDict):
    """One cluster's dry_run answer in a round (``ev.DryRunResult``'s fields the story keeps)."""

    score: float
    node: str
    gpus: list[str]
    error: str
    rejected_nodes: dict[str, str]
    node_scores: dict[str, float]
    #: the adapt stage's table (``ev.DryRunResult.adapt``)
    adapt: Any
    skipped: str


class Round(TypedDict):
    """One selection round: the candidates, the clusters filtered out and why, their answers."""

    round: int
    candidates: list[str]
    filtered: dict[str, str]
    dry_run: dict[str, DryRunAnswer]
    chosen: str
    why: str
    missing: list[str]


class InstanceFailure(TypedDict):
    event: str
    reason: str


class VerdictNote(TypedDict):
    verdict: str
    reason: str
    policy: str


class InstanceStory(TypedDict):
    """One instance: where it was placed, by what, what became of it."""

    node: str
    gpus: list[str]
    action: str
    status: NotRequired[str]
    replaces: NotRequired[str]
    #: ``ev.Placement.adaptive`` and ``.topology`` where set
    adaptive: NotRequired[Any]
    topology: NotRequired[dict[str, str]]
    reason: NotRequired[str]
    health: NotRequired[str]
    failures: NotRequired[list[InstanceFailure]]
    verdicts: NotRequired[list[VerdictNote]]


class Failure(TypedDict):
    step: str
    #: an allocation's selection round
    round: NotRequired[int]
    reason: str


class PolicyCalls(TypedDict):
    calls: int
    us: int
    #: action -> calls
    actions: dict[str, int]


class Calls(TypedDict):
    """The policy calls recorded: how many, failed, time in policies, by ``kind:policy@version``;
    ``blocks explain --inputs`` adds the replay's checks and the calls themselves."""

    count: int
    errors: int
    total_us: int
    by_policy: dict[str, PolicyCalls]
    inputs: NotRequired[dict[str, int]]
    calls: NotRequired[list[dict[str, object]]]


class Target(TypedDict):
    time: str
    target: int
    source: str
    reason: str
    request_id: str


#: one autoscaler decision (``ev.Autoscaled``; ``from`` is a keyword)
AutoscalerDecision = TypedDict("AutoscalerDecision", {
    "time": str, "from": int, "to": int, "proposal": float, "reason": str, "rules": list[str], "in_burst": bool,
    "stable": float, "burst": float, "inputs": Any, "request_id": str,
})


class AutoscalerFailure(TypedDict):
    time: str
    reason: str
    count: int
    quiet: int


class AutoscalerStory(TypedDict):
    decisions: list[AutoscalerDecision]
    failures: list[AutoscalerFailure]


class MoveStepNote(TypedDict):
    step: str
    time: str
    reason: str


#: one make-before-break move and its steps (``from`` is a keyword)
MoveStory = TypedDict("MoveStory", {
    "move_id": str, "instance": str, "from": str, "to": str, "new": str, "status": str, "reason": str,
    "requested_by": str, "steps": list[MoveStepNote],
})


class SpecErrorDoc(TypedDict):
    """``schemas.errors.SpecError`` as JSON."""

    path: str
    message: str


class ShortSpell(TypedDict):
    """A spell below ``minInstances`` the reconciler could not bring back (``block.degraded``, then
    ``block.restored``; docs/reliability.md "Short blocks")."""

    since: float
    live: int
    min_instances: int
    reason: str
    #: when it was whole again ("" while it lasts), and how
    restored: str
    restored_reason: str


class Explanation(TypedDict):
    """``blocks explain``'s document (``--json`` prints it; ``cli.render._render_explain`` shows it)."""

    block_id: str
    status: str
    reason: str
    rounds: list[Round]
    instances: dict[str, InstanceStory]
    failures: list[Failure]
    decisions: Calls
    rejected_errors: list[SpecErrorDoc]
    targets: list[Target]
    autoscaler: AutoscalerStory
    #: the latest adapt stage table a placement (or dry_run) used: {} without Adaptive entries
    adapt: Any
    #: make-before-break moves (docs/rebalance.md), in the order asked: each with its steps
    moves: list[MoveStory]
    #: its spells short of minInstances, oldest first (the last one open while ``restored`` is "")
    short: list[ShortSpell]
    #: added by ``blocks explain`` for a block in the pending queue (docs/priority.md)
    pending: NotRequired[Waiting]


def _empty() -> Explanation:
    return {
        "block_id": "",
        "status": "unknown",
        "reason": "",
        "rounds": [],
        "instances": {},
        "failures": [],
        "decisions": {"count": 0, "errors": 0, "total_us": 0, "by_policy": {}},
        "rejected_errors": [],
        "targets": [],
        "autoscaler": {"decisions": [], "failures": []},
        "adapt": {},
        "moves": [],
        "short": [],
    }


class Explain(Projection):
    """One block's explanation (``out``), built event by event."""

    #: events of a block's story that add nothing to its explanation
    ignores: ClassVar[frozenset[Event[Any]]] = frozenset({E.block_delete})

    def __init__(self) -> None:
        self.out = _empty()
        self.rounds: dict[int, Round] = {}

    def result(self) -> Explanation:
        self.out["rounds"] = [self.rounds[k] for k in sorted(self.rounds)]
        return self.out

    def _round(self, n: int) -> Round:
        if n not in self.rounds:
            self.rounds[n] = {"round": n, "candidates": [], "filtered": {}, "dry_run": {}, "chosen": "", "why": "", "missing": []}
        return self.rounds[n]

    def _calls(self, calls: list[ev.Decision]) -> None:
        """Policy calls, counted by policy and action."""
        d = self.out["decisions"]
        for call in calls:
            d["count"] += 1
            d["total_us"] += call.duration_us
            d["errors"] += 1 if call.error else 0
            # a stored policy is named by its URI and version, as `blocks replay` names it
            # (registry:packer@v2): the version alone ("@2") did not say which policy it was
            per = d["by_policy"].setdefault(f"{call.kind}:{call.policy}@{call.uri}" + (f"@v{call.version}" if call.version else ""),
                                            {"calls": 0, "us": 0, "actions": {}})
            per["calls"] += 1
            per["us"] += call.duration_us
            per["actions"][call.action] = per["actions"].get(call.action, 0) + 1

    def _failure(self, step: str, reason: str) -> None:
        self.out["failures"].append({"step": step, "reason": reason})

    def _dry_run(self, r: Round, a: ev.DryRunResult) -> None:
        """One cluster's dry_run answer in its round."""
        r["dry_run"][a.cluster_id] = {
            "score": a.score, "node": a.node_info.get("node_id", ""), "gpus": a.node_info.get("gpus", []), "error": a.error,
            "rejected_nodes": a.rejected_nodes, "node_scores": a.node_scores, "adapt": a.adapt, "skipped": a.skipped,
        }
        if a.adapt:
            self.out["adapt"] = a.adapt
        self._calls(a.decisions)

    # -- the block's steps ------------------------------------------------------------------------
    @on(E.block_submitted, E.block_create, E.block_parsed, E.block_ready, E.block_deleted)
    def on_status(self, m: Fact[Any]) -> None:
        """``create``: stored in AIOS by versions before AIOS_INTAKE. A waiting block's reason goes
        with its wait (the next round's ``parsed``, or its placement)."""
        if self.out["status"] == "pending":
            self.out["reason"] = ""
        self.out["status"] = _STATUS[m.event]

    @on(E.block_pending)
    def on_pending(self, m: Fact[pr.Pending]) -> None:
        """Fits nowhere now, or a whole victim of a preemption: it waits in the pending queue, with
        the reason, as the recovery fold has it (its status was left at ``parsed``, or ``ready`` for
        a victim, and no reason, which a tenant, who has no pending-queue line, could not learn)."""
        self.out["status"], self.out["reason"] = "pending", m.data.reason

    @on(E.block_rejected)
    def on_rejected(self, m: Fact[ev.Rejected]) -> None:
        self.out["status"] = "rejected"
        self.out["rejected_errors"] = _builtins(m.data.errors)
        self.out["reason"] = "; ".join(f"{e.path}: {e.message}" for e in m.data.errors)

    @on(E.block_failed)
    def on_failed(self, m: Fact[ev.BlockStatusReport]) -> None:
        self.out["status"], self.out["reason"] = "failed", m.data.reason
        self._failure("block", m.data.reason)

    @on(E.block_selection)
    def on_selection(self, m: Fact[ev.Selection]) -> None:
        r = self._round(m.data.attempt)
        r["candidates"], r["filtered"] = m.data.candidates, m.data.filtered
        self._calls(m.data.decisions)

    @on(E.block_dry_run_result)
    def on_dry_run(self, m: Fact[ev.DryRunResult]) -> None:
        """Stored apart by versions before the answers went into ``post_dry_run``."""
        self._dry_run(self._round(m.data.attempt), m.data)

    @on(E.block_post_dry_run)
    def on_post_dry_run(self, m: Fact[ev.PostDryRun]) -> None:
        d = m.data
        r = self._round(d.attempt)
        for a in d.answers:
            self._dry_run(r, a)
        r["chosen"], r["missing"] = d.cluster_id, d.missing
        if d.cluster_id:
            others = ", ".join(f"{c} {s:g}" for c, s in sorted(d.scores.items()) if c != d.cluster_id)
            r["why"] = f"clusterAllocator chose {d.cluster_id} with score {d.scores.get(d.cluster_id, 0):g}" + (
                f" (others: {others})" if others else "")
            skipped = next((a.skipped for a in d.answers if a.cluster_id == d.cluster_id and a.skipped), "")
            if skipped:  # the only candidate: no dry run was asked (workers.gateway.skip_reason)
                r["why"] += f" ({skipped})"
        self._calls(d.decisions)

    @on(E.block_placement)
    def on_placement(self, m: Fact[ev.PlacementMade]) -> None:
        d = m.data
        if d.adapt:
            self.out["adapt"] = d.adapt
        for p in d.placements:
            inst: InstanceStory = {
                "node": p.node_id, "gpus": p.gpus, "action": d.action, "status": "placed", "replaces": d.replaces,
            }
            self.out["instances"][p.instance_id] = inst
            if p.adaptive:
                inst["adaptive"] = p.adaptive
            if p.topology:  # the GPU link tier achieved and the best the node had (docs/topology.md)
                inst["topology"] = p.topology
        self._calls(d.decisions)

    @on(E.block_allocation_failed)
    def on_allocation_failed(self, m: Fact[ev.StepFailed]) -> None:
        rnd = int(m.data.request_id) if m.data.request_id.isdigit() else 0
        self.out["failures"].append({"step": "allocation", "round": rnd, "reason": m.data.reason})
        self._calls(m.data.decisions)

    @on(E.block_scale_failed, E.block_reassignment_failed)
    def on_step_failed(self, m: Fact[ev.StepFailed]) -> None:
        self._failure(m.data.step or _FAILED_STEP[m.event], m.data.reason)
        self._calls(m.data.decisions)

    @on(E.block_degraded)
    def on_degraded(self, m: Fact[cond.BlockShort]) -> None:
        d = m.data
        self.out["short"].append({"since": d.since, "live": d.live, "min_instances": d.min_instances, "reason": d.reason,
                                  "restored": "", "restored_reason": ""})

    @on(E.block_restored)
    def on_restored(self, m: Fact[cond.BlockShort]) -> None:
        spells = self.out["short"]
        if spells and not spells[-1]["restored"]:
            spells[-1]["restored"], spells[-1]["restored_reason"] = m.time, m.data.reason

    @on(E.block_health_failed)
    def on_health_failed(self, m: Fact[ev.StepFailed]) -> None:
        self._failure("health_check", m.data.reason)
        self._calls(m.data.decisions)

    @on(E.block_scale_down_failed)
    def on_scale_down_failed(self, m: Fact[ev.StepFailed]) -> None:
        self._calls(m.data.decisions)

    @on(E.block_scale_down_chosen)
    def on_scale_down_chosen(self, m: Fact[ev.ScaleDownChosen]) -> None:
        self._calls(m.data.decisions)

    @on(E.block_decision)
    def on_decision(self, m: Fact[ev.Decision]) -> None:
        self._calls([m.data])

    # -- instances --------------------------------------------------------------------------------
    def _instance(self, iid: str, node: str, gpus: list[str]) -> InstanceStory:
        return self.out["instances"].setdefault(iid, {"node": node, "gpus": gpus, "action": ""})

    @on(E.instance_added, E.instance_removed, E.instance_failed, E.instance_unhealthy)
    def on_instance(self, m: Fact[ev.InstanceEvent]) -> None:
        iid, d = m.tokens["iid"], m.data
        inst = self._instance(iid, d.node_id, d.gpus)
        inst["status"] = _INSTANCE_STATUS[m.event]
        if d.reason:
            inst["reason"] = d.reason
        if m.event in (E.instance_failed, E.instance_unhealthy):  # an agent's report: kept, whatever comes later
            kind = _INSTANCE_STATUS[m.event]
            inst.setdefault("failures", []).append({"event": kind, "reason": d.reason})
            self._failure(f"instance {iid}" + (" health" if m.event is E.instance_unhealthy else ""), d.reason)

    @on(E.instance_verdict)
    def on_verdict(self, m: Fact[ev.InstanceVerdict]) -> None:
        """The health checker's (docs/health.md): the instance's health, not its status."""
        d = m.data
        inst = self._instance(m.tokens["iid"], d.node_id, [])
        inst["health"] = d.verdict
        inst.setdefault("verdicts", []).append({"verdict": d.verdict, "reason": d.reason, "policy": d.policy})

    # -- moves (docs/rebalance.md) -----------------------------------------------------------------
    def _move(self, mid: str) -> MoveStory:
        for known in self.out["moves"]:
            if known["move_id"] == mid:
                return known
        mv_: MoveStory = {"move_id": mid, "instance": "", "from": "", "to": "", "new": "", "status": "requested",
                          "reason": "", "requested_by": "", "steps": []}
        self.out["moves"].append(mv_)
        return mv_

    @on(E.block_move_requested)
    def on_move_requested(self, m: Fact[mvs.MoveRequested]) -> None:
        d = m.data
        mv_ = self._move(d.move_id)
        mv_["instance"], mv_["to"], mv_["reason"] = d.instance_id, mv_["to"] or d.to_node, d.reason
        mv_["requested_by"] = d.requested_by
        mv_["steps"].append({"step": "requested", "time": m.time, "reason": d.reason})

    @on(E.block_move_started, E.block_move_switched, E.block_move_completed, E.block_move_failed)
    def on_move_step(self, m: Fact[mvs.MoveStep]) -> None:
        """Each step with its reason; the move's status is its last step."""
        d, word = m.data, m.event.name.rsplit(".", 1)[1]
        mv_ = self._move(d.move_id)
        mv_["instance"], mv_["status"] = d.instance_id, word
        mv_["requested_by"] = d.requested_by or mv_["requested_by"]
        mv_["from"] = d.from_node or mv_["from"]
        mv_["to"] = d.to_node or mv_["to"]
        mv_["new"] = d.new_instance_id or mv_["new"]
        mv_["steps"].append({"step": word, "time": m.time, "reason": d.reason})
        if m.event is E.block_move_failed:
            self._failure(f"move {d.move_id}", d.reason)
        self._calls(d.decisions)

    # -- its size ---------------------------------------------------------------------------------
    @on(E.block_scale_target)
    def on_target(self, m: Fact[ev.ScaleTarget]) -> None:
        d = m.data
        self.out["targets"].append({"time": m.time, "target": d.target, "source": d.source, "reason": d.reason,
                                    "request_id": d.request_id})

    @on(E.block_autoscaled)
    def on_autoscaled(self, m: Fact[ev.Autoscaled]) -> None:
        d = m.data
        self.out["autoscaler"]["decisions"].append({
            "time": m.time, "from": d.current, "to": d.desired, "proposal": d.raw, "reason": d.reason, "rules": d.rules,
            "in_burst": d.in_burst, "stable": d.stable, "burst": d.burst, "inputs": d.inputs, "request_id": d.request_id,
        })
        self._calls(d.decisions)

    @on(E.block_autoscale_failed)
    def on_autoscale_failed(self, m: Fact[ev.AutoscaleFailed]) -> None:
        d = m.data
        self.out["autoscaler"]["failures"].append({"time": m.time, "reason": d.reason, "count": d.current, "quiet": d.quiet})
        self._calls(d.decisions)


def explain(events: Sequence[tuple[str, StoredDoc]]) -> Explanation:
    """A block's events (subject, CloudEvent as a JSON document), oldest first -> its explanation."""
    x = Explain()
    for subject, env in events:
        if not x.out["block_id"]:
            found = parse(subject)
            x.out["block_id"] = found[1].get("bid", "") if found else ""
        x.feed_doc(subject, env)
    return x.result()
