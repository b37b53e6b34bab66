"""The one typed catalog of events. Everything about an event is written here once:

* its **subject pattern** with named tokens (``aios.block.{bid}.ready``);
* its **payload** struct (msgspec; ``None`` for a raw body);
* the **roles** that may publish it (NATS permissions are derived from these);
* whether the **stream stores** it (the stream's subjects are derived from these);
* its **message-id rule**: a template over the payload's fields and the subject's tokens, so a
  redelivered step that publishes again is deduplicated by JetStream;
* a one-line meaning (docs, ``blocks subjects``, the AsyncAPI document).

Builders (``Event.subject``), parsing (``Event.match``, ``parse``), consumer filters
(``Event.filter``), the stream's subjects, NATS permissions (``runtime.auth``), the CloudEvents
``type``, ``docs/subjects.md`` and ``blocks asyncapi`` all come from :data:`EVENTS`. Publishing is
``bus.emit(E.block_ready, payload)``; no handler builds or splits a subject.

Adding an event: one entry here, its handler (registered with ``Router.on``), its test.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from . import condition as cd
from . import dlq as dq
from . import events as ev
from . import moves as mv
from . import priority as pr
from . import vcluster as vc
from .roles import Role as Role  # re-exported: the catalog's publishers

ROOT = "aios"
STREAM = "AIOS"
#: the stream of the blocks' task outputs (docs/sidecars.md): its own limits, so a flood of outputs
#: never pushes a control event out of ``AIOS``
STREAM_OUTPUTS = "AIOS_OUTPUTS"
#: a read-only mirror of ``AIOS`` for observers (docs/security.md): no worker consumes it, so
#: observers may keep any consumer there, the unnamed and ordered ones of every client included
STREAM_OBSERVE = "AIOS_OBSERVE"
#: the creates as their publishers sent them (a bare spec or a CloudEvent): only the parser reads
#: it, and stores each in ``AIOS`` as a ``block.submitted`` CloudEvent, so every message of
#: ``AIOS`` (and of its mirror) is a CloudEvent whatever the publisher sent (docs/subjects.md)
STREAM_INTAKE = "AIOS_INTAKE"
CE_TYPE_PREFIX = "io.aios."

P = TypeVar("P")
_TOKEN = re.compile(r"\{([a-z_]+)\}")


class Body(enum.StrEnum):
    """How the body is framed on the wire."""

    CLOUDEVENT = "cloudevent"  # CloudEvents 1.0 structured mode, payload in ``data``
    RAW = "raw"  # the payload itself (a bare spec, a dead letter)
    CORE = "core"  # core NATS only: the payload itself, never stored


@dataclass(frozen=True)
class Event(Generic[P]):
    name: str
    pattern: str
    payload: type[P] | None
    publishers: tuple[Role, ...]
    meaning: str
    stored: bool = True
    #: message id template over the payload's fields and the subject's tokens ("" = chosen by
    #: the publisher, e.g. a client's fresh id, or none for core NATS)
    id_rule: str = ""
    body: Body = Body.CLOUDEVENT
    #: request/reply over core NATS: the publisher is the requester; ``responders`` answer
    responders: tuple[Role, ...] = ()
    #: extra stream/consumer filters that also belong to this event (malformed ids to dead-letter)
    extra_filters: tuple[str, ...] = ()
    #: payload field of a subject token, where it is not the usual one (``TOKEN_FIELDS``)
    token_fields: tuple[tuple[str, str], ...] = ()
    #: the stream that stores it (when ``stored``): ``AIOS``, ``AIOS_OUTPUTS`` for outputs,
    #: ``AIOS_INTAKE`` for creates
    stream: str = STREAM
    tokens: tuple[str, ...] = field(init=False)
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        toks = tuple(_TOKEN.findall(self.pattern))
        object.__setattr__(self, "tokens", toks)
        parts, pos = [], 0
        for m in _TOKEN.finditer(self.pattern):
            parts.append(re.escape(self.pattern[pos:m.start()]))
            parts.append(f"(?P<{m.group(1)}>.+)" if m.group(1) == "subject" else f"(?P<{m.group(1)}>[^.]+)")
            pos = m.end()
        rx = "^" + "".join(parts) + re.escape(self.pattern[pos:]) + "$"
        object.__setattr__(self, "_regex", re.compile(rx))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The CloudEvents ``type``."""
        return CE_TYPE_PREFIX + self.name

    def subject(self, **tokens: str) -> str:
        """The concrete subject; every token must be given."""
        try:
            return self.pattern.format_map(tokens)
        except KeyError as exc:
            raise ValueError(f"{self.name}: subject token {exc} missing") from None

    def filter(self, **tokens: str) -> str:
        """A NATS filter: the tokens given are fixed, the others ``*`` (a trailing ``{subject}`` ``>``)."""
        return _TOKEN.sub(lambda m: tokens.get(m.group(1)) or (">" if m.group(1) == "subject" else "*"), self.pattern)

    def filters(self, **tokens: str) -> tuple[str, ...]:
        return (self.filter(**tokens), *(self.extra_filters if not tokens else ()))

    def match(self, subject: str) -> dict[str, str] | None:
        """The subject's tokens if it is this event's, else ``None``."""
        m = self._regex.match(subject)
        return m.groupdict() if m else None

    def msg_id(self, payload: Any, tokens: dict[str, str], qualifier: str = "") -> str:
        """The logical message id (``bus.event_ids`` turns it into the keyed wire id)."""
        if not self.id_rule:
            raise ValueError(f"{self.name} has no id rule: the publisher names the id")
        base = self.id_rule.format_map(_IdFields(payload, tokens))
        return f"{base}:{qualifier}" if qualifier else base

    def resolve(self, payload: Any, tokens: dict[str, str]) -> dict[str, str]:
        """All subject tokens: those given, the rest from the payload's fields (``TOKEN_FIELDS``)."""
        if len(tokens) >= len(self.tokens):
            return tokens
        out = dict(tokens)
        own = dict(self.token_fields)
        for tok in self.tokens:
            if tok not in out:
                out[tok] = str(getattr(payload, own.get(tok) or TOKEN_FIELDS.get(tok, tok)))
        return out


