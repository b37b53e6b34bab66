"""The relay's read of an event's generation (``workers.tenants._gen_of``, asked of every block
event in the gateway's process) reads ``data.gen`` alone, the rest skipped by a typed decoder
(docs/trace.md "Where a create's time goes"): the same answer as decoding the whole event, on
every event of a create and on bodies of any other shape."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.testing import MemorySystem
from aios_blocks.workers import tenants

ODD = [b"", b"not json", b"[1]", b"null", b"3", b'{"data": null}', b'{"data": 0}', b'{"data": ""}',
       b'{"data": {}}', b'{"data": {"gen": true}}', b'{"data": {"gen": 0}}', b'{"data": {"gen": -2}}',
       b'{"data": {"gen": 2.0}}', b'{"data": {"gen": "3"}}', b'{"data": {"gen": 7, "x": [1, {"gen": 9}]}}',
       b'{"gen": 5}', b'{"data": {"gen": 1}, "data": {"gen": 4}}', b'{"data": [1]}', b'{"data": "s"}']


def _answer(body: bytes, read: Any) -> Any:
    try:
        return read(body)
    except Exception as exc:  # the same failure (the relay logs it and relays nothing)
        return type(exc)


@pytest.mark.parametrize("body", ODD)
def test_an_odd_body_gets_the_whole_decodes_answer(body: bytes) -> None:
    assert _answer(body, tenants._gen_of) == _answer(body, tenants._gen_of_any)


async def test_every_event_of_a_create_gets_the_whole_decodes_answer() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()
        events = [m.data for m in s.bus.stream if m.subject.startswith("aios.block.")]
    assert len(events) >= 8
    gens = [tenants._gen_of(e) for e in events]
    assert gens == [tenants._gen_of_any(e) for e in events] and any(g for g in gens)


def test_the_relays_event_lookup_is_the_catalogs_match() -> None:
    from aios_blocks.bus.history import RELAYED, relayed

    subjects = [e.subject(**{t: f"x{i}" for i, t in enumerate(e.tokens)}) for e in RELAYED]
    subjects += [s.replace("x0", "b-1_a") for s in subjects]
    subjects += ["aios.block.b1.create", "aios.block.b1.task", "aios.block._invalid.rejected", "aios.block..parsed",
                 "aios.block.b1.instance..added", "aios.block.b1.instance.i1.added.x", "aios.block.b1", "aios.block",
                 "aios.block.b1.parsed.x", "aios.cluster.c1.allocation", "aios.block.b1.instance.i1", "aios.block.b1.",
                 "x.block.b1.parsed", "aios.block.b1.scale.target", "aios.block.b1.scale", ""]
    for s in subjects:
        assert tenants.relayed_event(s) is relayed(s), s
    assert all(tenants.relayed_event(e.subject(**{t: "a" for t in e.tokens})) is e for e in RELAYED)


async def test_the_relays_owner_read_is_the_records() -> None:
    """``TenantDesk._read_owner`` reads a block's ``gen`` and its IR's labels alone: the tenant and
    generation that the whole record (``Store.get_block``) gives, for a labelled block, a plain
    one, a missing one and records of other shapes."""
    from aios_blocks.state.keys import block_key

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        plain = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        team = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                               "labels": {"tenant": "team-a", "qos": "LS"}})
        await s.run()
        await s.store.r.hset(block_key("odd1"), mapping={"gen": "3", "ir": '{"labels": ["x"]}'})
        await s.store.r.hset(block_key("odd2"), mapping={"gen": "4", "ir": "[1, 2]"})
        await s.store.r.hset(block_key("odd3"), mapping={"status": "parsed"})
        await s.store.r.hset(block_key("odd4"), mapping={"gen": "5", "ir": '{"labels": {"tenant": ""}}'})
        desk = tenants.TenantDesk(s.worker)
        for bid in (plain, team, "missing", "odd1", "odd2", "odd3", "odd4"):
            block = await s.store.get_block(bid)
            whole: Any
            try:
                whole = (tenants.block_tenant(block),
                         int(block["gen"]) if block is not None and str(block.get("gen", "")).isdigit() else None)
            except Exception as exc:
                whole = type(exc)
            try:
                got: Any = await desk._read_owner(bid)
            except Exception as exc:
                got = type(exc)
            assert got == whole, bid
        assert (await desk._read_owner(team))[0] == "team-a" and (await desk._read_owner(plain))[0] is None
