"""The Redis exchanges of a create's path (docs/trace.md "Fewer Redis exchanges on a create's
path"), on real NATS JetStream and Redis: reads and writes of a step that do not depend on each
other go to Redis in one exchange (``state.autopipeline`` gathers the commands of one turn of the
event loop), in the order the step needs, and the step's outcome is the same.

Each exchange a worker's client sends is noted (the command names and first keys, in order) by
wrapping the client's ``_exchange``: the real client, the real server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import AllocationRequest, Parsed
from aios_blocks.schemas.lifecycle import Step
from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.settings import Settings
from aios_blocks.state.announce import ANNOUNCE
from aios_blocks.workers import controller, effects, gateway
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir

pytestmark = pytest.mark.integration

BID = "ex-1"

Exchanges = list[list[tuple[str, str]]]


def _noted(w: Worker) -> Exchanges:
    """Note each exchange of ``w``'s Redis client: [(command, first key or script's first key)]."""
    r: Any = w.store.r
    seen: Exchanges = []
    real = r._exchange

    async def exchange(commands: list[Any]) -> list[Any]:
        names = []
        for args, _opts in commands:
            name = str(args[0]).upper()
            key = str(args[3]) if name == "EVALSHA" and len(args) > 3 else str(args[1]) if len(args) > 1 else ""
            names.append((name, key))
        seen.append(names)
        return await real(commands)

    r._exchange = exchange
    return seen


def _with(seen: Exchanges, *wanted: tuple[str, str]) -> list[tuple[str, str]]:
    """The one exchange that holds every command of ``wanted`` (``(name, key prefix)``)."""
    hits = [ex for ex in seen if all(any(n == name and k.startswith(key) for n, k in ex) for name, key in wanted)]
    assert len(hits) == 1, (wanted, seen)
    return hits[0]


def _first(ex: list[tuple[str, str]], name: str, key: str) -> int:
    return next(i for i, (n, k) in enumerate(ex) if n == name and k.startswith(key))


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Worker, Client]]:
    servers = EmbeddedServers(data_dir=tmp_path).start()
    gw = await Worker.open(servers.nats_url, servers.redis_url, "gateway", settings=Settings())
    ctl = await Worker.open(servers.nats_url, servers.redis_url, "controller", settings=Settings())
    client = await Client.open(servers.nats_url, servers.redis_url)
    await client.add_cluster(Cluster(id="c0"))  # the only candidate: the round asks no dry_run
    await client.add_node(Node(id="c0-n0", cluster="c0", gpus=[Gpu(id="c0-g0")]))
    try:
        yield gw, ctl, client
    finally:
        await client.close()
        await gw.close()
        await ctl.close()
        servers.stop()


async def _run(w: Worker, handler: Any, m: Any) -> None:
    """A handler as the consumer runner runs it: its outbox committed, then its after-commit effects."""
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await handler(w, m)
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    for f in box.pending:
        await f
    for effect in box.then:
        await effect()


async def test_a_create_s_gateway_and_controller_steps_share_their_independent_exchanges(
        rig: tuple[Worker, Worker, Client]) -> None:
    gw, ctl, client = rig
    ir = make_ir(bid=BID)
    await gw.store.create_block(BID, 1, "d", {"status": "parsed", "ir": ir, "attempt": "0"})
    g_seen = _noted(gw)
    parsed = Parsed(BID, 1, ir, 0)
    await _run(gw, gateway.on_parsed, Inbound(E.block_parsed, parsed, {}, Delivery(E.block_parsed.subject(bid=BID), b"", {}, 1, 7)))
    # the selection step's CAS and the quotas: one exchange
    _with(g_seen, ("EVALSHA", "aios:block:"), ("HGETALL", "aios:quotas"))
    # the skipped dry run: its timer armed and its answer recorded in one exchange, the timer first
    ex = _with(g_seen, ("ZADD", "aios:gather:due"), ("EVALSHA", "aios:gather:"))
    assert _first(ex, "ZADD", "aios:gather:due") < _first(ex, "EVALSHA", "aios:gather:")
    block = await ctl.store.get_block(BID)
    assert block is not None and block["status"] == "allocating" and block["cluster"] == "c0", block

    c_seen = _noted(ctl)
    req = AllocationRequest(BID, 1, "c0", 0)
    await _run(ctl, controller.on_allocation,
               Inbound(E.cluster_allocation, req, {}, Delivery(E.cluster_allocation.subject(cid="c0"), b"", {}, 1, 9)))
    # the block, the suspect nodes and the nominees: one exchange
    _with(c_seen, ("HGETALL", "aios:block:"), ("HGETALL", "aios:health:suspect"), ("HGETALL", "aios:meta:queue:nominated"))
    # after the plan's reads, one write: the gang's reservation with the block's step, the instance
    # records and the nomination's drop, one script on one Redis server (Store.reserve_then_start)
    writes = [ex for ex in c_seen if any(n == "EVALSHA" for n, _k in ex)]
    assert writes == [[("EVALSHA", "aios:{c:c0}:node:c0-n0")]], c_seen
    block = await ctl.store.get_block(BID)
    assert block is not None and block["status"] == "placing", block
    insts = await ctl.store.instances(BID)
    assert [(i["node"], i["gpus"]) for i in insts.values()] == [("c0-n0", ["c0-g0"])]
    stored = [s for s, _b, _q, _t in await client.stream()]
    assert stored.index(E.block_selection.subject(bid=BID)) < stored.index(E.block_post_dry_run.subject(bid=BID)) \
        < stored.index(E.cluster_allocation.subject(cid="c0")) < stored.index(E.block_placement.subject(bid=BID))

    # the block ready: the announcement's mark and the CAS in one exchange, the mark first
    iid = next(iter(insts))
    await ctl.store.set_instance_status(BID, iid, "running")
    c_seen.clear()
    with outbox(defer=bool(ctl.bus.atomic_streams)) as box:
        await effects._ready(ctl, BID, 1, "c0", Step.READY, [iid])
    ex = _with(c_seen, ("HSET", ANNOUNCE), ("EVALSHA", "aios:block:"))
    assert _first(ex, "HSET", ANNOUNCE) < _first(ex, "EVALSHA", "aios:block:")
    assert await ctl.store.r.hlen(ANNOUNCE) == 1  # marked until the ready is stored
    assert await ctl.bus.commit([box.deferred], 10.0) == [""]
    for effect in box.then:
        await effect()
    assert await ctl.store.r.hlen(ANNOUNCE) == 0
    block = await ctl.store.get_block(BID)
    assert block is not None and block["status"] == "ready", block
    assert E.block_ready.subject(bid=BID) in [s for s, _b, _q, _t in await client.stream()]
