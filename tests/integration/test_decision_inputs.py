"""Policy inputs are not stored: every recorded decision's input is rebuilt by replaying the stream
(``recovery.inputs``) and is bit-for-bit the one the policy got (its recorded digest), and running
the policy again on it gives the recorded output. Real NATS JetStream and Redis, real workers, a
burst of blocks placed at once (so steps read state that other steps are changing)."""

from __future__ import annotations

import asyncio
import json

import msgspec

from aios_blocks.bus.catalog import E
from aios_blocks.policies.contract import essential
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.events import input_digest, input_digest_of

from .conftest import System, event_kind
from .test_cli import blocks

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 4}


async def _rerun(rt: PolicyRuntime, d: dict) -> bytes:
    rule = {"name": d["kind"], "policyRuleURI": d["uri"], "parameters": {}, "settings": {}}
    return msgspec.json.encode(await rt.invoke(rule, f"{d['block_id']}.{d['kind']}", d["input"], {}))


async def test_every_recorded_decision_is_rebuilt_bit_for_bit_and_reruns_to_its_output(system: System) -> None:
    c = system.client
    for i in range(3):
        await c.add_sim_cluster(f"rbin{i}", nodes=6, gpus=4)
    bids = set(await asyncio.gather(*(c.submit(dict(SPEC)) for _ in range(8))))
    done = await system.wait_all(bids, timeout=120)
    assert {k for k, _ in done.values()} <= {"ready", "failed"} and len(done) == len(bids)
    ready = sorted(b for b, (k, _) in done.items() if k == "ready")
    assert ready
    # a scale step too: its input carries block_metrics (given, not state) and the block's instances
    req = await c.scale_request(ready[0])
    async with asyncio.timeout(60):
        async for subject, env in c.follow(ready[0]):
            if event_kind(subject) in ("placement", "scale.failed") and env["data"].get("request_id") == req.request_id:
                break

    # nothing stores an input: no input message, no input inside a decision record
    history = await c.history()
    assert not any(s.startswith("aios.input.") for s, _, _ in history)
    datas = [e.get("data") or {} for _, e, _ in history]
    datas += [a for data in datas for a in data.get("answers") or []]  # dry_run answers, carried by post_dry_run
    raw_decisions = [d for data in datas for d in data.get("decisions") or []]
    assert any(d["action"] == "dry_run" for d in raw_decisions)
    assert raw_decisions and all("input" not in d and "input_subject" not in d for d in raw_decisions)
    assert all(d["at"] > 0 for d in raw_decisions if d["action"] != "post_dry_run")

    decisions = await c.decisions()
    assert len(decisions) == len(raw_decisions)
    actions = {d["action"] for d in decisions}
    assert {"selection", "dry_run", "post_dry_run", "allocation", "scale"} <= actions
    bad = [(d["block_id"], d["action"], d["input_check"]) for d in decisions if d["input_check"] != "rebuilt"]
    assert not bad, bad
    rt = PolicyRuntime()
    for d in decisions:
        assert input_digest_of(d["input"]) == d["input_digest"]
        assert d["input"]["action"] == d["action"]
        if d["action"] in ("dry_run", "allocation", "scale"):
            assert d["input"]["payload"]["block"]["blockId"] == d["block_id"]
        if d["action"] == "scale":
            assert "block_metrics" in d["input"]["payload"]
        # the policy again, on the rebuilt input: the recorded output, byte for byte (where the
        # record keeps only the chosen cluster ids, the whole output's digest)
        again = await _rerun(rt, d)
        if d.get("output_digest"):
            assert input_digest(again) == d["output_digest"], (d["block_id"], d["action"])
            assert essential(d["action"], msgspec.json.decode(again)) == d["output"]
        else:
            assert again == msgspec.json.encode(d["output"]), (d["block_id"], d["action"])
    assert {d["action"] for d in decisions if d.get("output_digest")} == {"selection", "post_dry_run"}


async def test_policy_input_and_explain_use_the_rebuilt_input(system: System) -> None:
    assert blocks(system, "cluster", "add", "rbex1", "--nodes", "2", "--gpus", "2").returncode == 0
    _, kind, _ = await system.submit_and_wait(
        {"blockComponentURI": "aios://test/model", "blockId": "rbex-in", "minInstances": 2, "maxInstances": 2})
    assert kind == "ready"
    r = blocks(system, "policy", "input", "rbex-in", "--step", "allocation", "--index", "1")
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout)
    recorded = [d for d in await system.client.decisions(bid="rbex-in") if d["action"] == "allocation"]
    assert input_digest_of(second) == recorded[1]["input_digest"]
    # the second call of the gang sees the first call's choice taken
    first_node = recorded[0]["output"]["node_id"]
    gpus = {g["id"]: g for g in second["payload"]["cluster_metrics"]["nodes"][first_node]["gpus"]}
    assert all(gpus[g]["instances"] == 1 for g in recorded[0]["output"]["gpus"])
    r = blocks(system, "explain", "rbex-in", "--json", "--inputs")
    assert r.returncode == 0, r.stderr
    x = json.loads(r.stdout)
    assert x["decisions"]["inputs"] == {"rebuilt": x["decisions"]["count"]}
    assert E.block_placement.name  # the placement event still carries the allocation calls
