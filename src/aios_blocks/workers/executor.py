"""Executor worker (``blocks worker executor``, started by ``blocks up``): the gateway of every
block's tasks. Its parts, each a module of its own:

* **Map watch** (here): every executor watches the whole instance-map bucket (a full snapshot
  first, then each change) and keeps one :class:`~aios_blocks.executor.engine.Route` per block.
  The maps are written by the mapper, a worker kind of its own (``workers/mapper.py``).
* **Ingress** (``executor/ingress.py``): tasks from NATS (``aios.block.{bid}.task``, queue group
  ``executor``) and HTTP (``AIOS_EXECUTOR_HTTP_PORT``).
* **Dispatch** (``executor/dispatch.py``): a task to one instance (admission, the loadBalancer,
  retries only when it never reached one or is marked ``Aios-Idempotent: true``).
* **Activator** (here): a block of ``minInstances`` 0 with no ready instance has its tasks held
  (bounded, with a deadline) while the executor asks for one (``block.scale.target``, target 1).
* **Outputs** (``executor/outputs.py``): every answered task's output of blocks with side-cars (or
  ``outputs: true``) goes to ``aios.output.{bid}.{outcome}`` after the answer, never awaited by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import REGISTRY

from ..bus import subjects
from ..bus.catalog import E
from ..bus.instance_map import InstanceMaps
from ..bus.nats_bus import Serving
from ..executor.dispatch import Dispatcher
from ..executor.engine import Chooser, InlinePolicy, Limits, PolicyError, Route, Weighted
from ..executor.ingress import Ingress
from ..executor.outlier import Outliers
from ..executor.outputs import OutputPublisher
from ..executor.stats import ExecutorCollector
from ..executor.task_auth import TaskUsers
from ..policies.builtin.balancer import DEFAULT
from ..policies.runtime import BUILTINS, registry_name
from ..runtime.ticker import Ticker
from ..schemas.errors import PolicyFailed
from ..schemas.events import ScaleTarget
from ..schemas.protocol import INSTANCE_HEADER, METRICS_PATH
from ..schemas.records import BlockMap, RouteView, TaskInfo
from .base import Worker, run_consumers
from .mapper import Mapper
from .mapper import bindings as mapper_bindings

log = structlog.get_logger("aios.executor")

#: policies that never read instance metrics: their blocks' instances are not scraped
NO_METRICS = ("builtin:round-robin", "builtin:least-inflight")


class _Failing(Chooser):
    """A policy that could not be loaded: every task gets the reason (the executor lives)."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def choose(self, bid: str, task: TaskInfo, candidates: list[RouteView]) -> str:
        raise PolicyError(self.reason)


# -- metrics scraping (builtin:least-queue) ----------------------------------------------------------
#: name suffix -> the key builtin:least-queue reads (vLLM's ``vllm:num_requests_waiting``, the
#: instance SDK's ``aios_instance_requests_waiting``, ...)
QUEUE_METRICS = {"requests_waiting": "num_requests_waiting", "requests_running": "num_requests_running",
                 "kv_cache_usage_perc": "kv_cache_usage_perc"}


def parse_queue_metrics(text: str) -> dict[str, float]:
    """The engine-reported queue figures of a Prometheus text page: each metric whose name ends
    in ``requests_waiting``, ``requests_running`` or ``kv_cache_usage_perc``, summed over its label
    sets (KV use: the largest); a figure two metrics report (an SDK wrapping an engine) counts once
    (the larger)."""
    per_name: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        name = line[: brace if 0 <= brace < space or (brace >= 0 and space < 0) else space]
        key = next((k for suffix, k in QUEUE_METRICS.items() if name.endswith(suffix)), None)
        if key is None:
            continue
        try:
            value = float(line.rsplit("}", 1)[1].split()[0] if brace >= 0 else line.split()[1])
        except (ValueError, IndexError):
            continue
        _, prev = per_name.get(name, (key, 0.0))
        per_name[name] = (key, max(prev, value) if key == "kv_cache_usage_perc" else prev + value)
    out: dict[str, float] = {}
    for key, value in per_name.values():
        out[key] = max(out.get(key, 0.0), value)
    return out


