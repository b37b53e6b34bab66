"""Commands wait for *their own* outcome: `submit --wait` follows only what answers its create,
`scale` / `reassign` / `delete` wait by default and exit non-zero when the request fails."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from .conftest import System
from .test_cli import blocks


def _spec(tmp_path: Path, bid: str, lo: int = 1, hi: int = 2) -> str:
    f = tmp_path / f"{bid}.yaml"
    f.write_text(f"blockComponentURI: aios://test/model\nblockId: {bid}\nminInstances: {lo}\nmaxInstances: {hi}\n")
    return str(f)


async def test_resubmitting_an_id_in_use_prints_the_rejection_and_exits_4(system: System, tmp_path: Path) -> None:
    assert blocks(system, "cluster", "add", "c1", "--nodes", "2", "--gpus", "2").returncode == 0
    spec = _spec(tmp_path, "w-dup")
    r = blocks(system, "submit", spec, "--wait")
    assert r.returncode == 0 and "ready" in r.stdout, r.stdout + r.stderr
    r = blocks(system, "submit", spec, "--wait")  # the old history says "ready": it must not count
    assert r.returncode == 4, r.stdout + r.stderr
    assert "rejected" in r.stderr and "$.blockId" in r.stderr and "in use" in r.stderr
    assert not [line for line in r.stdout.splitlines() if line.startswith(("ready", "parsed", "placement"))], r.stdout


async def test_a_burst_of_creates_of_one_id_answers_each_create_once(system: System) -> None:
    await system.client.add_sim_cluster("c1", nodes=2, gpus=2)
    spec = {"blockComponentURI": "aios://test/model", "blockId": "w-burst", "minInstances": 1, "maxInstances": 1}
    reqs = await asyncio.gather(*(system.client.create(spec) for _ in range(5)))
    outcomes = await asyncio.gather(*(system.client.outcome(r, 60) for r in reqs))
    kinds = sorted(kind for _, kind, _ in outcomes)
    assert kinds == ["ready", "rejected", "rejected", "rejected", "rejected"], kinds
    for req, (ok, kind, env) in zip(reqs, outcomes, strict=True):
        assert env["data"]["gen"] == req.seq  # every answer is tied to the create it answers
        assert ok == (kind == "ready")


async def test_scale_reassign_delete_wait_for_their_outcome(system: System, tmp_path: Path) -> None:
    assert blocks(system, "cluster", "add", "c1", "--nodes", "2", "--gpus", "2").returncode == 0
    assert blocks(system, "submit", _spec(tmp_path, "w-ops", 1, 2), "--wait").returncode == 0
    r = blocks(system, "scale", "w-ops")
    assert r.returncode == 0 and "scale done" in r.stdout and "running on c1-n" in r.stdout, r.stdout + r.stderr
    block = json.loads(blocks(system, "get", "w-ops", "--json").stdout)
    assert len(block["instances"]) == 2
    r = blocks(system, "scale", "w-ops")  # past maxInstances
    assert r.returncode == 3 and "maxInstances" in r.stderr, r.stdout + r.stderr
    r = blocks(system, "reassign", "w-ops", "w-ops-nope")
    assert r.returncode == 1 and "no instance 'w-ops-nope'" in r.stderr
    r = blocks(system, "reassign", "w-ops", "w-ops-0")
    assert r.returncode == 0 and "reassignment done" in r.stdout, r.stdout + r.stderr
    r = blocks(system, "scale", "w-ops", "--no-wait")
    assert r.returncode == 0 and "blocks watch w-ops" in r.stdout
    r = blocks(system, "delete", "w-ops")
    assert r.returncode == 0 and "delete done" in r.stdout, r.stdout + r.stderr
    assert json.loads(blocks(system, "get", "w-ops", "--json").stdout)["status"] == "deleted"
    r = blocks(system, "delete", "w-ops")
    assert r.returncode == 1 and "already deleted" in r.stderr
    r = blocks(system, "delete", "w-never")
    assert r.returncode == 1 and "no block 'w-never'" in r.stderr
