"""The Redis exchanges of the controller's ``added`` turn (docs/trace.md "The `added` turn in two
exchanges"), on real NATS JetStream and Redis: the block and its instance records are read in one
exchange; when they say that the instance running makes the block ready, the ready's announcement
mark and one script (the instance's status, then the ``ready`` step if as many run and the block has
those instances) go in the next one, the mark first. The outcome is the one of the three exchanges
before: the instance running at its endpoint, the block ready, ``ready`` stored once with every
instance, the mark gone once it is stored; a gang not yet running, a redelivery, records that
changed since the read, and an instance gone each end as before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.schemas.events import InstanceEvent
from aios_blocks.schemas.lifecycle import Step
from aios_blocks.settings import Settings
from aios_blocks.state.announce import ANNOUNCE
from aios_blocks.workers import controller, effects
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig
from .loop_tasks import tasks_made
from .test_create_exchanges import _noted

pytestmark = pytest.mark.integration

BID = "ad-1"
EP = "http://127.0.0.1:9"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "controller", Settings(sim_start_delay_s=0), ["c0"]) as got:
        yield got


def _rec(status: str = "starting", node: str = "c0-n0") -> dict[str, Any]:
    return {"node": node, "gpus": ["c0-g0"], "cluster": "c0", "status": status, "action": "allocation"}


async def _placing(w: Worker, n: int = 1, running: tuple[int, ...] = ()) -> None:
    await w.store.create_block(BID, 1, "d", {"status": "placing", "ir": make_ir(bid=BID, min_instances=n, max_instances=n),
                                             "attempt": "0", "cluster": "c0"})
    await w.store.put_instances(BID, {f"{BID}-{i}": _rec("running" if i in running else "starting") for i in range(n)})


async def _commit(w: Worker, step: Any) -> None:
    """A handler's turn as the runner takes it: its outbox committed, then its after-commit effects."""
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await step()
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    for effect in box.then:
        await effect()


async def _added(w: Worker, i: int = 0) -> None:
    ev = InstanceEvent(BID, 1, f"{BID}-{i}", "c0-n0", ["c0-g0"], endpoint=EP)
    subject = E.instance_added.subject(bid=BID, iid=ev.instance_id)
    await _commit(w, lambda: controller.on_added(w, Inbound(E.instance_added, ev, {}, Delivery(subject, b"", {}, 1, 20 + i))))


async def _readies(client: Client) -> list[list[str]]:
    """The instances each stored ``ready`` of the block lists."""
    return [msgspec.json.decode(b)["data"]["instances"] for s, b, _q, _t in await client.stream()
            if s == E.block_ready.subject(bid=BID)]


