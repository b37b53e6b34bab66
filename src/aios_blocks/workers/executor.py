"""Executor worker (``blocks worker executor``, started by ``blocks up``): the gateway of every
block's tasks, and the mapper that keeps the blocks' instance maps.

* **Mapper**: a durable consumer (``mapper``, shared by the executors) turns lifecycle facts into
  each block's versioned instance map in the ``aios-instances`` bucket (``handlers/mapper.py``
  decides, ``bus/instance_map.py`` stores with compare-and-set).
* **Map watch**: every executor watches the whole bucket (a full snapshot first, then each change)
  and keeps one :class:`~aios_blocks.executor.engine.Route` per block.
* **NATS ingress**: ``aios.block.{bid}.task`` requests, as the queue group ``executor``; the reply
  is the instance's answer (``Aios-Status`` = its HTTP status, ``Aios-Instance``) or the
  executor's own error (``Aios-Status`` 404/429/500/502/503/504, ``Aios-Error``, ``Retry-After-Ms``).
* **Activator**: a block of ``minInstances`` 0 with no ready instance has its tasks held (bounded,
  with a deadline) while the executor asks for one (``block.scale.target``, target 1).
* **HTTP ingress** (``AIOS_EXECUTOR_HTTP_PORT``; copies share the port with SO_REUSEPORT):
  ``POST /blocks/{bid}/tasks`` goes to the component's input protocol path,
  ``/blocks/{bid}/{path}`` to ``/{path}`` of the instance, any method; responses are streamed.
* **Dispatch**: one pooled aiohttp session; a task goes to one instance. It is tried on another
  (bounded, with backoff) only when it never reached the first (connection refused), or when the
  task is marked ``Aios-Idempotent: true``; otherwise the instance's failure is the answer, so a
  task is never sent twice without that mark.
* **Outputs** (blocks with side-cars, or ``outputs: true``): every answered task's output goes to
  ``aios.output.{bid}.{outcome}`` (stream ``AIOS_OUTPUTS``) through a bounded buffer, after the
  answer and never awaited by it (``executor/outputs.py``, docs/sidecars.md). Every answer carries
  its task id (``Aios-Task-Id``: the caller's, else a fresh one), the output's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import REGISTRY

from ..bus import subjects
from ..bus.catalog import E
from ..bus.instance_map import InstanceMaps
from ..bus.router import Inbound, Router
from ..executor.engine import Chooser, InlinePolicy, Limits, PolicyError, Refused, Route, Weighted
from ..executor.outlier import Outliers
from ..executor.outputs import OutputPublisher, task_id_of
from ..executor.stats import ExecutorCollector
from ..handlers import mapper
from ..policies.builtin.balancer import DEFAULT
from ..policies.runtime import BUILTINS, registry_name
from ..schemas.errors import PolicyFailed
from ..schemas.events import ScaleTarget
from .base import Worker

log = structlog.get_logger("aios.executor")

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer",
               "proxy-authorization", "proxy-authenticate"}
RETRY_STATUSES = (502, 503, 504)
#: policies that never read instance metrics: their blocks' instances are not scraped
NO_METRICS = ("builtin:round-robin", "builtin:least-inflight")
#: an HTTP answer of known length up to this size is passed on in one write (others are streamed)
SMALL_BODY = 256 * 1024


def _clean(text: str) -> str:
    """A header value: one line, bounded."""
    return " ".join(text.split())[:1000]


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


class _Failing(Chooser):
    """A policy that could not be loaded: every task gets the reason (the executor lives)."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def choose(self, bid: str, task: dict[str, Any], candidates: list[dict[str, Any]]) -> str:
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
        self._serving: dict[str, Any] = {}
        self.s = w.settings
        self.maps = InstanceMaps(w.bus, on_created=self.refill_maps)
        self.routes: dict[str, Route] = {}
        #: block -> (revision, monotonic time) of the last map seen (mapper propagation figures)
        self.seen: dict[str, tuple[int, float]] = {}
        self.session: aiohttp.ClientSession | None = None
        self._weight_tasks: dict[str, asyncio.Task[None]] = {}
        self._map_lock = asyncio.Lock()
        self.map_ready = asyncio.Event()
        #: tasks for a block with no map (one unlabelled counter: block ids from callers are unbounded)
        self.unknown_tasks = 0
        #: activation publishes in flight (kept referenced until done)
        self._activations: set[asyncio.Task[None]] = set()
        #: blocks whose task outputs are published (side-cars consume them)
        self.outputs_on: set[str] = set()
        self.outputs = OutputPublisher(w.bus, self.s)

    # -- the instance map -----------------------------------------------------------------------
    async def on_map(self, bid: str, value: dict[str, Any] | None, rev: int) -> None:
        async with self._map_lock:  # a chooser may need loading: changes apply in order
            self.seen[bid] = (rev, time.monotonic())
            if self.cluster is not None and value is not None and value.get("cluster") != self.cluster:
                value = None  # not ours (any more)
            await self._apply_map(bid, value, rev)
            if self.cluster is not None:  # after the route exists: no task finds it missing
                await self._pin(bid, value is not None)

    async def _apply_map(self, bid: str, value: dict[str, Any] | None, rev: int) -> None:
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
        mi = value.get("minInstances")
        route.scale_to_zero = isinstance(mi, int) and mi == 0  # maps written before the field: as before
        route.apply(value.get("instances") or {}, rev, gen, value.get("boots") or {})

    async def _pin(self, bid: str, ours: bool) -> None:
        """A pinned executor answers exactly its cluster's blocks' task subjects."""
        serving = self._serving.get(bid)
        if ours and serving is None:
            self._serving[bid] = await self.w.bus.serve(E.block_task, subjects.EXECUTOR_QUEUE, self.on_task, bid=bid)
        elif not ours and serving is not None:
            del self._serving[bid]
            asyncio.get_running_loop().create_task(serving.stop(self.s.executor_task_timeout_s))

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
            inst, _, _ = await asyncio.wait_for(self.w.runtime.instance({**rule, "policyRuleURI": uri}, rule_id),
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
        """A Starlark loadBalancer: ``action: "weights"`` every interval, off the task path."""
        rule = {**rule, "name": "loadBalancer"}
        while True:
            route = self.routes.get(bid)
            if route is not None:
                payload = {"block": bid, "instances": [dict(v) for v in route.views.values() if v["state"] == "ready"]}
                try:
                    out = await self.w.runtime.invoke(rule, f"{bid}.loadBalancer", {"action": "weights", "payload": payload})
                    chooser.set(out["weights"])
                    chooser.error = ""
                except PolicyFailed as exc:  # keep the last weights; tasks go on
                    chooser.error = exc.reason
                    log.warning("executor.weights_failed", block=bid, error=exc.reason)
            await asyncio.sleep(self.s.executor_weights_interval_s)

    async def scrape_loop(self, stop: asyncio.Event) -> None:
        """Engine queue figures of the instances of blocks whose policy may read them
        (builtin:least-queue and custom policies; round-robin and least-inflight never do)."""
        interval = self.s.executor_scrape_interval_s
        if interval <= 0:
            return
        timeout = aiohttp.ClientTimeout(total=max(0.05, interval))
        while not stop.is_set():
            jobs = []
            for route in list(self.routes.values()):
                if route.chooser.name in NO_METRICS:
                    continue
                for v in list(route.views.values()):
                    if v["state"] == "ready" and v["endpoint"]:
                        jobs.append(self._scrape(route, v, timeout))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def _scrape(self, route: Route, v: dict[str, Any], timeout: aiohttp.ClientTimeout) -> None:
        assert self.session is not None
        async with self.session.get(v["endpoint"] + "/metrics", timeout=timeout) as resp:
            if resp.status == 200:
                route.set_metrics(v["id"], parse_queue_metrics(await resp.text()))

    async def collected_loop(self, stop: asyncio.Event) -> None:
        """The metrics collector's latest instance samples (``state.metrics``) into the routes'
        views: the loadBalancer's input carries them as each instance's ``metrics``."""
        interval = self.s.metrics_interval_s
        while not stop.is_set():
            bids = list(self.routes)
            if bids:
                try:
                    latest = await self.w.store.metrics.instances_many(bids)
                except Exception as exc:  # Redis away for a moment: routes keep the last figures
                    log.warning("executor.metrics_read_failed", error=repr(exc))
                    latest = {}
                for bid, insts in latest.items():
                    route = self.routes.get(bid)
                    if route is not None:
                        for iid, sample in insts.items():
                            route.set_collected(iid, sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    # -- passive health (docs/health.md) ------------------------------------------------------------
    def new_outliers(self) -> Outliers:
        return Outliers(self.s.outlier_base_ejection_s, self.s.outlier_max_ejection_s, self.s.outlier_consecutive_5xx,
                        self.s.health_max_out_ratio)

    async def passive_loop(self, stop: asyncio.Event) -> None:
        """Write this executor's per-instance passive counts (errors, timeouts, ejections,
        in-flight and how long without a completion) where the health checker reads them."""
        interval = self.s.outlier_publish_s
        holder = f"executor-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        while not stop.is_set():
            per_block = {bid: r.outliers.snapshot(r.views) for bid, r in list(self.routes.items()) if r.views}
            try:
                await self.w.store.health.write_passive(holder, per_block, max(5.0, interval * 10))
            except Exception as exc:  # Redis away for a moment: the next tick writes again
                log.warning("executor.passive_write_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
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

    # -- dispatch -------------------------------------------------------------------------------
    async def dispatch(self, bid: str, method: str, path: str | None, body: bytes, headers: dict[str, str],
                       consume: Callable[[aiohttp.ClientResponse, dict[str, Any]], Awaitable[Any]]) -> Any:
        """Send one task to one instance of the block (admission, policy, retries) and hand the
        accepted response to ``consume``. Raises :class:`Refused` with the reason otherwise."""
        route = self.routes.get(bid)
        if route is None:
            self.unknown_tasks += 1
            if self.cluster is not None:
                raise Refused(404, f"block {bid!r} is not served here: this executor serves cluster {self.cluster} only")
            raise Refused(404, f"unknown block {bid!r}: no instance map (never placed, or deleted)")
        assert self.session is not None
        idempotent = _truthy(headers.get("Aios-Idempotent") or headers.get("aios-idempotent"))
        tmo = headers.get("Aios-Timeout-Ms") or headers.get("aios-timeout-ms")
        timeout_s = task_timeout_s(tmo) if tmo else self.s.executor_task_timeout_s
        target = path if path is not None else route.path
        fwd = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS and not k.lower().startswith("nats-")}
        task = {"method": method, "path": target, "bytes": len(body), "idempotent": idempotent,
                "content_type": headers.get("Content-Type") or headers.get("content-type") or ""}
        tried: set[str] = set()
        attempt, last = 0, ""
        while True:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if attempt == 0:
                deadline = now + timeout_s  # the task's whole budget: queue, every attempt, backoff
            if deadline - now <= 0:
                raise Refused(504, (f"{last}; " if last else "") + f"the task's time limit ({timeout_s * 1000:g} ms) ran out")
            v = await route.acquire(task, frozenset(tried), deadline)
            iid = v["id"]
            if v["inflight"] == 1:  # progress: since when this instance has work (executor.outlier)
                route.outliers.get(iid).busy_since = time.monotonic()
            t0 = time.perf_counter()
            retry, ok, outcome = False, False, ""
            try:
                async with self.session.request(method, v["endpoint"] + target, data=body, headers=fwd,
                                                timeout=aiohttp.ClientTimeout(total=max(0.001, deadline - loop.time()))) as resp:
                    outcome = "5xx" if resp.status >= 500 else "ok"
                    if resp.status in RETRY_STATUSES and idempotent and attempt < self.s.executor_retries:
                        await resp.read()
                        last, retry = f"instance {iid} answered {resp.status}", True
                    else:
                        ok = resp.status < 500
                        return await consume(resp, v)
            except aiohttp.ClientConnectorError as exc:  # never reached the instance: safe to try another
                ok, last, retry, outcome = False, f"instance {iid} unreachable: {exc}", True, "connect"
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok = False
                # a failure after the answer began (the caller went away mid-stream) says nothing of the instance
                if not outcome:
                    outcome = "timeout" if isinstance(exc, TimeoutError) else "reset"
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {type(exc).__name__}: {exc}"
                last = f"instance {iid} {what}"
                if not idempotent:
                    raise Refused(504 if isinstance(exc, TimeoutError) else 502,
                                  f"{last}; not retried (the task is not marked Aios-Idempotent: true)")
                retry = True
            finally:
                took = time.perf_counter() - t0
                route.release(v, took, ok)
                if outcome:
                    route.record(v, outcome, last, took)
            if not retry or attempt >= self.s.executor_retries:
                raise Refused(502, f"{last}; gave up after {attempt + 1} attempt(s)")
            attempt += 1
            tried.add(iid)
            route.retried += 1
            route.stats.retries += 1
            await asyncio.sleep(min(0.5, 0.01 * 2 ** attempt) * (0.5 + random.random()))

    def _gen(self, bid: str) -> int:
        route = self.routes.get(bid)
        return route.gen if route is not None else 0

    # -- NATS ingress ---------------------------------------------------------------------------
    async def on_task(self, tokens: dict[str, str], body: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        bid = tokens.get("bid", "")
        task_id, problem = task_id_of(headers)
        if problem:
            r = Refused(400, problem)
            return refusal_body(r), refusal_headers(r)

        async def read_all(resp: aiohttp.ClientResponse, v: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
            data = await resp.read()
            h = {"Aios-Status": str(resp.status), "Aios-Instance": v["id"], "Aios-Task-Id": task_id}
            ct = resp.headers.get("Content-Type")
            if ct:
                h["Content-Type"] = ct
            if bid in self.outputs_on:  # queued, not published: the reply goes first
                self.outputs.offer(bid, task_id, v["id"], resp.status, data, ct or "", gen=self._gen(bid))
            return data, h

        try:
            route = self.routes.get(bid)
            return await self.dispatch(bid, route.method if route else "POST", None, body, headers, read_all)
        except Refused as r:
            return refusal_body(r), {**refusal_headers(r), "Aios-Task-Id": task_id}

    # -- HTTP ingress ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/blocks/{bid}/tasks", self._http_task)
        app.router.add_route("*", "/blocks/{bid}/{tail:.*}", self._http_pass)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "blocks": len(self.routes)})

    async def _http_task(self, request: web.Request) -> web.StreamResponse:
        return await self._http(request, None)  # to the input protocol's path (and method)

    async def _http_pass(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        if request.query_string:
            path += "?" + request.query_string
        return await self._http(request, path)

    async def _http(self, request: web.Request, path: str | None) -> web.StreamResponse:
        bid = request.match_info["bid"]
        body = await request.read()
        task_id, problem = task_id_of(dict(request.headers))
        if problem:
            return web.Response(status=400, body=refusal_body(Refused(400, problem)), content_type="application/json",
                                headers={"Aios-Error": _clean(problem)})
        publish = bid in self.outputs_on and path is None  # outputs of tasks, not of pass-through calls

        async def stream(resp: aiohttp.ClientResponse, v: dict[str, Any]) -> web.StreamResponse:
            headers = {k: val for k, val in resp.headers.items()
                       if k.lower() not in HOP_HEADERS and k.lower() not in ("content-encoding", "date", "server")}
            headers["Aios-Instance"] = v["id"]
            headers["Aios-Task-Id"] = task_id
            ct = resp.headers.get("Content-Type", "")
            n = resp.content_length
            if n is not None and n <= SMALL_BODY:  # a small answer of known size: one write
                data = await resp.read()
                if publish:
                    self.outputs.offer(bid, task_id, v["id"], resp.status, data, ct, gen=self._gen(bid))
                return web.Response(status=resp.status, reason=resp.reason, body=data, headers=headers)
            out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=headers)
            if n is not None:
                out.content_length = n
            await out.prepare(request)
            kept, size, limit = bytearray(), 0, self.s.outputs_max_msg_bytes + 4
            async for chunk in resp.content.iter_any():  # streamed: each chunk as it comes
                await out.write(chunk)
                if publish:
                    size += len(chunk)
                    if len(kept) < limit:
                        kept += chunk[: limit - len(kept)]
            await out.write_eof()
            if publish:
                self.outputs.offer(bid, task_id, v["id"], resp.status, bytes(kept), ct, size=size, gen=self._gen(bid))
            return out

        try:
            route = self.routes.get(bid)
            method = route.method if path is None and route is not None else request.method
            return await self.dispatch(bid, method, path, body, dict(request.headers), stream)
        except Refused as r:
            h = {"Aios-Error": _clean(r.reason), "Aios-Task-Id": task_id}
            if r.retry_after_ms is not None:
                h["Retry-After-Ms"] = str(r.retry_after_ms)
                h["Retry-After"] = str(max(1, -(-r.retry_after_ms // 1000)))
            return web.Response(status=r.status, body=refusal_body(r), headers=h, content_type="application/json")

    # -- mapper ---------------------------------------------------------------------------------
    async def refill_maps(self) -> int:
        """The bucket was made anew by this process (lost with its stream, or deleted): every live
        block's map rebuilt from the state (``mapper.from_state``) where the bucket has none yet,
        so blocks already running answer tasks again without waiting for their next fact. A map a
        fact wrote meanwhile is newer and is kept. Returns the number of maps written."""
        n = 0
        try:
            for bid in await self.w.store.list_blocks(limit=1_000_000):
                block, insts = await self.w.store.block_view(bid)
                rebuilt = mapper.from_state(bid, block, insts, time.time())
                if rebuilt is not None and await self.maps.update(bid, _only_if_absent(rebuilt)):
                    n += 1
        except Exception as exc:  # the maps then come back with each block's next fact, as before
            log.warning("instance_map.refill_failed", error=repr(exc), refilled=n)
            return n
        log.info("instance_map.refilled", blocks=n)
        return n

    def mapper_binding(self) -> tuple[subjects.ConsumerSpec, Any]:
        router = Router(subjects.MAPPER)
        w = self.w
        #: one change of a block's map at a time in this process (its facts come in bursts: a gang
        #: of instances added together); other mapper copies are kept apart by compare-and-set
        locks: dict[str, asyncio.Lock] = {}

        async def apply(bid: str, decide: Callable[[dict[str, Any] | None, dict[str, Any] | None, float], dict[str, Any] | None],
                        need_block: bool = False) -> None:
            lock = locks.setdefault(bid, asyncio.Lock())
            try:
                async with lock:
                    block = await w.store.get_block(bid)
                    if need_block and block is None:
                        return
                    await self.maps.update(bid, lambda cur: decide(cur, block, time.time()))
            finally:
                if not lock.locked() and not getattr(lock, "_waiters", None):
                    locks.pop(bid, None)

        @router.on(E.block_placement)
        async def on_placement(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_placement(m.data, cur, b, now), need_block=True)

        @router.on(E.instance_added)
        async def on_added(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_added(m.data, cur, b, now)
                        if b is not None and int(b.get("gen", -1)) == m.data.gen else None, need_block=True)

        @router.on(E.node_instance_remove)
        async def on_remove(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_remove_command(m.data, cur, b, now))

        @router.on(E.instance_failed)
        @router.on(E.instance_unhealthy)
        async def on_failed(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_failed(m.data, cur, b, now))

        @router.on(E.instance_verdict)
        async def on_verdict(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_verdict(m.data, cur, b, now))

        @router.on(E.instance_removed)
        async def on_removed(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_removed(m.data, cur, b, now))

        @router.on(E.block_ready)
        async def on_ready(m: Inbound[Any]) -> None:
            await apply(m.data.block_id, lambda cur, b, now: mapper.on_ready(m.data, cur, b, now), need_block=True)

        @router.on(E.node_inventory)
        async def on_inventory(m: Inbound[Any]) -> None:
            # every block with instances recorded on the node: its map takes the node's new boot
            nid = m.tokens["nid"]
            if m.data.node_id != nid:
                return  # the body's node is a claim; the subject's is vouched for by the server
            bids = sorted({str(rec["block_id"]) for rec in (await w.store.node_instances(nid)).values()})
            for bid in bids:
                await apply(bid, lambda cur, b, now: mapper.on_inventory(m.data, cur, now))

        @router.on(E.block_deleted)
        async def on_deleted(m: Inbound[Any]) -> None:
            cur, _ = await self.maps.get(m.data.block_id)
            if cur is not None and int(cur.get("gen", 0)) <= m.data.gen:
                await self.maps.delete(m.data.block_id)

        return router.binding()

    # -- running --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, mapper_on: bool = True) -> None:
        from .base import run_consumers

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
                                             auto_decompress=False)
        runner: web.AppRunner | None = None
        collector = ExecutorCollector(lambda: self.routes, lambda: self.unknown_tasks)
        REGISTRY.register(collector)  # served by the worker's /metrics (workers/telemetry.py)
        watch = asyncio.get_running_loop().create_task(self.maps.watch(self.on_map, stop, self.map_ready))
        sub = None
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.map_ready.wait(), 10)
            if self.cluster is None:  # a pinned one answers its blocks' subjects (on_map)
                sub = await self.w.bus.serve(E.block_task, subjects.EXECUTOR_QUEUE, self.on_task)
            if self.s.executor_http_port:
                runner = web.AppRunner(self.app(), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, self.s.executor_http_host, self.s.executor_http_port, reuse_port=True)
                await site.start()
            log.info("executor.serving", http=self.s.executor_http_port, blocks=len(self.routes))
            jobs = [self.scrape_loop(stop), self.collected_loop(stop), self.passive_loop(stop), self.outputs.run(stop), stop.wait()]
            if mapper_on:
                jobs.append(run_consumers(self.w, [self.mapper_binding()], stop))
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
            await self.session.close()
            REGISTRY.unregister(collector)


def refusal_headers(r: Refused) -> dict[str, str]:
    h = {"Aios-Status": str(r.status), "Aios-Error": _clean(r.reason)}
    if r.retry_after_ms is not None:
        h["Retry-After-Ms"] = str(r.retry_after_ms)
    return h


def refusal_body(r: Refused) -> bytes:
    return msgspec.json.encode({"error": r.reason, "status": r.status, "retry_after_ms": r.retry_after_ms})


async def run(w: Worker, stop: asyncio.Event, cluster: str | None = None) -> None:
    await Executor(w, cluster).run(stop)


#: the longest time limit a task may ask for (``Aios-Timeout-Ms``): one day
MAX_TASK_TIMEOUT_MS = 86_400_000


def task_timeout_s(header: str) -> float:
    """The task's time limit from its ``Aios-Timeout-Ms`` header, in seconds: a number of
    milliseconds above 0 and at most a day (``inf``, ``nan``, ``0`` and negatives are refused
    with 400, not taken as "no time left" or as no limit)."""
    try:
        ms = float(header)
    except ValueError:
        raise Refused(400, f"Aios-Timeout-Ms must be a number of milliseconds, got {header!r}") from None
    if not (0 < ms <= MAX_TASK_TIMEOUT_MS):  # nan fails every comparison
        raise Refused(400, f"Aios-Timeout-Ms must be above 0 and at most {MAX_TASK_TIMEOUT_MS} (a day), got {header!r}")
    return ms / 1000


def _only_if_absent(new: dict[str, Any]) -> Callable[[dict[str, Any] | None], dict[str, Any] | None]:
    """A map change that writes ``new`` only where the block has no map (a fact's is newer)."""
    return lambda current: new if current is None else None
