"""The allocation flow end to end over real NATS JetStream and Redis, with real worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import time
from typing import Any

import msgspec
import nats
import pytest

from aios_blocks.cli.client import decisions_of
from aios_blocks.schemas.events import input_digest_of

from .conftest import System, gpu_usage

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 4}


async def test_one_block_create_to_ready_and_replay_in_order(system: System) -> None:
    c = system.client
    for i in range(3):
        await c.add_sim_cluster(f"c{i}", nodes=8, gpus=8)
    started = time.perf_counter()
    bid, kind, env = await system.submit_and_wait(dict(SPEC))
    elapsed = time.perf_counter() - started
    print(f"\ncreate->ready: {elapsed * 1000:.1f} ms")
    assert kind == "ready", env
    block = await c.store.get_block(bid)
    assert block["status"] == "ready"
    assert block["ir"]["blockInitData"] == {"model": "m"}  # inherited from the component
    insts = await c.store.instances(bid)
    assert len(insts) == 2 and all(i["status"] == "running" for i in insts.values())
    assert sorted(env["data"]["instances"]) == sorted(insts)
    # every reservation belongs to one of the block's instances, each GPU held once
    usage = await gpu_usage(c, block["cluster"])
    assert sum(usage.values()) == 2 and set(usage.values()) == {1}

    history = await c.history(bid)
    events = [s.split(".", 3)[3] for s, _, _ in history]
    # one decision record per policy call, with its output and duration, carried by the step event
    # it decided (no separate decision messages)
    decisions = [d for s, e, _ in history for d in decisions_of(s, e.get("data"))]
    assert "decision" not in events
    on_step = {s.split(".", 3)[3]: [d["action"] for d in decisions_of(s, e.get("data"))] for s, e, _ in history}
    # the dry_run answers are not stored apart: the round's post_dry_run carries them, each with its decision
    assert on_step["selection"] == ["selection"] and on_step["post_dry_run"] == ["dry_run"] * 3 + ["post_dry_run"]
    assert on_step["placement"] == ["allocation", "allocation"]
    assert sorted(d["action"] for d in decisions) == sorted(
        ["selection", "dry_run", "dry_run", "dry_run", "post_dry_run", "allocation", "allocation"]
    )
    for d in decisions:
        assert d["error"] == "" and d["duration_us"] > 0 and d["output"] is not None
        assert "input" not in d and "input_subject" not in d  # inputs are not stored: rebuilt by replay
    fetched = await c.decisions(bid=bid)
    assert len(fetched) == len(decisions)
    for d in fetched:  # every input, rebuilt by replay, is the one the policy got (its digest at the call)
        assert d["input_check"] == "rebuilt", d
        assert input_digest_of(d["input"]) == d["input_digest"] and d["input"]["action"] == d["action"]
    allocs = [d["output"] for d in decisions if d["action"] == "allocation"]
    assert sorted(a["node_id"] for a in allocs) == sorted(i["node"] for i in insts.values())
    steps = ["submitted", "parsed", "selection", "post_dry_run", "placement", "ready"]
    positions = [events.index(s) for s in steps]
    assert positions == sorted(positions), events
    assert events.count("dry_run.result") == 0
    (post,) = [e["data"] for s, e, _ in history if s.endswith(".post_dry_run")]
    assert sorted(a["cluster_id"] for a in post["answers"]) == ["c0", "c1", "c2"]
    assert {a["cluster_id"]: a["score"] for a in post["answers"]} == post["scores"]
    added = [i for i, e in enumerate(events) if e.endswith(".added")]
    assert len(added) == 2 and max(added) < events.index("ready")


async def test_spec_from_plain_nats_client_is_placed(system: System) -> None:
    """The README's bare-client example as written: plain nats-py, no project code; with credentials
    on, as user ``upstream`` (password from the data dir's secrets file, its own inbox prefix)."""
    await system.client.add_sim_cluster("c0", nodes=2, gpus=2)
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}
    if system.servers is None:  # your own servers: the URL carries whatever credentials they want
        nc = await nats.connect(system.supervisor.nats_url)
    else:
        data = system.data_dir
        endpoints = json.loads((data / "endpoints.json").read_text())
        login: dict[str, Any] = {}
        if endpoints["auth"]:
            password = json.loads((data / "auth" / "secrets.json").read_text())["nats"]["upstream"]
            login = {"user": "upstream", "password": password, "inbox_prefix": "_INBOX.upstream"}
        if endpoints.get("nats_ca"):
            login["tls"] = ssl.create_default_context(cafile=endpoints["nats_ca"])
        nc = await nats.connect(endpoints["nats"], **login)
    try:
        await nc.jetstream().publish("aios.block.plain-1.create", json.dumps(spec).encode())
    finally:
        await nc.close()
    kind, event = await system.client.wait("plain-1", 30)  # upstream may not read events: the CLI's client does
    assert kind == "ready" and event["type"] == "io.aios.block.ready"
    assert event["data"]["block_id"] == "plain-1" and len(event["data"]["instances"]) == 1
    for attr in ("specversion", "id", "source", "subject", "time", "datacontenttype"):
        assert attr in event


