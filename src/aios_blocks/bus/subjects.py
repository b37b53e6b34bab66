"""Every NATS subject the system uses, and every durable consumer, named in one place.

Entity first, event last, so one wildcard follows one block (``aios.block.B.>``) or one kind of
event (``aios.block.*.ready``). Ids are validated (``schemas.spec.ID_RE``) before they become
subject tokens, so a block id can never be ``*``, ``>`` or contain a dot.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "aios"
STREAM = "AIOS"
#: What the stream keeps: every fact and command of the system. Left out on purpose (core NATS
#: only, never stored): node heartbeats (``aios.node.{nid}.heartbeat``, a liveness signal, not
#: state) and request/reply subjects (``aios.node.{nid}.expected``): a stream capturing a request
#: subject would answer the requester with its PubAck before the real responder does.
STREAM_SUBJECTS = [
    f"{ROOT}.block.>",
    f"{ROOT}.cluster.>",
    f"{ROOT}.component.>",
    f"{ROOT}.node.*.instance.>",
    f"{ROOT}.node.*.registered",
    f"{ROOT}.node.*.health",
    f"{ROOT}.policy.>",
    f"{ROOT}.input.>",
    f"{ROOT}.dlq.>",
]

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
    return f"{ROOT}.cluster.{cid}.inventory"


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


HEARTBEAT_ALL = f"{ROOT}.node.*.heartbeat"
EXPECTED_ALL = f"{ROOT}.node.*.expected"


def decision_input(digest: str) -> str:
    """A policy input too large to inline in its decision record, stored once by digest."""
    return f"{ROOT}.input.{digest}"


# -- policies and dead letters ------------------------------------------------------------------
def policy_updated(name: str) -> str:
    """Carries the whole registry record (name, version, source, language): ``blocks recover``
    rebuilds the registry from these."""
    return f"{ROOT}.policy.{name}.updated"


def dead_letter(consumer: str, original_subject: str) -> str:
    return f"{ROOT}.dlq.{consumer}.{original_subject}"


DLQ_ALL = f"{ROOT}.dlq.>"
INVENTORY_ALL = f"{ROOT}.cluster.*.inventory"
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
    """A durable pull consumer: its name and the subjects it filters on."""

    durable: str
    filters: tuple[str, ...]


#: The parser also takes create subjects whose id held dots (``aios.block.a.b.create``): they can
#: only be dead-lettered, but they must not sit in the stream unanswered.
PARSER = ConsumerSpec("parser", (f"{ROOT}.block.*.create", f"{ROOT}.block.*.*.create", f"{ROOT}.block.*.*.*.create"))
GATEWAY = ConsumerSpec(
    "gateway",
    (
        f"{ROOT}.block.*.parsed",
        f"{ROOT}.block.*.dry_run.result",
        f"{ROOT}.block.*.dry_run.deadline",
    ),
)


def controller(cluster: str | None = None) -> ConsumerSpec:
    """All clusters (``cluster=None``, one shared durable) or one cluster's own durable.

    Use one form or the other in a deployment, not both: two durables both receive a message.
    """
    cid = cluster or "*"
    name = f"controller-{cluster}" if cluster else "controller"
    return ConsumerSpec(
        name,
        (
            f"{ROOT}.cluster.{cid}.dry_run",
            f"{ROOT}.cluster.{cid}.allocation",
            f"{ROOT}.cluster.{cid}.scale",
            f"{ROOT}.cluster.{cid}.reassignment",
        ),
    )


#: Facts the controllers act on (readiness, deletion, failures, agents' nodes and leftovers).
#: Shared by all controllers.
LIFECYCLE = ConsumerSpec(
    "lifecycle",
    (
        f"{ROOT}.block.*.instance.*.added",
        f"{ROOT}.block.*.instance.*.removed",
        f"{ROOT}.block.*.instance.*.failed",
        f"{ROOT}.block.*.instance.*.unhealthy",
        f"{ROOT}.block.*.delete",
        f"{ROOT}.node.*.instance.dangling",
        f"{ROOT}.node.*.registered",
    ),
)


def agent(node: str | None = None) -> ConsumerSpec:
    """One node agent's own durable (``node``), or the simulated fleet's shared one (``None``)."""
    nid = node or "*"
    name = f"agent-{node}" if node else "agent-sim"
    return ConsumerSpec(name, (f"{ROOT}.node.{nid}.instance.create", f"{ROOT}.node.{nid}.instance.remove"))


# -- inventory registration (event-sourced: ``blocks recover`` rebuilds Redis from these) -----------
def component_registered(uri: str) -> str:
    """A component (full record) was registered. The token is a digest of the URI, which may
    hold dots and slashes; the URI itself is in the event."""
    import hashlib

    return f"{ROOT}.component.{hashlib.sha256(uri.encode()).hexdigest()[:20]}.registered"


def cluster_registered(cid: str) -> str:
    """A cluster (id, labels) was registered."""
    return f"{ROOT}.cluster.{cid}.registered"


def catalog() -> list[tuple[str, str, str]]:
    """(subject pattern, publisher, meaning) for docs and ``blocks subjects``."""
    return [
        ("aios.block.{bid}.create", "upstream / CLI", "block spec submitted (bare spec or CloudEvent)"),
        ("aios.block.{bid}.parsed", "parser / controller", "IR built; the controller sends it again when a gang no longer fits (back to selection)"),
        ("aios.block.{bid}.rejected", "parser", "invalid spec, with every error and its JSON path"),
        ("aios.block.{bid}.selection", "gateway", "candidate clusters and why others were filtered"),
        ("aios.cluster.{cid}.dry_run", "gateway", "feasibility request for one block"),
        ("aios.block.{bid}.dry_run.result", "controller", "score + node_info from one cluster"),
        ("aios.block.{bid}.dry_run.deadline", "gateway", "gather deadline timer (redelivered when due)"),
        ("aios.block.{bid}.post_dry_run", "gateway", "cluster chosen, with every score"),
        ("aios.cluster.{cid}.allocation", "gateway", "place minInstances (a gang)"),
        ("aios.cluster.{cid}.scale", "CLI / autoscaler", "place one more instance"),
        ("aios.cluster.{cid}.reassignment", "CLI / health checker", "move one instance"),
        ("aios.block.{bid}.allocation.failed", "controller", "chosen cluster could not take the gang: back to selection"),
        ("aios.block.{bid}.placement", "controller", "instances reserved: node + GPUs each"),
        ("aios.node.{nid}.instance.create", "controller", "start an instance"),
        ("aios.node.{nid}.instance.remove", "controller", "stop an instance"),
        ("aios.block.{bid}.instance.{iid}.added", "node agent", "instance running"),
        ("aios.block.{bid}.instance.{iid}.removed", "node agent / controller", "instance stopped (reason: removed, lost, evicted...)"),
        ("aios.block.{bid}.instance.{iid}.failed", "node agent", "instance exited or could not start, with the reason"),
        ("aios.block.{bid}.instance.{iid}.unhealthy", "node agent", "instance failed its health probe"),
        ("aios.node.{nid}.instance.dangling", "node agent", "a labelled container/process nobody asked this node to run"),
        ("aios.node.{nid}.registered", "node agent", "node capacity, labels and GPUs (controller records it)"),
        ("aios.node.{nid}.health", "controller", "node marked unhealthy (heartbeats stopped) or healthy again"),
        ("aios.node.{nid}.heartbeat", "node agent", "core NATS, not stored: free resources and load"),
        ("aios.node.{nid}.expected", "controller (replies)", "core NATS request/reply, not stored: instances the node should run"),
        ("aios.block.{bid}.ready", "controller", "minInstances are running"),
        ("aios.block.{bid}.failed", "gateway / controller", "block cannot be placed, with the reason"),
        ("aios.block.{bid}.scale.failed", "controller", "a scale step failed (block stays as it was)"),
        ("aios.block.{bid}.reassignment.failed", "controller", "a reassignment step failed"),
        ("aios.block.{bid}.delete", "CLI", "delete requested"),
        ("aios.block.{bid}.deleted", "controller", "every instance removed and released"),
        ("aios.cluster.{cid}.inventory", "controller / CLI", "nodes changed: caches refresh them"),
        ("aios.block.{bid}.decision", "gateway / controller", "one policy call: policy, version, action, input digest, output, duration, error"),
        ("aios.input.{digest}", "gateway / controller", "a large policy input, stored once by digest"),
        ("aios.policy.{name}.updated", "CLI", "policy stored: name, version, source, language (caches drop it)"),
        ("aios.component.{digest}.registered", "CLI", "component registered: the full record (digest of its URI)"),
        ("aios.cluster.{cid}.registered", "CLI", "cluster registered: id and labels"),
        ("aios.dlq.{consumer}.{subject}", "consumer runner", "message that kept failing, with the error"),
    ]
