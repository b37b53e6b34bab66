"""Simulated instances that really serve HTTP: every simulated instance of a process is one
listening socket on 127.0.0.1 of one shared aiohttp server (one ``web.AppRunner``; per instance
the event loop's server on its socket, not an aiohttp site; a request finds its instance by the
local port it came in on), so 1,000 instances cost 1,000 sockets and a few small objects, not
1,000 servers.

Each answers like a real instance (``schemas.protocol``):

* ``POST {inputProtocol.path}`` (default ``/infer``): waits the service time, then answers
  ``200 {"instance_id", "output": <the task's JSON>}``, or ``500 {"error": ...}`` at the failure
  rate; a task ``{"stream": N}`` is answered as N chunked lines (for streaming tests);
  a task whose ``Aios-Instance`` header names another instance (an executor whose map is behind
  sent it to a port that now serves this one) is answered ``421 Misdirected Request`` unrun;
* ``GET /health``: 200 ``{"status": "ready"}`` (421 when its ``Aios-Instance`` names another instance);
* ``GET /metrics``: Prometheus text of ``instance.metrics.SystemMetrics`` (421, as a task, when its
  ``Aios-Instance`` names another instance: an executor's scrape meant for the one that left).

Behaviour comes from the block's ``initSettings`` and ``parameters`` (parameters win), key
``sim`` (or flat ``sim.<key>``): ``serviceTimeMs`` (mean, default 0), ``serviceJitterMs`` (uniform
+-, default 0), ``failureRate`` (0..1, default 0), ``maxConcurrency`` (tasks handled at once; more
wait in a queue and count as waiting; default 0 = unlimited); ``instances`` overrides them for
some instances, by index (the id's last ``-`` part) or id: ``{"instances": {"0": {"serviceTimeMs":
100}}}`` makes instance 0 of the block slow. With a ``maxConcurrency`` an
instance also reports ``aios_instance_kv_cache_usage_perc`` = running / maxConcurrency (a stand-in
for an engine's KV cache filling with its batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..instance.metrics import CONTENT_TYPE, SystemMetrics
from ..schemas.protocol import (
    HEALTH_PATH,
    INSTANCE_HEADER,
    INSTANCE_TOKEN_HEADER,
    METRICS_PATH,
    MISDIRECTED,
    UNAUTHORIZED,
    misdirected,
    task_path,
    unauthorized,
)
from ..schemas.records import JSONObject

#: the listen backlog of an instance's socket (aiohttp's default)
BACKLOG = 128


@dataclass
class SimBehaviour:
    path: str = "/infer"
    service_time_s: float = 0.0
    jitter_s: float = 0.0
    failure_rate: float = 0.0
    max_concurrency: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> SimBehaviour:
        """From an instance's environment (``node_agent.instance_env``: JSON strings)."""
        conf: JSONObject = {}
        for key in ("initSettings", "parameters"):
            d = _json_obj(env.get(key, ""))
            nested = d.get("sim")
            if isinstance(nested, dict):
                conf.update(nested)
            conf.update({k[4:]: v for k, v in d.items() if k.startswith("sim.")})
        # per-instance overrides: {"instances": {"<index>" or "<instance id>": {...}}}
        per = conf.get("instances")
        iid = env.get("AIOS_INSTANCE_ID", "")
        if isinstance(per, dict) and iid:
            for key in (iid.rsplit("-", 1)[-1], iid):
                mine = per.get(key)
                if isinstance(mine, dict):
                    conf.update(mine)
        proto = _json_obj(env.get("inputProtocol", ""))
        return cls(
            path=task_path(proto),
            service_time_s=_num(conf.get("serviceTimeMs"), 0.0, 0.0, 3_600_000.0) / 1000.0,
            jitter_s=_num(conf.get("serviceJitterMs"), 0.0, 0.0, 3_600_000.0) / 1000.0,
            failure_rate=_num(conf.get("failureRate"), 0.0, 0.0, 1.0),
            max_concurrency=int(_num(conf.get("maxConcurrency"), 0, 0, 1_000_000)),
        )