async def test_malformed_spec_gets_one_rejected_event_with_every_error(system: System) -> None:
    c = system.client
    bad = {
        "blockComponentURI": "aios://nope",
        "minInstances": 5,
        "maxInstances": 2,
        "parameters": "not-an-object",
        "colour": "blue",
    }
    bid, kind, env = await system.submit_and_wait(bad, timeout=30)
    assert kind == "rejected"
    errors = {(e["path"], e["message"]) for e in env["data"]["errors"]}
    paths = {p for p, _ in errors}
    assert {"$.minInstances", "$.parameters", "$.colour", "$.blockComponentURI"} <= paths, errors
    assert any("greater than maxInstances" in m for _, m in errors)
    assert any("unknown component" in m for _, m in errors)
    assert ("$.colour", "unknown field") in errors
    history = [s for s, _, _ in await c.history(bid)]
    assert history.count(f"aios.block.{bid}.rejected") == 1
    assert (await c.store.get_block(bid))["status"] == "rejected"

    # not JSON at all
    await c.bus.publish_raw("aios.block.garbage-1.create", b"\xff{not json")
    kind, env = await c.wait("garbage-1", 30)
    assert kind == "rejected" and env["data"]["errors"][0]["path"] == "$"


async def test_bad_subject_id_gets_a_rejected_its_publisher_can_see(system: System) -> None:
    c = system.client
    answers: asyncio.Queue[bytes] = asyncio.Queue()

    async def cb(msg: object) -> None:
        await answers.put(msg.data)  # type: ignore[attr-defined]

    await c.bus.subscribe("aios.block._invalid.rejected", cb)
    # '{' is legal in a NATS token but not in a block id (it would be a Redis hash tag)
    ack = await c.bus.publish_raw("aios.block.{evil}.create", json.dumps(SPEC).encode())
    answer = msgspec.json.decode(await asyncio.wait_for(answers.get(), 30))["data"]
    assert answer["block_id"] == "{evil}" and answer["gen"] == ack.seq
    assert "not a valid id" in answer["errors"][0]["message"]
    # the parser is alive and well
    await c.add_sim_cluster("c0", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait({**SPEC, "minInstances": 1})
    assert kind == "ready"


async def test_raising_policy_fails_only_that_block(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=4)
    source = (
        "class Boom:\n"
        "    def __init__(self, rule_id, settings, parameters):\n"
        "        pass\n"
        "    def eval(self, parameters, input_data, context):\n"
        "        raise RuntimeError('policy exploded on purpose')\n"
    )
    await c.store.policy_put("boom", source, "python")
    spec = {
        **SPEC,
        "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:boom", "parameters": {}, "settings": {}}}],
    }
    bid, kind, env = await system.submit_and_wait(spec)
    assert kind == "failed"
    assert "policy exploded on purpose" in env["data"]["reason"]
    errors = [d["error"] for s, e, _ in await c.history(bid) for d in decisions_of(s, e.get("data")) if d["error"]]
    assert errors and all("policy exploded on purpose" in err for err in errors)
    assert (await c.store.get_block(bid))["status"] == "failed"
    assert await c.store.instances(bid) == {}
    # the workers that ran the policy are still serving
    _, kind, _ = await system.submit_and_wait(dict(SPEC))
    assert kind == "ready"
    assert system.supervisor.restarts == 0


