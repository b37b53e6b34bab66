"""A process's NATS connection says when it loses its server and when it is back (``nats.disconnected``,
``nats.reconnected``, bus/connection.py): neither was logged by the workers or agents, so a log
showed a gap with no cause. A real nats-server, killed and started again on its port; the
connection's own close is not a disconnection said."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from typing import Any

import structlog

from aios_blocks.bus.connection import connect
from aios_blocks.runtime.embedded import free_port, nats_binary


def _server(port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen([nats_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:  # until it accepts connections
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)


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
