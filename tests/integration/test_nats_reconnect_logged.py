"""A process's NATS connection says when it loses its server and when it is back (``nats.disconnected``,
``nats.reconnected``, bus/connection.py): neither was logged by the workers or agents, so a log
showed a gap with no cause. A real nats-server, killed and started again on its port; the
connection's own close is not a disconnection said."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from aios_blocks.bus.connection import connect
from aios_blocks.runtime.embedded import free_port

from .test_cli_connection_lost import _start as _server  # a bare nats-server, once it accepts


async def _until(logs: list[dict[str, Any]], event: str) -> dict[str, Any]:
    async with asyncio.timeout(30):
        while True:
            got = [e for e in logs if e["event"] == event]
            if got:
                return got[0]
            await asyncio.sleep(0.05)


async def test_a_process_connection_logs_losing_its_server_and_reconnecting() -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    servers = [_server(port)]
    try:
        with structlog.testing.capture_logs() as logs:
            nc = await connect(url, name="test/reconnect")  # a process's: first_wait_s None
            servers[0].kill()
            servers[0].wait(timeout=10)
            said = await _until(logs, "nats.disconnected")
            assert said["url"] == url and said["log_level"] == "warning", said
            servers.append(_server(port))
            said = await _until(logs, "nats.reconnected")
            assert said["url"] == url and said["server"] == url, said
            await nc.close()
        assert [e["event"] for e in logs if e["event"].startswith("nats.")].count("nats.disconnected") == 1, logs
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
                s.wait()
