"""Every worker's own ``/metrics`` for Prometheus (the process-wide ``prometheus_client`` registry:
the consumer runner's counters, the executor's figures, process CPU and memory), on
``AIOS_METRICS_HOST:AIOS_METRICS_PORT`` (port 0: a free one), announced in the metrics store
(``state.metrics``: a target that lapses unless refreshed), where the collector and
``blocks prometheus-config`` find it. One per process: a group process's kinds (``main.run_group``)
share the registry and announce one target, ``kind`` ``parser+gateway+metrics+autoscaler+checker`` with
``kinds`` listing them.

Served by a few lines of ``asyncio.start_server`` rather than aiohttp: a worker that needs no HTTP
otherwise (parser, gateway, controller, autoscaler) does not load aiohttp (~11 MiB per process,
docs/benchmarks.md "Idle footprint")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog
from prometheus_client import REGISTRY
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..runtime.ticker import Ticker
from ..schemas.records import MetricsTarget
from .base import Worker

log = structlog.get_logger("aios.telemetry")


#: how long a client may take to send its request line and headers
READ_TIMEOUT_S = 10.0


def response(head: bytes) -> bytes:
    """The answer to one request (its request line and headers): ``GET``/``HEAD /metrics`` -> the
    registry in the Prometheus text format; another path 404, another method 405. One request per
    connection (``Connection: close``)."""
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    if method not in (b"GET", b"HEAD"):
        status, ctype, body = b"405 Method Not Allowed", b"text/plain", b"405: Method Not Allowed"
    elif path != b"/metrics":
        status, ctype, body = b"404 Not Found", b"text/plain", b"404: Not Found"
    else:
        status, ctype, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), generate_latest(REGISTRY)
    headers = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (status, ctype, len(body))
    return headers if method == b"HEAD" else headers + body


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        with contextlib.suppress(Exception):  # a client that goes away or sends junk: just close
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            writer.write(response(head))
            await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def target_of(kind: str, kinds: list[str] | None, cluster: str | None, url: str) -> MetricsTarget:
    """This process's ``/metrics`` target, as ``serve`` announces it."""
    return {"id": f"{kind}-{socket.gethostname()}-{os.getpid()}", "kind": kind, "kinds": list(kinds or [kind]),
            "cluster": cluster or "", "url": url}


async def serve(w: Worker, kind: str, cluster: str | None, stop: asyncio.Event, kinds: list[str] | None = None) -> None:
    """Serve ``/metrics`` and keep this worker's target announced until ``stop``. A group process
    (``kinds``; ``kind`` is their ``+``-joined name) serves and announces one target: its kinds
    share the process's registry, so one scrape counts each series once."""
    s = w.settings
    if s.metrics_port < 0:
        return
    server = await asyncio.start_server(_handle, s.metrics_host, s.metrics_port)
    try:
        port = int(server.sockets[0].getsockname()[1])  # the port given, or the free one the system chose
        target = target_of(kind, kinds, cluster, f"http://{s.metrics_host}:{port}/metrics")
        log.info("telemetry.serving", url=target["url"])
        try:
            # Redis away for a moment: the registration lapses, then comes back
            await Ticker(s.metrics_target_ttl_s / 3, "telemetry.register_failed", log).run(
                lambda: w.store.metrics.register_target(target, s.metrics_target_ttl_s), stop)
        finally:
            with contextlib.suppress(Exception):
                await w.store.metrics.unregister_target(target)
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
