"""``state.autopipeline.pack``: the gathered pipeline's commands packed by hiredis are the very
bytes redis-py would send, and whatever hiredis cannot pack goes to redis-py (with its errors)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from aios_blocks.state import autopipeline
from aios_blocks.state.autopipeline import pack

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "1eccbe4f32a55a999e68ef98853bc2e56c6147b2", 1, "aios:gather:b:1:0", "c3", '{"score": 0.5}', 1795795438.8990686, 30.0),
    ("HSET", "aios:block:b", "status", "ready", "gen", 7, "ir", "é ü 中"),
    ("SET", "k", -0.0), ("SET", "k", 1e20), ("SET", "k", 0.1), ("SET", "k", b"\x00\xff\r\n"),
    ("HGETALL", "aios:block:b"), ("ZADD", "aios:gather:due", 1.5, "m"),
    (b"GET", b"k"),
    ("SCRIPT LOAD", "return 1"),  # two words: redis-py splits the name
    ("SET", "k", memoryview(b"abc")),
]


def _bytes(packed: bytes | list[bytes]) -> bytes:
    return packed if isinstance(packed, bytes) else b"".join(bytes(p) for p in packed)


def test_hiredis_packs_exactly_what_redis_py_would_send() -> None:
    assert autopipeline._hiredis_pack is not None  # the fast path is the one under test
    conn = Connection()
    plain = COMMANDS[:9]
    assert isinstance(pack(conn, plain), bytes)  # hiredis packed them all
    assert pack(conn, plain) == _bytes(conn.pack_commands(plain))
    for cmd in COMMANDS:  # (the two-word name and the memoryview go to redis-py)
        assert _bytes(pack(conn, [cmd])) == _bytes(conn.pack_commands([cmd])), cmd
    assert _bytes(pack(conn, COMMANDS)) == _bytes(conn.pack_commands(COMMANDS))


def test_what_hiredis_refuses_gets_redis_pys_error() -> None:
    with pytest.raises(DataError):
        pack(Connection(), [("SET", "k", True)])
    with pytest.raises(DataError):
        pack(Connection(), [("SET", "k", None)])