class _IdFields:
    """An id rule's fields: the subject's tokens first, then the payload's (a struct's attributes,
    read as the rule names them: no copy of the whole payload per event)."""

    __slots__ = ("payload", "tokens")

    def __init__(self, payload: Any, tokens: dict[str, str]) -> None:
        self.payload, self.tokens = payload, tokens

    def __getitem__(self, key: str) -> Any:
        if key in self.tokens:
            return self.tokens[key]
        p = self.payload
        if isinstance(p, msgspec.Struct):
            if key in p.__struct_fields__:
                return getattr(p, key)
        elif isinstance(p, dict) and key in p:
            return p[key]
        raise KeyError(key)


@dataclass(frozen=True)
class Emit:
    """An event to publish: the effect a handler returns (``bus.emit_all`` commits it)."""

    event: Event[Any]
    payload: Any
    tokens: dict[str, str] = field(default_factory=dict)
    #: appended to the id rule's id, for a distinct message about the same entity
    qualifier: str = ""
    #: the id, for events whose id the publisher chooses (no id rule)
    msg_id: str | None = None
    #: extra NATS headers (e.g. ``Content-Encoding`` of a compressed raw body)
    headers: tuple[tuple[str, str], ...] = ()
    #: an event the same on every attempt of its handler (``block.submitted``: the create as
    #: taken): where the runner holds a handler's events for its batch's commit and the batch is
    #: one delivery, it is published at once if nothing is held before it, so its disk sync
    #: overlaps the handler's work (``Outbox.early``); the input is still acked only once it is stored
    early: bool = False

    def subject(self) -> str:
        return self.event.subject(**self.event.resolve(self.payload, self.tokens))

    def logical_id(self) -> str:
        if self.msg_id is not None:
            return self.msg_id
        return self.event.msg_id(self.payload, self.event.resolve(self.payload, self.tokens), self.qualifier)


#: which payload field fills a subject token when the publisher does not give it
TOKEN_FIELDS = {"bid": "block_id", "cid": "cluster_id", "nid": "node_id", "iid": "instance_id", "name": "name"}

_B = f"{ROOT}.block.{{bid}}"
_C = f"{ROOT}.cluster.{{cid}}"
_N = f"{ROOT}.node.{{nid}}"
#: a tenant's subjects in AIOS (runtime.tenants)
_T = f"{ROOT}.tenant.{{tenant}}"
_I = f"{_B}.instance.{{iid}}"
_V = f"{ROOT}.vcluster.{{vid}}"
_VID = (("vid", "vcluster_id"),)
U, A, PA, G, C, AG, R = Role.UPSTREAM, Role.ADMIN, Role.PARSER, Role.GATEWAY, Role.CONTROLLER, Role.AGENT, Role.RUNNER
AS = Role.AUTOSCALER
HC = Role.CHECKER
TN = Role.TENANT


