"""The autoscaler worker on real NATS and Redis (its own role's credentials): one decision per
block per tick whichever copy holds the block's lease, the blocks split between copies, blocks
without an autoscaler policy left alone, the state handed over with the lease, and a policy that raises, hangs, answers garbage or
has bad parameters never changing the count (the failed tick stored once, with the reason).

The block records, instance records and metrics samples are written straight to Redis (as the
controller and the metrics collector would), so each test controls the load exactly; what is
checked is what the worker publishes (``block.autoscaled``, ``block.scale.target``,
``block.autoscale.failed``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.cli.client import Client
from aios_blocks.projections.explain import explain
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.settings import Settings
from aios_blocks.state.keys import block_key
from aios_blocks.workers.autoscaler import Autoscaler
from aios_blocks.workers.base import Worker

pytestmark = pytest.mark.integration

SETTINGS = Settings(autoscale_tick_s=1.0, autoscale_policy_timeout_s=0.5, autoscale_failure_record_s=60)


@dataclass
class Env:
    servers: EmbeddedServers
    admin: Client

    async def worker(self) -> Worker:
        env = self.servers.worker_env("autoscaler")  # the role's URLs and the event-id key, as blocks up gives them
        settings = SETTINGS.model_copy(update={"event_key": env.get("AIOS_EVENT_KEY")})
        return await Worker.open(env["AIOS_NATS_URL"], env["AIOS_REDIS_URL"], "autoscaler", settings)

    async def block(self, bid: str, instances: int, inflight: float, policy: dict[str, Any] | None,
                    lo: int = 1, hi: int = 20, t: float | None = None) -> None:
        ir: dict[str, Any] = {"blockId": bid, "minInstances": lo, "maxInstances": hi, "policies": {}}
        if policy is not None:
            ir["policies"]["autoscaler"] = {"name": "autoscaler", "parameters": {}, "settings": {}, **policy}
        r = self.admin.store.r
        await r.hset(block_key(bid), mapping={"status": "ready", "gen": "1", "version": "1", "ir": msgspec.json.encode(ir).decode()})
        await self.instances(bid, instances)
        await self.load(bid, inflight, t)

    async def instances(self, bid: str, n: int) -> None:
        await self.admin.store.put_instances(bid, {f"{bid}-{i}": {"node": "as-n1", "gpus": [], "status": "running", "cluster": "as-c1"}
                                                  for i in range(n)})

    async def load(self, bid: str, inflight: float, t: float | None = None) -> None:
        """The metrics collector's sample of the block (and of its instances)."""
        insts = await self.admin.store.instances(bid)
        now = time.time() if t is None else t
        per = {iid: {"t": now, "state": "ready", "inflight": inflight / max(1, len(insts))} for iid in insts}
        block = {"t": now, "cluster": "as-c1", "instances": len(insts), "ready": len(insts), "inflight": inflight, "queue": 0.0}
        await self.admin.store.metrics.write({bid: (block, per)}, 60, 120)

    def violations(self) -> list[str]:
        """Permission violations NATS logged (the autoscaler's role must need none)."""
        log = (self.servers.data_dir / "nats.log").read_text()
        return [line for line in log.splitlines() if "Violation" in line]

    async def events(self, bid: str, kind: str) -> list[dict[str, Any]]:
        return [env["data"] for subject, env, _ in await self.admin.history(bid, idle=0.3) if subject.endswith("." + kind)]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    admin = await Client.open(servers.nats_url, servers.redis_url)
    try:
        yield Env(servers, admin)
    finally:
        await admin.close()
        servers.stop()


INFLIGHT = {"policyRuleURI": "builtin:target-inflight", "parameters": {"target": 2, "upscaleDelayS": 0}}


