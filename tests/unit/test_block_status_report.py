"""The payload of block.ready / block.failed / block.deleted is ``BlockStatusReport``, named apart
from the lifecycle's ``BlockStatus`` enum (issue 35: one ``BlockStatus``), and its wire format is
the one the stream already holds: a rename of the class, not of a field."""

from __future__ import annotations

import msgspec

from aios_blocks.schemas import events, lifecycle
from aios_blocks.schemas.catalog import E

#: block.ready as encoded before the rename (at 9528d23, ``events.BlockStatus``)
READY = b'{"block_id":"b1","gen":7,"status":"ready","reason":"","cluster_id":"c1","instances":["b1-0","b1-1"]}'
FAILED = b'{"block_id":"b2","gen":1,"status":"failed","reason":"no room","cluster_id":"","instances":[]}'


def test_the_encoded_bytes_are_unchanged() -> None:
    ready = events.BlockStatusReport("b1", 7, "ready", cluster_id="c1", instances=["b1-0", "b1-1"])
    failed = events.BlockStatusReport(block_id="b2", gen=1, status="failed", reason="no room")
    assert msgspec.json.encode(ready) == READY
    assert msgspec.json.encode(failed) == FAILED
    assert msgspec.json.decode(READY, type=events.BlockStatusReport) == ready
    assert msgspec.json.decode(FAILED, type=events.BlockStatusReport) == failed


def test_the_catalog_s_status_events_carry_it() -> None:
    for e in (E.block_ready, E.block_failed, E.block_deleted):
        assert e.payload is events.BlockStatusReport


def test_one_block_status() -> None:
    """``BlockStatus`` names the lifecycle enum only; the report's ``status`` is one of its values."""
    assert not hasattr(events, "BlockStatus")
    assert events.BlockStatusReport("b", 1, lifecycle.BlockStatus.READY).status == "ready"
