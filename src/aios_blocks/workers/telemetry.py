"""Every worker's own ``/metrics`` for Prometheus (the process-wide ``prometheus_client`` registry:
the consumer runner's counters, the executor's figures, process CPU and memory), on
``AIOS_METRICS_HOST:AIOS_METRICS_PORT`` (port 0: a free one), announced in the metrics store
(``state.metrics``: a target that lapses unless refreshed), where the collector and
``blocks prometheus-config`` find it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog
from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from .base import Worker

log = structlog.get_logger("aios.telemetry")


def metrics_app() -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve(w: Worker, kind: str, cluster: str | None, stop: asyncio.Event) -> None:
    """Serve ``/metrics`` and keep this worker's target announced until ``stop``."""
    s = w.settings
    if s.metrics_port < 0:
        return
    runner = web.AppRunner(metrics_app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, s.metrics_host, s.metrics_port).start()
        port = int(runner.addresses[0][1])  # the port given, or the free one the system chose
        target = {"id": f"{kind}-{socket.gethostname()}-{os.getpid()}", "kind": kind, "cluster": cluster or "",
                  "url": f"http://{s.metrics_host}:{port}/metrics"}
        log.info("telemetry.serving", url=target["url"])
        try:
            while not stop.is_set():
                try:
                    await w.store.metrics.register_target(target, s.metrics_target_ttl_s)
                except Exception as exc:  # Redis away for a moment: the registration lapses, then comes back
                    log.warning("telemetry.register_failed", error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), s.metrics_target_ttl_s / 3)
        finally:
            with contextlib.suppress(Exception):
                await w.store.metrics.unregister_target(target)
    finally:
        await runner.cleanup()