async def test_an_added_that_makes_its_block_ready_takes_two_exchanges(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _placing(w)
    seen = _noted(w)
    await _added(w)
    # the block and its records; then the mark and the one script (status, then the step); then,
    # once ready is stored, the mark's removal (after the commit, off the path)
    assert seen == [[("HGETALL", f"aios:block:{BID}"), ("HGETALL", f"aios:block:{BID}:inst")],
                    [("HSET", ANNOUNCE), ("EVALSHA", f"aios:block:{BID}:inst")],
                    [("HDEL", ANNOUNCE)]], seen
    block = await w.store.get_block(BID)
    assert block is not None and block["status"] == "ready", block
    assert await w.store.instances(BID) == {f"{BID}-0": {**_rec("running"), "endpoint": EP}}
    assert await _readies(client) == [[f"{BID}-0"]]
    assert await w.store.r.hlen(ANNOUNCE) == 0

    # delivered again: the same two exchanges, the step refused (ready already), ready published
    # again and deduplicated by the stream, the block's version unchanged
    seen.clear()
    await _added(w)
    assert [len(ex) for ex in seen] == [2, 2, 1], seen
    again = await w.store.get_block(BID)
    assert again is not None and again["status"] == "ready" and again["version"] == block["version"]
    assert await _readies(client) == [[f"{BID}-0"]]
    assert await w.store.r.hlen(ANNOUNCE) == 0


async def test_a_gang_is_ready_at_its_last_added_with_every_instance(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _placing(w, 2)
    seen = _noted(w)
    await _added(w, 0)  # one of two runs: the status only, no mark, no step
    assert seen == [[("HGETALL", f"aios:block:{BID}"), ("HGETALL", f"aios:block:{BID}:inst")],
                    [("EVALSHA", f"aios:block:{BID}:inst")]], seen
    assert (await w.store.get_block(BID))["status"] == "placing"  # type: ignore[index]
    seen.clear()
    await _added(w, 1)
    assert seen == [[("HGETALL", f"aios:block:{BID}"), ("HGETALL", f"aios:block:{BID}:inst")],
                    [("HSET", ANNOUNCE), ("EVALSHA", f"aios:block:{BID}:inst")],
                    [("HDEL", ANNOUNCE)]], seen
    assert (await w.store.get_block(BID))["status"] == "ready"  # type: ignore[index]
    assert await _readies(client) == [[f"{BID}-0", f"{BID}-1"]]


async def _decided_on_the_read(w: Worker) -> tuple[Any, Any]:
    """A one-instance block placing, its ``added`` decided on the block and instance records as
    the turn's first exchange read them: (the decision's effects, the records read)."""
    await _placing(w, 1)
    block, insts = await w.store.block_and_instances(BID)
    assert block is not None
    ev = InstanceEvent(BID, 1, f"{BID}-0", "c0-n0", ["c0-g0"], endpoint=EP)
    return lc.on_added(ev, lc.View(block, {f"{BID}-0": insts.one(f"{BID}-0")})), insts  # type: ignore[dict-item]


async def test_records_that_changed_since_the_read_decide_as_before(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    decided, insts = await _decided_on_the_read(w)
    # a second instance recorded after the read (a replacement): the script refuses the step; the
    # records it returns decide, and ready lists both
    await w.store.put_instances(BID, {f"{BID}-1": _rec("running", "c0-n1")})
    await _commit(w, lambda: effects.commit_added(w, decided, insts))
    assert (await w.store.get_block(BID))["status"] == "ready"  # type: ignore[index]
    assert await _readies(client) == [[f"{BID}-0", f"{BID}-1"]]
    assert await w.store.r.hlen(ANNOUNCE) == 0


async def test_an_instance_gone_since_the_read_changes_nothing(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    decided, insts = await _decided_on_the_read(w)
    await w.store.drop_instance(BID, f"{BID}-0")  # released meanwhile
    await _commit(w, lambda: effects.commit_added(w, decided, insts))
    assert (await w.store.get_block(BID))["status"] == "placing"  # type: ignore[index]
    assert await w.store.instances(BID) == {}
    assert await _readies(client) == []
    assert await w.store.r.hlen(ANNOUNCE) == 0


async def test_the_turn_gathers_no_task_of_its_own(rig: tuple[Worker, Client]) -> None:
    """The mark and the script go to Redis as one pipeline the store builds (``Store.set_status_then_ready``
    with its ``mark``; ``Store.mark_then_transition`` for a ready on its own), not as two calls
    gathered in tasks: the only tasks of the turn are the auto-pipeline's flushes, one per exchange."""
    w, client = rig
    await _placing(w)
    await w.bus.ids()  # the bus's event key, looked up once per process (a task of its own)
    seen = _noted(w)
    with tasks_made() as made:
        with outbox(defer=bool(w.bus.atomic_streams)) as box:
            ev = InstanceEvent(BID, 1, f"{BID}-0", "c0-n0", ["c0-g0"], endpoint=EP)
            subject = E.instance_added.subject(bid=BID, iid=ev.instance_id)
            await controller.on_added(w, Inbound(E.instance_added, ev, {}, Delivery(subject, b"", {}, 1, 20)))
            made_in_turn = list(made)
            made.clear()
            await effects._ready(w, BID, 1, "c0", Step.READY, [f"{BID}-0"])  # a ready alone: the mark, then the CAS
    assert made_in_turn == ["AutoPipelineRedis._flush"] * 2, made_in_turn
    assert made == ["AutoPipelineRedis._flush"], made
    assert seen == [[("HGETALL", f"aios:block:{BID}"), ("HGETALL", f"aios:block:{BID}:inst")],
                    [("HSET", ANNOUNCE), ("EVALSHA", f"aios:block:{BID}:inst")],
                    [("HSET", ANNOUNCE), ("EVALSHA", f"aios:block:{BID}")]], seen
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    for effect in box.then:
        await effect()
    assert (await w.store.get_block(BID))["status"] == "ready"  # type: ignore[index]
    assert await _readies(client) == [[f"{BID}-0"]]
    assert await w.store.r.hlen(ANNOUNCE) == 0  # both marks (one key: the same ready) settled once it is stored
