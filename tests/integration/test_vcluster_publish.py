"""Seed 003's "flush and publish" vs "flush without publishing", as a subscriber sees it: a dead
node replaced in an indivisible cluster is announced on ``aios.vcluster.{vid}.changed``; one
replaced in a divisible cluster is stored only (``aios.vcluster.{vid}.flushed``): never on the
``changed`` subjects, still in the stream, and ``blocks recover`` rebuilds both. Real NATS
JetStream and Redis, real workers, a third-party nats-py subscriber with the observer's login."""

from __future__ import annotations

from typing import Any

import msgspec
import nats
from nats.aio.msg import Msg

from aios_blocks.bus.nats_bus import security_options
from aios_blocks.recovery.invariants import check
from aios_blocks.state.vcluster import VClusterStore

from .conftest import System
from .test_vcluster import _stored, create, kill, typed_cluster, until


async def test_only_published_changes_reach_changed_subscribers(system: System) -> None:
    c = system.client
    url = system.servers.endpoints.nats_url("observer") if system.servers else system.supervisor.nats_url
    nc = await nats.connect(url, **security_options(url))
    every: list[tuple[str, dict[str, Any]]] = []  # aios.vcluster.>: what the stream stores, live
    published: list[dict[str, Any]] = []  # aios.vcluster.*.changed: what the seed calls published

    def into(out: list[Any], with_subject: bool) -> Any:
        async def cb(msg: Msg) -> None:
            data = msgspec.json.decode(msg.data)["data"]
            out.append((msg.subject, data) if with_subject else data)
        return cb

    try:
        await nc.subscribe("aios.vcluster.>", cb=into(every, True))
        await nc.subscribe("aios.vcluster.*.changed", cb=into(published, False))
        await nc.flush()
        await typed_cluster(c, "c1", a100=4)
        assert (await create(c, "I", "c1", {"A100": 1}))[0]  # c1-n0
        assert (await create(c, "D", "c1", {"A100": 1}, divisible=True))[0]  # c1-n1
        vs = VClusterStore(c.store)
        await kill(c, "c1", "c1-n0")  # indivisible: replaced, stored and published
        await kill(c, "c1", "c1-n1")  # divisible: replaced, stored only

        def replenished(vid: str) -> list[tuple[str, dict[str, Any]]]:
            return [(s, d) for s, d in every if d.get("vcluster_id") == vid and d.get("op") == "replenish"]

        async def both_announced() -> bool:
            return bool(replenished("I") and replenished("D"))

        await until(both_announced, 60)
        await nc.flush()
        i, d = await vs.get("I"), await vs.get("D")
        assert i is not None and "c1-n0" not in i.nodes and d is not None and "c1-n1" not in d.nodes

        (i_subject, i_data), = replenished("I")
        (d_subject, d_data), = replenished("D")
        assert i_subject == "aios.vcluster.I.changed" and i_data["record"]["nodes"] == i.nodes
        assert d_subject == "aios.vcluster.D.flushed" and d_data["published"] is False
        assert d_data["record"]["nodes"] == d.nodes and d_data["revision"] == d.revision
        # the subscriber to the published subjects: the creates and I's replenish, never D's
        async def i_published() -> bool:
            return any(e["vcluster_id"] == "I" and e["op"] == "replenish" for e in published)

        await until(i_published, 10)
        assert sorted((e["vcluster_id"], e["op"]) for e in published) == [("D", "create"), ("I", "create"), ("I", "replenish")]
    finally:
        await nc.close()

    # stored for the system's own history: the stream has it, and rebuilds Redis's state from it
    stored = [e async for e in _stored(c, "aios.vcluster.*.flushed")]
    assert [(e["vcluster_id"], e["op"], e["published"]) for e in stored] == [("D", "replenish", False)]
    rep = await check(c.bus, c.store)
    assert rep.ok and rep.redis_digest == rep.stream_digest, rep.violations + rep.diff
