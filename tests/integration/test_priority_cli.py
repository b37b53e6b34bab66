"""Priority classes and quotas on real servers (issue 36, docs/priority.md): the commands, a block's
class in its IR and ``blocks get``, usage vs nominal vs borrowed from the state, and ``blocks
recover``'s fold rebuilding the classes and quotas exactly from the stream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.app import app
from aios_blocks.recovery import image as im
from aios_blocks.recovery.rebuild import fold_stream, read_image
from aios_blocks.state import keys

from .conftest import System


class _Done:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def blocks(system: System, *args: str) -> Any:
    """The command in this process (a thread: it runs its own event loop), against the servers."""
    env = {"AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}
    r = CliRunner().invoke(app, list(args), env=env)
    return _Done(r.exit_code, r.stdout, r.stderr)


async def run(system: System, *args: str) -> Any:
    return await asyncio.to_thread(blocks, system, *args)


async def _ok(system: System, *args: str) -> str:
    r = await run(system, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(r.stdout)


async def test_priority_classes_and_quotas_from_the_command_line(system: System, tmp_path: Path) -> None:
    await _ok(system, "cluster", "add", "c1", "--nodes", "2", "--gpus", "2")
    await _ok(system, "priority-class", "add", "high", "1000", "--description", "serving")
    await _ok(system, "priority-class", "add", "normal", "100", "--default")
    await _ok(system, "priority-class", "add", "batch", "0", "--default")  # the default moves to batch
    rows = json.loads(await _ok(system, "priority-class", "list", "--json"))
    assert [(r["name"], r["value"], r["default"]) for r in rows] == [("high", 1000, False), ("normal", 100, False), ("batch", 0, True)]

    # a block names its class, another gets the default; an unknown class is refused with the classes
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "hi", "minInstances": 1,
                                "maxInstances": 1, "priorityClass": "high", "preemptible": False,
                                "labels": {"tenant": "team-a"}}))
    assert "ready" in await _ok(system, "submit", str(spec), "--wait")
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "lo", "minInstances": 2,
                                "maxInstances": 2, "labels": {"tenant": "team-b"}}))
    assert "ready" in await _ok(system, "submit", str(spec), "--wait")
    hi = json.loads(await _ok(system, "get", "hi", "--json"))["ir"]
    assert (hi["priorityClass"], hi["priority"], hi["preemptible"]) == ("high", 1000, False)
    lo = json.loads(await _ok(system, "get", "lo", "--json"))["ir"]
    assert (lo["priorityClass"], lo["priority"]) == ("batch", 0) and "preemptible" not in lo
    assert "priority high (1000); not preemptible" in await _ok(system, "get", "hi")
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "nope", "minInstances": 1,
                                "maxInstances": 1, "priorityClass": "urgent"}))
    r = await run(system, "submit", str(spec), "--wait")
    assert r.returncode == 4 and "unknown priority class 'urgent'" in r.stdout + r.stderr
    assert "high (1000), normal (100), batch (0)" in r.stdout + r.stderr

    # quotas: team-b borrows one GPU of team-a's idle nominal in their cohort
    await _ok(system, "quota", "set", "team-a", "--nominal", "sim-h100:gpus=2,cpu=8", "--cohort", "lab")
    await _ok(system, "quota", "set", "team-b", "--nominal", "sim-h100:gpus=1", "--cohort", "lab")
    await _ok(system, "quota", "set", "gone", "--nominal", "*:gpus=1")
    await _ok(system, "quota", "set", "gone", "--remove")
    rows = {r["tenant"]: r for r in json.loads(await _ok(system, "quota", "list", "--json"))}
    assert set(rows) == {"team-a", "team-b"}
    assert rows["team-a"]["usage"] == {"cpu": 1.0, "memory": 1024.0, "gpus": 1.0} and rows["team-a"]["borrowed"] == {}
    assert rows["team-b"]["usage"]["gpus"] == 2.0 and rows["team-b"]["borrowed"] == {"gpus": 1.0}
    got = json.loads(await _ok(system, "quota", "get", "team-b", "--json"))
    assert got["quota"]["cohort"] == "lab" and got["usage"][0]["nominal"] == {"gpus": 1.0}
    assert (await run(system, "quota", "get", "nobody")).returncode == 1
    r = await run(system, "quota", "set", "team-c", "--nominal", "A100:gpus")
    assert r.returncode == 2

    await _ok(system, "priority-class", "remove", "normal")
    assert (await run(system, "priority-class", "remove", "normal")).returncode == 1
    assert [r["name"] for r in json.loads(await _ok(system, "priority-class", "list", "--json"))] == ["high", "batch"]

    # a dry run of a preemption: 1 GPU free, a high block of 2 needs lo's (batch, a gang of 2: whole)
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "urgent", "minInstances": 2,
                                "maxInstances": 2, "priorityClass": "high"}))
    plan = json.loads(await _ok(system, "preempt", "--dry-run", str(spec), "--cluster", "c1", "--json"))
    assert plan["input"]["block"]["priority"] == 1000
    assert {c["block_id"]: c["preemptible"] for c in plan["input"]["candidates"]} == {"hi": False, "lo": True}
    assert sorted(plan["output"]["blocks"]) == ["lo"] and len(plan["output"]["blocks"]["lo"]) == 2
    assert plan["quota"]["tenant"] is None and plan["quota"]["verdict"] == "admit"
    assert "victim block" in await _ok(system, "preempt", "--dry-run", str(spec), "--cluster", "c1")
    # team-a asks 2 more within its nominal? it uses 1 of 2: 3 > 2, over; the cohort (3) is full: wait
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "urgent", "minInstances": 1,
                                "maxInstances": 1, "priorityClass": "high", "labels": {"tenant": "team-a"}}))
    plan = json.loads(await _ok(system, "preempt", "--dry-run", str(spec), "--cluster", "c1", "--json"))
    # team-a (1 of its 2) asks 1 more: within its nominal, but team-b borrows the cohort's third GPU
    assert plan["quota"]["verdict"] == "reclaim" and plan["quota"]["victims"] == ["lo"]
    assert plan["quota"]["victim_reason"] == "InCohortReclamation"
    assert json.loads(await _ok(system, "get", "lo", "--json"))["status"] == "ready"  # nothing was evicted

    # `blocks recover` rebuilds both from the stream: the fold's image equals Redis
    c = system.client
    redis_image = await read_image(c.store.r)
    folded = (await fold_stream(c.bus)).image(include_gathers=False)
    assert keys.PRIORITY_CLASSES in folded and keys.QUOTAS in folded
    assert folded[keys.PRIORITY_CLASSES] == redis_image[keys.PRIORITY_CLASSES]
    assert folded[keys.QUOTAS] == redis_image[keys.QUOTAS]
    assert im.digest(redis_image) == im.digest(folded), im.diff(redis_image, folded)


async def test_removing_a_quota_that_is_not_there_is_refused(system: System) -> None:
    """It said 'quota of t removed' (exit 0) and stored a removal for a tenant that had none."""
    await _ok(system, "quota", "set", "team-a", "--nominal", "*:gpus=8", "--cohort", "lab")
    assert "removed" in await _ok(system, "quota", "set", "team-a", "--remove")
    r = await run(system, "quota", "set", "team-a", "--remove")
    assert r.returncode == 1 and "no quota for tenant 'team-a'" in r.stderr, r.stdout + r.stderr
    r = await run(system, "quota", "set", "nobody", "--remove")
    assert r.returncode == 1 and "no quota for tenant 'nobody'" in r.stderr, r.stdout + r.stderr


async def test_a_preemption_dry_run_whose_policy_fails_exits_1_and_says_why_as_written(
        system: System, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--json printed the policy's "error" and exited 0; the text output read its brackets as markup."""
    monkeypatch.setenv("AIOS_POLICY_TIMEOUT_S", "120")  # the CLI's own call, on a loaded machine: fails, not times out
    monkeypatch.setenv("AIOS_STARLARK_CALL_TIMEOUT_S", "120")
    await _ok(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "1")
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "b", "minInstances": 1, "maxInstances": 1}))
    r = await run(system, "preempt", "--dry-run", str(spec), "--cluster", "c1", "--policy", "bogus", "--json")
    assert r.returncode == 1 and "unknown policyRuleURI 'bogus'" in json.loads(r.stdout)["output"]["error"], r.stdout + r.stderr
    bad = tmp_path / "bad.star"
    bad.write_text('def eval(parameters, input_data, context):\n    fail("needs [bold]more[/bold] room")\n')
    await _ok(system, "policy", "add", "bad-preempt", str(bad))
    r = await run(system, "preempt", "--dry-run", str(spec), "--cluster", "c1", "--policy", "registry:bad-preempt")
    assert r.returncode == 1 and "needs [bold]more[/bold] room" in r.stderr, r.stdout + r.stderr


