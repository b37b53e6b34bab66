"""Events on the wire: msgspec structs inside a CloudEvents 1.0 envelope (JSON).

Every event carries the block's ``gen`` (the stream sequence of the create message it descends
from) so that deterministic message ids stay unique when a block id is deleted and reused.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import msgspec

from .errors import SpecError
from .records import (
    AdaptiveTerm,
    AdaptTable,
    BlockIR,
    JSONObject,
    LaunchRecord,
    NodeView,
    SidecarRecord,
    Wire,
)
from .records import Placement as PlacementRecord


class Envelope(msgspec.Struct):
    id: str
    source: str
    type: str
    subject: str
    time: str
    data: Any = None
    specversion: str = "1.0"
    datacontenttype: str = "application/json"


class Parsed(msgspec.Struct):
    block_id: str
    gen: int
    ir: Wire[BlockIR]
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0



class Submitted(msgspec.Struct):
    """A create as the parser took it from ``AIOS_INTAKE`` (``block.submitted``): what a publisher
    sent, bare or a CloudEvent, kept in ``AIOS`` as a CloudEvent like every stored event."""

    block_id: str
    #: the create's sequence in ``AIOS_INTAKE``: its publisher's PubAck ``seq``, the block's gen
    gen: int
    #: the subject it was published on
    subject: str
    #: sha256 (16 hex) of the body as sent: the block record's ``digest``
    digest: str
    #: the spec (a CloudEvent's ``data``); ``None`` when the body held none (its rejected says why)
    spec: Wire[JSONObject] | None = None
    #: ``cloudevent`` or ``bare``: how the publisher framed it
    framing: str = "bare"
    #: the publisher's CloudEvent attributes (id, source, type, time...), without ``data``
    attributes: Wire[JSONObject] = {}
    #: its headers of note (``Nats-Msg-Id``, ``Content-Type``)
    headers: dict[str, str] = {}
    #: the body's first bytes as text, when it held no spec (not JSON, too large, not an object)
    body: str = ""


class Rejected(msgspec.Struct):
    block_id: str
    gen: int
    errors: list[SpecError]


class Selection(msgspec.Struct):
    block_id: str
    gen: int
    candidates: list[str]
    #: cluster id -> why the filter rule or the selection policy dropped it
    filtered: dict[str, str] = {}
    policy: str = ""
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0
    #: when the gather of this round's dry_run answers decides at the latest (epoch seconds)
    deadline: float = 0.0
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []



class DryRunRequest(msgspec.Struct, omit_defaults=True):
    """Feasibility of one block in one cluster. The IR is not sent (the block's ``parsed`` event
    and record hold it, the same for every cluster): the controller reads it once per block;
    ``ir`` is read when a request carries it (sent before it was left out)."""

    block_id: str
    gen: int
    cluster_id: str
    ir: Wire[BlockIR] = {}
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0
    #: the state version the round started from (the stream sequence of the ``parsed`` event the
    #: gateway handled): a request is not stored, so the controller records its dry_run decision
    #: with this (``Decision.at``) and ``blocks explain`` rebuilds the input from there
    at: int = 0



class DryRunResult(msgspec.Struct):
    block_id: str
    gen: int
    cluster_id: str
    score: float
    node_info: Wire[PlacementRecord] = {}
    #: instances that fit in this cluster, when the resourceAllocator says so; -1: it did not say
    placeable: int = -1
    #: minInstances - placeable when the cluster said it cannot hold the gang (else 0): such an
    #: answer does not end a gather early; another cluster may still answer with room
    shortfall: int = 0
    error: str = ""
    #: node -> why Required affinity rejected it; node -> Preferred/Adaptive affinity score (explain)
    rejected_nodes: dict[str, str] = {}
    node_scores: dict[str, float] = {}
    #: the adapt stage's table (Adaptive affinity entries: per node p50 and weight multiplier), else {}
    adapt: Wire[AdaptTable] = {}
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []
    #: why this answer is not a resourceAllocator's (the gateway skipped the dry_run: the round's
    #: only candidate, ``workers.gateway.skip_reason``); "" for an answer the cluster gave
    skipped: str = ""



class GatherDeadline(msgspec.Struct):
    """The gateway's timer for one gather round: redelivered (NAK with delay) until it is due."""

    block_id: str
    gen: int
    attempt: int
    deadline: float


