"""A worker given ``--cluster`` that names no registered cluster says so (``worker.unknown_cluster``,
a warning with the known clusters): `blocks worker autoscaler --cluster nope` served nothing,
unsaid. A warning, not a refusal: a worker may start before its cluster exists (a node agent's
``--cluster`` registers it when new). Real servers; the worker as `blocks worker` runs it."""

from __future__ import annotations

import asyncio
import logging

import structlog

from aios_blocks.runtime.main import run_worker

from .conftest import System


async def _said(system: System, cluster: str, logs: list[dict[str, object]]) -> list[dict[str, object]]:
    """What the worker for ``cluster`` warned (``logs``: the test's capture)."""
    stop = asyncio.Event()
    start = len(logs)
    run = asyncio.create_task(run_worker("autoscaler", system.supervisor.nats_url, system.supervisor.redis_url,
                                         cluster, stop=stop))
    try:
        async with asyncio.timeout(30):  # until it is past its start (its consumers or its warning)
            while not any(e["event"] in ("worker.unknown_cluster", "autoscaler.started") for e in logs[start:]) \
                    and not run.done():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    return [e for e in logs[start:] if e["event"] == "worker.unknown_cluster"]


async def test_a_worker_for_a_cluster_that_does_not_exist_warns_naming_the_known_ones(system: System) -> None:
    await system.client.add_sim_cluster("c1", nodes=1, gpus=1)
    # every level captured: a CLI command run in this process before (as in `make test`) leaves
    # structlog filtering below warning (cli.common), so the worker's info `autoscaler.started`,
    # which the wait below looks for, never came and the registered cluster's run waited out 30 s
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            said = await _said(system, "nope", logs)
            assert len(said) == 1 and said[0]["cluster"] == "nope" and said[0]["known"] == ["c1"], said
            assert said[0]["log_level"] == "warning" and "blocks cluster list" in str(said[0]["note"])
            assert await _said(system, "c1", logs) == []  # a registered one: nothing said
    finally:
        structlog.configure(**saved)
