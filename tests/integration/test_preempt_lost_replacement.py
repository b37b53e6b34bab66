"""A preemptor whose instance is lost keeps its room (docs/priority.md "A short block's room").

A high-priority block ``hi`` preempted ``lo`` (which waits again, as a victim) on a one-GPU cluster;
then the simulated fleet restarts (``blocks down`` / ``blocks up``: its instances die with it) and
its inventory has ``hi``'s instance ``lost``. The replacement fits nowhere beside the lost
instance's reservation, so the reservation is released and the reconciler asks for the instance
``hi`` is short of. That release is a capacity event: the queue walker gave the GPU to ``lo`` (it
waits, ``hi`` does not), and ``hi`` stayed ``ready`` short of its only instance for good (a short
block never preempts). Now the room stays ``hi``'s while its instance is replaced. Real NATS,
Redis and worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.schemas.priority import PriorityClassRegistered
from aios_blocks.state.priority import PriorityStore

from .conftest import COMPONENT
from .test_agent_restart_inventory import Sys, sys_  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration


def spec(bid: str, **extra: Any) -> dict[str, Any]:
    return {"blockComponentURI": COMPONENT["componentURI"], "blockId": bid, "minInstances": 1, "maxInstances": 1,
            "parameters": {"sim": {"serviceTimeMs": 5}}, **extra}


async def status_of(s: Sys, bid: str, want: str, timeout: float = 60) -> dict[str, Any]:
    block: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                block = await s.client.store.get_block(bid)  # type: ignore[assignment]
                if block is not None and block["status"] == want:
                    return block
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{bid} is not {want}: {block and {k: v for k, v in block.items() if k != 'ir'}}") from None


async def running(s: Sys, bid: str) -> list[str]:
    return sorted(i for i, r in (await s.client.store.instances(bid)).items() if r["status"] == "running")


async def test_a_preemptor_whose_instance_is_lost_gets_its_room_back_not_its_victim(sys_: Sys) -> None:  # noqa: F811
    c = sys_.client
    record = {"name": "high", "value": 1000, "default": False, "description": ""}
    await c.bus.emit(E.priority_class_registered, PriorityClassRegistered("high", record), msg_id="priorityclass:test-high")
    await PriorityStore(c.store.r).put_class(record)
    await c.add_sim_cluster("c0", nodes=1, gpus=1)
    await c.submit(spec("lo"))
    assert (await c.wait("lo", 60))[0] == "ready"
    await c.submit(spec("hi", priorityClass="high"))
    assert (await c.wait("hi", 60))[0] == "ready"  # it preempted lo
    lo = await status_of(sys_, "lo", "pending")
    assert lo.get("preempted_by") == "hi"
    (old,) = await running(sys_, "hi")

    (pid,) = sys_.sup.pids("agent-sim")
    os.kill(pid, signal.SIGKILL)  # the restart: the simulated instances die with the fleet
    # the restarted fleet reports hi's instance lost; hi gets an instance again, lo waits
    async with asyncio.timeout(120):
        while True:
            now = await running(sys_, "hi")
            if now and old not in now:
                break
            assert not await running(sys_, "lo"), "the victim took the room of the preemptor's lost instance"
            await asyncio.sleep(0.2)
    # and it stays so: lo waits (the walker's passes and the reconciler's see hi whole)
    await asyncio.sleep(3)
    assert (await c.store.get_block("lo") or {})["status"] == "pending"
    assert not await running(sys_, "lo")
    hi = await c.store.get_block("hi") or {}
    assert hi["status"] == "ready" and not hi.get("short"), hi.get("short")
