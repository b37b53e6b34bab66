"""Make-before-break moves over real NATS JetStream and Redis with the real worker processes and
the simulated fleet's instances serving HTTP (docs/rebalance.md, "Moves"): a move under a steady
task load loses no task and the block never has fewer ready instances than minInstances; a move
to a full node fails and the old instance keeps serving; a request delivered twice is one move;
two requests at once respect the disruption budget; and a move between real instance processes
(the process runtime's agents) under load."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.handlers import moves as mv
from aios_blocks.schemas.moves import MoveRequested
from aios_blocks.state.moves import MoveStore

from .conftest import System
from .test_agent import Agents
from .test_cli import blocks
from .test_instance_sdk import ECHO


def _spec(bid: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": n, "maxInstances": n, **extra}


async def until(pred: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.05)


async def _steps(system: System, bid: str) -> list[tuple[str, dict[str, Any]]]:
    """The block's move events, in stream order: (step, payload)."""
    return [(s.rsplit(".", 1)[1], e["data"]) for s, e, _ in await system.client.history(bid, idle=0.3) if ".move." in s]


async def _over(system: System, bid: str, mid: str, timeout: float = 60) -> dict[str, Any]:
    ms = MoveStore(system.client.store.r)
    rec: dict[str, Any] | None = None

    async def done() -> bool:
        nonlocal rec
        rec = await ms.get(bid, mid)
        return rec is not None and rec["phase"] in ("completed", "failed")

    await until(done, timeout)
    assert rec is not None
    return rec


