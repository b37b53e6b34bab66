"""Every NATS subject the system uses, and every durable consumer, named in one place.

Entity first, event last, so one wildcard follows one block (``aios.block.B.>``) or one kind of
event (``aios.block.*.ready``). Ids are validated (``schemas.spec.ID_RE``) before they become
subject tokens, so a block id can never be ``*``, ``>`` or contain a dot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .catalog import EVENTS, ROOT, STREAM, STREAM_INTAKE, STREAM_OUTPUTS, E, Event, stream_subjects
from .catalog import STREAM_OBSERVE as STREAM_OBSERVE  # re-exported: the observers' mirror of STREAM

#: What the stream keeps: every stored event of the catalog (``catalog.stream_subjects``). Left out
#: on purpose (core NATS only): node heartbeats (a liveness signal, not state), inventory hints
#: (cache invalidation) and request/reply subjects (``aios.node.{nid}.expected``): a stream
#: capturing a request subject would answer the requester with its PubAck before the real
#: responder does.
STREAM_SUBJECTS = stream_subjects()
#: What ``AIOS_OUTPUTS`` keeps: the blocks' task outputs (``aios.output.{bid}.{outcome}``), apart
#: from ``AIOS`` so their volume never pushes a control event out (docs/sidecars.md).
OUTPUT_STREAM_SUBJECTS = stream_subjects(STREAM_OUTPUTS)
#: What ``AIOS_INTAKE`` keeps: the creates as sent (the parser stores each in ``AIOS`` as ``submitted``)
INTAKE_STREAM_SUBJECTS = stream_subjects(STREAM_INTAKE)
#: The instance-map KV bucket (``bus.instance_map``; its stream is ``KV_<bucket>``)
INSTANCE_BUCKET = "aios-instances"

# -- block lifecycle (aios.block.{bid}.*) -------------------------------------------------------
def block_create(bid: str) -> str:
    return f"{ROOT}.block.{bid}.create"


def block_event(bid: str, event: str) -> str:
    """``parsed``, ``rejected``, ``selection``, ``post_dry_run``, ``placement``, ``ready``,
    ``failed``, ``deleted``, ``delete``, ``scale.failed``, ``reassignment.failed``, ``dry_run.result``."""
    return f"{ROOT}.block.{bid}.{event}"


def block_all(bid: str = "*") -> str:
    return f"{ROOT}.block.{bid}.>"


def instance_event(bid: str, iid: str, event: str) -> str:
    """``added``, ``removed``, ``failed``, ``unhealthy``."""
    return f"{ROOT}.block.{bid}.instance.{iid}.{event}"


# -- cluster controller commands (aios.cluster.{cid}.*) -----------------------------------------
def cluster_command(cid: str, command: str) -> str:
    """``dry_run``, ``allocation``, ``scale``, ``reassignment``."""
    return f"{ROOT}.cluster.{cid}.{command}"


def cluster_inventory(cid: str) -> str:
    """Inventory changed on some nodes of the cluster (reserve/release/node add): caches refresh."""
    return E.inventory_hint.subject(cid=cid)


# -- node agent commands and node facts (aios.node.{nid}.*) ---------------------------------------
def node_command(nid: str, command: str) -> str:
    """``instance.create``, ``instance.remove``."""
    return f"{ROOT}.node.{nid}.{command}"


def node_dangling(nid: str) -> str:
    """An agent found a container/process labelled for its node that it was not told to run."""
    return f"{ROOT}.node.{nid}.instance.dangling"


def node_registered(nid: str) -> str:
    """A node agent announced its node: labels, CPU, memory, GPUs (the controller records it)."""
    return f"{ROOT}.node.{nid}.registered"


def node_health(nid: str) -> str:
    """The node went unhealthy (heartbeats stopped) or healthy again (they resumed)."""
    return f"{ROOT}.node.{nid}.health"


def node_heartbeat(nid: str) -> str:
    """Core NATS only (not stored): free resources and load, every few seconds."""
    return f"{ROOT}.node.{nid}.heartbeat"


def node_expected(nid: str) -> str:
    """Core NATS request/reply (not stored): which instances should run on this node."""
    return f"{ROOT}.node.{nid}.expected"


def node_sidecar_grant(nid: str) -> str:
    """Core NATS request/reply (not stored) of node ``nid``'s agent on an external NATS: the
    credentials of a block's side-car user, from ``blocks sidecar-auth`` (runtime/sidecar_callout.py)."""
    return f"{ROOT}.node.{nid}.sidecar.grant"


