"""The cuttable links of the partition suite (``links.py``): traffic passes, a cut drops the open
connections and refuses new ones, a heal lets new ones through again."""

from __future__ import annotations

import asyncio

import pytest

from .links import Links


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _roundtrip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1024), 5)
    finally:
        writer.close()


async def test_a_cut_link_drops_and_refuses_until_healed() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    links = Links()
    try:
        link = links.add(target, "test")
        assert await _roundtrip(link.port, b"hello") == b"hello"

        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"x")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), 5) == b"x"
        link.cut()
        # the open connection is gone: EOF or a reset, never an answer
        with pytest.raises((ConnectionError, AssertionError)):
            writer.write(b"y")
            await writer.drain()
            got = await asyncio.wait_for(reader.read(1), 5)
            assert got != b""  # EOF
        # a new one is refused (accepted and closed at once: nothing comes back)
        with pytest.raises(ConnectionError):
            got = await _roundtrip(link.port, b"again")
            if not got:
                raise ConnectionResetError("closed")
        assert link.refused >= 1

        link.heal()
        assert await _roundtrip(link.port, b"back") == b"back"
    finally:
        links.close()
        server.close()
