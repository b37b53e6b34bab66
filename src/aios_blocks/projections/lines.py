"""One line per stored event (``blocks watch``, ``blocks replay``): what the event says, read from
its payload struct, with the policy calls it records indented under it.

A projection (``projections.base``) that names every catalog event: a method for those whose line
says more than their name, ``PLAIN`` for the others (their name and policy calls). The
completeness test (``tests/unit/test_projections.py``) fails for an event in neither.
"""

from __future__ import annotations

from typing import Any

from ..schemas import condition as cd
from ..schemas import events as ev
from ..schemas import moves as mv
from ..schemas import priority as pr
from ..schemas.catalog import EVENTS, E, Event
from ..schemas.records import AdaptTable
from .base import Fact, Projection, StoredDoc, on, parse

#: events shown by their name alone (and the policy calls they carry)
PLAIN: frozenset[Event[Any]] = frozenset({
    E.block_create, E.block_parsed, E.cluster_dry_run, E.cluster_allocation, E.cluster_scale, E.block_autoscaled,
    E.cluster_scale_down, E.cluster_reassignment, E.node_instance_create, E.node_instance_remove,
    E.node_instance_restart, E.node_dangling, E.node_inventory, E.node_registered, E.node_health, E.node_heartbeat,
    E.block_task, E.node_expected, E.block_delete, E.inventory_hint, E.policy_updated, E.component_registered,
    E.cluster_registered, E.vcluster_create, E.vcluster_update, E.vcluster_remove, E.vcluster_changed,
    E.vcluster_flushed, E.vcluster_refused, E.node_drain, E.node_removed, E.cluster_removed, E.node_sidecar_start,
    E.node_sidecar_stop, E.node_sidecar_grant, E.node_sidecar_release, E.block_output, E.sidecar_alert,
    E.output_dead_letter, E.dlq_replayed, E.priority_class_registered,
    E.priority_class_removed, E.quota_set, E.tenant_create_request, E.tenant_block_create, E.tenant_block_task,
    E.tenant_block_scale,
    E.tenant_block_delete, E.tenant_block_history, E.tenant_event,
})
#: a line's colour, by the last word of its kind
COLOUR = {"ready": "green", "restored": "green", "degraded": "red", "failed": "red", "rejected": "red", "deleted": "yellow", "pending": "yellow",
          "preempted": "magenta"}


def _kind_template(e: Event[Any]) -> str:
    """The part of its subject a line names an event by: after the first token (the block, node,
    cluster...), its other tokens filled in (``instance.{iid}.added``)."""
    _, sep, tail = e.pattern.partition("}.")
    return tail if sep else e.name


_KIND = {e: _kind_template(e) for e in EVENTS}


def kind_of(subject: str) -> str:
    """What a line names a stored event by (``aios.block.B.instance.I.added`` ->
    ``instance.I.added``); a subject outside the catalog: its tail."""
    found = parse(subject)
    if found is None:
        return subject.split(".", 3)[3] if subject.count(".") >= 3 else subject
    return _KIND[found[0]].format_map(found[1])


def call_line(c: ev.Decision) -> str:
    """One policy call's record, on one line (its log lines below it)."""
    detail = f"{c.kind}.{c.action} {c.uri}" + (f"@v{c.version}" if c.version else "")
    detail += f" {c.duration_us}µs" + (f" error={c.error}" if c.error else "")
    for level, text in c.logs:
        detail += f"\n    [{level}] {text}"
    return detail


def adapt_line(adapt: AdaptTable) -> str:
    """The adapt stage's table on one line: the figure, the block median, each node's p50 and multiplier."""
    if not adapt.get("figure"):
        return "no live metrics for the block: every Adaptive entry has its base weight"
    bounds: list[float] | list[str] = adapt.get("bounds") or ["?", "?"]
    lo, hi = bounds
    nodes = ", ".join(f"{n} {v['p50_ms']:g} ms x{v['multiplier']:g}" for n, v in sorted((adapt.get("nodes") or {}).items()))
    return f"{adapt['figure']} block median {adapt['block_median_ms']:g} ms; {nodes} (multiplier = median / node p50, in [{lo:g}, {hi:g}])"


def answer_line(a: ev.DryRunResult, indent: str) -> str:
    """One cluster's dry_run answer: score, error, why nodes were rejected, affinity scores, its policy calls.
    An answer the gateway made up in the cluster's place (the round's one candidate: no dry_run asked,
    ``DryRunResult.skipped``) says so: its score is no resourceAllocator's, it counted nothing."""
    detail = f"cluster={a.cluster_id} score={a.score}" + (f" ({a.skipped})" if a.skipped else "")
    detail += f" error={a.error}" if a.error else ""
    for node, why in a.rejected_nodes.items():
        detail += f"\n    {indent}{node}: {why}"
    if a.node_scores:
        detail += f"\n    {indent}affinity scores: " + ", ".join(f"{n}={v:g}" for n, v in a.node_scores.items())
    if a.adapt.get("nodes"):
        detail += f"\n    {indent}adapt: " + adapt_line(a.adapt)
    if indent:  # inside a post_dry_run: the answer's own policy calls (the event's are listed after it)
        for c in a.decisions:
            detail += f"\n    {indent}policy " + call_line(c)
    return detail