class InventoryHint(msgspec.Struct, omit_defaults=True):
    """Core NATS: these nodes of ``cluster`` changed (``nodes`` empty: the whole cluster and the
    cluster list). A lost hint only costs a stale cache read until the next one."""

    cluster: str
    nodes: list[str] | None = None
    #: the worker process that sent it, which has already brought its own view up to date
    #: (it ignores its own hints; the others re-read the nodes)
    origin: str = ""


class PostDryRun(msgspec.Struct):
    block_id: str
    gen: int
    cluster_id: str
    scores: dict[str, float]
    #: clusters that did not answer before the deadline (counted as score 0)
    missing: list[str] = []
    errors: dict[str, str] = {}
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []
    #: every dry_run answer the round had when it decided (they are not stored apart: the answers
    #: travel over core NATS), each with its own decision records; clusters in ``missing`` have none
    answers: list[DryRunResult] = []



class AllocationRequest(msgspec.Struct):
    block_id: str
    gen: int
    cluster_id: str
    #: selection round (an allocation that fails sends the block back through selection)
    attempt: int = 0



class ScaleRequest(msgspec.Struct):
    block_id: str
    cluster_id: str
    request_id: str
    block_metrics: Wire[JSONObject] = {}
    #: the block's generation when the request was made (0: whichever is current)
    gen: int = 0
    #: the version of the block's desired count (``desired_seq``) that asked for this instance;
    #: 0: a plain "one more" (``blocks scale BID``). A step whose target was superseded places nothing
    target_seq: int = 0


class ScaleDownRequest(msgspec.Struct):
    """Remove instances of a block down to ``target`` (never below ``minInstances``): the
    resourceAllocator (action ``scale_down``) names each one; it drains, then is removed."""

    block_id: str
    cluster_id: str
    request_id: str
    #: the instance count to come down to (the floor: the step never goes below it)
    target: int
    #: how many instances this step removes at most
    count: int = 1
    block_metrics: Wire[JSONObject] = {}
    #: the block's generation when the request was made (0: whichever is current)
    gen: int = 0
    #: as ``ScaleRequest.target_seq``: 0 = not from a target
    target_seq: int = 0
    reason: str = ""


class ScaleDownChosen(msgspec.Struct):
    """An instance chosen by a ``scale_down`` step: it drains (no new task), then is removed."""

    block_id: str
    gen: int
    cluster_id: str
    request_id: str
    instance_id: str
    node_id: str
    #: ``policy`` (the resourceAllocator named it) or ``default`` (least loaded, newest first)
    chosen_by: str
    reason: str = ""
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []


class ScaleTarget(msgspec.Struct):
    """A block's desired instance count (``blocks scale BID --to N``, the autoscaler, the executor
    waking a block scaled to zero). The controller reaches it with ``scale`` and ``scale_down``
    steps; the framework clamps it to ``[minInstances, maxInstances]``."""

    block_id: str
    request_id: str
    target: int
    reason: str = ""
    #: who asked: ``cli``, ``autoscaler``, ``activator`` (executor, first task of a block at zero)
    source: str = "cli"
    #: the block's generation when the request was made (0: whichever is current)
    gen: int = 0


class PlacementReason(enum.StrEnum):
    """Why an instance is being placed, as seed 004 tells a placement scriptlet (``request.reason``)."""

    NEW = "new"
    #: moved off a node being drained (``blocks node drain``)
    EVACUATION = "evacuation"
    #: moved for any other reason: its node died, the health checker replaces it, a user's reassign
    RELOCATION = "relocation"

    @classmethod
    def of_reassignment(cls, reason: str) -> PlacementReason:
        """A reassignment's reason word for scriptlets from its request's free-text ``reason``."""
        return cls.EVACUATION if reason == cls.EVACUATION else cls.RELOCATION