async def test_two_copies_decide_each_block_once_per_tick_and_hand_over_with_the_state(env: Env) -> None:
    bids = ["as-b1", "as-b2", "as-b3"]
    for bid in bids:
        await env.block(bid, instances=2, inflight=20, policy=INFLIGHT)  # wants 10: a burst (10 >= 2 x 2)
    await env.block("as-plain", instances=2, inflight=20, policy=None)
    wa, wb = await env.worker(), await env.worker()
    a, b = Autoscaler(wa, holder="copy-a"), Autoscaler(wb, holder="copy-b")
    try:
        for rnd in range(3):
            now = time.time()
            for bid in bids:
                await env.load(bid, 20, now)
            ra = await (a if rnd % 2 == 0 else b).tick(now)
            rb = await (b if rnd % 2 == 0 else a).tick(now)
            assert set(ra) | set(rb) == set(bids) and not set(ra) & set(rb), (rnd, ra, rb)
        assert "as-plain" not in a.held + b.held
        # the blocks are split between the two copies (rendezvous hashing of block and copy)
        assert sorted(a.held) == ["as-b1", "as-b2"] and b.held == ["as-b3"], (a.held, b.held)
        assert await env.admin.store.r.get("aios:meta:{b:as-plain}:as:lease") is None
        for bid in bids:
            targets = await env.events(bid, "scale.target")
            # 2 -> 8 (x4 per step) once: the same step is not asked again while the count has not moved
            assert [(t["target"], t["source"]) for t in targets] == [(8, "autoscaler")], (bid, targets)
            (dec,) = await env.events(bid, "autoscaled")
            assert dec["current"] == 2 and dec["desired"] == 8 and dec["raw"] == 10 and dec["request_id"] == targets[0]["request_id"]
            assert any(r.startswith("burst") for r in dec["rules"]) and any(r.startswith("rate limit up") for r in dec["rules"])
            assert "20 ongoing" in dec["reason"] and dec["inputs"]["inflight"] == 20
            (call,) = dec["decisions"]
            assert call["kind"] == "autoscaler" and call["uri"] == "builtin:target-inflight" and call["output"]["desired"] == 10
        # copy a stops cleanly: b holds every block on its next tick and goes on from a's state
        held_by_a = list(a.held)
        assert held_by_a
        await wa.store.autoscale.release(a.held, a.holder)
        await env.instances(held_by_a[0], 8)  # the controller reached 8 for one of them
        now = time.time()
        for bid in bids:
            await env.load(bid, 20, now)
        res = await b.tick(now)
        assert set(res) == set(bids)
        assert res[held_by_a[0]].what == "changed" and res[held_by_a[0]].outcome is not None
        assert res[held_by_a[0]].outcome.current == 8 and res[held_by_a[0]].outcome.desired == 10
        targets = await env.events(held_by_a[0], "scale.target")
        assert [t["target"] for t in targets] == [8, 10]
        assert targets[1]["request_id"].startswith("as2-")  # the sequence went on from a's state
        for bid in held_by_a[1:]:
            assert len(await env.events(bid, "scale.target")) == 1  # a's ask is remembered: not repeated
        assert env.violations() == []
        # blocks explain tells why it grew, from the stream alone
        x = explain([(s, e) for s, e, _ in await env.admin.history(held_by_a[0], idle=0.3)])
        assert [(d["from"], d["to"], d["proposal"]) for d in x["autoscaler"]["decisions"]] == [(2, 8, 10), (8, 10, 10)]
        assert "20 ongoing" in x["autoscaler"]["decisions"][1]["reason"] and x["autoscaler"]["decisions"][1]["rules"]
        assert [t["source"] for t in x["targets"]] == ["autoscaler", "autoscaler"]
        assert x["decisions"]["by_policy"]["autoscaler:autoscaler@builtin:target-inflight"]["actions"] == {"autoscale": 2}
    finally:
        await wa.close()
        await wb.close()


BAD = {
    "as-raise": ("class P:\n    def __init__(self, r, s, p): pass\n    def eval(self, p, i, c): raise KeyError('boom')\n",
                 "raised KeyError"),
    "as-hang": ("import time\nclass P:\n    def __init__(self, r, s, p): pass\n    def eval(self, p, i, c):\n        time.sleep(3)\n"
                "        return {'desired': 9}\n", "timed out after 0.5s"),
    "as-garbage": ("class P:\n    def __init__(self, r, s, p): pass\n    def eval(self, p, i, c): return {'desired': 'lots'}\n",
                   "wrong return shape"),
}


async def test_a_failing_policy_never_changes_the_count_and_its_failure_is_stored_once(env: Env) -> None:
    for bid, (source, _) in BAD.items():
        name = bid.replace("as-", "p")
        await env.admin.policy_put(name, source, "python")
        await env.block(bid, instances=3, inflight=40, policy={"policyRuleURI": f"registry:{name}"})
    await env.block("as-badparam", instances=3, inflight=40,
                    policy={"policyRuleURI": "builtin:target-inflight", "parameters": {"tolerance": 7}})
    await env.block("as-ok", instances=1, inflight=8, policy=INFLIGHT)
    await env.block("as-stale", instances=1, inflight=40, policy=INFLIGHT, t=time.time() - 300)
    w = await env.worker()
    scaler = Autoscaler(w, holder="copy-f")
    try:
        for _ in range(2):
            res = await scaler.tick()
            assert res["as-ok"].what in ("changed", "hold")
            assert res["as-stale"].what == "skipped"
            for bid in (*BAD, "as-badparam"):
                assert res[bid].what == "failed" and res[bid].outcome is None
        # the hung policy is not called again on the next tick (its thread may still be busy)
        assert "not called again" in res["as-hang"].reason and "not called again" not in res["as-raise"].reason
        expected = {**{b: why for b, (_, why) in BAD.items()}, "as-badparam": "tolerance must be in [0, 1)"}
        for bid, why in expected.items():
            failed = await env.events(bid, "autoscale.failed")
            assert len(failed) == 1, (bid, failed)  # the second failed tick is counted, not stored
            assert why in failed[0]["reason"] and failed[0]["current"] == 3
            assert await env.events(bid, "scale.target") == [] and await env.events(bid, "autoscaled") == []
            assert len(await env.admin.store.instances(bid)) == 3
            state = msgspec.json.decode(await w.store.autoscale.state(bid) or "{}")
            assert state["failed_quiet"] == 1 and why in state["latest"]["failed"]
        from aios_blocks.cli import top

        shown = await top.read(env.admin.store, "as-raise")  # blocks top BID: the latest tick
        assert "raised KeyError" in shown["autoscaler"]["failed"] and shown["autoscaler"]["current"] == 3
        assert [t["target"] for t in await env.events("as-ok", "scale.target")] == [4]
        assert await env.events("as-stale", "scale.target") == []
        assert env.violations() == []
        x = explain([(s, e) for s, e, _ in await env.admin.history("as-hang", idle=0.3)])
        assert x["autoscaler"]["decisions"] == [] and len(x["autoscaler"]["failures"]) == 1
        assert "timed out" in x["autoscaler"]["failures"][0]["reason"] and x["autoscaler"]["failures"][0]["count"] == 3
    finally:
        await w.close()


