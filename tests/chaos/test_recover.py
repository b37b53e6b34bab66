"""Redis is rebuilt from the stream: after a real flow (placed, scaled, deleted, rejected, failed)
the rebuilt state has the same canonical digest as the live one."""

from __future__ import annotations

import asyncio

from aios_blocks.recovery import image as im
from aios_blocks.recovery.invariants import check
from aios_blocks.recovery.rebuild import RecoverRefused, drop_project_keys, read_image, recover, state_digest

from ..integration.conftest import System
from .conftest import explain, settled_check, spec


async def _until(pred, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.05)


async def test_flow_then_flush_then_recover_gives_the_same_digest(chaos: System) -> None:
    c = chaos.client
    await c.add_sim_cluster("c0", nodes=2, gpus=4)
    await c.add_sim_cluster("c1", nodes=2, gpus=2, labels={"zone": "b"})
    await c.policy_put("boom", "class Boom:\n    def __init__(self, r, s, p):\n        pass\n"
                       "    def eval(self, p, i, c):\n        raise RuntimeError('no')\n", "python")
    bids = {}
    for name, s in {
        "a": spec(minInstances=2, maxInstances=3),
        "b": spec(),
        "gone": spec(),
        "bad": {**spec(), "colour": "blue"},
        "boom": {**spec(), "policyRulesSpec": [{"name": "resourceAllocator", "policyRuleURI": "registry:boom"}]},
        "shared": {**spec(), "resources": {"gpus": 1, "gpuMemory": 1000, "cpu": 0.5, "memory": 10},
                   "policyRulesSpec": [{"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": {"gpuSharing": True}}]},
    }.items():
        bid, kind, env = await chaos.submit_and_wait({**s, "blockId": f"blk-{name}"})
        bids[name] = (bid, kind)
    assert {n: k for n, (_, k) in bids.items()} == {
        "a": "ready", "b": "ready", "gone": "ready", "bad": "rejected", "boom": "failed", "shared": "ready"
    }
    await c.scale("blk-a")
    await c.delete("blk-gone")

    async def settled() -> bool:
        a = await c.store.instances("blk-a")
        gone = await c.store.get_block("blk-gone")
        return len(a) == 3 and all(i["status"] == "running" for i in a.values()) and gone["status"] == "deleted"

    await _until(settled)
    # a target below what it runs: one instance chosen (scale_down), drained, removed; the desired
    # count and the choice are rebuilt from the stream too
    ok, why = await c.wait_scaled(await c.scale_to("blk-a", 2, reason="chaos"), 60)
    assert ok, why
    # the simulated instances serve: their endpoints are part of the state the stream must rebuild
    assert all(i["endpoint"].startswith("http://127.0.0.1:") for i in (await c.store.instances("blk-a")).values())
    expected = {b for b, _ in bids.values()}
    rep = await settled_check(c, expected)
    assert rep.ok, explain(rep)
    before = await state_digest(c.store)
    assert before == rep.redis_digest == rep.stream_digest

    # the project's keys only: a foreign key survives
    await c.store.r.set("not-ours", "1")
    with_refusal = False
    try:
        await recover(c.bus, c.store)
    except RecoverRefused:
        with_refusal = True
    assert with_refusal  # Redis is not empty: recover refuses without --force
    dropped = await drop_project_keys(c.store.r)
    assert dropped > 10 and await state_digest(c.store) != before
    report = await recover(c.bus, c.store)
    assert report.digest == before
    assert await state_digest(c.store) == before
    assert await c.store.r.get("not-ours") == "1"
    assert report.anomalies == []

    # the rebuilt state is live: the workers carry on from it
    _, kind, _ = await chaos.submit_and_wait({**spec(), "blockId": "blk-after"})
    assert kind == "ready"
    rep = await settled_check(c, expected | {"blk-after"})
    assert rep.ok, explain(rep)
    # --force replaces in place and lands on the same state
    again = await recover(c.bus, c.store, force=True)
    assert again.digest == rep.redis_digest
    img = await read_image(c.store.r)
    assert im.digest(img) == again.digest
    final = await check(c.bus, c.store, expected=expected | {"blk-after"})
    assert final.ok, explain(final)
