"""The block lifecycle's decisions on instance facts and delete requests: pure functions
``(event, snapshot) -> list[Effect]``. The lifecycle consumer (``workers/controller.py``) loads the
snapshot, calls one of these and commits the effects (``workers/effects.py``); the rules are
documented in docs/agents.md and the lifecycle table in ``schemas/lifecycle.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..schemas.catalog import E, Emit
from ..schemas.events import InstanceCommand, InstanceEvent, InstanceVerdict, NodeInventory, StepFailed
from ..schemas.lifecycle import LIVE, BlockStatus, InstanceStatus, Step
from ..schemas.records import BlockIR, BlockRecord, InstanceRecord, PolicyRule, wire
from . import faults, sidecars, stability
from .effects import (
    DeletedIfEmpty,
    Effect,
    ReadyIfRunning,
    Release,
    RemoveAll,
    Replace,
    SetInstance,
    Transition,
    publish,
)


@dataclass(frozen=True)
class View:
    """What a decision sees: the block record (``None``: unknown id) and its instances."""

    block: BlockRecord | None
    instances: dict[str, InstanceRecord] = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        return None if self.block is None else self.block.get("status")


def remove_command(bid: str, gen: int, cid: str, iid: str, node: str, reason: str, qualifier: str = "") -> Emit:
    return Emit(E.node_instance_remove, InstanceCommand(bid, gen, cid, iid, node, [], reason=reason), qualifier=qualifier)


def on_added(ev: InstanceEvent, view: View) -> list[Effect]:
    """An agent runs the instance: it is running (at ``ev.endpoint``, recorded when the agent
    reports one), and the block may now be ready; a copy nobody
    wants (a late start of a replaced or deleted instance, a duplicate on a node that came back) is
    stopped on the reporting node only, so each instance id runs once."""
    block, known = view.block, view.instances.get(ev.instance_id)
    if block is None or block["gen"] != ev.gen or known is None or known["node"] != ev.node_id:
        cid = known["cluster"] if known else ""
        return [publish(remove_command(ev.block_id, ev.gen, cid, ev.instance_id, ev.node_id, "not wanted here", ev.node_id))]
    if known["status"] == InstanceStatus.REMOVING:
        return []
    out: list[Effect] = [SetInstance(ev.block_id, ev.instance_id, InstanceStatus.RUNNING, ev.endpoint or None)]
    if view.status in (BlockStatus.DELETING, BlockStatus.DELETED):  # raced with a delete: stop it again
        out += _remove(ev.block_id, ev.gen, known["cluster"], ev.instance_id, known["node"], "block deleted")
    elif view.status == BlockStatus.READY and known["status"] != InstanceStatus.RUNNING:
        pass  # one more instance of a ready block (a scale-up): its ``ready`` was announced already
    elif view.status in LIVE:
        # placing: ready once enough run; or this ``added`` is redelivered after it made the block
        # ready and the announcement may not have gone out (re-published, deduplicated)
        out.append(ReadyIfRunning(ev.block_id, ev.gen, int(block["ir"]["minInstances"]), block.get("cluster", "")))
    return out


def lost_request(iid: str) -> str:
    """The id of the reassignment that replaces instance ``iid`` once it is ``lost`` (one per
    instance: a redelivered ``removed`` asks once); an operator's request has an id of its own."""
    return f"{iid}:lost"


def fault_request(iid: str, kind: str) -> str:
    """The id of the reassignment that replaces instance ``iid`` after its agent reported it
    ``failed`` / ``unhealthy`` (or the checker's ``replace``): one per instance and kind."""
    return f"{iid}:{kind}"


def on_removed(ev: InstanceEvent, view: View) -> list[Effect]:
    """An instance stopped (removed, start failed, lost, evicted): its reservation is released; a
    ``lost`` one of a live block is replaced first (the reassignment then removes this record), so
    the block never drops below what it had; a deleting block with nothing left is deleted."""
    block = view.block
    if block is not None and block["gen"] != ev.gen:
        return []  # a fact about an older generation of this block id
    inst = view.instances.get(ev.instance_id)
    out: list[Effect] = []
    if inst is not None and inst["node"] == ev.node_id:
        if ev.reason == "lost" and block is not None and view.status in LIVE and inst["status"] != InstanceStatus.REMOVING:
            return [Replace(ev.block_id, block["gen"], inst["cluster"], ev.instance_id, "lost", lost_request(ev.instance_id),
                            inst["node"])]
        out.append(Release(ev.block_id, ev.instance_id, inst))
    # deleted too: a redelivered removal whose first handling took the DELETED step and died
    # before publishing ``deleted`` publishes it again (the step's redo; deduplicated), else the
    # stream never says deleted (issue 39's soak: a SIGKILLed controller)
    if block is not None and view.status in (BlockStatus.DELETING, BlockStatus.DELETED):
        out.append(DeletedIfEmpty(ev.block_id, block["gen"]))
    return out