async def test_a_preemption_dry_run_of_a_rejected_spec_exits_2_as_the_submit_dry_run(system: System, tmp_path: Path) -> None:
    """`blocks preempt --dry-run` exited 4 on a spec the parser rejects, `blocks submit --dry-run` 2
    (bad input): a script checking one code for both was told different things."""
    await _ok(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "1")
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "b", "minInstances": 1,
                                "maxInstances": 1, "priorityClass": "no-such-class"}))
    submit = await run(system, "submit", str(spec), "--dry-run")
    preempt = await run(system, "preempt", "--dry-run", str(spec), "--cluster", "c1")
    assert submit.returncode == preempt.returncode == 2, submit.stdout + submit.stderr + preempt.stdout + preempt.stderr
    assert "unknown priority class 'no-such-class'" in preempt.stderr and "rejected" in preempt.stderr, preempt.stderr


async def test_a_dry_runs_preemption_forecast_asks_the_blocks_own_preemption_policy(system: System, tmp_path: Path) -> None:
    """`submit --dry-run` said "would preempt lo" from builtin:preempt-min whatever preemption policy
    the block names: the walker asks the block's own, which here never preempts."""
    await _ok(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "1")
    await _ok(system, "priority-class", "add", "high", "1000")
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "lo", "minInstances": 1, "maxInstances": 1}))
    assert "ready" in await _ok(system, "submit", str(spec), "--wait")
    never = tmp_path / "never.star"
    never.write_text('def eval(parameters, input_data, context):\n    return {"victims": {}, "reason": "this one never preempts"}\n')
    await _ok(system, "policy", "add", "never-preempt", str(never))
    urgent = {"blockComponentURI": "aios://test/model", "blockId": "urgent", "minInstances": 1, "maxInstances": 1,
              "priorityClass": "high"}
    spec.write_text(json.dumps(urgent))
    r = await run(system, "submit", str(spec), "--dry-run")
    assert r.returncode == 4 and "would preempt lo" in " ".join(r.stdout.split()), r.stdout + r.stderr  # the default's
    from .conftest import COMPONENT

    comp = tmp_path / "never.json"  # the same model, but its component names its preemption policy
    comp.write_text(json.dumps({**COMPONENT, "componentURI": "aios://test/never", "policies": [
        *COMPONENT["policies"], {"name": "preemption", "policyRuleURI": "registry:never-preempt", "parameters": {}, "settings": {}}]}))
    await _ok(system, "component", "add", str(comp))
    spec.write_text(json.dumps({**urgent, "blockComponentURI": "aios://test/never"}))
    r = await run(system, "submit", str(spec), "--dry-run")
    said = " ".join(r.stdout.split())
    assert r.returncode == 4 and "would wait behind 0 block(s)" in said and "would preempt" not in said, r.stdout + r.stderr