class ReassignRequest(msgspec.Struct):
    """Move one instance elsewhere. ``reason``: free text shown in events, except the drain's
    ``evacuation`` (``PlacementReason.EVACUATION``), which a scriptlet sees as such."""

    block_id: str
    cluster_id: str
    request_id: str
    instance_id: str
    reason: str = "requested"
    block_metrics: Wire[JSONObject] = {}
    #: the block's generation when the request was made (0: whichever is current)
    gen: int = 0
    #: the node the replacement must not land on: the one the instance is moved off (its node
    #: died, or the instance failed there); "" = none. It is used anyway only when no other node
    #: can take it and it is healthy, not suspect, and its agent has sent a heartbeat since ``at``
    #: (it is alive after the fault; docs/health.md "Suspect nodes")
    avoid_node: str = ""
    #: when the request was made (Unix seconds; 0: not said)
    at: float = 0.0


class Placement(msgspec.Struct):
    instance_id: str
    node_id: str
    gpus: list[str]
    #: Adaptive affinity entries on this node: [{"entry", "base", "multiplier", "weight", "why"}]
    adaptive: list[Wire[AdaptiveTerm]] = []
    #: a multi-GPU instance on a node that reports its GPU topology: {"tier": the link tier its
    #: GPUs achieve, "best": the best tier the node had free} (docs/topology.md); {}: not known
    topology: dict[str, str] = {}


class PlacementMade(msgspec.Struct):
    """Published on the block's subject when instances are reserved: the block's story stays
    readable from ``aios.block.{bid}.>`` alone."""

    block_id: str
    gen: int
    cluster_id: str
    action: str
    placements: list[Placement]
    attempts: int = 1
    replaces: str = ""
    #: what asked for it: ``gang`` (the allocation) or the scale/reassignment request id
    request_id: str = "gang"
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []
    #: the adapt stage's table the placement used (Adaptive affinity entries), else {}
    adapt: Wire[AdaptTable] = {}


class InstanceCommand(msgspec.Struct):
    block_id: str
    gen: int
    cluster_id: str
    instance_id: str
    node_id: str
    gpus: list[str]
    image: str = ""
    env: dict[str, Any] = {}
    reason: str = ""
    #: how to run it (``schemas.spec.Launch`` JSON) and what it was reserved (cpu, memory, gpus...)
    launch: Wire[LaunchRecord] = {}
    resources: dict[str, Any] = {}
    #: remove commands of a scale-down: the node agent lets tasks in flight at the instance finish,
    #: for at most this many seconds, before it stops it (0: no wait beyond ``drain_grace_s``)
    drain_s: float = 0.0


class SidecarCommand(msgspec.Struct):
    """Start or stop a block's side-car on a node (docs/sidecars.md). ``sidecar`` is the
    ``schemas.spec.Sidecar`` entry of the block's IR (JSON); ``reason`` says why it stops."""

    block_id: str
    gen: int
    cluster_id: str
    node_id: str
    name: str
    sidecar: Wire[SidecarRecord] = {}
    reason: str = ""


class TaskOutput(msgspec.Struct):
    """One task's output, published by the executor after it answered (docs/sidecars.md).
    ``output`` is the answer's body, ``utf-8`` text or ``base64`` (``encoding``), cut to the
    output limit (``truncated``; ``size`` is the whole answer's size in bytes)."""

    block_id: str
    task_id: str
    instance_id: str
    status: int
    output: str = ""
    encoding: str = "utf-8"
    content_type: str = ""
    size: int = 0
    truncated: bool = False
    #: epoch seconds when the executor got the answer
    time: float = 0.0
    #: ``ok`` (status < 400) or ``error``: the last token of the subject
    outcome: str = "ok"
    #: the block's generation (a side-car of another generation of the same block id skips it)
    gen: int = 0


class SidecarAlert(msgspec.Struct):
    """What a side-car found in an output (the example alerting side-car publishes these)."""

    block_id: str
    name: str
    task_id: str
    message: str
    time: float = 0.0


class InstanceEvent(msgspec.Struct):
    block_id: str
    gen: int
    instance_id: str
    node_id: str
    gpus: list[str] = []
    reason: str = ""
    #: base URL of the instance's HTTP server (``http://host:port``, no trailing slash), set on
    #: ``added``: tasks go to ``{endpoint}{inputProtocol.path}``, health to ``{endpoint}/health``,
    #: metrics to ``{endpoint}/metrics`` (``schemas.protocol``); "" = the instance serves no HTTP
    endpoint: str = ""
    #: the boot id of the agent that reports it (``NodeInventory.boot``; "" = not said): an
    #: ``added`` of an older boot than the node's latest inventory is not routed to (docs/agents.md)
    boot: str = ""