#: a run of more alike calls than this (one per instance of a gang's allocation: 100 lines for 100
#: instances) is shown as its first call and a count: ``x N more alike, T µs in all``
RUN = 3


def _alike(a: ev.Decision, b: ev.Decision) -> bool:
    """Calls a line may count together: the same policy, action and version, neither failed nor logged."""
    return ((a.kind, a.action, a.uri, a.version) == (b.kind, b.action, b.uri, b.version)
            and not (a.error or b.error or a.logs or b.logs))


def _calls(data: Any) -> str:
    calls: list[ev.Decision] = list(getattr(data, "decisions", ()))
    out: list[str] = []
    i = 0
    while i < len(calls):
        j = i + 1
        while j < len(calls) and _alike(calls[i], calls[j]):
            j += 1
        if j - i > RUN:  # the first of the run, then how many more and their time
            c = calls[i]
            out += [call_line(c), f"{c.kind}.{c.action} {c.uri} x{j - i - 1} more alike, "
                    f"{sum(d.duration_us for d in calls[i + 1:j])}µs in all"]
        else:
            out += [call_line(d) for d in calls[i:j]]
        i = j
    return "".join("\n    policy " + line for line in out)


class Lines(Projection):
    """The detail of one event's line (``detail``), set by the method for its event."""

    def __init__(self) -> None:
        self.detail = ""

    @on(*PLAIN)
    def on_plain(self, m: Fact[Any]) -> None:
        self.detail = _calls(m.data)

    @on(E.block_submitted)
    def on_submitted(self, m: Fact[ev.Submitted]) -> None:
        """The create, as the parser stored it (its publisher may have sent a bare spec)."""
        d, spec = m.data, m.data.spec or {}
        framing = "CloudEvent" if d.framing == "cloudevent" else "bare spec"
        self.detail = (f"gen={d.gen} {framing} on {d.subject}"
                       + (f" component={spec['blockComponentURI']}" if spec.get("blockComponentURI") else "")
                       + ("" if spec else " (no spec in its body)"))

    @on(E.block_rejected)
    def on_rejected(self, m: Fact[ev.Rejected]) -> None:
        self.detail = "; ".join(f"{e.path}: {e.message}" for e in m.data.errors)

    @on(E.block_selection)
    def on_selection(self, m: Fact[ev.Selection]) -> None:
        self.detail = f"candidates={m.data.candidates} filtered={m.data.filtered}" + _calls(m.data)

    @on(E.block_dry_run_result)
    def on_dry_run(self, m: Fact[ev.DryRunResult]) -> None:
        """Stored apart by versions before the answers went into ``post_dry_run``."""
        self.detail = answer_line(m.data, "") + _calls(m.data)

    @on(E.block_post_dry_run)
    def on_post_dry_run(self, m: Fact[ev.PostDryRun]) -> None:
        d = m.data
        self.detail = f"chosen={d.cluster_id or '-'} scores={d.scores}" + (f" missing={d.missing}" if d.missing else "")
        for a in d.answers:  # each cluster's dry_run answer, with its policy calls
            self.detail += "\n    dry_run " + answer_line(a, "    ")
        self.detail += _calls(d)

    @on(E.block_placement)
    def on_placement(self, m: Fact[ev.PlacementMade]) -> None:
        ps = m.data.placements
        self.detail = ", ".join(f"{p.instance_id}@{p.node_id}{p.gpus}" for p in ps)
        for p in ps:
            for a in p.adaptive:
                self.detail += f"\n    {p.instance_id} entry {a['entry']} (Adaptive): base {a['base']:g} -> {a['weight']:g}: {a['why']}"
        self.detail += _calls(m.data)

    @on(E.block_ready, E.block_failed, E.block_deleted)
    def on_status(self, m: Fact[ev.BlockStatusReport]) -> None:
        self.detail = m.data.reason or f"instances={m.data.instances}"

    @on(E.block_pending)
    def on_pending(self, m: Fact[pr.Pending]) -> None:
        """Why it waits (per cluster), its priority, and who preempted it."""
        d = m.data
        self.detail = (f"waits (priority {d.priority})" + (f", preempted by {d.preempted_by}" if d.preempted_by else "")
                       + f": {d.reason}" + "".join(f"\n    {c}: {why}" for c, why in sorted(d.reasons.items())))

    @on(E.block_preempted)
    def on_preempted(self, m: Fact[pr.Preempted]) -> None:
        d = m.data
        self.detail = (f"by {d.preemptor} (priority {d.preemptor_priority} over {d.priority}, {d.reason}): "
                       + ", ".join(f"{i}@{n}" for i, n in sorted(d.instances.items())))

    @on(E.block_preempting)
    def on_preempting(self, m: Fact[pr.Preempting]) -> None:
        d = m.data
        self.detail = (f"{d.reason}: {d.gpus_freed} GPU(s) freed from "
                       + "; ".join(f"{b} ({', '.join(i)})" for b, i in sorted(d.victims.items()))
                       + (f" for its {d.short} missing instance(s) (ready, short)" if d.short else ""))

    @on(E.block_allocation_failed, E.block_scale_failed, E.block_scale_down_failed, E.block_reassignment_failed,
        E.block_health_failed, E.block_autoscale_failed, E.instance_failed)
    def on_failed_step(self, m: Fact[ev.StepFailed | ev.AutoscaleFailed | ev.InstanceEvent]) -> None:
        self.detail = m.data.reason + _calls(m.data)

    @on(E.block_move_requested)
    def on_move_requested(self, m: Fact[mv.MoveRequested]) -> None:
        d = m.data
        self.detail = (f"{d.move_id}: {d.instance_id} -> {d.to_node or 'any other node'} by {d.requested_by or '-'}"
                       + (f": {d.reason}" if d.reason else ""))

    @on(E.block_move_started, E.block_move_switched, E.block_move_completed, E.block_move_failed)
    def on_move_step(self, m: Fact[mv.MoveStep]) -> None:
        """Which move, from where to where, and why (a failed one: what went wrong)."""
        d = m.data
        to = f"{d.new_instance_id}@{d.to_node}" if d.new_instance_id else (d.to_node or "-")
        self.detail = f"{d.move_id}: {d.instance_id}@{d.from_node or '-'} -> {to}" + (f": {d.reason}" if d.reason else "")
        self.detail += _calls(d)

    @on(E.block_degraded, E.block_restored)
    def on_short(self, m: Fact[cd.BlockShort]) -> None:
        """A ready block short of its minInstances, or whole again (docs/reliability.md "Short blocks")."""
        d = m.data
        self.detail = f"{d.live} live ({d.running} running) of minInstances {d.min_instances}: {d.reason}"

    @on(E.dead_letter)
    def on_dead_letter(self, m: Fact[ev.DeadLetter]) -> None:
        """A worker gave up on a message (its kind: the message's subject): who, after how many
        deliveries, why (docs/dead-letters.md)."""
        d = m.data
        self.detail = f"dead letter: {d.consumer} gave up after {d.deliveries} deliveries: {d.error}"

    @on(E.block_decision)
    def on_decision(self, m: Fact[ev.Decision]) -> None:
        self.detail = call_line(m.data)

    @on(E.block_scale_target)
    def on_scale_target(self, m: Fact[ev.ScaleTarget]) -> None:
        """What count, asked by whom and why."""
        d = m.data
        self.detail = f"target={d.target} by {d.source or '-'}" + (f": {d.reason}" if d.reason else "")

    @on(E.block_scale_down_chosen)
    def on_scale_down_chosen(self, m: Fact[ev.ScaleDownChosen]) -> None:
        d = m.data
        self.detail = f"{d.instance_id}@{d.node_id} chosen by {d.chosen_by or '-'}" + (f": {d.reason}" if d.reason else "")
        self.detail += _calls(d)

    @on(E.instance_added, E.instance_removed, E.instance_unhealthy)
    def on_instance(self, m: Fact[ev.InstanceEvent]) -> None:
        d = m.data
        self.detail = f"node={d.node_id} gpus={d.gpus}" + (f" reason={d.reason}" if d.reason else "")
        self.detail += f" at {d.endpoint}" if d.endpoint else ""

    @on(E.instance_verdict)
    def on_verdict(self, m: Fact[ev.InstanceVerdict]) -> None:
        self.detail = f"node={m.data.node_id} {m.data.verdict}" + (f" reason={m.data.reason}" if m.data.reason else "")

    def line(self, subject: str, env: StoredDoc) -> tuple[str, str]:
        """(kind, detail) of one event as a JSON document (``kind``: the subject's tail)."""
        found = parse(subject)
        if found is None:  # not a catalog subject: its tail, nothing more known
            return kind_of(subject), ""
        event, tokens = found
        kind = _KIND[event].format_map(tokens)
        if event is E.dead_letter:  # the letter of a message: "dlq." and the message's own kind (dlq.create)
            kind = "dlq." + kind_of(tokens["subject"])
        self.detail = ""
        if not self.feed_doc(subject, env):
            return kind, f"(its data is not a {getattr(event.payload, '__name__', 'payload')})"
        return kind, self.detail


_LINES = Lines()


def line(subject: str, env: StoredDoc) -> tuple[str, str, str]:
    """(kind, detail, colour) of one stored event (``cli.render._line`` prints it)."""
    kind, detail = _LINES.line(subject, env)
    return kind, detail, COLOUR.get(kind.rpartition(".")[2], "cyan")


__all__ = ["COLOUR", "PLAIN", "Lines", "adapt_line", "answer_line", "call_line", "kind_of", "line"]
