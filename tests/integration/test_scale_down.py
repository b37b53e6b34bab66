"""Scaling to a target (``block.scale.target``, ``blocks scale BID --to N``) and the scale_down
step over real NATS JetStream and Redis with the real worker processes: up then down, the clamp,
never below minInstances, the resourceAllocator's ``scale_down`` choice (a policy that names an
instance, one that raises, the seed-shaped example that does not know the action), redelivery,
and a block of minInstances 0."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aios_blocks.agent.node_agent import in_flight
from aios_blocks.bus.catalog import E
from aios_blocks.bus.instance_map import BUCKET, InstanceMaps
from aios_blocks.schemas.events import ScaleDownRequest, ScaleTarget

from .conftest import System
from .test_cli import blocks

EXAMPLE = Path(__file__).resolve().parents[2] / "src" / "aios_blocks" / "examples" / "first_fit.py"

#: places first fit; for scale_down names the gang's first instance ({bid}-0), never the default's pick
KEEP_NEWEST = """
class KeepNewest:
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input_data, context):
        payload = input_data["payload"]
        if input_data["action"] == "scale_down":
            context["seen"] = sorted(i["instance_id"] for i in payload["instances"])
            return {"instance_id": payload["block"]["blockId"] + "-0"}
        nodes = payload["cluster_metrics"]["nodes"]
        usable = [n for n in sorted(nodes) if any(g["instances"] == 0 for g in nodes[n]["gpus"])]
        if input_data["action"] == "dry_run":
            return {"selection_score_data": {"score": 1.0 if usable else 0.0, "node_info": {}}}
        node = nodes[usable[0]]
        return {"node_id": node["node_id"], "gpus": [next(g["id"] for g in node["gpus"] if g["instances"] == 0)]}