class Executor:
    """``cluster``: serve only the blocks placed on that cluster (a pinned executor: it answers each
    of their task subjects as one of the same ``executor`` queue group, so pinned and unpinned
    copies may run side by side without a task being answered twice)."""

    def __init__(self, w: Worker, cluster: str | None = None):
        self.w = w
        self.cluster = cluster or None
        #: a pinned executor's per-block responders
        self._serving: dict[str, Serving] = {}
        self.s = w.settings
        self.maps = InstanceMaps(w.bus)
        # the executors may make the bucket too (whoever comes first): one made here is refilled
        self.maps.on_created = Mapper(w, self.maps).refill
        self.routes: dict[str, Route] = {}
        #: block -> (revision, monotonic time) of the last map seen (mapper propagation figures)
        self.seen: dict[str, tuple[int, float]] = {}
        self._weight_tasks: dict[str, asyncio.Task[None]] = {}
        self._map_lock = asyncio.Lock()
        self.map_ready = asyncio.Event()
        #: activation publishes and serving stops in flight (kept referenced until done)
        self._activations: set[asyncio.Task[None]] = set()
        #: blocks whose task outputs are published (side-cars consume them)
        self.outputs_on: set[str] = set()
        self.outputs = OutputPublisher(w.bus, self.s)
        self.dispatcher = Dispatcher(self.routes, self.s, self.cluster, fetch=self.fetch_map)
        users = TaskUsers(self.s.executor_http_users) if self.s.executor_http_users else None
        self.ingress = Ingress(self.dispatcher, self.outputs, self.outputs_on, self.s.outputs_max_msg_bytes, users)

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.dispatcher.session

    @property
    def unknown_tasks(self) -> int:
        """Tasks for a block with no map (one unlabelled counter: block ids from callers are unbounded)."""
        return self.dispatcher.unknown_tasks

    # -- the instance map -----------------------------------------------------------------------
    async def on_map(self, bid: str, value: BlockMap | None, rev: int) -> None:
        async with self._map_lock:  # a chooser may need loading: changes apply in order
            await self.on_map_locked(bid, value, rev)

    async def on_map_locked(self, bid: str, value: BlockMap | None, rev: int) -> None:
        self.seen[bid] = (rev, time.monotonic())
        if self.cluster is not None and value is not None and value.get("cluster") != self.cluster:
            value = None  # not ours (any more)
        await self._apply_map(bid, value, rev)
        if self.cluster is not None:  # after the route exists: no task finds it missing
            await self._pin(bid, value is not None)

    async def fetch_map(self, bid: str) -> Route | None:
        """The block's route from its map in the bucket, for a task that found none: the watch may
        not have brought a map the bucket already holds (the block just became ready)."""
        value, rev = await self.maps.get(bid)
        if value is None:
            return None
        async with self._map_lock:
            if bid not in self.routes:  # the watch may have applied it (or a newer one) meanwhile
                await self.on_map_locked(bid, value, rev)
        return self.routes.get(bid)

    async def _apply_map(self, bid: str, value: BlockMap | None, rev: int) -> None:
        route = self.routes.get(bid)
        if value is not None and value.get("outputs"):
            self.outputs_on.add(bid)
        else:
            self.outputs_on.discard(bid)
        if value is None:
            if route is not None:
                route.close(rev)
                del self.routes[bid]
            self._stop_weights(bid)
            return
        rule = value.get("loadBalancer") or {}
        gen = int(value.get("gen", 0))
        if route is None or route.rule != rule or route.gen != gen:
            chooser, limits = await self.chooser(bid, rule)
            if route is None or route.gen != gen:
                old = route
                route = Route(bid, chooser, limits, gen=gen, rule=rule, outliers=self.new_outliers(), on_activate=self.activate)
                if old is not None:
                    old.close(rev)  # the old generation's waiters are told at once
            else:
                route.chooser, route.limits, route.rule = chooser, limits, rule
            self.routes[bid] = route
            self._stop_weights(bid)
            if isinstance(chooser, Weighted):
                self._weight_tasks[bid] = asyncio.get_running_loop().create_task(self._weights_loop(bid, rule, chooser))
        route.path = str(value.get("path") or "/infer")
        route.method = str(value.get("method") or "POST")
        route.tenant = str(value.get("tenant") or "") or None
        mi = value.get("minInstances")
        route.scale_to_zero = isinstance(mi, int) and mi == 0  # maps written before the field: as before
        route.apply(value.get("instances") or {}, rev, gen, value.get("boots") or {})

    async def _pin(self, bid: str, ours: bool) -> None:
        """A pinned executor answers exactly its cluster's blocks' task subjects."""
        serving = self._serving.get(bid)
        if ours and serving is None:
            self._serving[bid] = await self.w.bus.serve(E.block_task, subjects.EXECUTOR_QUEUE, self.ingress.on_task, bid=bid)
        elif not ours and serving is not None:
            del self._serving[bid]
            task = asyncio.get_running_loop().create_task(serving.stop(self.s.executor_task_timeout_s))
            self._activations.add(task)  # held until done, as the activations (a weak reference only otherwise)
            task.add_done_callback(self._activations.discard)

    def _stop_weights(self, bid: str) -> None:
        t = self._weight_tasks.pop(bid, None)
        if t is not None:
            t.cancel()

    async def chooser(self, bid: str, rule: dict[str, Any]) -> tuple[Chooser, Limits]:
        """The block's loadBalancer policy, ready to decide: built-ins and Python inline (custom
        Python under a time limit), Starlark as periodically computed weights."""
        settings = rule.get("settings") or {}
        limits = Limits(
            max_ongoing=int(settings.get("maxOngoing", self.s.executor_max_ongoing)),
            queue_size=int(settings.get("queueSize", self.s.executor_queue_size)),
            queue_timeout_s=float(settings.get("queueTimeoutS", self.s.executor_queue_timeout_s)),
            hold_s=self.s.activator_hold_s,
            max_held=self.s.activator_max_held,
        )
        uri = str(rule.get("policyRuleURI") or DEFAULT)
        rule_id = f"{bid}.loadBalancer"
        params = rule.get("parameters") or {}
        try:
            if uri in BUILTINS:
                return InlinePolicy(BUILTINS[uri](rule_id, settings, params), uri, params), limits
            if await self._is_starlark(uri, rule.get("version")):
                return Weighted(uri), limits
            inst, _, _ = await asyncio.wait_for(self.w.runtime.instance({**rule, "policyRuleURI": uri}, rule_id,
                                                                        inline=True),  # its own inline limit, per task
                                                self.s.policy_timeout_s)
            ctx = await self.w.store.context_load(rule_id)
            return InlinePolicy(inst, uri, params, self.s.executor_policy_time_limit_ms / 1000, ctx), limits
        except Exception as exc:
            reason = f"loadBalancer policy {uri} cannot be loaded: {type(exc).__name__}: {exc}"
            log.warning("executor.policy_load_failed", block=bid, error=reason)
            return _Failing(uri, reason), limits

    async def _is_starlark(self, uri: str, version: Any) -> bool:
        if uri.endswith(".star"):
            return True
        reg = registry_name(uri)
        if reg is None or uri.endswith(".py"):
            return False
        name, pinned = reg
        record = await self.w.store.policy_get(name, pinned if pinned is not None else version)
        return record is not None and record.get("language") == "starlark"

    async def _weights_loop(self, bid: str, rule: dict[str, Any], chooser: Weighted) -> None:
        """A Starlark loadBalancer: ``action: "weights"`` every interval, off the task path; ends
        when its task is cancelled (``_stop_weights``)."""
        rule = {**rule, "name": "loadBalancer"}

        async def tick() -> None:
            route = self.routes.get(bid)
            if route is None:
                return
            payload = {"block": bid, "instances": [dict(v) for v in route.views.values() if v["state"] == "ready"]}
            try:
                out = await self.w.runtime.invoke(rule, f"{bid}.loadBalancer", {"action": "weights", "payload": payload})
                chooser.set(out["weights"])
                chooser.error = ""
            except PolicyFailed as exc:  # keep the last weights; tasks go on
                chooser.error = exc.reason
                log.warning("executor.weights_failed", block=bid, error=exc.reason)

        await Ticker(self.s.executor_weights_interval_s, "executor.weights_failed", log.bind(block=bid)).run(tick, asyncio.Event())

    async def scrape_loop(self, stop: asyncio.Event) -> None:
        """Engine queue figures of the instances of blocks whose policy may read them
        (builtin:least-queue and custom policies; round-robin and least-inflight never do)."""
        interval = self.s.executor_scrape_interval_s
        if interval <= 0:
            return
        timeout = aiohttp.ClientTimeout(total=max(0.05, interval))

        async def tick() -> None:
            jobs = []
            for route in list(self.routes.values()):
                if route.chooser.name in NO_METRICS:
                    continue
                for v in list(route.views.values()):
                    if v["state"] == "ready" and v["endpoint"]:
                        jobs.append(self._scrape(route, v, timeout))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)

        await Ticker(interval, "executor.scrape_failed", log).run(tick, stop)

    async def _scrape(self, route: Route, v: RouteView, timeout: aiohttp.ClientTimeout) -> None:
        assert self.session is not None
        # named like a task: an instance now at a reused port answers 421, not its own figures
        async with self.session.get(v["endpoint"] + METRICS_PATH, timeout=timeout,
                                    headers={INSTANCE_HEADER: v["id"]}) as resp:
            if resp.status == 200:
                route.set_metrics(v["id"], parse_queue_metrics(await resp.text()))

    async def collected_loop(self, stop: asyncio.Event) -> None:
        """The metrics collector's latest instance samples (``state.metrics``) into the routes'
        views: the loadBalancer's input carries them as each instance's ``metrics``."""
        await Ticker(self.s.metrics_interval_s, "executor.metrics_read_failed", log).run(self.collected_tick, stop)

    async def collected_tick(self) -> None:
        """One read of the collected samples (raises with Redis away: the routes keep the last ones)."""
        bids = list(self.routes)
        if not bids:
            return
        latest = await self.w.store.metrics.instances_many(bids)
        for bid, insts in latest.items():
            route = self.routes.get(bid)
            if route is not None:
                for iid, sample in insts.items():
                    route.set_collected(iid, sample)

    # -- passive health (docs/health.md) ------------------------------------------------------------
    def new_outliers(self) -> Outliers:
        return Outliers(self.s.outlier_base_ejection_s, self.s.outlier_max_ejection_s, self.s.outlier_consecutive_5xx,
                        self.s.health_max_out_ratio)

    async def passive_loop(self, stop: asyncio.Event) -> None:
        """Write this executor's per-instance passive counts (errors, timeouts, ejections,
        in-flight and how long without a completion) where the health checker reads them."""
        interval = self.s.outlier_publish_s
        holder = f"executor-{socket.gethostname()}-{os.getpid()}-{id(self):x}"

        async def tick() -> None:  # Redis away for a moment: the next tick writes again
            per_block = {bid: r.outliers.snapshot(r.views) for bid, r in list(self.routes.items()) if r.views}
            await self.w.store.health.write_passive(holder, per_block, max(5.0, interval * 10))

        await Ticker(interval, "executor.passive_write_failed", log).run(tick, stop)

    # -- the activator (scale-to-zero) ------------------------------------------------------------
    def activate(self, route: Route) -> None:
        """Held tasks of a block at zero need an instance: ask for one (``block.scale.target``,
        target 1, source ``activator``). Called by the route at most once per hold period. The
        request id is the map's revision and the hold period's number, so every executor holding
        tasks of the same map in the same period publishes the same message id (one request in
        the stream), and a block that went back to zero later asks anew."""
        epoch = int(time.time() // max(1.0, self.s.activator_hold_s))
        target = ScaleTarget(route.block_id, f"activator-r{route.version}-{epoch}", 1,
                             f"{route.held or 1} task(s) held with no ready instance", "activator", route.gen)
        task = asyncio.get_running_loop().create_task(self._emit_activation(target))
        self._activations.add(task)
        task.add_done_callback(self._activations.discard)

    async def _emit_activation(self, target: ScaleTarget) -> None:
        try:
            await self.w.bus.emit(E.block_scale_target, target)
            log.info("executor.activate", block=target.block_id, request=target.request_id)
        except Exception as exc:  # the held tasks still get their answer at the deadline
            log.warning("executor.activate_failed", block=target.block_id, error=repr(exc))

    # -- running --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, mapper_on: bool = False) -> None:
        """Serve until ``stop``. ``mapper_on``: run a mapper in this process too (in-process tests
        and benchmarks; ``blocks up`` runs the mapper as a worker kind of its own)."""
        self.dispatcher.session = session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
                                             auto_decompress=False)
        runner: web.AppRunner | None = None
        collector = ExecutorCollector(lambda: self.routes, lambda: self.unknown_tasks)
        REGISTRY.register(collector)  # served by the worker's /metrics (workers/telemetry.py)
        watch = asyncio.get_running_loop().create_task(self.maps.watch(lambda b, v, r: self.on_map(b, v, r), stop, self.map_ready))
        sub = None
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.map_ready.wait(), 10)
            if self.cluster is None:  # a pinned one answers its blocks' subjects (on_map)
                sub = await self.w.bus.serve(E.block_task, subjects.EXECUTOR_QUEUE, self.ingress.on_task)
            if self.s.executor_http_port:
                runner = web.AppRunner(self.ingress.app(), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, self.s.executor_http_host, self.s.executor_http_port, reuse_port=True)
                await site.start()
            log.info("executor.serving", http=self.s.executor_http_port, blocks=len(self.routes))
            jobs = [self.scrape_loop(stop), self.collected_loop(stop), self.passive_loop(stop), self.outputs.run(stop), stop.wait()]
            if mapper_on:
                jobs.append(run_consumers(self.w, mapper_bindings(self.w, Mapper(self.w, self.maps)), stop))
            await asyncio.gather(*jobs)
        finally:
            for serving in [*([sub] if sub is not None else []), *self._serving.values()]:
                with contextlib.suppress(Exception):  # leave the queue group, answer what was taken
                    await serving.stop(self.s.executor_task_timeout_s)
            watch.cancel()
            for bid in list(self._weight_tasks):
                self._stop_weights(bid)
            if runner is not None:
                await runner.cleanup()
            await session.close()
            REGISTRY.unregister(collector)


async def run(w: Worker, stop: asyncio.Event, cluster: str | None = None) -> None:
    await Executor(w, cluster).run(stop)