class InventoryItem(msgspec.Struct):
    """One instance a node agent runs at the time of its inventory."""

    instance_id: str
    block_id: str = ""
    gen: int = 0
    endpoint: str = ""


class NodeInventory(msgspec.Struct):
    """What a node agent really runs, published once when it starts, before it takes a command
    (docs/agents.md "Inventory"). ``boot`` is new at every start of the agent: the controller marks
    the instances the state has running on the node but missing here ``lost`` (removed, then
    replaced), and the mapper routes only to instances confirmed under this boot."""

    node_id: str
    boot: str
    instances: list[InventoryItem] = []
    #: when it was taken (Unix seconds)
    time: float = 0.0


class InstanceVerdict(msgspec.Struct):
    """The health checker's verdict on one instance (its block's stabilityChecker policy, after the
    framework's startup grace and out-of-routing cap; docs/health.md). Only changes are published: ``healthy``
    (back to full routing), ``degrade`` (routing ``weight`` < 1), ``unready`` (no routing), ``restart`` (its
    node agent restarts it, same id), ``replace`` (the resourceAllocator's ``reassignment``)."""

    block_id: str
    gen: int
    instance_id: str
    node_id: str
    verdict: str
    reason: str
    weight: float = 1.0
    #: the stabilityChecker that decided (its policyRuleURI)
    policy: str = ""
    #: distinguishes repeated verdicts about the same instance (the checker's tick, ms)
    seq: str = ""


class NodeRegistered(msgspec.Struct):
    """A node announced by its agent (or by ``blocks node add`` / ``cluster add`` for simulated
    inventory): ``node`` is a ``schemas.spec.Node`` as JSON. The controller records it."""

    node: Wire[JSONObject]
    #: who serves the node's commands: "" = the simulated fleet (``agent-sim``), else the agent's
    #: name (``{runtime}@{host}``), whose own durable is ``agent-{nid}``
    agent: str = ""
    runtime: str = "sim"


class NodeHealth(msgspec.Struct):
    """A node's health changed: heartbeats stopped for ``timeout_s`` (unhealthy) or resumed."""

    node_id: str
    cluster_id: str
    healthy: bool
    reason: str = ""
    #: instances moved off the node when it went unhealthy
    evicted: list[str] = []


class Heartbeat(msgspec.Struct):
    """Core NATS, every few seconds, from each node agent (not stored in the stream). ``metrics``: the
    agent's own ``/metrics`` URL (``--metrics-port``; "" none), announced as a target (``workers.health``)."""

    node_id: str
    cluster_id: str
    seq: int
    cpu_free: float
    memory_free: int
    gpus_free: int
    instances: int
    load1: float = 0.0
    gpu_util: dict[str, float] = {}
    metrics: str = ""


class Dangling(msgspec.Struct):
    """A labelled container/process found on a node that the control plane did not ask it to run."""

    node_id: str
    instance_id: str
    block_id: str = ""
    gen: int = 0
    runtime: str = ""
    handle: str = ""
    labels: dict[str, str] = {}


class BlockStatusReport(msgspec.Struct):
    """A block reached a status (``block.ready``, ``block.failed``, ``block.deleted``); named apart
    from the lifecycle's ``schemas.lifecycle.BlockStatus`` enum, whose value ``status`` carries."""

    block_id: str
    gen: int
    status: str
    reason: str = ""
    cluster_id: str = ""
    instances: list[str] = []


class DeleteRequest(msgspec.Struct):
    block_id: str
    request_id: str = ""


class StepFailed(msgspec.Struct):
    """A non-fatal step of a live block failed (a scale or reassignment), with the reason."""

    block_id: str
    gen: int
    step: str
    reason: str
    request_id: str = ""
    #: the policy calls this step made (folded into the step's event, not stored apart)
    decisions: list[Decision] = []