def node_sidecar_release(nid: str) -> str:
    """Core NATS request/reply: node ``nid`` runs none of a block's side-cars any more."""
    return f"{ROOT}.node.{nid}.sidecar.release"


HEARTBEAT_ALL = f"{ROOT}.node.*.heartbeat"
EXPECTED_ALL = f"{ROOT}.node.*.expected"


# -- policies and dead letters ------------------------------------------------------------------
def policy_updated(name: str) -> str:
    """Carries the whole registry record (name, version, source, language): ``blocks recover``
    rebuilds the registry from these."""
    return f"{ROOT}.policy.{name}.updated"


def dead_letter(consumer: str, original_subject: str) -> str:
    return f"{ROOT}.dlq.{consumer}.{original_subject}"


DLQ_ALL = f"{ROOT}.dlq.>"
INVENTORY_ALL = E.inventory_hint.filter()
POLICY_UPDATED_ALL = f"{ROOT}.policy.*.updated"

def matches(filter_: str, subject: str) -> bool:
    """NATS wildcard match of a concrete subject: ``*`` is one token, a trailing ``>`` one or more."""
    f, s = filter_.split("."), subject.split(".")
    for i, tok in enumerate(f):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(f) == len(s)


# Event types (CloudEvents ``type``) are the subject with the ids removed.
def event_type(kind: str) -> str:
    return f"io.aios.{kind}"


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: its name, the catalog events it takes (``scope`` fixes subject
    tokens, e.g. one cluster) and the subject filters derived from them."""

    durable: str
    filters: tuple[str, ...]
    events: tuple[Event[Any], ...] = ()
    scope: tuple[tuple[str, str], ...] = ()
    stream: str = STREAM
    #: the filters of the events it takes that are not stored (queries over core NATS): a queue
    #: group named ``durable`` takes them (``bus.runner.CoreRunner``), one copy per message
    core_filters: tuple[str, ...] = ()


def consumer(durable: str, *events: Event[Any], **scope: str) -> ConsumerSpec:
    filters: list[str] = []
    core: list[str] = []
    for e in events:
        into = filters if e.stored else core
        for f in e.filters(**scope):
            if f not in into:
                into.append(f)
    streams = {e.stream for e in events if e.stored}
    if len(streams) > 1:
        raise ValueError(f"consumer {durable}: its events are stored in several streams {sorted(streams)}")
    return ConsumerSpec(durable, tuple(filters), events, tuple(sorted(scope.items())), stream=streams.pop() if streams else STREAM,
                        core_filters=tuple(core))


#: The parser also takes create subjects whose id held dots (``aios.block.a.b.create``): they can
#: only be dead-lettered, but they must not sit in the stream unanswered. Its stream is ``AIOS_INTAKE``;
#: tenants' creates come there as ``aios.tenant.<t>.block.<bid>.create`` (``runtime.tenants``).
PARSER = consumer("parser", E.block_create, E.tenant_block_create)
GATEWAY = consumer("gateway", E.block_parsed, E.block_dry_run_result)

CONTROLLER_EVENTS = (E.cluster_dry_run, E.cluster_allocation, E.cluster_scale, E.cluster_scale_down, E.cluster_reassignment)


def controller(cluster: str | None = None) -> ConsumerSpec:
    """All clusters (``cluster=None``, one shared durable) or one cluster's own durable.

    Use one form or the other in a deployment, not both: two durables both receive a message.
    """
    if cluster:
        return consumer(f"controller-{cluster}", *CONTROLLER_EVENTS, cid=cluster)
    return consumer("controller", *CONTROLLER_EVENTS)


#: Facts the controllers act on (readiness, deletion, failures, agents' nodes and leftovers).
#: Shared by all controllers.
LIFECYCLE = consumer(
    "lifecycle", E.instance_added, E.instance_removed, E.instance_failed, E.instance_unhealthy, E.block_delete,
    E.node_dangling, E.node_registered, E.block_scale_target, E.instance_verdict, E.node_inventory,
    E.quota_set, E.block_pending, E.block_move_requested,
)


#: The mapper's facts: placements (starting), additions (ready), remove commands (draining),
#: failures (stopping), removals (gone), deletions (the map goes), readiness (the first map of a
#: block of minInstances 0). Shared by the executors that run it.
MAPPER = consumer(
    "mapper", E.block_placement, E.instance_added, E.node_instance_remove, E.instance_failed, E.instance_unhealthy,
    E.instance_removed, E.block_deleted, E.instance_verdict, E.block_ready, E.node_inventory,
)
#: Every executor is one of this queue group on ``aios.block.*.task``.
EXECUTOR_QUEUE = "executor"
#: Virtual cluster requests (seed 003), and the ends of blocks whose job clusters go with them.
#: Shared by all controllers (a request's Lua commit re-checks everything).
VCLUSTER = consumer("vcluster", E.vcluster_create, E.vcluster_update, E.vcluster_remove, E.block_deleted, E.block_failed,
                    E.block_pending)


def agent(node: str | None = None) -> ConsumerSpec:
    """One node agent's own durable (``node``), or the simulated fleet's shared one (``None``)."""
    if node:
        return consumer(f"agent-{node}", *AGENT_EVENTS, nid=node)
    return consumer("agent-sim", *AGENT_EVENTS)


#: a node agent's commands: its instances and its side-cars
AGENT_EVENTS = (E.node_instance_create, E.node_instance_remove, E.node_instance_restart, E.node_sidecar_start,
                E.node_sidecar_stop)


def sidecar_durable(bid: str, name: str) -> str:
    """The durable consumer of a block's side-car (every copy of it pulls from this one)."""
    return f"sidecar-{bid}-{name}"


