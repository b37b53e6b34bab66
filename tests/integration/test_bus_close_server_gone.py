"""Closing a bus whose NATS server died first (issue 32, item 16: a SIGKILLed `blocks up` takes its
servers down with its workers; each worker then closed its bus, and nats-py, writing what it had
buffered to the dead connection, raised uvloop's "the handler is closed", a traceback in
controller-0.log). A real nats-server, killed; the workers' event loop (uvloop)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import uvloop

from aios_blocks.bus.nats_bus import Bus
from aios_blocks.runtime.embedded import free_port, nats_binary


async def _close_after_the_server_died(url: str, server: subprocess.Popen[bytes]) -> None:
    bus = await Bus.open(url, source="test/close", first_wait_s=10)
    server.kill()
    server.wait(timeout=10)
    async with asyncio.timeout(30):  # the client sees the connection go (then reconnects, in vain)
        while not bus.nc.is_reconnecting:
            await asyncio.sleep(0.05)
    await bus.nc.publish("aios.test.buffered", b"x")  # buffered while reconnecting: written at close
    await bus.close()
    assert bus.nc.is_closed


def test_closing_a_bus_after_its_server_was_killed_raises_nothing() -> None:
    port = free_port()
    server = subprocess.Popen([nats_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_close_after_the_server_died(f"nats://127.0.0.1:{port}", server))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