async def test_many_blocks_never_overcommit_a_gpu(system: System) -> None:
    c = system.client
    clusters = [f"c{i}" for i in range(3)]
    for cid in clusters:
        await c.add_sim_cluster(cid, nodes=8, gpus=8)
    capacity = 3 * 8 * 8
    n = int(os.environ.get("AIOS_TEST_BLOCKS", 200))
    # queue: false: a block beyond the capacity fails (counted below) rather than waiting pending (issue 36)
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1, "queue": False}
    started = time.perf_counter()
    bids = set(await asyncio.gather(*(c.submit(dict(spec)) for _ in range(n))))
    done = await system.wait_all(bids, timeout=240)
    elapsed = time.perf_counter() - started
    ready = [b for b, (k, _) in done.items() if k == "ready"]
    failed = {b: e["data"]["reason"] for b, (k, e) in done.items() if k == "failed"}
    print(f"\n{n} blocks: {len(ready)} ready, {len(failed)} failed in {elapsed:.2f}s = {n / elapsed:.1f} blocks/s")
    assert len(done) == n  # none missing
    assert all(failed.values())  # every failure says why
    usage: dict[str, int] = {}
    for cid in clusters:
        usage.update(await gpu_usage(c, cid))
    assert all(v == 1 for v in usage.values()), "a GPU is reserved twice"
    assert sum(usage.values()) == len(ready) <= capacity
    # node-level counters agree with the reservation records
    for cid in clusters:
        nodes = await c.store.read_nodes(cid, await c.store.node_ids(cid))
        held = sum(g["instances"] for n_ in nodes.values() for g in n_["gpus"])
        assert held == sum(1 for g, v in usage.items() if g.startswith(f"{cid}-"))
    if n > capacity:
        # re-selection after a lost race means capacity anywhere is used before a block fails
        assert len(ready) == capacity and len(failed) == n - capacity


async def test_sigkilled_controller_is_replaced_and_blocks_still_become_ready(system: System) -> None:
    c = system.client
    for cid in ("c0", "c1"):
        await c.add_sim_cluster(cid, nodes=4, gpus=8)
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 3, "maxInstances": 3}
    bids = set()
    for i in range(20):
        bids.add(await c.submit(dict(spec)))
        if i == 8:
            for pid in system.supervisor.pids("controller"):
                os.kill(pid, signal.SIGKILL)
    done = await system.wait_all(bids, timeout=180)
    assert {k for k, _ in done.values()} == {"ready"}, {b: e["data"] for b, (k, e) in done.items() if k != "ready"}
    assert system.supervisor.restarts >= 1
    seen_gpus: set[str] = set()
    for bid in bids:
        insts = await c.store.instances(bid)
        assert len(insts) == 3, (bid, insts)  # no duplicate, none missing
        for i in insts.values():
            assert not seen_gpus & set(i["gpus"])
            seen_gpus |= set(i["gpus"])
    total = len(await c.store.reservations("c0")) + len(await c.store.reservations("c1"))
    assert total == 3 * len(bids)