"""
RAISES = KEEP_NEWEST.replace(
    'context["seen"] = sorted(i["instance_id"] for i in payload["instances"])', 'raise RuntimeError("no removals today")'
).replace("class KeepNewest", "class Raises")
NAMES_STRANGER = KEEP_NEWEST.replace('payload["block"]["blockId"] + "-0"', '"someone-else-7"').replace("class KeepNewest", "class Stranger")


def _spec(bid: str, lo: int, hi: int, policy: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": lo, "maxInstances": hi}
    if policy:
        spec["policyRulesSpec"] = [{"values": {"name": "resourceAllocator", "policyRuleURI": policy}}]
    return spec


async def until(pred: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.05)


async def _events(system: System, bid: str, tail: str) -> list[dict[str, Any]]:
    return [e["data"] for s, e, _ in await system.client.history(bid, idle=0.2) if s.endswith(f".{tail}")]


async def _running(system: System, bid: str) -> dict[str, dict[str, Any]]:
    return {i: r for i, r in (await system.client.store.instances(bid)).items() if r["status"] == "running"}


async def _reach(system: System, bid: str, n: int, timeout: float = 60) -> tuple[bool, str]:
    c = system.client
    return await c.wait_scaled(await c.scale_to(bid, n), timeout)


async def test_scale_to_up_then_down_with_clamp_and_floor(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-a", nodes=3, gpus=2)
    bid, kind, env = await system.submit_and_wait(_spec("sdn-up", 1, 4))
    assert kind == "ready", env

    ok, why = await _reach(system, bid, 3)
    assert ok, why
    assert len(await _running(system, bid)) == 3 and len(await c.store.reservations("sdn-a")) == 3
    assert (await c.store.get_block(bid))["desired"] == 3

    # down to 1: two instances chosen (by the built-in: least loaded, newest first), drained, removed, released
    before = await c.store.instances(bid)
    ok, why = await _reach(system, bid, 1)
    assert ok, why
    left = await c.store.instances(bid)
    assert len(left) == 1 and len(await c.store.reservations("sdn-a")) == 1
    assert list(left) == [f"{bid}-0"]  # the oldest stays: the two newer ones went first
    chosen = await _events(system, bid, "scale_down.chosen")
    assert sorted(e["instance_id"] for e in chosen) == sorted(set(before) - {f"{bid}-0"})
    for e in chosen:
        assert e["chosen_by"] == "policy" and [d["action"] for d in e["decisions"]] == ["scale_down"]
    inputs = [d["input"] for d in await c.decisions(bid=bid) if d["action"] == "scale_down"]
    assert len(inputs) == 2
    for given in inputs:  # the seed's scale payload plus the instances, each with its load where known
        assert {"block", "cluster", "cluster_metrics", "block_metrics", "healthy_nodes"} <= set(given["payload"])
        entries = given["payload"]["instances"]
        assert {i["instance_id"] for i in entries} <= set(before)
        assert all({"node_id", "gpus", "status", "since", "age_s", "load"} <= set(i) for i in entries)
    removed = [e for e in await _events(system, bid, f"instance.{chosen[0]['instance_id']}.removed")]
    assert removed and removed[0]["reason"].startswith("scale down")

    # out of range: clamped to [minInstances, maxInstances], and said so
    req = await c.scale_to(bid, 0)
    assert (req.target, req.note) == (1, "0 raised to minInstances 1")
    ok, why = await c.wait_scaled(req, 30)
    assert ok, why
    block = await c.store.get_block(bid)
    assert block["desired"] == 1 and "clamped: 0 raised to minInstances 1" in block["desired_reason"]
    req = await c.scale_to(bid, 9)
    assert (req.target, req.note) == (4, "9 lowered to maxInstances 4")
    ok, why = await c.wait_scaled(req, 60)
    assert ok, why
    assert len(await c.store.reservations("sdn-a")) == 4

    # a scale_down step can never take the block below minInstances, even asked directly and twice at once
    for rid in ("direct-1", "direct-2"):
        await c.bus.emit(E.cluster_scale_down, ScaleDownRequest(bid, "sdn-a", rid, target=0, count=10, gen=block["gen"]))

    async def floor_reached() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 1 and all(r["status"] == "running" for r in insts.values())

    await until(floor_reached)
    await asyncio.sleep(1.0)  # nothing more comes
    assert len(await c.store.instances(bid)) == 1 and len(await c.store.reservations("sdn-a")) == 1
    assert (await c.store.get_block(bid))["status"] == "ready"


async def test_redelivered_target_and_step_do_not_remove_twice(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-b", nodes=2, gpus=2)
    bid, kind, _ = await system.submit_and_wait(_spec("sdn-redo", 1, 4))
    assert kind == "ready"
    ok, why = await _reach(system, bid, 3)
    assert ok, why
    gen = (await c.store.get_block(bid))["gen"]
    # the same scale_down request three times (a publisher retrying; the stream deduplicates) and the
    # same target event again under a new stream sequence would be a new target: here one request id only
    req = ScaleDownRequest(bid, "sdn-b", "redo-1", target=1, count=1, gen=gen)
    for _ in range(2):
        await c.bus.emit(E.cluster_scale_down, req)
    # and handled twice (a redelivery: the same request under another message id)
    await c.bus.emit(E.cluster_scale_down, req, qualifier="again")

    async def two() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 2 and all(r["status"] == "running" for r in insts.values())

    await until(two)
    await asyncio.sleep(1.0)
    assert len(await c.store.instances(bid)) == 2
    assert len(await _events(system, bid, "scale_down.chosen")) == 1
    # a target redelivered by a publisher (same request id: deduplicated) changes nothing either
    t = ScaleTarget(bid, "redo-t", 1, gen=gen)
    for _ in range(2):
        await c.bus.emit(E.block_scale_target, t)

    async def one() -> bool:
        return len(await c.store.instances(bid)) == 1

    await until(one)
    await asyncio.sleep(1.0)
    assert len(await c.store.instances(bid)) == 1

    # a target for a block that is not live (unknown, deleted): a clear failed event, nothing else
    await c.bus.emit(E.block_scale_target, ScaleTarget("sdn-ghost", "ghost-1", 2))

    async def ghost_failed() -> bool:
        return bool(await _events(system, "sdn-ghost", "scale.failed"))

    await until(ghost_failed)
    failed = (await _events(system, "sdn-ghost", "scale.failed"))[0]
    assert failed["step"] == "scale.target" and failed["reason"] == "target 2 not applied: unknown block"
    await c.delete(bid)

    async def deleted() -> bool:
        return (await c.store.get_block(bid))["status"] == "deleted"

    await until(deleted)
    await c.bus.emit(E.block_scale_target, ScaleTarget(bid, "late-1", 3, gen=gen))

    async def late_failed() -> bool:
        return any(e["request_id"] == "late-1" for e in await _events(system, bid, "scale.failed"))

    await until(late_failed)
    failed = next(e for e in await _events(system, bid, "scale.failed") if e["request_id"] == "late-1")
    assert failed["reason"] == "target 3 not applied: block is deleted"


async def test_policy_names_the_instance_raises_or_does_not_know_the_action(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-c", nodes=4, gpus=2)
    await c.policy_put("keepnewest", KEEP_NEWEST, "python")
    await c.policy_put("raises", RAISES, "python")
    await c.policy_put("stranger", NAMES_STRANGER, "python")
    await c.policy_put("firstfit", EXAMPLE.read_text(), "python")

    # a policy that names an instance: that one goes (the default would have taken the newest)
    bid, kind, _ = await system.submit_and_wait(_spec("sdn-pick", 1, 3, "registry:keepnewest"))
    assert kind == "ready"
    ok, why = await _reach(system, bid, 2)
    assert ok, why
    ok, why = await _reach(system, bid, 1)
    assert ok, why
    assert f"{bid}-0" not in await c.store.instances(bid)
    chosen = await _events(system, bid, "scale_down.chosen")
    assert [(e["instance_id"], e["chosen_by"]) for e in chosen] == [(f"{bid}-0", "policy")]
    assert chosen[0]["decisions"][0]["output"] == {"instance_id": f"{bid}-0"}
    assert len((await c.store.context_load(f"{bid}.resourceAllocator"))["seen"]) == 2

    # a policy that raises, or names an instance the block does not have: the step fails with the
    # reason, nothing is removed
    for name, words in (("raises", "no removals today"), ("stranger", "'someone-else-7', which is not a live instance")):
        bid, kind, _ = await system.submit_and_wait(_spec(f"sdn-{name}", 1, 3, f"registry:{name}"))
        assert kind == "ready"
        ok, why = await _reach(system, bid, 2)
        assert ok, why
        ok, why = await _reach(system, bid, 1, timeout=30)
        assert not ok and words in why, why
        failed = await _events(system, bid, "scale_down.failed")
        assert len(failed) == 1 and words in failed[0]["reason"] and failed[0]["decisions"][0]["action"] == "scale_down"
        await asyncio.sleep(0.5)
        assert len(await _running(system, bid)) == 2 and len(await c.store.instances(bid)) == 2

    # the seed-shaped example (first_fit.py) does not know scale_down: the framework's default, said so
    bid, kind, _ = await system.submit_and_wait(_spec("sdn-seed", 1, 3, "registry:firstfit"))
    assert kind == "ready"
    ok, why = await _reach(system, bid, 3)
    assert ok, why
    ok, why = await _reach(system, bid, 2)
    assert ok, why
    chosen = await _events(system, bid, "scale_down.chosen")
    assert len(chosen) == 1 and chosen[0]["chosen_by"] == "default" and chosen[0]["instance_id"] != f"{bid}-0"
    assert chosen[0]["decisions"][0]["output"] is None and "least loaded" in chosen[0]["reason"]


async def test_min_instances_zero_scales_to_zero_and_back(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-z", nodes=2, gpus=2)
    bid, kind, env = await system.submit_and_wait(_spec("sdn-zero", 0, 2))
    assert kind == "ready", env
    assert await c.store.instances(bid) == {}
    ok, why = await _reach(system, bid, 1)
    assert ok, why
    assert len(await _running(system, bid)) == 1
    ok, why = await _reach(system, bid, 0)
    assert ok, why
    assert await c.store.instances(bid) == {} and await c.store.reservations("sdn-z") == []
    assert (await c.store.get_block(bid))["status"] == "ready"
    ok, why = await _reach(system, bid, 2)
    assert ok, why


async def test_cli_scale_to(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-cli", nodes=2, gpus=2)
    bid, kind, _ = await system.submit_and_wait(_spec("sdn-cli1", 1, 3))
    assert kind == "ready"
    r = blocks(system, "scale", bid, "--to", "3")
    assert r.returncode == 0 and "scale done" in r.stdout and "runs 3 instance(s)" in r.stdout, r.stdout + r.stderr
    r = blocks(system, "scale", bid, "--to", "7")
    assert r.returncode == 0 and "7 lowered to maxInstances 3" in r.stdout, r.stdout + r.stderr
    r = blocks(system, "scale", bid, "--to", "1")
    assert r.returncode == 0 and "runs 1 instance(s)" in r.stdout and "removing" in r.stdout, r.stdout + r.stderr
    assert len(await c.store.instances(bid)) == 1
    r = blocks(system, "scale", bid, "--to", "-1")
    assert r.returncode == 2 and "target must be a count" in r.stderr, r.stdout + r.stderr
    r = blocks(system, "scale", "sdn-nosuch", "--to", "2")
    assert r.returncode == 1 and "no block 'sdn-nosuch'" in r.stderr
    r = blocks(system, "scale", bid, "--to", "2", "--no-wait")
    assert r.returncode == 0 and "follow with" in r.stdout
    await until(lambda: _count(c, bid, 2))
    r = blocks(system, "scale", bid)  # without --to: one more, as before
    assert r.returncode == 0 and "scale done" in r.stdout, r.stdout + r.stderr


async def _count(c: Any, bid: str, n: int) -> bool:
    insts = await c.store.instances(bid)
    return len(insts) == n and all(r["status"] == "running" for r in insts.values())


async def test_a_draining_instance_takes_no_new_task_and_finishes_its_own(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("sdn-x", nodes=2, gpus=1)
    spec = {**_spec("sdn-drain", 1, 2), "parameters": {"sim": {"serviceTimeMs": 2000}}}
    bid, kind, _ = await system.submit_and_wait(spec)
    assert kind == "ready"
    ok, why = await _reach(system, bid, 2)
    assert ok, why
    maps = InstanceMaps(c.bus)

    async def states() -> dict[str, str]:
        m, _ = await maps.get(bid)
        return {i: v["state"] for i, v in (m or {}).get("instances", {}).items()}

    async def both_ready() -> bool:
        return list((await states()).values()) == ["ready", "ready"]

    await until(both_ready)

    async def task(n: int) -> tuple[str, float]:
        status, body, _ = await c.task(bid, b'{"n": %d}' % n, timeout=30)
        assert status == 200, body
        return json.loads(body)["instance_id"], time.time()

    early = [asyncio.ensure_future(task(n)) for n in range(4)]  # two at each instance (least in-flight)

    async def all_in_flight() -> bool:  # the four early tasks are at the instances (each says so)
        m, _ = await maps.get(bid)
        running = [await in_flight(v["endpoint"]) for v in (m or {}).get("instances", {}).values()]
        return sum(r or 0 for r in running) == 4

    await until(all_in_flight)
    req = await c.scale_to(bid, 1)

    async def draining() -> bool:
        return "draining" in (await states()).values()

    await until(draining)
    gone = next(i for i, st in (await states()).items() if st == "draining")
    _, marked = await maps.get(bid)  # the map's revision that says so (or a later one)

    async def watchers_have_it() -> bool:
        # the executor watches the map (an ordered consumer of its bucket's stream): every watcher
        # has been sent that revision (the agent's drain_grace_s stands in for this in the system)
        infos = await c.bus.js.consumers_info(f"KV_{BUCKET}")
        return bool(infos) and all(i.delivered.stream_seq >= marked for i in infos)

    await until(watchers_have_it)
    late = [asyncio.ensure_future(task(n)) for n in range(4, 6)]
    ok, why = await c.wait_scaled(req, 60)
    assert ok, why
    done_early, done_late = await asyncio.gather(*early), await asyncio.gather(*late)
    at_gone = [t for i, t in done_early if i == gone]
    assert at_gone, done_early  # the chosen one had tasks in flight
    assert all(i != gone for i, _ in done_late), done_late  # no new task went to it while it drained
    hist = await c.history(bid, idle=0.2)
    mine = [(s.rsplit(".", 1)[1], e) for s, e, _ in hist if f".instance.{gone}." in s]
    assert mine[-1][0] == "removed", mine
    removed_at = dt.datetime.fromisoformat(mine[-1][1]["time"].replace("Z", "+00:00")).timestamp()
    # its tasks in flight (2 s each) were answered before it was stopped (not 0.25 s after the command)
    assert removed_at >= max(at_gone) - 0.5, (removed_at, at_gone)