def sidecar(bid: str, name: str, status: str = "any") -> ConsumerSpec:
    """A side-car's durable on ``AIOS_OUTPUTS``: the block's outputs, all or one outcome."""
    outcome = {"ok": "ok", "error": "error"}.get(status, "")
    return ConsumerSpec(sidecar_durable(bid, name), (E.block_output.filter(bid=bid, outcome=outcome),), (E.block_output,),
                        (("bid", bid),), STREAM_OUTPUTS)


# -- inventory registration (event-sourced: ``blocks recover`` rebuilds Redis from these) -----------
def uri_digest(uri: str) -> str:
    """The subject token of a component URI (which may hold dots and slashes)."""
    import hashlib

    return hashlib.sha256(uri.encode()).hexdigest()[:20]


def component_registered(uri: str) -> str:
    """A component (full record) was registered. The token is a digest of the URI, which may
    hold dots and slashes; the URI itself is in the event."""
    return E.component_registered.subject(digest=uri_digest(uri))


def cluster_registered(cid: str) -> str:
    """A cluster (id, labels) was registered."""
    return f"{ROOT}.cluster.{cid}.registered"


def catalog() -> list[tuple[str, str, str]]:
    """(subject pattern, publishers, meaning) for docs and ``blocks subjects`` (from ``bus.catalog``)."""
    out = []
    for e in EVENTS:
        who = " / ".join(r.value for r in e.publishers)
        if e.responders:
            who += " (" + " / ".join(r.value for r in e.responders) + " replies)"
        out.append((e.pattern, who, e.meaning))
    return out