async def test_scale_reassign_delete(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=3, gpus=2)
    bid, kind, _ = await system.submit_and_wait({**SPEC, "minInstances": 1, "maxInstances": 2})
    assert kind == "ready"

    async def until(pred, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
        async with asyncio.timeout(timeout):
            while not await pred():
                await asyncio.sleep(0.05)

    await c.scale(bid)

    async def two_running() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 2 and all(i["status"] == "running" for i in insts.values())

    await until(two_running)
    # at maxInstances: a further scale fails that step only
    await c.scale(bid)
    await until(lambda: _has_event(c, bid, "scale.failed"))
    assert (await c.store.get_block(bid))["status"] == "ready"

    old_iid, old = sorted((await c.store.instances(bid)).items())[0]
    await c.reassign(bid, old_iid)

    async def moved() -> bool:
        insts = await c.store.instances(bid)
        return old_iid not in insts and len(insts) == 2 and all(i["status"] == "running" for i in insts.values())

    await until(moved)
    assert len(await c.store.reservations("c0")) == 2

    await c.delete(bid)
    await until(lambda: _has_event(c, bid, "deleted"))
    assert await c.store.instances(bid) == {}
    assert await c.store.reservations("c0") == []
    nodes = await c.store.read_nodes("c0", await c.store.node_ids("c0"))
    assert all(g["instances"] == 0 and g["memory_used"] == 0 for n in nodes.values() for g in n["gpus"])
    events = [s.rsplit(".", 1)[1] for s, _, _ in await c.history(bid)]
    assert events.count("removed") == 3  # reassigned one + two deleted


async def test_a_burst_of_scale_calls_stops_at_max_instances(system: System) -> None:
    """Scale calls sent at once reach the controller in one batch (or several copies): each sees
    room when it starts, yet the block ends with exactly maxInstances, every call past it fails
    with the reason, and no GPU stays reserved for an instance that is not there."""
    c = system.client
    await c.add_sim_cluster("c0", nodes=4, gpus=4)
    bid, kind, _ = await system.submit_and_wait({**SPEC, "minInstances": 1, "maxInstances": 4})
    assert kind == "ready"
    rids = await asyncio.gather(*(c.scale(bid) for _ in range(12)))
    failed: dict[str, str] = {}

    async def settled() -> bool:
        for s_, env, _ in await c.history(bid, idle=0.2):
            if s_.endswith(".scale.failed"):
                failed[env["data"]["request_id"]] = env["data"]["reason"]
        insts = await c.store.instances(bid)
        return len(failed) + len(insts) - 1 == len(rids) and all(i["status"] == "running" for i in insts.values())

    async with asyncio.timeout(60):
        while not await settled():
            await asyncio.sleep(0.1)
    assert len(await c.store.instances(bid)) == 4
    assert len(failed) == 9 and set(failed.values()) == {"already at maxInstances (4)"}, failed
    usage = await gpu_usage(c, "c0")
    assert sorted(usage.values()) == [1] * 4  # one GPU per instance, none held for a refused step
    nodes = await c.store.read_nodes("c0", await c.store.node_ids("c0"))
    assert sum(g["instances"] for n in nodes.values() for g in n["gpus"]) == 4


async def _has_event(c, bid: str, tail: str) -> bool:  # type: ignore[no-untyped-def]
    return any(s.endswith(f".{tail}") for s, _, _ in await c.history(bid, idle=0.2))


@pytest.fixture
def zero_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_DRY_RUN_DEADLINE_S", "0")  # inherited by the worker processes
    # a round that spent its patience would not decide within the test: deciding at all shows it did not
    monkeypatch.setenv("AIOS_DRY_RUN_PATIENCE_S", "3600")


async def test_gather_past_its_deadline_waits_for_a_usable_answer_instead_of_failing(
    zero_deadline: None, system: System
) -> None:
    """With a zero dry_run deadline every round is past it before any controller answers. Under a
    backlog that is the normal case, and it must not fail blocks that fit: the first usable answer
    decides. A block no cluster can host still fails at once (every cluster answered score 0)."""
    c = system.client
    for i in range(3):
        await c.add_sim_cluster(f"c{i}", nodes=2, gpus=2)
    bids = {await c.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}) for _ in range(6)}
    done = await system.wait_all(bids, timeout=90)
    assert {kind for kind, _ in done.values()} == {"ready"}, {b: e["data"] for b, (k, e) in done.items() if k != "ready"}
    for bid in bids:
        posts = [e["data"] for s, e, _ in await c.history(bid) if s.endswith(".post_dry_run")]
        # one decision per selection round (a full cluster sends the block to another round),
        # each for a cluster that answered with room
        assert len({p["attempt"] for p in posts}) == len(posts) >= 1, posts
        assert all(p["scores"][p["cluster_id"]] > 0 for p in posts), posts
    # a resourceAllocator that says "no room" in every dry_run: every cluster answers score 0
    await c.policy_put("never", NEVER_FITS, "python")
    bid, kind, env = await system.submit_and_wait(
        {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
         "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:never"}}],
         "queue": False},  # (--no-queue: "no room" everywhere would wait in the pending queue)
        timeout=50,
    )
    assert kind == "failed" and "no candidate cluster can place an instance" in env["data"]["reason"], env
    assert "no answer in time" not in env["data"]["reason"]  # every cluster answered: no patience spent
    # decided on every candidate's answer (none missing), each a score 0, in the one round
    (post,) = [e["data"] for s, e, _ in await c.history(bid) if s.endswith(".post_dry_run")]
    assert post["missing"] == [] and post["scores"] and set(post["scores"].values()) == {0.0}, post