class Autoscaled(msgspec.Struct):
    """The autoscaler changed a block's instance target (docs/autoscaling.md): from ``current`` to
    ``desired``; ``raw``: the policy's proposal; ``rules``: what the framework did to it (bounds,
    burst, tolerance, delays, rate limits); ``reason``: the policy's own words; ``inputs``: the
    figures that mattered (the whole input is in the decision record). A ``block.scale.target``
    with the same ``request_id`` follows."""

    block_id: str
    gen: int
    request_id: str
    current: int
    desired: int
    raw: float
    rules: list[str] = []
    reason: str = ""
    stable: float = 0.0
    burst: float = 0.0
    in_burst: bool = False
    inputs: Wire[dict[str, object]] = {}
    #: the policy call of this tick (folded into the step's event, not stored apart)
    decisions: list[Decision] = []


class AutoscaleFailed(msgspec.Struct):
    """An autoscaler tick failed (the policy raised, overran its time limit, answered the wrong
    shape, or its parameters are wrong): the instance count stays. Stored at most once per
    ``AIOS_AUTOSCALE_FAILURE_RECORD_S`` per block unless the reason changes; ``quiet``: failed
    ticks not stored since the last stored one."""

    block_id: str
    gen: int
    request_id: str
    reason: str
    current: int = 0
    quiet: int = 0
    decisions: list[Decision] = []


class Decision(msgspec.Struct, omit_defaults=True):
    """One policy invocation: what ran, on what, what it said, how long it took.

    The input itself is not stored: it is rebuilt by replay (``recovery.inputs``). ``at`` is the
    state version the call saw (the stream sequence of the message its step handled; 0 for a step
    a timer ran), ``input_digest`` the SHA-256 prefix of the input as the policy got it (compact
    JSON), ``given`` the parts of the input that are not in the stream (the metrics collector's
    ``block_metrics``). Replaying the stream up to ``at`` (or a little past it: the state a step
    reads may already hold a reservation whose placement is published after it) and running the
    step's own payload code gives an input with that digest (``blocks explain``, ``blocks policy
    test``). Empty fields are left out of the JSON."""

    block_id: str
    kind: str
    policy: str
    uri: str
    version: int | None
    action: str
    input_digest: str
    output: Any = None
    error: str = ""
    duration_us: int = 0
    #: the input inline, for calls not rebuilt by replay (``workers.base.REPLAYED_ACTIONS``) and in
    #: records made before inputs were rebuilt; or why it is not stored
    input: Any = None
    input_subject: str = ""
    #: log lines of the call (Starlark ``log_info/log_warn/log_error``): [level, text]
    logs: list[list[str]] = []
    #: the state version: stream sequence of the message the step handled (0: a timer's step)
    at: int = 0
    #: input parts that are not state (``{"block_metrics": {...}}`` when the payload has them)
    given: dict[str, Any] = {}
    #: when ``output`` holds only what the flow acts on (``policies.contract.essential``: the
    #: chosen cluster ids of a clusterAllocator's answer), the digest of the whole output
    output_digest: str = ""


class DeadLetter(msgspec.Struct):
    subject: str
    consumer: str
    error: str
    deliveries: int
    stream_seq: int
    data: str
    headers: dict[str, str] = {}


def input_digest(raw: bytes) -> str:
    """A policy input's digest (``Decision.input_digest``): SHA-256 of its compact JSON, 24 hex digits."""
    return hashlib.sha256(raw).hexdigest()[:24]


