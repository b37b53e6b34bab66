"""Every setting of the system, in one typed object (pydantic-settings), read from ``AIOS_*``
environment variables once, when a process starts, and passed in: library modules never read the
environment. ``docs/settings.md`` is generated from it (``blocks settings --markdown``; a test
keeps the file equal)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AIOS_", extra="ignore", frozen=True)

    # -- placement ---------------------------------------------------------------------------------
    commit_retries: int = Field(5, ge=1, description="reservation attempts of one placement step before it gives up (conflicts with other controllers)")
    max_replacements: int = Field(5, ge=0, description="instance replacements (after failed / unhealthy / lost) per block before giving up")
    selection_rounds: int = Field(3, ge=1, description="selection rounds of a block whose chosen cluster could not take the gang")
    reassign_attempts: int = Field(5, ge=1, description="deliveries of a reassignment that finds no room, or its instance being replaced by another, before it fails (backoff 0.5, 1, 2, 4 s)")
    reassign_claim_s: float = Field(60.0, gt=0, description="how long a reassignment's claim on the instance it replaces lasts if its controller dies (longer than a redelivery's wait, 30 s)")
    dry_run_deadline_s: float = Field(5.0, ge=0, description="how long the gateway gathers dry_run answers before deciding")
    dry_run_patience_s: float = Field(60.0, ge=0, description="after the deadline, how much longer a round with no usable answer keeps waiting")
    dry_run_single: bool = Field(False, description="ask the one candidate cluster for a dry_run too (off: a block with exactly one candidate, no affinity entries and the built-in clusterAllocator goes straight to allocation in its first round, recorded as a skipped answer in post_dry_run; docs/trace.md \"Live vs Ray\")")
    handoff: bool = Field(False, description="each worker process hands a stored event it committed to its own consumer of it at once, the stream's later delivery acked unhandled (off: measured, it saves nothing, the server pushes the event as fast; docs/trace.md \"Live vs Ray\")")
    preempt_min_delta: int = Field(10, ge=1, description="a block preempts only blocks at least this many priority points lower (Nomad's rule against preemption loops; docs/priority.md): builtin:preempt-min's minDelta")
    max_pending_s: float = Field(3600.0, ge=0, description="how long a block that fits nowhere waits in the pending queue before it fails with the reason (0: forever); a spec's maxPendingS overrides it (docs/priority.md)")
    queue_window: int = Field(16, ge=1, description="how many blocks at the head of each pending queue one capacity event looks at (docs/priority.md): a capacity event costs O(this), not a scan of the queue")
    queue_resync_s: float = Field(2.0, gt=0, description="the pending queue's periodic pass (expiry of maxPendingS, a capacity event another controller process saw): the queue's head, never the whole queue")
    move_rate_limit: int = Field(10, ge=0, description="make-before-break moves (docs/rebalance.md): at most this many start per cluster within AIOS_MOVE_RATE_WINDOW_S; one more fails with the reason (0: no moves)")
    move_rate_window_s: float = Field(60.0, gt=0, description="the window of AIOS_MOVE_RATE_LIMIT")
    move_ready_timeout_s: float = Field(120.0, gt=0, description="a move whose new instance is not ready this long after it started is rolled back: the new instance removed and released, the old one keeps serving")
    move_sweep_s: float = Field(2.0, gt=0, description="how often a controller looks at moves whose time is up (new instance never ready, a controller died mid-move)")
    rebalance_policy: str = Field("builtin:rebalance-min", description="the rebalancer policy (a policyRuleURI) of the rebalancer worker and of blocks rebalance; a pending block's own rebalancer policy, when its spec names one, wins for its moves (docs/rebalance.md)")
    rebalance_max_moves: int = Field(8, ge=0, description="the most moves one rebalance asks for a pending block: it is given room only when it fits after this many moves or fewer (else it may preempt); an 8-GPU room takes 4-7 on the Alibaba trace (docs/rebalance.md)")
    rebalance_frag_moves: int = Field(2, ge=0, description="the most moves one fragmentation round asks for (moves that lower a cluster's fragmentation, AIOS_REBALANCE_FRAG_THRESHOLD; docs/rebalance.md)")
    rebalance_interval_s: float = Field(10.0, gt=0, description="how often the rebalancer worker looks at each cluster (pending blocks that fit after a few moves, fragmentation above AIOS_REBALANCE_FRAG_THRESHOLD)")
    rebalance_frag_threshold: float = Field(0.1, ge=0, description="the rebalancer also moves instances to lower a cluster's fragmentation when its FGD fragmentation (free GPU compute a task of its workload could not use, over its GPU compute) is at or above this fraction and some block waits for it (with AIOS_REBALANCE_FRAG_IDLE, also when none waits)")
    rebalance_frag_wait_s: float = Field(30.0, ge=0, description="the rebalancer moves instances for fragmentation (above AIOS_REBALANCE_FRAG_THRESHOLD) only once some block has waited for the cluster this long (a block that just arrived is usually placed as capacity comes; docs/rebalance.md)")
    rebalance_frag_idle: bool = Field(False, description="the rebalancer moves instances for fragmentation alone (above AIOS_REBALANCE_FRAG_THRESHOLD) even when no block waits for the cluster; off: a cluster where nothing waits is left as it is (docs/rebalance.md)")
    rebalance_cooldown_s: float = Field(30.0, ge=0, description="the rebalancer's rate limit per cluster: after it asked for moves in a cluster, it asks for none there for this long (the moves themselves are limited by AIOS_MOVE_RATE_LIMIT)")
    rebalance_hold_s: float = Field(60.0, gt=0, description="after moves were asked for to make room for a pending block, neither the rebalancer nor the queue walker asks for more for it, nor preempts for it, for this long")
    # -- nodes -------------------------------------------------------------------------------------
    node_timeout_s: float = Field(15.0, gt=0, description="a node with no heartbeat for this long is unhealthy (its instances are moved)")
    node_suspect_failures: int = Field(2, ge=1, description="a node is suspect (no placement on it) before its heartbeat times out when every instance on it the health checker probes has failed this many probes in a row and its agent has been silent AIOS_NODE_SUSPECT_SILENCE_S")
    node_suspect_silence_s: float = Field(3.0, gt=0, description="heartbeat silence that, with every probed instance failing, makes a node suspect (a crashed instance on a node whose agent still beats does not)")
    node_suspect_ttl_s: float = Field(30.0, gt=0, description="a suspect mark not renewed by the health checker lapses after this long; a passing probe or a fresh heartbeat clears it at once")
    reconcile_resync_s: float = Field(5.0, gt=0, description="how often the controllers' reconciler compares every ready block's live instances with its minInstances (and at once after a failed reassignment, scale or eviction)")
    reconcile_backoff_s: float = Field(2.0, gt=0, description="the reconciler's wait after asking for a block's missing instances before it asks again, doubled per attempt while the block stays short")
    reconcile_max_backoff_s: float = Field(60.0, gt=0, description="the longest wait between the reconciler's asks for one block (one scale.target, and the step's failure with its reason, per wait)")
    vcluster_sweep_s: float = Field(2.0, gt=0, description="how often controllers replenish virtual clusters' dead nodes and destroy job clusters left behind")
    vcluster_idle_s: float = Field(300.0, gt=0, description="a node of an autoscaled virtual cluster idle this long is given back (down to its min)")
    sim_start_delay_s: float = Field(0.05, ge=0, description="simulated fleet: how long an instance takes to start")
    sim_fail_rate: float = Field(0.0, ge=0, le=1, description="simulated fleet: share of instance starts that fail")
    sim_serve: bool = Field(True, description="simulated fleet: every simulated instance serves HTTP on 127.0.0.1 (task path, /health, /metrics)")
    scale_down_grace_s: float = Field(20.0, ge=0, le=25, description="scale-down: the node agent lets the tasks in flight at a removed instance finish (it watches the instance's aios_instance_requests_running) for at most this long before it stops it; an instance with no such figure gets the whole grace (at most 25: under the 30 s ack wait of the remove command)")
    drain_grace_s: float = Field(0.25, ge=0, le=30, description="node agents wait this long between a planned remove command (the mapper marks the instance draining) and stopping an instance that serves HTTP, so every executor has stopped routing to it first")
    # -- stream ------------------------------------------------------------------------------------
    stream_max_age_s: float = Field(7 * 24 * 3600, gt=0, description="the AIOS stream keeps events this long")
    stream_max_bytes: int = Field(8 * 1024**3, gt=0, description="the AIOS stream keeps at most this many bytes (oldest dropped)")
    stream_replicas: int = Field(1, ge=1, le=5, description="replicas of the AIOS stream and the key bucket (3 on a NATS cluster)")
    observe_mirror: bool = Field(True, description="keep AIOS_OBSERVE, the observers' read-only mirror of AIOS (same limits: twice the disk), where they may keep any consumer, the JS clients' ordered ones included; off: observers have named consumers on AIOS only")
    nats_ca: str | None = Field(None, description="CA file to verify a tls:// NATS server (the embedded self-signed certificate)")
    nats_creds: str | None = Field(None, description="a NATS .creds file (JWT + nkey seed) for operator-mode servers")
    event_key: str | None = Field(None, repr=False, description="key of the keyed event ids (else the shared one in the KV bucket)")
    instance_key: str | None = Field(None, repr=False, description="the system's instance key K (executors, the simulated fleet): each try at an instance carries its token Aios-Instance-Token, derived from K and the map's node and instance ids; blocks up gives its executors <data dir>/auth/instance-key when auth is on; unset: no token is sent (docs/security.md \"Instances' ports: a token per instance\")")
    instance_node_key: str | None = Field(None, repr=False, description="a node agent's own instance key K_N = HMAC(K, node id) (blocks instance-key --node-id N prints it; an agent next to blocks up gets it from its data dir): it starts each instance with its token in AIOS_INSTANCE_TOKEN; unset: instances get no token and take any caller's tasks")
    atomic_batch_min: int = Field(
        24, ge=0, description="a fetched batch's stored events go as one atomic batch per stream from this many on (0: never; publish_async each)"
    )
    atomic_batch_max: int = Field(256, ge=1, le=1000, description="most events in one atomic batch (the server takes at most 1000)")
    consumer_batch: int = Field(128, ge=1, le=1000, description="most messages a worker takes from its durable consumer in one fetch (one batch: one commit of its events)")
    consumer_inflight: int = Field(
        512, ge=1, description="most messages a worker's consumer has in its batches in flight (taken, not yet acked): a batch waits for its events to be stored, so this bounds one copy's rate at it over the commit latency"
    )
    gc_gen0_threshold: int = Field(
        10_000, ge=0, description="worker processes: Python's cyclic garbage collector looks at the youngest objects after this many new ones (Python's default is 700, at which a burst kept the core process ~18 % of its CPU in the collector, mostly re-scanning its inventory caches; docs/benchmarks.md, Stop 26); 0 keeps Python's default"
    )
    # -- Redis -------------------------------------------------------------------------------------
    redis_max_connections: int = Field(64, ge=1, description="Redis connection pool size per process")
    redis_pool_wait_s: float = Field(30.0, gt=0, description="how long a command waits for a free pooled connection")
    redis_autopipeline: bool = Field(
        True, description="gather the commands a process issues in one event-loop turn into one pipeline (one server: state/autopipeline.py)"
    )
    # -- policies ----------------------------------------------------------------------------------
    policy_timeout_s: float = Field(5.0, gt=0, description="time limit of one Python registry policy call")
    python_policy_sandbox: Literal["process", "thread"] = Field("process", description="where Python registry policies (registry:NAME, NAME.py) run: child processes, stopped at their time limit, or threads of the worker (a call past its limit keeps its thread)")
    python_policy_processes: int = Field(4, ge=1, description="Python policy processes per worker (AIOS_PYTHON_POLICY_SANDBOX=process), started on first use")
    starlark_sandbox: Literal["process", "inline"] = Field("process", description="where Starlark policies run: a sandbox process pool, or inline (tests)")
    starlark_call_timeout_s: float = Field(4.0, gt=0, description="time limit of one Starlark policy call")
    starlark_memory_mb: int = Field(1024, ge=64, description="memory limit of a Starlark sandbox process")
    starlark_processes: int = Field(2, ge=1, description="Starlark sandbox processes per worker")
    sample_nodes: int = Field(100, ge=1, description="default of the built-in policies' node sampling threshold (rule setting sampleNodes)")
    max_candidates: int = Field(3, ge=1, description="default of builtin:cluster-rank's candidates (rule setting maxCandidates)")
    max_spec_bytes: int = Field(256 * 1024, ge=1024, description="largest block spec accepted")
    # -- executor (block tasks) -------------------------------------------------------------------
    executor_http_port: int = Field(0, ge=0, le=65535, description="HTTP ingress port of the executors (blocks up picks a free one and writes it to endpoints.json as http; 0 = none)")
    executor_http_host: str = Field("127.0.0.1", description="address the executors' HTTP ingress listens on")
    executor_http_users: str = Field("", description="file of the users that may send tasks over the executors' HTTP port (HTTP Basic, hashed passwords; blocks up names <data dir>/auth/task-users.json when auth is on); empty: the port takes no credentials (docs/security.md)")
    executor_max_ongoing: int = Field(100, ge=1, description="default per-instance in-flight limit (loadBalancer rule setting maxOngoing)")
    executor_queue_size: int = Field(1000, ge=0, description="default per-block queue of tasks waiting for a free instance (rule setting queueSize)")
    executor_queue_timeout_s: float = Field(10.0, gt=0, description="how long a task waits in the block's queue before it is refused")
    executor_task_timeout_s: float = Field(60.0, gt=0, description="time limit of one task at its instance (header Aios-Timeout-Ms overrides)")
    executor_retries: int = Field(2, ge=0, description="retries of an idempotent task (Aios-Idempotent: true) on another instance")
    executor_policy_time_limit_ms: float = Field(5.0, gt=0, description="time limit of one inline custom Python loadBalancer decision")
    executor_weights_interval_s: float = Field(1.0, gt=0, description="how often a Starlark loadBalancer policy recomputes its weights")
    executor_scrape_interval_s: float = Field(0.25, ge=0, description="how often the executor reads instances' /metrics for builtin:least-queue (0 = never)")
    activator_hold_s: float = Field(30.0, gt=0, description="scale-to-zero (minInstances 0): how long the executor holds a task while the block's first instance starts (then 503 with the reason)")
    activator_max_held: int = Field(1000, ge=0, description="scale-to-zero: tasks held per block and executor while the first instance starts (beyond: 429)")
    # -- task outputs and side-cars (docs/sidecars.md) --------------------------------------------
    outputs_max_age_s: float = Field(24 * 3600, gt=0, description="the AIOS_OUTPUTS stream keeps task outputs this long")
    outputs_max_bytes: int = Field(1024**3, gt=0, description="the AIOS_OUTPUTS stream keeps at most this many bytes (oldest dropped: discard old)")
    outputs_max_msg_bytes: int = Field(256 * 1024, ge=1024, le=4 * 1024 * 1024, description="largest output body published; a larger one is cut to this size and marked truncated (size says the whole)")
    outputs_buffer: int = Field(10_000, ge=1, description="outputs an executor holds while NATS is slow or away; beyond it new outputs are dropped and counted (aios_executor_outputs_dropped_total)")
    outputs_linger_ms: float = Field(10.0, ge=0, le=1000, description="the executor gathers outputs this long before publishing a batch (fewer, larger batches: less CPU per output; side-cars see them this much later)")
    outputs_publish_timeout_s: float = Field(5.0, gt=0, description="how long the executor waits for the stream to store a batch of outputs before it tries that batch again")
    sidecar_nats_url: str | None = Field(None, repr=False, description="NATS URL node agents give the side-cars they start (credentials of the sidecar role; blocks up sets it); else the agent's URL without credentials")
    sidecar_restart_s: float = Field(1.0, gt=0, description="node agents restart a side-car that exited after this long (doubling up to 30 s while it keeps dying)")
    # -- metrics (docs/metrics.md) ----------------------------------------------------------------
    metrics_port: int = Field(0, ge=-1, le=65535, description="port of each worker's Prometheus /metrics (0 = a free one, registered in Redis for the collector and `blocks prometheus-config`; -1 = none)")
    metrics_host: str = Field("127.0.0.1", description="address the workers' /metrics and the collector's discovery listen on, and that Prometheus is given")
    metrics_sd_port: int = Field(0, ge=0, le=65535, description="the metrics collector's HTTP port: Prometheus http_sd targets and block summaries (blocks up picks a free one and writes it to endpoints.json as metrics)")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often the metrics collector scrapes instances and executors (the windows' resolution)")
    metrics_window_s: float = Field(60.0, gt=0, description="how much history the collector keeps per instance and block in Redis")
    metrics_rate_span_s: float = Field(10.0, gt=0, description="span of the collector's rates and latency quantiles")
    metrics_scrape_timeout_s: float = Field(0.5, gt=0, description="time limit of one /metrics scrape by the collector")
    metrics_target_ttl_s: float = Field(15.0, gt=0, description="a worker's /metrics registration lapses this long after its last refresh")
    metrics_remote_write_url: str | None = Field(None, description="the global metrics DBs: Prometheus remote-write receivers (comma-separated URLs, e.g. http://prom:9090/api/v1/write) the metrics collector pushes every block and instance sample to (none: no push)")
    metrics_remote_write_interval_s: float = Field(10.0, gt=0, description="how often the metrics collector sends the samples taken since its last push (each keeps its own time)")
    metrics_remote_write_timeout_s: float = Field(5.0, gt=0, description="time limit of one remote-write request")
    metrics_remote_write_max_samples: int = Field(200_000, ge=1, description="samples kept per receiver while it is down or refusing with 429/5xx (the oldest dropped beyond)")
    # -- autoscaler (docs/autoscaling.md; the rule parameters in brackets override per block) -------
    autoscale_tick_s: float = Field(2.0, gt=0, description="how often the autoscaler decides each block's instance count (Knative ticks every 2 s)")
    autoscale_policy_timeout_s: float = Field(1.0, gt=0, description="time limit of one Python autoscaler policy call (a call past it fails that tick)")
    autoscale_tolerance: float = Field(0.1, ge=0, lt=1, description="a stable mean within this fraction of the current count changes nothing [tolerance]")
    autoscale_upscale_delay_s: float = Field(2.0, ge=0, description="a larger count must be wanted this long before the block grows (outside a burst) [upscaleDelayS]")
    autoscale_downscale_delay_s: float = Field(30.0, ge=0, description="a smaller count must be wanted this long before the block shrinks [downscaleDelayS]")
    autoscale_stable_window_s: float = Field(60.0, gt=0, description="the policy's proposals are averaged over this window (Knative's stable window) [stableWindowS]")
    autoscale_burst_window_s: float = Field(6.0, gt=0, description="short window (Knative's panic window): a mean proposal here of burstThreshold x the count grows the block at once and blocks scale-down [burstWindowS]")
    autoscale_burst_threshold: float = Field(2.0, gt=1, description="burst when the burst window's mean proposal is at least this many times the current count [burstThreshold]")
    autoscale_max_up_factor: float = Field(4.0, gt=1, description="one step grows a block to at most this many times its count (at least +1) [maxUpFactor]")
    autoscale_max_down_factor: float = Field(2.0, gt=1, description="one step shrinks a block to no less than its count divided by this (at least -1) [maxDownFactor]")
    autoscale_failure_record_s: float = Field(60.0, ge=0, description="a block whose autoscaler policy keeps failing gets one stored failure per this many seconds (or when the reason changes)")
    # -- health checker (docs/health.md) -------------------------------------------------------------
    health_interval_s: float = Field(1.0, gt=0, description="how often the health checker probes every instance and runs each block's stabilityChecker policy")
    health_probe_timeout_s: float = Field(0.5, gt=0, description="time limit of one active health probe (GET {endpoint}/health)")
    health_startup_grace_s: float = Field(5.0, ge=0, description="default startup grace of a block's instances: no verdict about an instance younger than this (rule setting startupGraceS)")
    health_max_out_ratio: float = Field(0.1, ge=0, le=1, description="at most max(1, this share) of a block's instances out of routing at once, by the health checker and by the executors' ejection")
    health_lease_s: float = Field(5.0, gt=0, description="a health checker copy decides a block for this long after its last tick (copies wait their turn)")
    health_failure_record_s: float = Field(60.0, gt=0, description="a block's failing stabilityChecker tick is recorded (block.health.failed) at most once per this many seconds per reason")
    outlier_base_ejection_s: float = Field(1.0, gt=0, description="executor: an instance whose dispatch failed (refused, reset, timed out) gets no task from this executor for this long times its ejection count")
    outlier_max_ejection_s: float = Field(30.0, gt=0, description="executor: the longest local ejection")
    outlier_consecutive_5xx: int = Field(5, ge=1, description="executor: consecutive 5xx answers of an instance that eject it like a transport failure")
    outlier_publish_s: float = Field(0.5, gt=0, description="executor: how often its per-instance passive counts are written for the health checker")
    # -- processes ---------------------------------------------------------------------------------
    warm_timeout_s: float = Field(60.0, gt=0, description="how long a starting worker waits for NATS and Redis")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="worker log level")


class BadSettings(SystemExit):
    """A setting that does not fit: the process stops with one line per variable."""


@lru_cache(maxsize=1)
def load() -> Settings:
    """The process's settings, from the environment, built once (entry points call this and pass
    the object down; tests build their own ``Settings(...)``)."""
    return current()


def current() -> Settings:
    """Settings from the environment as it is now (a connection opened without settings passed
    in: a program that sets ``AIOS_NATS_CA`` and then connects gets what it set)."""
    try:
        return Settings()
    except ValidationError as exc:
        lines = [f"AIOS_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()]
        raise BadSettings("invalid settings:\n  " + "\n  ".join(lines)) from None


def markdown() -> str:
    """The settings table of docs/settings.md."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, f in Settings.model_fields.items():
        default = f.default
        shown = f"`{default}`" if not isinstance(default, float) or default != int(default) else f"`{default:g}`"
        lines.append(f"| `AIOS_{name.upper()}` | {shown} | {f.description or ''} |")
    return "\n".join(lines)
