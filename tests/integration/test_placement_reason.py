"""Seed 004: a placement scriptlet's ``request.reason`` is the real one: ``evacuation`` for the
instances of a drained node, ``relocation`` for a user's reassign (and a dead node's or the health
checker's), ``new`` for a first placement. Real NATS JetStream and Redis, real workers, the seed's
example scriptlet (it logs ``targeting N for REASON instance NAME``)."""

from __future__ import annotations

from pathlib import Path

from aios_blocks.cli import nodes as ncli
from aios_blocks.cli.client import decisions_of
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import System
from .test_cli import blocks
from .test_vcluster import until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(bid: str) -> dict:
    return {
        "blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
        "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:lxd-reason"}}],
    }


async def _logs(system: System, bid: str) -> list[str]:
    return [text for s, e, _ in await system.client.history(bid) for d in decisions_of(s, e.get("data"))
            for level, text in d["logs"] if level == "info" and text.startswith("targeting ")]


async def test_scriptlet_sees_evacuation_for_a_drain_and_relocation_for_a_reassign(system: System) -> None:
    c = system.client
    await c.add_cluster(Cluster(id="rsn"))
    for n, mem in enumerate((512, 256, 128)):  # GiB: the scriptlet picks the most free memory
        await c.add_node(Node(id=f"rsn-n{n}", cluster="rsn", memory=mem * 1024, gpus=[Gpu(id=f"rsn-n{n}-g0")]))
    r = blocks(system, "policy", "add", "lxd-reason", str(EXAMPLES / "lxd_most_free_memory.star"))
    assert r.returncode == 0, r.stderr
    bid, kind, env = await system.submit_and_wait(_spec("rsn-b"))
    assert kind == "ready", env
    (iid, inst), = (await c.store.instances(bid)).items()
    assert inst["node"] == "rsn-n0"
    # the allocation only: a first round whose one candidate is the built-in clusterAllocator's
    # asks no dry_run (workers/gateway.skip_reason, since 42c2159)
    first = await _logs(system, bid)
    assert first == [f"targeting rsn-n0 for new instance {bid}"], first

    # drain its node: the replacement's scriptlet call says evacuation
    await ncli.drain(c, "rsn-n0")

    async def moved_to(node: str, old: str) -> bool:
        insts = await c.store.instances(bid)
        return old not in insts and [i["node"] for i in insts.values() if i["status"] == "running"] == [node]

    await until(lambda: moved_to("rsn-n1", iid), 60)
    logs = await _logs(system, bid)
    assert logs[len(first):] == [f"targeting rsn-n1 for evacuation instance {iid}"], logs

    # a user's reassign: relocation
    (iid2, _), = (await c.store.instances(bid)).items()
    await c.reassign(bid, iid2)
    await until(lambda: moved_to("rsn-n2", iid2), 60)
    logs = await _logs(system, bid)
    assert logs[len(first) + 1:] == [f"targeting rsn-n2 for relocation instance {iid2}"], logs

    # the reason is part of the reassignment's input, and the stream rebuilds it bit for bit
    async def recorded() -> list[dict]:
        return [d for d in await c.decisions(bid=bid) if d["action"] == "reassignment"]

    await until(lambda: _has(recorded, 2), 30)
    reasons = [(d["input"]["payload"]["reason"], d["input_check"]) for d in await recorded()]
    assert reasons == [("evacuation", "rebuilt"), ("requested", "rebuilt")], reasons


async def _has(get, n: int) -> bool:  # type: ignore[no-untyped-def]
    return len(await get()) >= n