def _plain_node_refs(nodes: Mapping[str, object]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(
        {nid: "sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest() for nid, v in nodes.items()}
    ))


def nodes_root(refs: bytes) -> str:
    """The root of a node map's tree in the form before :func:`chunked_root` (:func:`input_digests`'
    second): ``"sha256:"`` + the SHA-256 of its whole reference map's JSON."""
    return "sha256:" + hashlib.sha256(refs).hexdigest()


#: entries of the reference map per chunk of the chunked root (:func:`chunked_root`)
ROOT_CHUNK = 64
#: what a chunked root starts with (the form's name: SHA-256 over chunks of 64 entries)
CHUNKED_PREFIX = "sha256c64:"


def ref_entry(nid: str, ref: str) -> bytes:
    """One entry of a node-reference map's JSON, ``"<nid>":"sha256:<hex>"``, as
    ``msgspec.json.encode({nid: ref})`` writes it between its braces."""
    return _encoder.encode(nid) + b":" + _encoder.encode(ref)


def chunk_digest(entries: list[bytes]) -> bytes:
    """The SHA-256 (32 bytes) of one chunk: its entries joined by commas, as in the map's JSON."""
    return hashlib.sha256(b",".join(entries)).digest()


def chunked_root(count: int, digests: list[bytes]) -> str:
    """The root of a node map's tree (the newest form): the reference map's entries in the map's
    order, cut into chunks of ``ROOT_CHUNK`` (the last one shorter), each chunk's SHA-256
    (:func:`chunk_digest`), and ``"sha256c64:"`` + the SHA-256 of the entry count in decimal, a
    colon and those digests (32 bytes each) in order. A worker keeps each chunk's digest, so a
    changed node re-hashes its chunk (~5 KB) and the ~20 digests of the trace's 1,213 nodes instead
    of the whole ~110 KB reference map (``policies.node_digest``)."""
    return CHUNKED_PREFIX + hashlib.sha256(str(count).encode() + b":" + b"".join(digests)).hexdigest()


def chunked_root_of(entries: list[bytes]) -> str:
    """:func:`chunked_root` of a whole list of reference-map entries."""
    return chunked_root(len(entries), [chunk_digest(entries[i:i + ROOT_CHUNK]) for i in range(0, len(entries), ROOT_CHUNK)])


def _plain_nodes_root(nodes: Mapping[str, object]) -> str:
    return chunked_root_of([ref_entry(nid, "sha256:" + hashlib.sha256(msgspec.json.encode(v)).hexdigest())
                            for nid, v in nodes.items()])


def input_digest_of(input_data: Mapping[str, object], nodes_digest: Callable[[dict[str, NodeView]], str] = _plain_nodes_root) -> str:
    """A policy input's digest (``Decision.input_digest``). An input with a node map
    (``payload.cluster_metrics.nodes``: a placement's, up to ``sampleNodes`` node views, ~1 KB each) is hashed
    as a tree: the SHA-256 prefix of the input's compact JSON with the whole map replaced by its root
    (``nodes_digest(nodes)``: :func:`chunked_root` of the reference map ``{nid: "sha256:<SHA-256 of the view's
    JSON>"}``). A worker keeps each view's reference per view and each chunk's digest per inventory version
    (``policies.node_digest.nodes_root``), so a call hashes ~1 KB plus the chunks of the views that changed
    instead of ~100 KB (or ~110 KB of reference map for the trace's 1,213 nodes). Every byte of the input is
    covered (in two parts: :func:`input_digest_later`). Any other input: :func:`input_digest` of its JSON.
    Records made before a form existed hold an older one (:func:`input_digests`)."""
    return input_digest_later(input_data, nodes_digest)()


def input_digest_later(input_data: Mapping[str, object], nodes_digest: Callable[[dict[str, NodeView]], str] = _plain_nodes_root) -> Callable[[], str]:
    """:func:`input_digest_of` in two parts: what reads the node map (a live inventory view, changed
    in place: its root, its healthy ids' JSON) now, the rest's JSON and hash when the function is called."""
    nodes = node_map(input_data)
    if nodes is None:
        digest = input_digest(msgspec.json.encode(input_data))
        return lambda: digest
    root, healthy = nodes_digest(nodes), _healthy_json(input_data, nodes)
    return lambda: input_digest(msgspec.json.encode(_with_node_map(input_data, root, healthy)))


def _healthy_json(input_data: Mapping[str, object], nodes: dict[str, NodeView]) -> bytes | None:
    """The JSON of the input's ``healthy_nodes`` as its inventory view keeps it
    (``capacity.Nodes.healthy_json``: encoded once while the list does not change; the same bytes
    as encoding the list here), or None (encoded with the rest)."""
    known = getattr(nodes, "healthy_json", None)
    payload = input_data["payload"]
    ids = payload.get("healthy_nodes") if isinstance(payload, dict) else None
    if known is None or not isinstance(ids, list):
        return None
    raw: bytes | None = known(ids)
    return raw


def input_digests(raw: bytes) -> Iterator[str]:
    """Every digest a recorded input (its JSON, ``raw``) may carry, newest form first: the tree
    with the chunked root (:func:`input_digest_of`), the tree before it (the root hashing the whole
    reference map, :func:`nodes_root`), the tree of stops 22-28 (the node map replaced by the
    whole reference map) and the flat one (the JSON itself). ``recovery.inputs`` checks a rebuilt
    input against them; lazily, as the first usually matches."""
    data = msgspec.json.decode(raw)
    yield input_digest_of(data)
    nodes = node_map(data)
    if nodes is not None:
        refs = _plain_node_refs(nodes)
        yield input_digest(msgspec.json.encode(_with_node_map(data, nodes_root(bytes(refs)))))
        yield input_digest(msgspec.json.encode(_with_node_map(data, refs)))
    yield input_digest(raw)


def input_matches(raw: bytes, digest: Any) -> bool:
    """Whether a recorded input's ``digest`` is one of the forms of the input ``raw`` (its JSON)."""
    return any(d == digest for d in input_digests(raw))


def node_map(input_data: Mapping[str, object]) -> dict[str, NodeView] | None:
    """A policy input's node views (``payload.cluster_metrics.nodes``: a mapping of mappings, a
    placement's), or None when it has none."""
    payload = input_data.get("payload")
    metrics = payload.get("cluster_metrics") if isinstance(payload, dict) else None
    nodes = metrics.get("nodes") if isinstance(metrics, dict) else None
    # every value a dict: the set of their types, built in C (a generator over the trace's 1,213
    # views took ~0.1 ms of every placement's decision record); an inventory view answers from
    # what changed since it was last asked (``capacity.Nodes.all_dicts``)
    if not isinstance(nodes, dict) or not nodes:
        return None
    known = getattr(nodes, "all_dicts", None)
    if not (known() if known is not None else set(map(type, nodes.values())) == {dict}):
        return None
    return nodes


def _with_node_map(input_data: Mapping[str, object], value: object, healthy: bytes | None = None) -> dict[str, object]:
    """A shallow copy of an input that has a :func:`node_map`, the whole map replaced by ``value``
    (and ``healthy_nodes`` by ``healthy``, its JSON, when given: it keeps its place)."""
    payload = input_data["payload"]
    assert isinstance(payload, dict)  # it has a node map
    copy = {**payload, "cluster_metrics": {**payload["cluster_metrics"], "nodes": value}}
    if healthy is not None:
        copy["healthy_nodes"] = msgspec.Raw(healthy)
    return {**input_data, "payload": copy}


def with_nodes(input_data: Mapping[str, object], each: Callable[[NodeView], object]) -> dict[str, object]:
    """A shallow copy of an input that has a :func:`node_map`, each node view replaced by ``each(view)``."""
    payload = input_data["payload"]
    assert isinstance(payload, dict)  # it has a node map
    nodes: dict[str, NodeView] = payload["cluster_metrics"]["nodes"]
    return _with_node_map(input_data, {nid: each(v) for nid, v in nodes.items()})


_second: tuple[int, str] = (-1, "")


def now_iso() -> str:
    """Now in UTC as RFC 3339 with microseconds (``2026-11-27T03:38:52.123456Z``); the part up to
    the second is formatted once per second (every event's ``time`` is one of these)."""
    global _second
    now = time.time()
    sec = int(now)
    if _second[0] != sec:
        _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{_second[1]}.{int((now - sec) * 1_000_000):06d}Z"


_encoder = msgspec.json.Encoder()


def envelope(event_id: str, source: str, type_: str, subject: str, data: Any) -> bytes:
    return _encoder.encode(Envelope(id=event_id, source=source, type=type_, subject=subject, time=now_iso(), data=data))


def decode_envelope(raw: bytes) -> Envelope:
    return msgspec.json.decode(raw, type=Envelope)


T = TypeVar("T")


def data_as(env: Envelope, cls: type[T]) -> T:
    return msgspec.convert(env.data, cls)


class ComponentRegistered(msgspec.Struct):
    """A component registered (or replaced): the full record, as ``schemas.spec.Component`` JSON."""

    uri: str
    component: Wire[JSONObject]


class ClusterRegistered(msgspec.Struct):
    """A cluster registered (or its labels replaced): ``schemas.spec.Cluster`` JSON."""

    cluster: dict[str, Any]


class PolicyUpdated(msgspec.Struct):
    """A policy stored in the registry as ``version``: the whole record, so the registry can be
    rebuilt from the stream (``blocks recover``)."""

    name: str
    version: int
    source: str = ""
    language: str = "python"