# -- end to end: blocks up, simulated instances serving, the controller reaching the targets ----------
async def test_a_block_grows_under_load_and_shrinks_back_to_min_after_it(system: Any) -> None:
    """builtin:target-inflight on a block of simulated instances (0.3 s a task): 12 tasks kept in
    flight through the executor ask for 6 instances (target 2 each, maxInstances 4 caps it); when
    the load stops the block goes back to minInstances. Short windows keep the test quick."""
    from .conftest import COMPONENT

    c = system.client
    await c.add_sim_cluster("as-e2e", nodes=2, gpus=4)
    params = {"target": 2, "upscaleDelayS": 0, "stableWindowS": 8, "burstWindowS": 4, "downscaleDelayS": 4}
    bid, kind, _ = await system.submit_and_wait({
        "blockComponentURI": COMPONENT["componentURI"], "blockId": "as-grow", "minInstances": 1, "maxInstances": 4,
        "parameters": {"sim": {"serviceTimeMs": 300}},
        "policyRulesSpec": [{"values": {"name": "autoscaler", "policyRuleURI": "builtin:target-inflight", "parameters": params}}],
    })
    assert kind == "ready"

    async def live() -> int:
        return sum(1 for r in (await c.store.instances(bid)).values() if r.get("status") != "removing")

    async with asyncio.timeout(30):  # the executors have the block's map
        while (await c.task(bid, b'{"x": 1}', timeout=10))[0] != 200:
            await asyncio.sleep(0.2)
    stop = asyncio.Event()
    answered: list[int] = []

    async def loop() -> None:
        while not stop.is_set():
            status, _, _ = await c.task(bid, b'{"x": 1}', timeout=20)
            answered.append(status)
            if status != 200:
                await asyncio.sleep(0.2)

    loops = [asyncio.get_running_loop().create_task(loop()) for _ in range(12)]
    try:
        async with asyncio.timeout(90):
            while await live() < 4:
                await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
    assert answered and all(s == 200 for s in answered), sorted(set(answered))
    async with asyncio.timeout(90):  # the load is gone: back to minInstances
        while await live() > 1:
            await asyncio.sleep(0.5)
    hist = await c.history(bid, idle=0.5)
    decisions = [env["data"] for s, env, _ in hist if s.endswith(".autoscaled")]
    ups = [d for d in decisions if d["desired"] > d["current"]]
    downs = [d for d in decisions if d["desired"] < d["current"]]
    assert ups and downs and downs[-1]["desired"] == 1, decisions
    assert all("ongoing" in d["reason"] and d["rules"] is not None for d in decisions)
    targets = [env["data"] for s, env, _ in hist if s.endswith(".scale.target")]
    assert [t["target"] for t in targets] == [d["desired"] for d in decisions] and {t["source"] for t in targets} == {"autoscaler"}
    assert any(s.endswith(".placement") and env["data"]["action"] == "scale" for s, env, _ in hist)
    x = explain([(s, e) for s, e, _ in hist])
    assert [(d["from"], d["to"]) for d in x["autoscaler"]["decisions"]] == [(d["current"], d["desired"]) for d in decisions]
    log = (system.data_dir / "nats.log").read_text()
    assert "Violation" not in log


async def test_a_hung_policy_backs_off_from_when_it_failed_not_from_its_call(env: Env) -> None:
    # the tick's reads (or the blocks ahead of it) take longer than the back-off (tick 1 s x 2):
    # measured from the call alone, the back-off was over by the next tick, and the hung policy
    # (whose thread may still be busy) was called again on a loaded machine
    source, _ = BAD["as-hang"]
    await env.admin.policy_put("phang", source, "python")
    await env.block("as-hang", instances=3, inflight=40, policy={"policyRuleURI": "registry:phang"})
    w = await env.worker()
    scaler = Autoscaler(w, holder="copy-s")
    live = scaler._live

    async def slow_live() -> Any:
        await asyncio.sleep(3 * SETTINGS.autoscale_tick_s)
        return await live()

    scaler._live = slow_live  # type: ignore[method-assign]
    try:
        first = await scaler.tick()
        assert "timed out" in first["as-hang"].reason and "not called again" not in first["as-hang"].reason
        await env.load("as-hang", 40)  # fresh metrics for the next tick
        second = await scaler.tick()  # starts ~3.5 s after the first's now, inside the 2 s from the failure
        assert "not called again" in second["as-hang"].reason, second["as-hang"].reason
    finally:
        await w.close()
