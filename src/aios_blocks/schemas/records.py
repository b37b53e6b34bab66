"""Typed records for the dicts passed most: a block's record and an instance's record as the
state keeps them (``state.store``), an entry of the executors' instance map (``bus.instance_map``),
and the seed-000 policy payloads (docs/policies.md).

TypedDicts, not classes: the wire and Redis shapes stay exactly what they were (plain JSON objects
and hashes), and mypy checks every key a reader names. ``total=False`` where a field is set only
in some states (a record's fields arrive step by step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, NotRequired, TypedDict, TypeVar, cast

#: A JSON value as a decoder returns it: only for data that is truly open JSON (a JSON Schema
#: document, a foreign event's body, a policy's own output), never for a record whose fields the
#: code names (those get a TypedDict below). Readers narrow it with ``isinstance``.
JSON = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]
#: a JSON object of open shape (``JSON``)
JSONObject = dict[str, JSON]

_T = TypeVar("_T")

if TYPE_CHECKING:
    #: ``Wire[T]``: a field of a msgspec struct or pydantic model that holds a plain JSON object,
    #: read by mypy as ``T`` (a record below, or ``JSONObject``). The decoders see the open object
    #: they always saw: they cannot take the recursive ``JSON`` alias, and decoding into a
    #: TypedDict would drop the fields it does not name and refuse a wrong value (what is sent and
    #: what is decoded stay exactly what they were; ``tests/unit/test_records_wire.py`` checks both).
    Wire = Annotated[_T, "a plain JSON object on the wire"]
else:
    class Wire:
        """At run time ``Wire[T]`` is the plain object the decoders always saw."""

        def __class_getitem__(cls, _item: object) -> object:
            return dict[str, Any]


class PolicyRule(TypedDict, total=False):
    """One policy rule as the IR keeps it (``schemas.spec.PolicyRule`` as JSON, seed 000's
    ``{name, policyRuleURI, parameters, settings}``), by kind in ``BlockIR.policies``."""

    name: str
    policyRuleURI: str
    #: the policy's own (open JSON)
    parameters: JSONObject
    settings: JSONObject
    #: a registry policy's version, when a caller pins one (absent: the latest)
    version: int


class ProbeRecord(TypedDict, total=False):
    """``schemas.spec.Probe`` as JSON: how a node agent checks an instance."""

    type: str
    port: str
    path: str
    intervalS: float
    timeoutS: float
    failureThreshold: int
    startTimeoutS: float


class LaunchRecord(TypedDict, total=False):
    """``schemas.spec.Launch`` as JSON (the IR's ``launch``, ``InstanceCommand.launch``)."""

    command: list[str]
    ports: list[str]
    probe: ProbeRecord
    stopGraceS: float


class LinkRecord(TypedDict, total=False):
    """``schemas.topology.GpuLink`` as JSON: how two GPUs (by index) are connected."""

    a: int
    b: int
    tier: str
    nvlinks: int


class TopologyRecord(TypedDict, total=False):
    """``schemas.topology.GpuTopology`` as JSON (a node's ``topology``; docs/topology.md)."""

    profile: str
    source: str
    gpus: int
    links: list[LinkRecord]


# -- the block's IR (``schemas.ir.block_create_IR``) ---------------------------------------------


class Needs(TypedDict, total=False):
    """What one instance needs (``schemas.spec.ResourceNeeds`` as JSON: the IR's ``resources``,
    a placement's ``needs``). MiB for the memory figures; ``gpuMemory`` per GPU."""

    gpus: int
    gpuMemory: int
    cpu: float
    memory: int
    #: the fraction of each GPU's compute (with gpuSharing); left out when unset
    gpuShare: float
    #: the GPU models it may use (empty: any); left out when unset
    gpuModels: list[str]


class AffinityTerm(TypedDict):
    """One normalised affinity constraint as the IR holds it (``schemas.affinity.AffinityEntry``
    as JSON)."""

    #: Resource, State, Topology or Trust
    category: str
    #: Required, Preferred or Adaptive
    strength: str
    #: False: toward, True: away
    anti: bool
    target_type: str
    target: str


class SidecarConsumesRecord(TypedDict):
    event: str
    status: str


class SidecarRecord(TypedDict, total=False):
    """``schemas.spec.Sidecar`` as JSON: one side-car of the block (the IR's ``sidecars``,
    ``SidecarCommand.sidecar``; docs/sidecars.md)."""

    name: str
    image: str
    command: list[str]
    consumes: SidecarConsumesRecord
    #: the side-car's own (open JSON)
    parameters: JSONObject
    env: dict[str, str]
    maxDeliver: int
    ackWaitS: float
    replicas: int
    stopGraceS: float


class JobClusterRecord(TypedDict):
    """``schemas.spec.JobClusterSpec`` as JSON: node type -> count (seed 003)."""

    replicaSets: dict[str, int]


class BlockIR(TypedDict, total=False):
    """A block's intermediate representation: its spec over its component's fields, as the parser
    builds it (``schemas.ir._ir``), the block record keeps it (``ir``) and policies receive it."""

    blockId: str
    blockComponentURI: str
    image: str
    minInstances: int
    maxInstances: int
    #: inherited: the block's, else its component's (``schemas.ir.INHERITED``): the user's JSON
    blockInitData: JSONObject
    initSettings: JSONObject
    parameters: JSONObject
    blockMetadata: JSONObject
    inputProtocol: JSONObject
    outputProtocol: JSONObject
    tags: list[str]
    resources: Needs
    launch: LaunchRecord
    #: the merged policy rules by name (``schemas.ir.merge_policies``)
    policies: dict[str, Any]
    affinity: list[AffinityTerm]
    #: ``schemas.spec.Sidecar`` entries as JSON
    sidecars: list[SidecarRecord]
    outputs: bool
    #: set only when given (a spec without them keeps its IR and digest)
    labels: dict[str, str]
    virtualClusterId: str
    #: ``schemas.spec.JobClusterSpec`` as JSON
    jobCluster: JobClusterRecord
    priorityClass: str
    priority: int
    preemptible: bool
    queue: bool
    maxPendingS: float
    maxMoving: int


def ir_of(wire: BlockIR) -> BlockIR:
    """The IR a wire payload carries (``Parsed.ir``, ``DryRunRequest.ir``: ``Wire[BlockIR]``, a
    plain JSON object as decoded): the same object."""
    return wire


def wire_ir(ir: BlockIR) -> BlockIR:
    """The IR as a wire payload holds it (``ir_of``'s inverse): the same object."""
    return ir


def wire(record: Mapping[str, Any]) -> dict[str, Any]:
    """A typed record as a payload struct's JSON field holds it (``InstanceCommand.resources``:
    ``Needs``): the same object."""
    return cast(dict[str, Any], record)


# -- the state (Redis) ---------------------------------------------------------------------------


class BlockRecord(TypedDict, total=False):
    """A block's hash as ``Store.get_block`` returns it (``state.records._block``): ``ir`` decoded,
    ``gen``, ``version``, ``desired``, ``desired_seq`` and ``created`` as ints, every other field
    the string the lifecycle scripts wrote."""

    gen: int
    version: int
    digest: str
    #: ``schemas.lifecycle.BlockStatus`` value
    status: str
    #: the block's IR (``schemas.ir.block_create_IR``)
    ir: BlockIR
    #: the create's stream sequence
    created: int
    updated: str
    reason: str
    #: the cluster it was placed in (set by the step that placed it)
    cluster: str
    #: its selection round
    attempt: str
    desired: int
    desired_seq: int
    desired_reason: str
    desired_request: str
    #: instance replacements counted (``Store.block_bump``)
    replacements: str
    #: the node its side-cars run on (``handlers.sidecars.NODE_FIELD``)
    sidecar_node: str
    #: waiting in the pending queue (``workers.queue``): since when and until when (s, as text),
    #: the preemptor that evicted it, the victims it is preempting for
    pending_since: str
    pending_deadline: str
    preempted_by: str
    preempting: str
    #: a ready block below its minInstances that the reconciler could not bring back: the
    #: condition as JSON (``schemas.condition.BlockShort``; docs/reliability.md "Short blocks")
    short: str


class InstanceRecord(TypedDict, total=False):
    """One instance's record in its block's instance hash (``Store.instances``)."""

    node: str
    gpus: list[str]
    cluster: str
    #: ``schemas.lifecycle.InstanceStatus`` value: starting, running, removing
    status: str
    #: the action that placed it (allocation, scale, reassignment)
    action: str
    #: when it was placed (the controller's clock, s)
    since: float
    endpoint: str
    #: its block's generation (``Store.node_instances`` adds it with ``block_id``)
    gen: int
    block_id: str
    #: the node agent's restarts of it (absent: none)
    restarts: int
    #: the scale-down request that marked it ``removing`` (``Store.drain_instance``)
    drain: str


class GpuView(TypedDict):
    """One GPU of a node view: its memory (MiB) and what is taken of it."""

    id: str
    model: str
    memory: int
    memory_used: int
    memory_free: int
    #: instances on it (exclusive or sharing)
    instances: int
    exclusive: bool
    #: thousandths of its compute not taken by sharing instances' gpuShare
    share_free: int


class AdaptNode(TypedDict):
    """One node's row of the adapt stage's table: its instances' p50 and the multiplier."""

    p50_ms: float
    instances: int
    multiplier: float


class AdaptTable(TypedDict, total=False):
    """The adapt stage's table (``policies.affinity.adapt``; docs/affinity.md): the figure it
    adapts from, the block's median of it, the multiplier's bounds and each node's row. Empty
    (``{}``) where a step had no Adaptive entry."""

    figure: str
    block_median_ms: float | None
    bounds: list[float]
    nodes: dict[str, AdaptNode]


class AffinityIndex(TypedDict):
    """What State/Topology affinity read of the other blocks' placements (``policies.affinity``):
    per block uuid its instances' ``[node, rack]``, per instance uuid its node; and, for a block
    with Adaptive entries or Topology terms, the adapt table and its GPUs per instance."""

    services: dict[str, list[list[str]]]
    leases: dict[str, str]
    adapt: NotRequired[AdaptTable]
    gpus: NotRequired[int]


class AdaptiveTerm(TypedDict):
    """What one Adaptive affinity entry gave a node (``policies.affinity.annotate``; a placement's
    ``adaptive``): its base weight, the adapt table's multiplier, the weight and why."""

    entry: int
    base: float
    multiplier: float
    weight: float
    why: str


#: a node's affinity verdict for one block (``policies.affinity.annotate``; ``pass`` is a keyword)
NodeAffinity = TypedDict("NodeAffinity", {
    "pass": bool, "score": float, "reasons": list[str],
    "require_gpus": list[str], "prefer_gpus": list[str], "avoid_gpus": list[str],
    #: the adaptive terms that applied (docs/affinity.md)
    "adaptive": list[AdaptiveTerm],
}, total=False)


class NodeView(TypedDict, total=False):
    """A node as placement and the policies see it (``state.nodes.node_view``): capacity, what is
    free, its GPUs; ``topology``, ``virtualCluster`` and ``draining`` only when set; the affinity
    fields only in a policy's input where the block has affinity (``policies.affinity.annotate``)."""

    node_id: str
    cluster: str
    labels: dict[str, str]
    #: healthy and not draining: it may take new instances
    healthy: bool
    cpu: float
    cpu_free: float
    memory: int
    memory_free: int
    gpus: list[GpuView]
    #: its GPU links (``schemas.topology``)
    topology: TopologyRecord
    virtualCluster: str
    draining: bool
    #: in a policy's input, where the block has affinity
    affinity: NodeAffinity


class ClusterRecord(TypedDict):
    """A registered cluster (``schemas.spec.Cluster`` as JSON, ``Store.clusters``)."""

    id: str
    labels: dict[str, str]


class GatherRecord(TypedDict):
    """A selection round's gather (``Store.gather_read``): the clusters asked, when it is due, the
    answers so far by cluster (a ``DryRunResult`` as JSON), who decided it, the stream sequence
    of the fact that opened it."""

    expected: list[str]
    results: dict[str, dict[str, Any]]
    #: not in the one ``recovery.inputs`` rebuilds (the decision's inputs need only the above)
    deadline: NotRequired[float]
    #: the decider's token (None: not decided yet)
    decided: NotRequired[str | None]
    #: a round that asked no dry_run: its ``block.selection`` (JSON), stored first by whichever
    #: decider stores the round's decision (``workers.gateway._decide``)
    selection: NotRequired[str]
    at: NotRequired[int]


class NodeMeta(TypedDict):
    """A registered node's registration (``Store.node_meta``)."""

    cluster: str
    #: who serves its commands: "" the simulated fleet, else the agent's name
    agent: str
    healthy: bool
    #: its ``schemas.spec.Node`` as JSON, as the agent registered it: read through ``Node.model_validate``
    spec: JSONObject


# -- the instance map (NATS KV ``aios-instances``) -------------------------------------------------


class MapEntry(TypedDict, total=False):
    """One instance of a block's map: where the executors send its tasks."""

    node: str
    endpoint: str
    #: ``schemas.lifecycle.InstanceState`` value: starting, ready, draining, stopping
    state: str
    since: float
    #: the node agent run that reported it (``executor.engine.confirmed``)
    boot: str
    #: the health checker's verdict and the weight it leaves the instance (docs/health.md)
    health: str
    weight: float
    health_reason: str
    #: read by the stability input (``handlers.stability.instance_input``) before ``since``; no
    #: writer sets it today, so ``since`` is what counts
    ready_since: float


class BlockMap(TypedDict, total=False):
    """A block's instance map (one key per block; ``handlers.mapper`` writes it, the executors
    route by it): the block's fields the executor needs, its instances, its nodes' latest agent
    boots and the instances gone (so a late ``added`` never brings one back)."""

    block_id: str
    gen: int
    cluster: str
    #: the input protocol's path and method
    path: str
    method: str
    loadBalancer: dict[str, Any]
    stabilityChecker: dict[str, Any]
    #: 0: scale-to-zero (the executor holds tasks while one starts)
    minInstances: int
    #: whether the executor publishes task outputs (side-cars)
    outputs: bool
    #: the block's tenant (its ``tenant`` label): its users may send it tasks over HTTP
    tenant: str
    instances: dict[str, MapEntry]
    boots: dict[str, str]
    gone: list[str]


class TaskInfo(TypedDict):
    """What a loadBalancer policy sees of one task (``executor.dispatch.Task.info``; the ``route``
    action's ``payload.task``)."""

    method: str
    path: str
    #: the body's size
    bytes: int
    idempotent: bool
    content_type: str


class PassiveCounts(TypedDict):
    """One executor's passive-health counts of one instance (``executor.outlier.Outliers.snapshot``,
    ``state.health``): what the health checker merges into its policy's ``passive`` and
    ``progress`` (``handlers.stability.merge_passive``; docs/health.md)."""

    ok: int
    errors: int
    timeouts: int
    consecutive_errors: int
    ejections: int
    #: ejected by this executor now
    ejected: bool
    last_error: str
    inflight: int
    latency_s: float
    #: how long it has had tasks in flight and none completed
    stalled_s: float
    #: since its last completion (-1: none yet)
    since_done_s: float


class RouteView(TypedDict, total=False):
    """An executor's view of one instance of a route (``executor.engine.Route``): the map's entry
    (``MapEntry``) as this executor routes by it, with its own counts; a loadBalancer's
    ``candidates``."""

    id: str
    node: str
    endpoint: str
    #: what the executor routes by (``schemas.lifecycle.InstanceState``): the map's state less
    #: this executor's ejections and the health checker's ``unready``
    state: str
    map_state: str
    health: str
    weight: float
    #: reported by the node agent run the node runs now (``executor.engine.confirmed``)
    confirmed: bool
    inflight: int
    max_ongoing: int
    #: the engine's queue figures (scraped) over the collector's latest sample
    metrics: dict[str, object]


# -- the metrics collector's samples (``metrics.window``, ``state.metrics``; docs/metrics.md) -------


class InstanceSample(TypedDict):
    """One instance's sample at a collector tick. Rates per second over the tick's span, latencies
    in ms; ``None``: nobody reports the figure (or a first reading has no rate yet)."""

    t: float
    #: its state in the instance map (``gone``: only an executor still counts it)
    state: str
    node: str
    #: its metrics page answered
    up: bool
    #: tasks the executors have in flight on it
    inflight: float
    #: the engine's own queue figures
    running: float | None
    waiting: float | None
    rate: float | None
    error_rate: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_mean_ms: float | None
    dispatch_p50_ms: float | None
    dispatch_p99_ms: float | None
    #: only when the engine reports it
    kv_cache_usage_perc: NotRequired[float]


class BlockSample(TypedDict):
    """One block's sample at a collector tick: its instances' figures summed (latency: their
    rate-weighted mean) and its executors' (queue, rejections, retries, policy time)."""

    t: float
    cluster: str
    instances: int
    ready: int
    inflight: float
    running: float | None
    waiting: float | None
    queue: float
    queue_wait_p99_ms: float | None
    rate: float | None
    error_rate: float | None
    rejected_rate: float | None
    retry_rate: float | None
    latency_mean_ms: float | None
    dispatch_p50_ms: float | None
    dispatch_p99_ms: float | None
    policy_mean_us: float | None


class MetricsTarget(TypedDict):
    """A worker process's ``/metrics`` target as it announces it (``workers.telemetry``,
    ``state.metrics``): what the collector scrapes executors by and Prometheus discovers."""

    #: ``<kind>-<host>-<pid>``
    id: str
    #: its kind, or its group's ``+``-joined kinds
    kind: str
    kinds: list[str]
    #: a pinned worker's cluster ("" for none)
    cluster: str
    url: str


#: one collector tick (``metrics.window.Windows.tick``): block -> (its sample, instance -> sample)
TickSamples = dict[str, tuple[BlockSample, dict[str, InstanceSample]]]


# -- the policy decisions (``schemas.events.Decision``) ---------------------------------------------


class DecisionGiven(TypedDict, total=False):
    """The input parts a decision records that are not state (``workers.base``: ``Decision.given``)."""

    #: the metrics collector's figures for the block (open: the collector's own shape)
    block_metrics: JSONObject
    #: nodes left out of the policy's input, and why (``handlers.controller.plan``)
    excluded_nodes: dict[str, str]


class DecisionRecord(TypedDict, total=False):
    """One policy call as the stream stores it (``schemas.events.Decision`` as JSON, its empty
    fields left out): what ran, on what, what it said. ``input``/``output`` are the policy's own
    (their shape is the action's: docs/policies.md)."""

    block_id: str
    kind: str
    policy: str
    uri: str
    version: int | None
    action: str
    input_digest: str
    output: Any
    error: str
    duration_us: int
    input: Any
    input_subject: str
    logs: list[list[str]]
    at: int
    given: DecisionGiven
    output_digest: str


class ReplayedDecision(DecisionRecord, total=False):
    """A decision with its input rebuilt by replay (``cli.client.Client.decisions``): how
    (``recovery.inputs.Call.status``) and from the state after which stream sequence."""

    input_check: str
    state_seq: int


# -- the seed-000 policy payloads (docs/policies.md: exact field names) -----------------------------


class Totals(TypedDict):
    """A cluster's capacity totals over all its nodes (``policies.capacity.totals``)."""

    gpus: int
    gpus_free: int
    gpu_memory_free: int
    cpu_free: float
    memory_free: int
    healthy_node_count: int


class ClusterFigures(TypedDict, total=False):
    """A cluster's totals over its nodes (``handlers.gateway.cluster_metrics`` without ``nodes``):
    a clusterAllocator entry's ``metrics``; ``affinity_score`` where the block has affinity."""

    node_count: int
    healthy_node_count: int
    gpus: int
    gpus_free: int
    gpu_memory_free: int
    cpu_free: float
    memory_free: int
    #: the best Preferred-affinity score a node of the cluster could get
    affinity_score: float


class SampleInfo(TypedDict):
    """What a policy sees under ``cluster_metrics["sample"]`` when the cluster was sampled
    (``policies.sampling.Sample.info``)."""

    total_nodes: int
    visited: int
    feasible: int
    limit: int
    seed: str
    #: set when no visited node passes Required affinity
    unsatisfiable: NotRequired[str]


class ClusterMetrics(ClusterFigures, total=False):
    """A placement payload's ``cluster_metrics``: the totals, the node views (all, or a sample:
    then ``sample`` says so) and, for a block with affinity, the affinity index."""

    nodes: dict[str, NodeView]
    sample: SampleInfo
    affinity_index: AffinityIndex


class ScoreData(TypedDict, total=False):
    """A dry_run's ``selection_score_data`` (and a post_dry_run entry's ``score_data``): the
    feasibility score, the first instance's placement, how many instances fit (optional)."""

    score: float
    node_info: Placement
    placeable: int


class DryRunAnswer(TypedDict):
    """``dry_run``'s answer."""

    selection_score_data: ScoreData


class ClusterEntry(TypedDict, total=False):
    """A clusterAllocator's cluster entry (``handlers.gateway.cluster_entry``): ``selection``'s
    ``filter_result``, ``post_dry_run``'s ``clusters`` with ``score_data`` (``missing``: no
    answer in time)."""

    cluster_id: str
    id: str
    labels: dict[str, str]
    metrics: ClusterFigures
    score_data: ScoreData
    missing: bool


class ScaleDownAnswer(TypedDict):
    """``scale_down``'s answer when it names the instance (else nothing: the default)."""

    instance_id: str


class PolicyBlock(BlockIR, total=False):
    """A placement payload's ``block``: the IR plus its instances' records by id."""

    instances: dict[str, InstanceRecord]


class ScaleDownCandidate(TypedDict):
    """One of a ``scale_down`` payload's ``instances`` (``handlers.scaling.candidates``): where it
    runs, its status, when it was placed and the collector's latest figures (None: no sample)."""

    instance_id: str
    node_id: str
    gpus: list[str]
    status: str
    since: float
    age_s: float | None
    inflight: float | None
    running: float | None
    waiting: float | None
    rate: float | None
    load: float | None


class PolicyInput(TypedDict, total=False):
    """``input_data`` of a policy call: the action and its payload (resource and autoscaling
    actions), or the action and its own fields (``selection``: ``filter_result``; ``post_dry_run``:
    ``clusters``)."""

    action: str
    #: ``PlacementPayload`` for the resource actions; each other kind's own (docs/policies.md)
    payload: Any
    filter_result: list[ClusterEntry]
    clusters: list[ClusterEntry]


class PlacementPayload(TypedDict, total=False):
    """The resourceAllocator's payload (``dry_run``, ``allocation``, ``scale``, ``reassignment``,
    ``scale_down``)."""

    #: the block's entry: its IR and its instances
    block: PolicyBlock
    #: the cluster's entry
    cluster: ClusterRecord
    #: the cluster's metrics (its totals and nodes' views, ``state.nodes.node_view``)
    cluster_metrics: ClusterMetrics
    #: the ids of the healthy nodes
    healthy_nodes: list[str]
    #: scale, reassignment, scale_down: the block's metrics (the collector's, under what the
    #: request carries: open)
    block_metrics: JSONObject
    #: reassignment: the instance being replaced, its pod name and why
    instance_id: str
    pod_name: str
    reason: str
    #: scale_down: the live instances to choose from
    instances: list[ScaleDownCandidate]


class Placement(TypedDict, total=False):
    """A placement answer (``allocation``, ``scale``, ``reassignment``): a node and its GPUs."""

    node_id: str
    gpus: list[str]