async def test_a_nan_quota_an_older_version_stored_is_read_as_no_quota_not_a_failed_placement(system: System, tmp_path: Path) -> None:
    """`blocks quota set t --nominal '*:gpus=nan'` stored the NaN (as null: msgspec's JSON) before
    the schema refused it; every later read of the quotas failed: the placements' quota gate
    (a block stayed 'selecting'), quota list/get. It reads as no quota for that tenant now, and
    `--remove` still drops it."""
    from aios_blocks.state.priority import PriorityStore

    await _ok(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "2")
    await _ok(system, "quota", "set", "fine", "--nominal", "*:gpus=1")
    # written as the older version wrote it: the record as dumped, through the state's own store
    await PriorityStore(system.client.store.r).put_quota({"tenant": "old", "cohort": None, "nominal": {"*": {"gpus": float("nan")}},
                                                          "borrowingLimit": None}, "old")
    assert "null" in str(await system.client.store.r.hget(keys.QUOTAS, "old"))
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "b-old", "minInstances": 1,
                                "maxInstances": 1, "labels": {"tenant": "old"}}))
    r = await run(system, "submit", str(spec), "--wait", "--timeout", "60")
    assert r.returncode == 0 and "ready" in r.stdout, r.stdout + r.stderr
    rows = json.loads(await _ok(system, "quota", "list", "--json"))  # it failed on the record too
    assert {row["tenant"] for row in rows} == {"fine", "old"} and all(not row["nominal"] for row in rows if row["tenant"] == "old"), rows
    assert "removed" in await _ok(system, "quota", "set", "old", "--remove")
    assert await system.client.store.r.hget(keys.QUOTAS, "old") is None