NEVER_FITS = """
class NeverFits:
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input_data, context):
        return {"selection_score_data": {"score": 0.0, "node_info": {}}}
"""


async def _drained(system: System, durable: str, timeout: float = 30) -> None:
    from aios_blocks.bus import subjects

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = await system.client.bus.js.consumer_info(subjects.STREAM, durable)
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"consumer {durable} still busy after {timeout}s")


async def test_a_node_announced_as_already_recorded_changes_nothing_and_a_changed_one_is_refreshed(system: System) -> None:
    """`blocks cluster add` writes Redis and publishes a registration per node; the controller must
    not answer each of those with an inventory hint (10,000 of them made every worker re-read most
    of its inventory). A real change is recorded and hinted."""
    from aios_blocks.bus import subjects
    from aios_blocks.schemas.events import NodeRegistered
    from aios_blocks.schemas.spec import Node

    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=1)
    await _drained(system, subjects.LIFECYCLE.durable)
    hints: list[dict[str, Any]] = []

    async def on_hint(msg: Any) -> None:
        hints.append(json.loads(msg.data))

    await c.bus.nc.subscribe(subjects.cluster_inventory("c0"), cb=on_hint)
    meta = await c.store.node_meta("c0-n0")
    assert meta is not None
    same = NodeRegistered(meta["spec"])
    await c.bus.publish(subjects.node_registered("c0-n0"), "node.registered", same, "again:c0-n0")
    await _drained(system, subjects.LIFECYCLE.durable)
    await c.bus.nc.flush()
    assert hints == []
    changed = Node.model_validate({**meta["spec"], "labels": {**meta["spec"]["labels"], "zone": "z9"}})
    await c.bus.publish(subjects.node_registered("c0-n0"), "node.registered", NodeRegistered(changed.model_dump(mode="json")), "changed:c0-n0")
    await _drained(system, subjects.LIFECYCLE.durable)
    for _ in range(50):
        if hints:
            break
        await asyncio.sleep(0.1)
    assert [{k: h[k] for k in ("cluster", "nodes")} for h in hints] == [{"cluster": "c0", "nodes": ["c0-n0"]}]
    assert hints[0]["origin"]  # the controller that sent it (it skips its own hints)
    assert (await c.store.node_meta("c0-n0"))["spec"]["labels"]["zone"] == "z9"