async def test_a_move_under_a_steady_task_load_loses_no_task_and_keeps_min_instances_ready(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("mv-a", nodes=3, gpus=1)
    bid, kind, env = await system.submit_and_wait(_spec("mv-load", 2, parameters={"sim": {"serviceTimeMs": 150}}))
    assert kind == "ready", env
    maps = InstanceMaps(c.bus)

    async def map_ready() -> int:
        m, _ = await maps.get(bid)
        return sum(1 for v in (m or {}).get("instances", {}).values() if v["state"] == "ready")

    await until(lambda: _is(map_ready, 2))
    insts = await c.store.instances(bid)
    old = f"{bid}-0"
    free = next(n for n in ("mv-a-n0", "mv-a-n1", "mv-a-n2") if n not in {r["node"] for r in insts.values()})

    stop = asyncio.Event()
    answers: list[tuple[int, str]] = []
    lowest = {"store": 99, "map": 99}

    async def load(k: int) -> None:  # tasks one after another, not marked idempotent: never retried on another instance
        n = 0
        while not stop.is_set():
            status, body, _ = await c.task(bid, json.dumps({"k": k, "n": n}).encode(), timeout=30)
            answers.append((status, json.loads(body).get("instance_id", "") if status == 200 else body.decode()))
            n += 1

    async def watch() -> None:  # ready instances, as the state and as the executors' map say
        while not stop.is_set():
            running = sum(1 for r in (await c.store.instances(bid)).values() if r["status"] == "running")
            lowest["store"] = min(lowest["store"], running)
            lowest["map"] = min(lowest["map"], await map_ready())
            await asyncio.sleep(0.02)

    workers = [asyncio.ensure_future(load(k)) for k in range(4)] + [asyncio.ensure_future(watch())]
    await until(lambda: _true(len(answers) >= 8))
    r = await asyncio.to_thread(blocks, system, "move", bid, old, "--to", free, "--wait", "--json", "--reason", "test: make room")
    n_during = len(answers)
    await until(lambda: _true(len(answers) >= n_during + 8))  # the load goes on on the new instance
    stop.set()
    await asyncio.gather(*workers)

    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    new = mv.new_instance_id(bid, out["move_id"])
    assert (out["status"], out["new_instance_id"], out["node"]) == ("completed", new, free)
    failed = [a for a in answers if a[0] != 200]
    assert not failed, failed  # no task lost or refused during the move
    assert {i for _, i in answers} >= {old, new}  # served before by the old one, after by the new one
    assert lowest == {"store": 2, "map": 2}, lowest  # never fewer ready than minInstances
    after = await c.store.instances(bid)
    assert old not in after and after[new]["node"] == free and len(await c.store.reservations("mv-a")) == 2
    steps = [s for s, _ in await _steps(system, bid)]
    assert steps == ["requested", "started", "switched", "completed"], steps
    x = await asyncio.to_thread(blocks, system, "explain", bid)
    assert f"move {out['move_id']} completed: {old}@" in x.stdout and "test: make room" in x.stdout, x.stdout


async def _is(f: Callable[[], Awaitable[int]], n: int) -> bool:
    return await f() == n


async def _true(v: bool) -> bool:
    return v


async def test_a_move_to_a_full_node_fails_and_the_old_instance_keeps_serving(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("mv-b", nodes=2, gpus=1)
    bid, kind, _ = await system.submit_and_wait(_spec("mv-full", 1))
    other, kind2, _ = await system.submit_and_wait(_spec("mv-filler", 1))
    assert kind == kind2 == "ready"
    before = await c.store.instances(bid)
    full = (await c.store.instances(other))[f"{other}-0"]["node"]
    r = await asyncio.to_thread(blocks, system, "move", bid, f"{bid}-0", "--to", full, "--wait")
    assert r.returncode == 3 and "move failed" in r.stderr and "no room for the new instance" in r.stderr, r.stdout + r.stderr
    assert await c.store.instances(bid) == before  # untouched: still running where it was
    assert len(await c.store.reservations("mv-b")) == 2
    status, body, _ = await c.task(bid, b"{}", timeout=30)
    assert status == 200 and json.loads(body)["instance_id"] == f"{bid}-0"
    assert [s for s, _ in await _steps(system, bid)] == ["requested", "failed"]


async def test_a_request_delivered_twice_is_one_move(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("mv-c", nodes=3, gpus=1)
    bid, kind, _ = await system.submit_and_wait(_spec("mv-twice", 1))
    assert kind == "ready"
    req = MoveRequested(bid, "twice-1", f"{bid}-0", reason="test", requested_by="test")
    # two messages (the second one's id differs): the controller is handed the same move twice
    await c.bus.emit(E.block_move_requested, req)
    await c.bus.emit(E.block_move_requested, req, qualifier="again")
    rec = await _over(system, bid, "twice-1")
    assert rec["phase"] == "completed", rec
    await asyncio.sleep(1.0)  # the second delivery handled too (it finds the move decided)
    assert set(await c.store.instances(bid)) == {mv.new_instance_id(bid, "twice-1")}
    steps = [s for s, _ in await _steps(system, bid)]
    assert steps.count("started") == 1 and steps.count("completed") == 1 and "failed" not in steps, steps
    assert len(await c.store.reservations("mv-c")) == 1


async def test_two_requests_at_once_respect_the_disruption_budget(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("mv-d", nodes=4, gpus=1)
    bid, kind, _ = await system.submit_and_wait(_spec("mv-budget", 2))
    assert kind == "ready"
    await asyncio.gather(*(c.bus.emit(E.block_move_requested, MoveRequested(bid, f"b-{i}", f"{bid}-{i}", reason="test"))
                           for i in range(2)))
    recs = [await _over(system, bid, f"b-{i}") for i in range(2)]
    assert sorted(r["phase"] for r in recs) == ["completed", "failed"], recs
    (refused,) = [r for r in recs if r["phase"] == "failed"]
    assert refused["why"] == "disruption budget: 1 of the block's moves open, maxMoving 1"
    open_now, most = 0, 0  # never two moving at once, in the stream's order
    for step, _ in await _steps(system, bid):
        open_now += {"started": 1, "completed": -1}.get(step, 0)
        most = max(most, open_now)
    assert most == 1
    assert len(await c.store.instances(bid)) == 2 and len(await c.store.reservations("mv-d")) == 2


@pytest.fixture
async def proc_agents(system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    a = Agents(system, "process", tmp_path)
    try:
        yield a
    finally:
        a.stop_all()
        rt = a.runtime()
        for nid in list(a.procs):
            for inst in await rt.list(nid):
                await rt.stop(inst.handle, 0)


async def test_a_move_between_real_process_instances_under_load_loses_no_task(proc_agents: Agents) -> None:
    """The same under the process runtime: two `blocks agent --runtime process` nodes, the SDK's
    echo instance as a real process, moved from one node to the other while tasks flow."""
    a = proc_agents
    c = a.system.client
    for nid in ("n1", "n2"):
        a.start(nid)
    for nid in ("n1", "n2"):
        await a.wait_registered(nid)
    await c.add_component(ECHO)
    bid, kind, env = await a.system.submit_and_wait(
        {"blockId": "mv-proc", "blockComponentURI": "aios://test/echo-sdk", "minInstances": 1, "maxInstances": 1}, timeout=120)
    assert kind == "ready", env
    stop = asyncio.Event()
    answers: list[tuple[int, str]] = []

    async def load(k: int) -> None:
        n = 0
        while not stop.is_set():
            status, body, _ = await c.task(bid, json.dumps({"k": k, "n": n}).encode(), timeout=30)
            answers.append((status, json.loads(body).get("instance_id", "") if status == 200 else body.decode()))
            n += 1

    workers = [asyncio.ensure_future(load(k)) for k in range(3)]
    await until(lambda: _true(len(answers) >= 10), 90)
    # the instance as it is now (read late: one that failed a probe on the loaded machine was replaced)
    old, rec = next((i, r) for i, r in (await c.store.instances(bid)).items() if r["status"] == "running")
    to = "n2" if rec["node"] == "n1" else "n1"
    r = await asyncio.to_thread(blocks, a.system, "move", bid, old, "--to", to, "--wait", "--json", timeout=150)
    n_during = len(answers)
    await until(lambda: _true(len(answers) >= n_during + 10), 90)
    stop.set()
    await asyncio.gather(*workers)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert (out["status"], out["node"]) == ("completed", to)
    assert not [x for x in answers if x[0] != 200], [x for x in answers if x[0] != 200]
    assert {old, out["new_instance_id"]} <= {i for _, i in answers}
    assert list(await c.store.instances(bid)) == [out["new_instance_id"]]
    assert not [i for i in await a.runtime().list(rec["node"]) if i.running]  # the old process stopped
