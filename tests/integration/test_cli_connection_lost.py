"""A command's NATS connection whose server goes away (`blocks down` under a `blocks watch` or a
`blocks submit --wait`): it keeps reconnecting, so a restart is waited out, but says the error once,
and once that it is back. It printed the same `nats.error` at every attempt, twice a second, until
the command's timeout (a `watch` for ever). A real nats-server, stopped and started again."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

from structlog.testing import capture_logs

from aios_blocks.bus.connection import RECONNECT_WAIT_S, connect
from aios_blocks.runtime.embedded import free_port, nats_binary


def _start(port: int) -> subprocess.Popen[bytes]:
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


async def test_a_commands_connection_says_a_lost_server_once_and_that_it_is_back() -> None:
    port = free_port()
    server = _start(port)
    try:
        with capture_logs() as logs:
            nc = await connect(f"nats://127.0.0.1:{port}", name="blocks-cli", first_wait_s=5)
            server.terminate()
            server.wait(timeout=10)
            await asyncio.sleep(RECONNECT_WAIT_S * 8)  # several attempts in vain (a pause, not a measure)
            errors = [e["error"] for e in logs if e["event"] == "nats.error"]
            # each error once (the connection's end, then the refused connect), however many attempts
            assert errors and len(errors) == len(set(errors)) <= 2, errors
            server = _start(port)
            async with asyncio.timeout(30):
                while not nc.is_connected:
                    await asyncio.sleep(0.05)
                while not any(e["event"] == "nats.reconnected" for e in logs):
                    await asyncio.sleep(0.05)
            await nc.close()
        assert [e["event"] for e in logs].count("nats.reconnected") == 1, logs
    finally:
        server.kill()
        server.wait()
