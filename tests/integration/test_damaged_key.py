"""A block record whose Redis key holds another kind than a hash (a damaged key: real servers, the
real CLI in its own process): `blocks get` and `blocks explain` printed a rich traceback of redis'
WRONGTYPE; `blocks check` crashed ("'str' object has no attribute 'get'") where its report should
name the key. Now: one line (exit 2) for the commands, a violation naming the key (exit 1) for the
check (a stranger's pass)."""

from __future__ import annotations

from aios_blocks.state.keys import block_key

from .conftest import System
from .test_dlq_replay import blocks
from .test_pending_queue import spec


async def test_a_damaged_block_key_is_one_line_and_a_violation_not_a_traceback(system: System) -> None:
    assert system.servers is not None
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait(spec("dk-1"))
    assert kind == "ready"
    await c.store.r.delete(block_key("dk-1"))
    await c.store.r.set(block_key("dk-1"), "not a hash")
    for args in (("get", "dk-1"), ("explain", "dk-1")):
        rc, out, errs = await blocks(system.servers, *args)
        said = " ".join((out + errs).split())
        assert rc == 2 and "Redis refused a command: WRONGTYPE" in said and "Traceback" not in said, (args, out, errs)
    rc, out, errs = await blocks(system.servers, "check")
    said = " ".join((out + errs).split())
    assert rc == 1 and "block dk-1: its Redis key holds a string, not a hash" in said and "Traceback" not in said, (out, errs)
