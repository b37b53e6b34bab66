"""Worker process entry: ``python -m aios_blocks.workers.main KIND`` (or ``blocks worker KIND``)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import structlog

from . import agent_sim, controller, gateway, parser, vcluster
from .base import EpochGuard, Worker, run_consumers, stop_on_signals

KINDS = ("parser", "gateway", "controller", "agent-sim")
log = structlog.get_logger("aios.worker")
WARM_TIMEOUT_S = float(os.environ.get("AIOS_WARM_TIMEOUT_S", 60))


def configure_logging() -> None:
    level = os.environ.get("AIOS_LOG_LEVEL", "info").upper()
    import logging

    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(message)s", stream=sys.stderr)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
    )


async def run_worker(kind: str, nats_url: str, redis_url: str, cluster: str | None = None, stop: asyncio.Event | None = None) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; one of {', '.join(KINDS)}")
    w = await Worker.open(nats_url, redis_url, kind)
    stop = stop or stop_on_signals()
    if kind == "parser":
        binds = parser.bindings(w)
    elif kind == "gateway":
        binds = gateway.bindings(w)
    elif kind == "controller":
        binds = controller.bindings(w, cluster) + controller.lifecycle_bindings(w) + vcluster.bindings(w)
    else:
        binds = agent_sim.bindings(w)
    if kind in ("gateway", "controller"):
        w.inventory.prefetch = True
        # like kube-scheduler's cache sync: load the inventory before taking work, so the first
        # placements do not each pay for reading a cluster (other copies serve meanwhile)
        await _warm(w, cluster)
    try:
        if kind == "controller":
            from .health import HealthMonitor

            await asyncio.gather(
                run_consumers(w, binds, stop), HealthMonitor(w).run(stop), vcluster.run_sweeps(w, stop, EpochGuard(w))
            )
        elif kind == "gateway":
            await asyncio.gather(run_consumers(w, binds, stop), gateway.run_timers(w, stop, EpochGuard(w)))
        else:
            await run_consumers(w, binds, stop)
    finally:
        await w.close()


async def _warm(w: Worker, cluster: str | None) -> None:
    started = time.perf_counter()
    try:
        nodes = await asyncio.wait_for(w.inventory.warm(cluster), WARM_TIMEOUT_S)
    except Exception as exc:  # a cold cache is only slower: never fail (or stall) the worker for it
        log.warning("inventory.warm_failed", error=repr(exc))
        return
    log.info("inventory.warm", nodes=nodes, seconds=round(time.perf_counter() - started, 3))


def main() -> None:
    configure_logging()
    kind = sys.argv[1]
    cluster = sys.argv[2] if len(sys.argv) > 2 else None
    nats_url, redis_url = os.environ["AIOS_NATS_URL"], os.environ["AIOS_REDIS_URL"]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_worker(kind, nats_url, redis_url, cluster))


if __name__ == "__main__":
    main()