def _json_obj(raw: str) -> JSONObject:
    if not raw or raw == "{}":  # a block's settings, mostly
        return {}
    try:
        d = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _num(v: Any, default: float, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return default
    return min(max(float(v), lo), hi)


@dataclass
class SimInstance:
    instance_id: str
    behaviour: SimBehaviour
    port: int = 0
    metrics: SystemMetrics = field(default_factory=SystemMetrics)
    #: the event loop's server on the instance's socket
    server: asyncio.AbstractServer | None = None
    slots: asyncio.Semaphore | None = None
    #: what its tasks must carry (``Aios-Instance-Token``; its ``AIOS_INSTANCE_TOKEN``), "" none
    token: str = field(default="", repr=False)

    def service_time(self) -> float:
        b = self.behaviour
        if b.jitter_s:
            return max(b.service_time_s + random.uniform(-b.jitter_s, b.jitter_s), 0.0)
        return b.service_time_s


class SimServer:
    """The one HTTP server of every simulated instance in this process."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.by_port: dict[int, SimInstance] = {}
        self.by_id: dict[str, SimInstance] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    async def _ensure(self) -> web.AppRunner:
        if self._runner is None:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            # a task whose connection is gone (its requester gave up, or its instance was cut off
            # after the stop grace) stops too, as a killed process's would, instead of serving on
            runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
            await runner.setup()
            self._runner = runner
        return self._runner

    async def add(self, instance_id: str, behaviour: SimBehaviour, port: int = 0, token: str = "") -> SimInstance:
        """Serve ``instance_id`` on ``port`` (0: any free port); idempotent per id. ``token``: what
        its tasks must carry (as the instance SDK's, ``AIOS_INSTANCE_TOKEN``), "" any caller's."""
        async with self._lock:
            inst = self.by_id.get(instance_id)
            if inst is not None:
                return inst
            runner = await self._ensure()
            # a socket of our own, bound to the numeric host: ``TCPSite`` would resolve the host
            # through the event loop's resolver first (~60 us more per instance, a simulated
            # fleet's largest cost per start). Served by the loop's server with the runner's
            # protocol factory (what ``web.SockSite.start`` does), not by an aiohttp site: a site
            # registers in the runner's list, which every start and stop scans (``_reg_site``,
            # ``_unreg_site``: a cost per instance growing with the instances served) and names
            # itself by a URL it builds; nothing here reads either
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if port:  # a recorded port bound again (a restart: its old connections in TIME_WAIT)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                # any free port: without SO_REUSEADDR, which makes Linux's bind(0) look in the lower
                # half of the ephemeral range only (~7,000 ports of one parity there, then a search of
                # every port: 1.5-2 ms a bind past ~7,000 instances; without it, flat to ~12,000)
                sock.bind((self.host, port))
                # then set, before listen: the connections it accepts inherit it, so after a restart
                # the port is bound again over their TIME_WAIT (Linux checks both sides' flag)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.listen(BACKLOG)
                sock.setblocking(False)
                assert runner.server is not None
                server = await asyncio.get_running_loop().create_server(runner.server, sock=sock, backlog=BACKLOG)
            except BaseException:
                sock.close()
                raise
            actual = int(sock.getsockname()[1])
            inst = SimInstance(instance_id, behaviour, actual, server=server, token=token)
            if behaviour.max_concurrency:
                inst.slots = asyncio.Semaphore(behaviour.max_concurrency)
                inst.metrics.kv_cache_usage = 0.0
            inst.metrics.ready = True
            self.by_port[actual] = inst
            self.by_id[instance_id] = inst
            return inst

    async def remove(self, instance_id: str, grace_s: float | None = None) -> None:
        """Stop serving an instance. Its tasks in flight may finish within ``grace_s`` (a stopping
        process's SIGTERM grace), then their connections are cut, as the SIGKILL after the grace
        would (0: at once, a crash); ``None``: they may finish whenever they do."""
        inst = self.by_id.pop(instance_id, None)
        if inst is None:
            return
        self.by_port.pop(inst.port, None)
        if inst.server is not None:
            with contextlib.suppress(Exception):
                inst.server.close()  # no new connection (``web.BaseSite.stop``)
        # its open keep-alive connections end too (after the task in flight, as a stopping server's)
        for conn in self._connections(inst.port):
            if getattr(conn, "_request_in_progress", True) and grace_s != 0:
                conn.close()  # ends after the task it is answering
            else:
                conn.force_close()  # idle keep-alive (or a crash): gone now, as with a stopped process
        if grace_s:
            asyncio.get_running_loop().call_later(grace_s, self._cut, inst.port)

    def _connections(self, port: int) -> list[Any]:
        server = self._runner.server if self._runner is not None else None
        out = []
        for conn in list(server.connections) if server is not None else []:
            sock = conn.transport.get_extra_info("sockname") if conn.transport else None
            if sock and sock[1] == port:
                out.append(conn)
        return out

    def _cut(self, port: int) -> None:
        """The grace is over: what still answers on ``port`` (a hung task) is cut off."""
        if port in self.by_port:  # the port serves another instance since
            return
        for conn in self._connections(port):
            conn.force_close()

    async def close(self) -> None:
        for iid in list(self.by_id):
            await self.remove(iid)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        inst = self.by_port.get(int(sock[1])) if sock else None
        if inst is None:
            return web.json_response({"error": "no such instance (it was removed)"}, status=503)
        path = request.path
        probe = path == HEALTH_PATH and request.method == "GET"
        scrape = path == METRICS_PATH and request.method == "GET"
        task = path == inst.behaviour.path and request.method == "POST"
        why = misdirected(inst.instance_id, request.headers.get(INSTANCE_HEADER), "task" if task else "request")
        if (probe or scrape or task) and why:  # meant for the instance that left
            return web.json_response({"error": why, "instance_id": inst.instance_id}, status=MISDIRECTED,
                                     headers={INSTANCE_HEADER: inst.instance_id})
        if inst.token and not (probe or scrape):  # only the executors, with its token (the SDK's rule)
            if refused := unauthorized(inst.token, request.headers.get(INSTANCE_TOKEN_HEADER), "task" if task else "request"):
                return web.json_response({"error": refused}, status=UNAUTHORIZED, headers={"WWW-Authenticate": INSTANCE_TOKEN_HEADER})
        if probe:
            return web.json_response({"status": "ready", "instance_id": inst.instance_id})
        if scrape:
            return web.Response(body=inst.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})
        if task:
            return await self._task(inst, request)
        return web.json_response({"error": f"no route {request.method} {path}"}, status=404)

    async def _task(self, inst: SimInstance, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        m = inst.metrics
        body = await request.read()
        try:
            task = json.loads(body) if body else None
        except ValueError:
            task = None
        ok = False
        try:
            if inst.slots is not None:
                m.waiting += 1
                try:
                    await inst.slots.acquire()
                finally:
                    m.waiting -= 1
            m.running += 1
            if inst.slots is not None:
                m.kv_cache_usage = m.running / inst.behaviour.max_concurrency
            try:
                delay = inst.service_time()
                if delay:
                    await asyncio.sleep(delay)
                fail = inst.behaviour.failure_rate > 0 and random.random() < inst.behaviour.failure_rate
                if fail:
                    return web.json_response({"error": "simulated failure", "instance_id": inst.instance_id}, status=500)
                chunks = task.get("stream") if isinstance(task, dict) else None
                if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0:
                    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                    resp.enable_chunked_encoding()
                    await resp.prepare(request)
                    for n in range(min(chunks, 10_000)):
                        await resp.write(json.dumps({"instance_id": inst.instance_id, "chunk": n}).encode() + b"\n")
                    await resp.write_eof()
                    ok = True
                    return resp
                ok = True
                return web.json_response({"instance_id": inst.instance_id, "output": task})
            finally:
                m.running -= 1
                if inst.slots is not None:
                    m.kv_cache_usage = m.running / inst.behaviour.max_concurrency
                    inst.slots.release()
        finally:
            m.observe(time.perf_counter() - started, error=not ok)