class E:
    """Every event, by name. ``E.block_ready.subject(bid="b1")``, ``bus.emit(E.block_ready, status)``."""

    # -- a block's story: aios.block.{bid}.* ------------------------------------------------------
    block_create: Event[Any] = Event(
        "block.create", f"{_B}.create", None, (U, A),
        "block spec submitted: a CloudEvent whose data is the spec (what the CLI and the SDK send) or a bare spec "
        "from another client; stored as sent in AIOS_INTAKE (the PubAck's seq is the block's gen), read only by "
        "the parser, which stores it in AIOS as block.submitted",
        extra_filters=(f"{ROOT}.block.*.*.create", f"{ROOT}.block.*.*.*.create"), stream=STREAM_INTAKE,
    )
    block_submitted = Event(
        "block.submitted", f"{_B}.submitted", ev.Submitted, (PA,),
        "a create as the parser took it from AIOS_INTAKE, before its parsed or rejected: the spec, gen (the "
        "create's AIOS_INTAKE sequence), the subject and headers it was sent with (bid _invalid when the subject "
        "named no valid id)",
        id_rule="{block_id}:{gen}:submitted",
    )
    block_parsed = Event(
        "block.parsed", f"{_B}.parsed", ev.Parsed, (PA, C),
        "IR built; the controller sends it again when a gang no longer fits (back to selection)",
        id_rule="{block_id}:{gen}:parsed:{attempt}",
    )
    block_rejected = Event(
        "block.rejected", f"{_B}.rejected", ev.Rejected, (PA,),
        "invalid create, with every error and its JSON path at once (a CloudEvent's wrong attributes and its spec's)",
        id_rule="{block_id}:{gen}:rejected",
    )
    block_selection = Event(
        "block.selection", f"{_B}.selection", ev.Selection, (G,), "candidate clusters and why others were filtered",
        id_rule="{block_id}:{gen}:selection:{attempt}",
    )
    #: a query, not a command: it changes nothing. So it goes over core NATS to the controllers'
    #: queue group (``bus.runner.CoreRunner``) and is not stored; one lost with a controller that
    #: stopped is asked again by the gather's timer (``workers.gateway.on_due``)
    cluster_dry_run = Event(
        "cluster.dry_run", f"{_C}.dry_run", ev.DryRunRequest, (G,),
        "core NATS, not stored: feasibility query for one block (a query changes nothing; the gateway asks again a "
        "cluster that has not answered by the deadline)",
        stored=False, id_rule="{block_id}:{gen}:dry_run:{cluster_id}:{attempt}",
    )
    #: the query's answer, also over core NATS (to the gateways' queue group): the stored fact is
    #: the round's ``post_dry_run``, which carries every answer it decided on (``answers``, each
    #: with the decision record that rebuilds its input). An answer lost with a gateway that
    #: stopped is asked again by the gather's timer, like a lost query
    block_dry_run_result = Event(
        "block.dry_run.result", f"{_B}.dry_run.result", ev.DryRunResult, (C,),
        "core NATS, not stored: score + node_info from one cluster (the round's post_dry_run stores every answer)",
        stored=False, id_rule="{block_id}:{gen}:dry_run.result:{cluster_id}:{attempt}",
    )
    block_post_dry_run = Event(
        "block.post_dry_run", f"{_B}.post_dry_run", ev.PostDryRun, (G,),
        "cluster chosen, with every score and every dry_run answer it decided on",
        id_rule="{block_id}:{gen}:post_dry_run:{attempt}",
    )
    cluster_allocation = Event(
        "cluster.allocation", f"{_C}.allocation", ev.AllocationRequest, (G,), "place minInstances (a gang)",
        id_rule="{block_id}:{gen}:allocation:{attempt}",
    )
    cluster_scale = Event(
        "cluster.scale", f"{_C}.scale", ev.ScaleRequest, (A, C, G), "place one more instance (CLI / autoscaler; the gateway "
        "for a tenant's scale request)",
        id_rule="{block_id}:{gen}:scale:{request_id}",
    )
    block_scale_target = Event(
        "block.scale.target", f"{_B}.scale.target", ev.ScaleTarget, (A, C, AS, Role.EXECUTOR, G),
        "desired instance count (CLI --to, autoscaler, activator, a tenant's scale request): the controller reaches it "
        "with scale / scale_down",
        id_rule="{block_id}:{gen}:scale.target:{request_id}",
    )
    block_autoscaled = Event(
        "block.autoscaled", f"{_B}.autoscaled", ev.Autoscaled, (AS,),
        "the autoscaler changed the block's instance target: current, the policy's proposal and reason, the "
        "framework's rules that shaped it, the inputs (a block.scale.target follows)",
        id_rule="{block_id}:{gen}:autoscaled:{request_id}",
    )
    block_autoscale_failed = Event(
        "block.autoscale.failed", f"{_B}.autoscale.failed", ev.AutoscaleFailed, (AS,),
        "an autoscaler tick failed (policy raised, timed out, wrong shape, bad parameters): the count stays; "
        "at most one per block per AIOS_AUTOSCALE_FAILURE_RECORD_S unless the reason changes",
        id_rule="{block_id}:{gen}:autoscale.failed:{request_id}",
    )
    cluster_scale_down = Event(
        "cluster.scale_down", f"{_C}.scale_down", ev.ScaleDownRequest, (A, C),
        "remove instances down to a target (never below minInstances): resourceAllocator action scale_down picks each",
        id_rule="{block_id}:{gen}:scale_down:{request_id}",
    )
    block_scale_down_chosen = Event(
        "block.scale_down.chosen", f"{_B}.scale_down.chosen", ev.ScaleDownChosen, (C,),
        "an instance chosen for removal (by the policy or the default, with the decisions): it drains, then goes",
        id_rule="{block_id}:{gen}:scale_down.chosen:{instance_id}",
    )
    cluster_reassignment = Event(
        "cluster.reassignment", f"{_C}.reassignment", ev.ReassignRequest, (A, C),
        "move one instance (CLI / health checker / controller after a fault)",
        id_rule="{block_id}:{gen}:reassign:{request_id}",
    )
    block_allocation_failed = Event(
        "block.allocation.failed", f"{_B}.allocation.failed", ev.StepFailed, (C,),
        "chosen cluster could not take the gang: back to selection", id_rule="{block_id}:{gen}:allocation.failed:{request_id}",
    )
    block_placement = Event(
        "block.placement", f"{_B}.placement", ev.PlacementMade, (C,), "instances reserved: node + GPUs each",
        id_rule="{block_id}:{gen}:placement:{request_id}",
    )
    node_instance_create = Event(
        "node.instance.create", f"{_N}.instance.create", ev.InstanceCommand, (C,), "start an instance",
        id_rule="{block_id}:{gen}:create:{instance_id}",
    )
    node_instance_remove = Event(
        "node.instance.remove", f"{_N}.instance.remove", ev.InstanceCommand, (C,), "stop an instance",
        id_rule="{block_id}:{gen}:remove:{instance_id}",
    )
    instance_added = Event(
        "block.instance.added", f"{_I}.added", ev.InstanceEvent, (AG,), "instance running",
        id_rule="{block_id}:{gen}:added:{instance_id}",
    )
    instance_removed = Event(
        "block.instance.removed", f"{_I}.removed", ev.InstanceEvent, (AG, C),
        "instance stopped (reason: removed, lost, evicted...)", id_rule="{block_id}:{gen}:removed:{instance_id}",
    )
    instance_failed = Event(
        "block.instance.failed", f"{_I}.failed", ev.InstanceEvent, (AG,), "instance exited or could not start, with the reason",
        id_rule="{block_id}:{gen}:failed:{instance_id}",
    )
    instance_unhealthy = Event(
        "block.instance.unhealthy", f"{_I}.unhealthy", ev.InstanceEvent, (AG,), "instance failed its health probe",
        id_rule="{block_id}:{gen}:unhealthy:{instance_id}",
    )
    instance_verdict = Event(
        "block.instance.verdict", f"{_I}.verdict", ev.InstanceVerdict, (HC,),
        "health checker verdict on an instance (healthy, degrade, unready, restart, replace) with the reason; "
        "the mapper sets its routing (weight, unready), the controller restarts or replaces it",
        id_rule="{block_id}:{gen}:verdict:{instance_id}:{verdict}:{seq}",
    )
    block_health_failed = Event(
        "block.health.failed", f"{_B}.health.failed", ev.StepFailed, (HC, C),
        "a health checker tick of the block failed (its stabilityChecker raised, timed out or answered garbage): "
        "nothing changed; recorded at most once a minute per reason. Step agent_report (the controller's): the "
        "stabilityChecker failed on an agent's failed/unhealthy report, the old rule (replace) was applied",
        id_rule="{block_id}:{gen}:health.failed:{request_id}",
    )
    node_instance_restart = Event(
        "node.instance.restart", f"{_N}.instance.restart", ev.InstanceCommand, (C,),
        "restart an instance in place, keeping its id (a health checker verdict)",
        id_rule="{block_id}:{gen}:restart:{instance_id}",
    )
    node_dangling = Event(
        "node.instance.dangling", f"{_N}.instance.dangling", ev.Dangling, (AG,),
        "a labelled container/process nobody asked this node to run", id_rule="{node_id}:dangling:{instance_id}:{handle}",
    )
    node_inventory = Event(
        "node.inventory", f"{_N}.inventory", ev.NodeInventory, (AG,),
        "what a node agent really runs, sent when it starts (boot: new at each start): instances the state has "
        "running on the node but not listed are lost at once (removed, replaced); the executors route only to "
        "instances confirmed under the latest boot",
        id_rule="{node_id}:inventory:{boot}",
    )
    node_registered = Event(
        "node.registered", f"{_N}.registered", ev.NodeRegistered, (AG, A), "node capacity, labels and GPUs (controller records it)",
        id_rule="{nid}:registered",
    )
    node_health = Event(
        "node.health", f"{_N}.health", ev.NodeHealth, (C,), "node marked unhealthy (heartbeats stopped) or healthy again",
        id_rule="{node_id}:health",
    )
    node_heartbeat = Event(
        "node.heartbeat", f"{_N}.heartbeat", ev.Heartbeat, (AG,), "core NATS, not stored: free resources and load",
        stored=False, body=Body.CORE,
    )
    block_task: Event[Any] = Event(
        "block.task", f"{_B}.task", None, (U, A, G),
        "core NATS request/reply, not stored: one task for the block (any body); an executor of the queue group "
        "replies with the instance's answer, or an error status (Aios-Status, Aios-Error, Retry-After-Ms headers)",
        stored=False, body=Body.CORE, responders=(Role.EXECUTOR,),
    )
    # -- tenants (docs/security.md "Tenants"): a tenant account's requests reach AIOS under its name -----
    tenant_create_request: Event[Any] = Event(
        "tenant.create.request", f"{_T}.intake.{{bid}}.create", None, (TN,),
        "a tenant's create as its clients send it (a JetStream publish of aios.block.B.create in its own account; the "
        "server adds the tenant's name), not stored here: the gateway stores it in AIOS_INTAKE as tenant.block.create, "
        "its Nats-Msg-Id scoped to the tenant (tenant:<t>:<id>, so no other publisher's id can suppress it), and "
        "answers the stream's PubAck",
        stored=False, responders=(G,),
    )
    tenant_block_create: Event[Any] = Event(
        "tenant.block.create", f"{_T}.block.{{bid}}.create", None, (G,),
        "a tenant's create, stored as sent in AIOS_INTAKE like block.create by the gateway (tenant.create.request), "
        "its Nats-Msg-Id tenant:<t>:<the client's>; the parser labels the block with the tenant",
        stream=STREAM_INTAKE,
    )
    tenant_block_task: Event[Any] = Event(
        "tenant.block.task", f"{_T}.block.{{bid}}.task", None, (TN,),
        "core NATS request/reply, not stored: a tenant's task for one of its blocks; the gateway checks the block is "
        "the tenant's and forwards it as block.task (its answer back, or Aios-Status 403/404)",
        stored=False, body=Body.CORE, responders=(G,),
    )
    tenant_block_scale: Event[Any] = Event(
        "tenant.block.scale", f"{_T}.block.{{bid}}.scale", None, (TN,),
        "core NATS request/reply, not stored: a tenant scales one of its blocks (body {\"target\": n}, or empty: one "
        "more instance); the gateway checks the block is the tenant's and publishes block.scale.target / cluster.scale",
        stored=False, body=Body.CORE, responders=(G,),
    )
    tenant_block_delete: Event[Any] = Event(
        "tenant.block.delete", f"{_T}.block.{{bid}}.delete", None, (TN,),
        "core NATS request/reply, not stored: a tenant deletes one of its blocks; the gateway checks the block is the "
        "tenant's and publishes block.delete",
        stored=False, body=Body.CORE, responders=(G,),
    )
    tenant_block_history: Event[Any] = Event(
        "tenant.block.history", f"{_T}.block.{{bid}}.history", None, (TN,),
        "core NATS request/reply, not stored: a page of one of the tenant's blocks' stored events, oldest first (body "
        "{\"from\": seq, \"limit\": n}, both optional); the gateway reads them from AIOS and answers only those of the "
        "tenant's own creates (Aios-Status 404 for a block that is not the tenant's, as for none)",
        stored=False, body=Body.CORE, responders=(G,),
    )
    tenant_event: Event[Any] = Event(
        "tenant.event", f"{_T}.event.{{subject}}", None, (G,),
        "core NATS, not stored: a stored event of a tenant's block (aios.block.B.>, as B.>), relayed by the gateway "
        "to that tenant only; its clients receive it as aios.block.B.>",
        stored=False, body=Body.CORE,
    )
    node_expected: Event[Any] = Event(
        "node.expected", f"{_N}.expected", None, (AG,),
        "core NATS request/reply, not stored: instances the node should run (the controller replies)",
        stored=False, body=Body.CORE, responders=(C,),
    )
    node_sidecar_grant: Event[Any] = Event(
        "node.sidecar.grant", f"{_N}.sidecar.grant", None, (AG,),
        "core NATS request/reply, not stored: on your own NATS, the credentials of a block's side-car user "
        "(body {\"block_id\", \"name\"}); blocks sidecar-auth serve replies, to the agent's inbox only (docs/security.md)",
        stored=False, body=Body.CORE,
    )
    node_sidecar_release: Event[Any] = Event(
        "node.sidecar.release", f"{_N}.sidecar.release", None, (AG,),
        "core NATS request/reply, not stored: the node runs none of a block's side-cars any more (body {\"block_id\"}); "
        "blocks sidecar-auth serve replies; with the last node the block's side-car user goes",
        stored=False, body=Body.CORE,
    )
    block_ready = Event(
        "block.ready", f"{_B}.ready", ev.BlockStatusReport, (C,), "minInstances are running", id_rule="{block_id}:{gen}:ready",
    )
    block_failed = Event(
        "block.failed", f"{_B}.failed", ev.BlockStatusReport, (G, C), "block cannot be placed, with the reason",
        id_rule="{block_id}:{gen}:failed",
    )
    block_scale_failed = Event(
        "block.scale.failed", f"{_B}.scale.failed", ev.StepFailed, (C,), "a scale step failed (block stays as it was)",
        id_rule="{block_id}:{gen}:scale.failed:{request_id}",
    )
    block_scale_down_failed = Event(
        "block.scale_down.failed", f"{_B}.scale_down.failed", ev.StepFailed, (C,),
        "a scale_down step failed (policy error, unknown instance, block not live): nothing removed by it",
        id_rule="{block_id}:{gen}:scale_down.failed:{request_id}",
    )
    block_reassignment_failed = Event(
        "block.reassignment.failed", f"{_B}.reassignment.failed", ev.StepFailed, (C,), "a reassignment step failed",
        id_rule="{block_id}:{gen}:reassignment.failed:{request_id}",
    )
    block_degraded = Event(
        "block.degraded", f"{_B}.degraded", cd.BlockShort, (C,),
        "a ready block is short of its minInstances and the reconciler's ask for the missing instances placed "
        "nothing (no node can take them): live, running, minInstances, since when, why (the failed step's reason); "
        "it stays ready (a condition beside the status: blocks get/list show it), once per spell",
        id_rule="{block_id}:{gen}:degraded:{episode}",
    )
    block_restored = Event(
        "block.restored", f"{_B}.restored", cd.BlockShort, (C,),
        "a short block is whole again (minInstances live): live now, since when it was short, how long; once per spell",
        id_rule="{block_id}:{gen}:restored:{episode}",
    )
    block_delete = Event(
        "block.delete", f"{_B}.delete", ev.DeleteRequest, (A, G), "delete requested (CLI; the gateway for a tenant's "
        "delete request)", id_rule="{block_id}:delete:{request_id}",
    )
    block_deleted = Event(
        "block.deleted", f"{_B}.deleted", ev.BlockStatusReport, (C,), "every instance removed and released",
        id_rule="{block_id}:{gen}:deleted",
    )
    block_decision = Event(
        "block.decision", f"{_B}.decision", ev.Decision, (G, C),
        "a policy call no step event carries (a reassignment deferred for lack of room, the stabilityChecker's "
        "verdict on an agent's fault report); every other call is in its "
        "step event's decisions",
        id_rule="{block_id}:decision:{kind}:{action}:{input_digest}",
    )
    inventory_hint = Event(
        "hint.inventory", f"{ROOT}.hint.{{cid}}.inventory", ev.InventoryHint, (C, A),
        "core NATS, not stored: nodes of a cluster changed, caches refresh them", stored=False, body=Body.CORE,
        token_fields=(("cid", "cluster"),),
    )
    policy_updated = Event(
        "policy.updated", f"{ROOT}.policy.{{name}}.updated", ev.PolicyUpdated, (A,),
        "policy stored: name, version, source, language (caches drop it)", id_rule="policy:{name}:v{version}",
    )
    component_registered = Event(
        "component.registered", f"{ROOT}.component.{{digest}}.registered", ev.ComponentRegistered, (A,),
        "component registered: the full record (digest of its URI)",
    )
    cluster_registered = Event(
        "cluster.registered", f"{_C}.registered", ev.ClusterRegistered, (A,), "cluster registered: id and labels",
    )
    # -- contended clusters (issue 36, docs/priority.md) -------------------------------------------
    priority_class_registered = Event(
        "priorityclass.registered", f"{ROOT}.priorityclass.{{name}}.registered", pr.PriorityClassRegistered, (A,),
        "priority class registered or replaced (blocks priority-class add): the whole record (name, value, default, "
        "description); blocks recover rebuilds the classes from it",
    )
    priority_class_removed = Event(
        "priorityclass.removed", f"{ROOT}.priorityclass.{{name}}.removed", pr.PriorityClassRemoved, (A,),
        "priority class removed (blocks priority-class remove); parsed blocks keep the value their IR holds",
    )
    quota_set = Event(
        "quota.set", f"{ROOT}.quota.{{name}}.set", pr.QuotaSet, (A,),
        "a tenant's quota set (blocks quota set: nominal per GPU model, cohort, borrowing limit) or removed "
        "(record null); blocks recover rebuilds the quotas from it",
    )
    block_pending = Event(
        "block.pending", f"{_B}.pending", pr.Pending, (G, C),
        "the block fits nowhere now and waits in the pending queue (not failed): the reason per cluster, its "
        "priority, since when it waits, when it fails if still waiting (maxPendingS), the preemptor of a victim",
        id_rule="{block_id}:{gen}:pending:{attempt}:{preempted_by}",
    )
    block_preempted = Event(
        "block.preempted", f"{_B}.preempted", pr.Preempted, (C,),
        "the block was preempted: the preemptor, the reason (Priority, InCohortReclamation), the instances it "
        "loses (all of them when it falls below minInstances); it drains and goes back to pending, not failed",
        id_rule="{block_id}:{gen}:preempted:{preemptor}:{preemptor_gen}",
    )
    block_preempting = Event(
        "block.preempting", f"{_B}.preempting", pr.Preempting, (C,),
        "the block preempts others to be placed: its victims (block -> instances), the reason, the GPUs freed; "
        "sent once a plan shows its whole gang (minInstances) fits after they are gone; short: a ready block short "
        "of that many instances preempts for them (it stays ready), 0 for a waiting block",
        id_rule="{block_id}:{gen}:preempting:{request_id}",
    )
    # -- make-before-break moves (issue 38 item 2, docs/rebalance.md) --------------------------------
    block_move_requested = Event(
        "block.move.requested", f"{_B}.move.requested", mv.MoveRequested, (A, C, Role.REBALANCER),
        "move one instance of a placed block, make-before-break (blocks move, the rebalancer): move_id names the "
        "move (one move per id), to_node a target node or none (placement chooses any other node), to_gpus its GPUs "
        "there or none (the resourceAllocator picks)",
        id_rule="{block_id}:move.requested:{move_id}",
    )
    block_move_started = Event(
        "block.move.started", f"{_B}.move.started", mv.MoveStep, (C,),
        "a move's new instance is reserved on its node and being started (the old one keeps serving)",
        id_rule="{block_id}:{gen}:move.started:{move_id}",
    )
    block_move_switched = Event(
        "block.move.switched", f"{_B}.move.switched", mv.MoveStep, (C,),
        "a move's new instance is ready: the mapper routes to it, the old one drains (its tasks in flight finish)",
        id_rule="{block_id}:{gen}:move.switched:{move_id}",
    )
    block_move_completed = Event(
        "block.move.completed", f"{_B}.move.completed", mv.MoveStep, (C,),
        "a move is done: the old instance is removed and its reservation released",
        id_rule="{block_id}:{gen}:move.completed:{move_id}",
    )
    block_move_failed = Event(
        "block.move.failed", f"{_B}.move.failed", mv.MoveStep, (C,),
        "a move failed (no capacity, disruption budget, rate limit, new instance never ready, block gone), with "
        "the reason: the old instance keeps serving, the new one (if any) is removed and released",
        id_rule="{block_id}:move.failed:{move_id}",
    )
    # -- virtual clusters (seed 003): aios.vcluster.{vid}.* ----------------------------------------
    vcluster_create = Event(
        "vcluster.create", f"{_V}.create", vc.VClusterCreate, (A,),
        "create a virtual cluster in a cluster: divisible or not, replica sets by node type",
        id_rule="vc:{vcluster_id}:create:{request_id}", token_fields=_VID,
    )
    vcluster_update = Event(
        "vcluster.update", f"{_V}.update", vc.VClusterUpdate, (A,),
        "change a virtual cluster's replica sets, naming its latest revision", id_rule="vc:{vcluster_id}:update:{request_id}",
        token_fields=_VID,
    )
    vcluster_remove = Event(
        "vcluster.remove", f"{_V}.remove", vc.VClusterRemove, (A,), "remove an empty virtual cluster (nodes go back)",
        id_rule="vc:{vcluster_id}:remove:{request_id}", token_fields=_VID,
    )
    vcluster_changed = Event(
        "vcluster.changed", f"{_V}.changed", vc.VClusterChanged, (C,),
        "a virtual cluster after a change (create, update, remove, replenish, job cluster made or destroyed): "
        "the whole record and the nodes moved; the seed's \"publish\" (a change stored only is vcluster.flushed)",
        id_rule="vc:{vcluster_id}:{gen}:r{revision}", token_fields=_VID,
    )
    vcluster_flushed = Event(
        "vcluster.flushed", f"{_V}.flushed", vc.VClusterChanged, (C,),
        "a virtual cluster's change stored but not published (seed 003's \"flush without publishing\": a "
        "divisible cluster's replenish): kept for the history and recovery, never on vcluster.*.changed",
        id_rule="vc:{vcluster_id}:{gen}:r{revision}", token_fields=_VID,
    )
    vcluster_refused = Event(
        "vcluster.refused", f"{_V}.refused", vc.VClusterRefused, (C,),
        "a virtual cluster request refused whole, with the reason and the current revision",
        id_rule="vc:{vcluster_id}:refused:{request_id}", token_fields=_VID,
    )
    node_drain = Event(
        "node.drain", f"{_N}.drain", vc.NodeDrain, (A,),
        "node drained (no new placements, its instances moved with reason evacuation) or undrained",
        id_rule="{node_id}:drain:{request_id}",
    )
    node_removed = Event(
        "node.removed", f"{_N}.removed", vc.NodeRemoved, (A,), "a drained, idle node removed from its cluster",
        id_rule="{node_id}:removed:{request_id}",
    )
    cluster_removed = Event(
        "cluster.removed", f"{_C}.removed", vc.ClusterRemoved, (A,),
        "a cluster with nothing running and no virtual cluster removed, with its nodes",
        id_rule="{cluster_id}:removed:{request_id}",
    )
    # -- side-cars (docs/sidecars.md) -------------------------------------------------------------
    node_sidecar_start = Event(
        "node.sidecar.start", f"{_N}.sidecar.start", ev.SidecarCommand, (C,),
        "run a block's side-car on this node (placed with the block's gang)",
        id_rule="{block_id}:{gen}:sidecar.start:{name}",
    )
    node_sidecar_stop = Event(
        "node.sidecar.stop", f"{_N}.sidecar.stop", ev.SidecarCommand, (C,),
        "stop a block's side-car and delete its consumer (the block was deleted or failed)",
        id_rule="{block_id}:{gen}:sidecar.stop:{name}",
    )
    block_output = Event(
        "block.output", f"{ROOT}.output.{{bid}}.{{outcome}}", ev.TaskOutput, (Role.EXECUTOR,),
        "a task's output (outcome ok / error), published after the answer; stored in AIOS_OUTPUTS "
        "(its own limits), consumed by the block's side-cars",
        id_rule="output:{block_id}:{task_id}", stream=STREAM_OUTPUTS,
    )
    #: an output is the users' data (docs/security.md "Tasks and outputs are not events"): its dead
    #: letter stays in AIOS_OUTPUTS, which observers cannot read, not in AIOS with the other dead letters
    output_dead_letter = Event(
        "output.dlq", f"{ROOT}.output.{{bid}}.dlq.{{name}}.{{outcome}}", ev.DeadLetter, (Role.SIDECAR,),
        "an output the block's side-car {name} gave up on (maxDeliver failed deliveries, or malformed), with the "
        "error and the output cut to 8 KiB; stored in AIOS_OUTPUTS with the outputs (users' data: no observer reads "
        "it); blocks dlq lists it with the other dead letters",
        id_rule="dlq:sidecar-{bid}-{name}:{stream_seq}", stream=STREAM_OUTPUTS,
    )
    sidecar_alert = Event(
        "block.sidecar.alert", f"{_B}.sidecar.{{name}}.alert", ev.SidecarAlert, (Role.SIDECAR,),
        "core NATS, not stored: a side-car found something in an output (the alerting example)",
        stored=False, body=Body.CORE,
    )
    dead_letter = Event(
        "dlq", f"{ROOT}.dlq.{{consumer}}.{{subject}}", ev.DeadLetter, (R,),
        "message that kept failing, with the error (a CloudEvent like every event the system stores); a "
        "side-car's output goes to output.dlq instead",
        id_rule="dlq:{consumer}:{stream_seq}",
    )
    #: the letter's mark (not a header on the copy only): ``blocks dlq`` shows it, and a second
    #: replay of the same letter is refused without --force. Only the admin replays (it alone may
    #: publish every original subject again); it carries no payload of the original (an output's is users' data)
    dlq_replayed = Event(
        "dlq.replayed", f"{ROOT}.replayed.{{stream}}.{{seq}}", dq.DlqReplayed, (A,),
        "a dead letter (stream, seq) republished on its original subject by blocks dlq replay: by whom, when, the "
        "copy's sequence, the attempt (2 and up: --force)",
        id_rule="dlq.replayed:{stream}:{seq}:{attempt}",
    )