def on_inventory(inv: NodeInventory, on_node: Mapping[str, InstanceRecord]) -> list[Effect]:
    """A node agent that starts says what it really runs (``node.inventory``): every instance the
    state has ``running`` on that node (``on_node``: ``Store.node_instances``, each with its
    ``block_id`` and block ``gen``) that is not listed died with the agent's last run: it is
    ``removed`` with reason ``lost`` now (:func:`on_removed` then has it replaced, the mapper drops
    it from routing), not after its health probes fail. A ``starting`` one is left alone: its
    create command still waits in the node's mailbox."""
    runs = {i.instance_id for i in inv.instances}
    lost = [Emit(E.instance_removed,
                 InstanceEvent(str(rec["block_id"]), int(rec.get("gen", 0)), iid, inv.node_id, [], "lost", "", inv.boot),
                 qualifier=f"lost:{inv.boot}")
            for iid, rec in sorted(on_node.items())
            if iid not in runs and rec.get("node") == inv.node_id and rec.get("status") == InstanceStatus.RUNNING]
    return [publish(*lost)] if lost else []


def on_fault(ev: InstanceEvent, kind: str, view: View, max_replacements: int) -> tuple[faults.Verdict, list[Effect]]:
    """An instance ``failed`` or went ``unhealthy``: replace it through the resourceAllocator, up to
    ``max_replacements`` per block; past that a block still placing fails (and stops what it has),
    a ready one keeps running degraded (the step is reported failed)."""
    block, inst = view.block, view.instances.get(ev.instance_id) if view.block is not None else None
    replacements = int(block.get("replacements", 0)) if block else 0
    verdict = faults.on_fault(block, inst, ev.node_id, ev.gen, replacements, max_replacements)
    if block is None or inst is None:
        return verdict, []
    why = f"instance {ev.instance_id} {kind}: {ev.reason}"
    if verdict.action == "reassign":
        return verdict, [Replace(ev.block_id, block["gen"], inst["cluster"], ev.instance_id, why, fault_request(ev.instance_id, kind),
                                 inst["node"])]
    if verdict.action == "fail_block":
        return verdict, fail_placing(ev.block_id, ev.gen, inst["cluster"], f"{why}; {verdict.why}", view)
    if verdict.action == "give_up":
        failed = StepFailed(ev.block_id, block["gen"], "reassignment", f"{why}; {verdict.why}", fault_request(ev.instance_id, kind))
        return verdict, [publish(Emit(E.block_reassignment_failed, failed))]
    return verdict, []


