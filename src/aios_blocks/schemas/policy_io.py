"""What each policy kind is called with and what it answers (seed 000's class shape; docs/policies.md:
exact field names), as TypedDicts: a seed-shaped policy still gets plain dicts and lists (the wire
and the policy's view are unchanged), and mypy checks every field a built-in or a builder names.

``parameters``, ``settings`` and ``context`` are the rule's and the policy's own: open JSON
(``JSONObject``), read with :func:`as_int` / :func:`as_float` where a built-in takes a number.
The resourceAllocator's payloads (``PolicyInput``, ``PlacementPayload``) are in ``records``.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

from .records import BlockSample, InstanceSample, JSONObject, RouteView, TaskInfo


def as_int(value: object) -> int:
    """``int(value)`` of a JSON value or figure (a rule's setting): a number or a numeric string; anything
    else raises the ``TypeError`` ``int()`` raises."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"int() argument must be a string, a bytes-like object or a real number, not '{type(value).__name__}'")


def as_float(value: object) -> float:
    """``float(value)`` of a JSON value or figure (a rule's setting): a number or a numeric string; anything
    else raises the ``TypeError`` ``float()`` raises."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"float() argument must be a string or a real number, not '{type(value).__name__}'")


class PolicySource(TypedDict):
    """A registry policy's version as the runtime compiles it (``Store.policy_get``)."""

    version: int
    source: str
    #: ``python`` or ``starlark``
    language: str
    #: when the head was last written (s, as Redis keeps it); only on the head's record
    updated: NotRequired[str]


# -- loadBalancer (``executor.engine.InlinePolicy``, ``workers.executor``'s weights loop) -----------


class RoutePayload(TypedDict):
    block: str
    #: the task's metadata, never its body
    task: TaskInfo
    #: the instances that may take it now (``ready``, under ``maxOngoing``)
    instances: list[RouteView]


class RouteInput(TypedDict):
    """A per-task loadBalancer call."""

    action: Literal["route"]
    payload: RoutePayload


class RouteAnswer(TypedDict):
    """``route``'s answer: one of the given instances."""

    instance_id: str


class WeightsPayload(TypedDict):
    block: str
    instances: list[RouteView]


class WeightsInput(TypedDict):
    """A Starlark loadBalancer's periodic call (off the task path)."""

    action: Literal["weights"]
    payload: WeightsPayload


# -- autoscaler (``handlers.autoscale.policy_input``) -----------------------------------------------


class AutoscaleInstance(TypedDict, total=False):
    """One instance of an ``autoscale`` input: its record's ``status`` and ``node`` with the
    collector's latest sample of it (``InstanceSample``'s fields; absent before its first scrape)."""

    status: str
    node: str
    t: float
    state: str
    up: bool
    inflight: float
    running: float | None
    waiting: float | None
    rate: float | None
    error_rate: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_mean_ms: float | None
    dispatch_p50_ms: float | None
    dispatch_p99_ms: float | None
    kv_cache_usage_perc: float


class AutoscaleMetrics(TypedDict, total=False):
    """An ``autoscale`` input's ``block_metrics``: the collector's latest block sample
    (``BlockSample``'s fields) and its ``history`` (block samples, oldest first)."""

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
    history: list[BlockSample]


#: one applied decision of the framework's (``handlers.autoscale.State.last``)
LastDecision = TypedDict("LastDecision", {"t": float, "from": int, "to": int, "reason": str, "request_id": str},
                         total=False)


class AutoscalePayload(TypedDict):
    block: str
    instances: dict[str, AutoscaleInstance]
    block_metrics: AutoscaleMetrics
    current: int
    min: int
    max: int
    last_decisions: list[LastDecision]


class AutoscaleInput(TypedDict):
    """An autoscaler tick's call."""

    action: Literal["autoscale"]
    payload: AutoscalePayload


class AutoscaleAnswer(TypedDict, total=False):
    """``{"desired": N, "reason": "..."}``: the raw count the load asks for (the framework bounds it)."""

    desired: float
    reason: str


# -- stabilityChecker (``handlers.stability``; docs/health.md) ---------------------------------------


class ProbeInput(TypedDict, total=False):
    """The checker's active probes of one instance as its policy sees them (``ProbeRecord.as_input``;
    an instance never probed, or an agent's report, has only ``ok`` and the counts)."""

    ok: bool
    latency_s: float
    status: int
    error: str
    consecutive_failures: int
    consecutive_successes: int
    failing_for_s: float
    probes: int


class Passive(TypedDict):
    """The executors' passive counts of one instance, merged (``merge_passive``)."""

    ok: int
    errors: int
    timeouts: int
    consecutive_errors: int
    ejections: int
    ejected: bool
    last_error: str
    latency_s: float
    executors: int


class Progress(TypedDict):
    """What the executors measure of one instance's progress, merged (``merge_passive``)."""

    inflight: int
    stalled_s: float
    since_done_s: float


class AgentSignal(TypedDict):
    """A node agent's report on one instance (``agent_input``; docs/health.md, "Agent reports")."""

    report: str
    reason: str


class HealthInstance(TypedDict):
    """One instance of a ``health_check`` input (docs/health.md): ``instance_input`` builds it
    from the map, ``agent_input`` from an agent's report."""

    instance_id: str
    node_id: str
    endpoint: str
    #: ``schemas.lifecycle.InstanceState`` value
    state: str
    health: str
    weight: float
    #: since it was ready (s; absent in an agent's report)
    age_s: NotRequired[float]
    probe: ProbeInput
    passive: Passive
    progress: Progress
    restarts: int
    #: the metrics collector's latest sample of it (empty: none)
    metrics: InstanceSample | JSONObject
    agent: NotRequired[AgentSignal]


class HealthCheckPayload(TypedDict):
    block: str
    instances: list[HealthInstance]
    startup_grace_s: float
    max_out_of_routing: int


class HealthCheckInput(TypedDict):
    """A stabilityChecker's input (``payload``)."""

    action: Literal["health_check"]
    payload: HealthCheckPayload


class Verdict(TypedDict, total=False):
    """One instance's verdict in a stabilityChecker's answer (checked by ``handlers.stability.validate``)."""

    verdict: str
    reason: str
    weight: float


class HealthAnswer(TypedDict):
    """``{"verdicts": {instance_id: verdict}}``."""

    verdicts: dict[str, Verdict]