def events() -> Iterator[Event[Any]]:
    for value in vars(E).values():
        if isinstance(value, Event):
            yield value


EVENTS: tuple[Event[Any], ...] = tuple(events())
BY_NAME: dict[str, Event[Any]] = {e.name: e for e in EVENTS}
BY_TYPE: dict[str, Event[Any]] = {e.type: e for e in EVENTS}
assert len(BY_NAME) == len(EVENTS), "two catalog events share a name"


def parse(subject: str) -> tuple[Event[Any], dict[str, str]] | None:
    """Which event a concrete subject is, and its tokens (``None``: not a catalog subject)."""
    for e in EVENTS:
        toks = e.match(subject)
        if toks is not None:
            return e, toks
    return None


def stream_of(event: Event[Any]) -> str | None:
    """The stream that stores ``event`` (``None``: core NATS only)."""
    return event.stream if event.stored else None


def stream_subjects(stream: str = STREAM) -> list[str]:
    """What ``stream`` captures: every event it stores, by its filter (and its extra filters)."""
    out: list[str] = []
    for e in EVENTS:
        if stream_of(e) == stream:
            for f in (e.filter(), *e.extra_filters):
                if f not in out:
                    out.append(f)
    return out


def published_by(role: Role) -> list[Event[Any]]:
    return [e for e in EVENTS if role in e.publishers]