#: the stabilityChecker a block that names none gets (docs/health.md)
DEFAULT_STABILITY_RULE: PolicyRule = {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold"}


def stability_rule(ir: BlockIR) -> PolicyRule:
    """The block's stabilityChecker rule (the default ``builtin:probe-threshold`` when it names none)."""
    named: PolicyRule | None = (ir.get("policies") or {}).get("stabilityChecker")
    rule: PolicyRule = {**(named or DEFAULT_STABILITY_RULE)}
    rule.setdefault("name", "stabilityChecker")
    rule.setdefault("policyRuleURI", DEFAULT_STABILITY_RULE["policyRuleURI"])
    return rule


def fault_input(ev: InstanceEvent, kind: str, view: View) -> dict[str, Any] | None:
    """The block's stabilityChecker input (``action: "health_check"``) for an agent's ``failed`` /
    ``unhealthy`` report: that one instance, with the ``agent`` signal (``stability.agent_input``).
    ``None``: the fact is ignored without asking (the instance is not live on that node: an older
    generation, replaced, removed, or a node speaking for another's instance; ``faults``)."""
    block, inst = view.block, view.instances.get(ev.instance_id) if view.block is not None else None
    if faults._not_live_here(block, inst, ev.node_id, ev.gen):
        return None
    assert block is not None and inst is not None
    entry = stability.agent_input(ev.instance_id, ev.node_id, str(inst.get("endpoint") or ""), kind, ev.reason,
                                  int(inst.get("restarts", 0) or 0))
    return wire(stability.payload(ev.block_id, [entry], 0.0, 1))


def fault_verdict(result: Any, data: dict[str, Any], iid: str) -> dict[str, Any]:
    """The policy's verdict on the reported instance, checked (raises ``stability.BadVerdicts``:
    the wrong shape, a stranger named, or the instance left out of the answer)."""
    verdicts = stability.validate(result, data["payload"]["instances"])
    if iid not in verdicts:
        raise stability.BadVerdicts(f"no verdict on {iid}, the instance its node agent reported")
    return wire(verdicts[iid])


def on_fault_verdict(
    ev: InstanceEvent, kind: str, view: View, max_replacements: int, verdict: dict[str, Any] | None, failure: str = "",
    qualifier: str = "",
) -> tuple[str, list[Effect]]:
    """Carry out the block's stabilityChecker verdict on an agent's ``failed`` / ``unhealthy``
    report (docs/health.md, "Agent reports"). Returns (what, effects).

    * ``replace`` -> :func:`on_fault` (the resourceAllocator's ``reassignment``; the framework's
      bounds: ``max_replacements`` per block, then a placing block fails, a ready one gives up);
    * ``restart`` -> ``node.instance.restart`` (same id, same reservation), as the checker's verdict;
    * ``healthy`` / ``degrade`` / ``unready`` -> kept as it is: its reservation stays, the mapper
      gives it no task since the report, until its agent reports it again (``added``);
    * ``verdict`` None (the policy raised, timed out, answered garbage: ``failure`` says why) ->
      the old rule, :func:`on_fault`: an instance that exited is never left dead because a policy
      is broken."""
    if verdict is None:
        v, effects = on_fault(ev, kind, view, max_replacements)
        return f"stabilityChecker failed ({failure}); old rule: {v.action} ({v.why})", effects
    word, reason = verdict["verdict"], str(verdict.get("reason", ""))
    if word == "replace":
        v, effects = on_fault(ev, kind, view, max_replacements)
        return f"replace: {v.action} ({v.why})", effects
    if word == "restart":
        return _restart(ev.block_id, ev.gen, ev.instance_id, ev.node_id, view,
                        f"{kind} ({ev.reason}); stabilityChecker: restart: {reason}", qualifier)
    return f"{word}: kept ({reason})", []


def on_verdict(ev: InstanceVerdict, view: View, max_replacements: int) -> tuple[str, list[Effect]]:
    """A health checker verdict (docs/health.md): ``replace`` goes the way of a fault (the
    resourceAllocator's ``reassignment``, counted against ``max_replacements`` like the agents'
    ``failed`` / ``unhealthy`` reports); ``restart`` asks the instance's node agent to restart it in
    place (same id); the other verdicts are routing only (the mapper's). Returns (what, effects)."""
    if ev.verdict == "replace":
        fault = InstanceEvent(ev.block_id, ev.gen, ev.instance_id, ev.node_id, [], f"health checker: {ev.reason}")
        verdict, effects = on_fault(fault, "replace", view, max_replacements)
        return f"replace: {verdict.action} ({verdict.why})", effects
    if ev.verdict != "restart":
        return "routing only", []
    return _restart(ev.block_id, ev.gen, ev.instance_id, ev.node_id, view, f"health checker: {ev.reason}", ev.seq)


def _restart(bid: str, gen: int, iid: str, node: str, view: View, reason: str, qualifier: str) -> tuple[str, list[Effect]]:
    """``node.instance.restart`` to the instance's node: stopped and started again under its id."""
    block, inst = view.block, view.instances.get(iid)
    why = faults._not_live_here(block, inst, node, gen)
    if why:
        return f"restart ignored: {why}", []
    assert block is not None and inst is not None
    from .controller import env_for

    ir = block["ir"]
    cmd = InstanceCommand(
        bid, gen, inst["cluster"], iid, node, list(inst.get("gpus", [])), ir.get("image", ""),
        env_for(ir, iid, list(inst.get("gpus", []))), reason=reason[:500],
        launch=ir.get("launch") or {}, resources=wire(ir.get("resources") or {}),
    )
    return "restart", [publish(Emit(E.node_instance_restart, cmd, qualifier=qualifier))]


def on_delete(bid: str, view: View) -> list[Effect]:
    """A delete request: the block goes ``deleting``, every instance is stopped (each removal
    releases its share), and a block with none is deleted at once."""
    if view.block is None:
        return []
    gen = view.block["gen"]
    out: list[Effect] = [Transition(bid, gen, Step.DELETE, then=(RemoveAll(bid, gen, "block deleted"), DeletedIfEmpty(bid, gen)),
                                    redo=False)]
    stop = sidecars.stops(view.block, view.instances, "block deleted")
    if stop:  # outside the transition: a redelivered delete sends them again (deduplicated)
        out.append(publish(*stop))
    return out


def fail_placing(bid: str, gen: int, cluster: str, reason: str, view: View | None = None) -> list[Effect]:
    """Fail a block that is still placing, and stop what it has (its instances, its side-cars):
    a failed block holds nothing."""
    from ..schemas.events import BlockStatusReport

    failed = Emit(E.block_failed, BlockStatusReport(block_id=bid, gen=gen, status="failed", reason=reason, cluster_id=cluster))
    out: list[Effect] = [
        Transition(bid, gen, Step.FAIL_PLACEMENT, (("reason", reason),), then=(publish(failed),)),
        RemoveAll(bid, gen, "block failed"),
    ]
    stop = sidecars.stops(view.block, view.instances, "block failed") if view is not None else []
    if stop:
        out.append(publish(*stop))
    return out


def _remove(bid: str, gen: int, cid: str, iid: str, node: str, reason: str) -> list[Effect]:
    return [SetInstance(bid, iid, InstanceStatus.REMOVING), publish(remove_command(bid, gen, cid, iid, node, reason))]
