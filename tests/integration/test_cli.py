"""The `blocks` command as a user runs it: a real process against real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import System

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [sys.executable, "-m", "aios_blocks.cli"]


def blocks(system: System, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}
    return subprocess.run([*BLOCKS, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


async def test_submit_wait_exit_codes_get_and_replay(system: System, tmp_path: Path) -> None:
    r = blocks(system, "cluster", "add", "c1", "--nodes", "2", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    good = tmp_path / "good.yaml"
    good.write_text("blockComponentURI: aios://test/model\nblockId: cli-good\nminInstances: 1\nmaxInstances: 2\n")
    r = blocks(system, "submit", str(good), "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready" in r.stdout

    r = blocks(system, "get", "cli-good", "--json")
    block = json.loads(r.stdout)
    assert block["status"] == "ready" and len(block["instances"]) == 1

    r = blocks(system, "replay", "cli-good", "--json")
    kinds = [json.loads(line)["subject"].split(".", 3)[3] for line in r.stdout.splitlines()]
    assert kinds[0] == "submitted" and kinds[-1] == "ready"  # the create as the parser stored it in AIOS
    seqs = [json.loads(line)["seq"] for line in r.stdout.splitlines()]
    assert seqs == sorted(seqs)

    r = blocks(system, "explain", "cli-good", "--json")
    x = json.loads(r.stdout)
    assert x["status"] == "ready" and x["rounds"][0]["chosen"] == "c1"
    # c1 is the only candidate: no dry run was asked, its skipped answer says so (AIOS_DRY_RUN_SINGLE)
    assert x["rounds"][0]["dry_run"]["c1"]["score"] == 1.0 and x["rounds"][0]["dry_run"]["c1"]["skipped"]
    [(iid, inst)] = x["instances"].items()
    assert inst["status"] == "running" and inst["node"] == block["instances"][iid]["node"]
    assert x["decisions"]["count"] == 3 and x["decisions"]["errors"] == 0  # selection, post_dry_run, allocation
    r = blocks(system, "explain", "cli-good")
    assert r.returncode == 0 and "clusterAllocator chose c1 with score 1" in r.stdout

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "cli-bad", "minInstances": 3, "maxInstances": 1}))
    r = blocks(system, "submit", str(bad), "--wait")
    assert r.returncode == 4
    assert "greater than maxInstances" in r.stdout

    # a user's text is shown as written, not read as Rich markup: "x[ocr]y" lost its "[ocr]"
    brackets = tmp_path / "brackets.json"
    brackets.write_text(json.dumps({"blockComponentURI": "aios://test/model", "blockId": "cli-brackets", "minInstances": 1,
                                    "maxInstances": 1, "x[ocr]y": 1, "[bold]": 2}))
    assert blocks(system, "submit", str(brackets), "--wait").returncode == 4
    for args in (("get", "cli-brackets"), ("explain", "cli-brackets"), ("list",)):
        r = blocks(system, *args)
        assert r.returncode == 0 and "x[ocr]y" in r.stdout and "[bold]" in r.stdout, (args, r.stdout)

    away = tmp_path / "away.yaml"  # replay explains per node why affinity rejected it
    away.write_text(
        "blockComponentURI: aios://test/model\nblockId: cli-away\nminInstances: 1\nmaxInstances: 1\n"
        "affinity:\n  - {category: Topology, strength: Required, anti: true, target: {type: RackId, value: 0}}\n"
    )
    assert blocks(system, "submit", str(away), "--wait").returncode == 0
    r = blocks(system, "replay", "cli-away")
    assert "c1-n0: rejected by entry 0: Required away from rack 0" in r.stdout, r.stdout
    x = json.loads(blocks(system, "explain", "cli-away", "--json").stdout)
    assert x["rounds"][0]["dry_run"]["c1"]["rejected_nodes"] == {"c1-n0": "rejected by entry 0: Required away from rack 0"}

    huge = tmp_path / "huge.yaml"  # 8 GPUs per instance: no node has them
    huge.write_text(
        "blockComponentURI: aios://test/model\nblockId: cli-huge\nminInstances: 1\nmaxInstances: 1\n"
        "resources: {gpus: 8}\nqueue: false\n"
    )
    r = blocks(system, "submit", str(huge), "--wait")
    assert r.returncode == 3
    assert "no cluster passed the filter rule" in r.stdout
    x = json.loads(blocks(system, "explain", "cli-huge", "--json").stdout)
    assert x["status"] == "failed" and "c1" in x["rounds"][0]["filtered"]
    assert x["failures"][-1]["reason"].startswith("no cluster passed the filter rule")

    # an id that would be a wildcard or a second subject token is refused before anything is sent
    sneaky = tmp_path / "sneaky.yaml"
    sneaky.write_text("blockComponentURI: aios://test/model\nblockId: 'cli.*'\nminInstances: 1\nmaxInstances: 1\n")
    for args in (("submit", str(sneaky)), ("scale", "cli-*"), ("delete", "a.b"), ("reassign", "cli-good", "x>"),
                 ("replay", "a b")):
        r = blocks(system, *args)
        assert r.returncode == 2 and "is not a valid id" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_policy_run_prints_result_and_fails_cleanly(tmp_path: Path) -> None:
    policy = tmp_path / "first_node.py"
    policy.write_text(
        "class FirstNode:\n"
        "    def __init__(self, rule_id, settings, parameters):\n"
        "        self.settings = settings\n"
        "    def eval(self, parameters, input_data, context):\n"
        "        nodes = input_data['payload']['healthy_nodes']\n"
        "        if not nodes:\n"
        "            raise ValueError('no nodes')\n"
        "        return {'node_id': nodes[0], 'gpus': []}\n"
    )
    inp = tmp_path / "in.json"
    inp.write_text(json.dumps({"action": "allocation", "payload": {"healthy_nodes": ["n7", "n8"]}}))
    r = subprocess.run([*BLOCKS, "policy", "run", str(policy), "--input", str(inp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"node_id": "n7", "gpus": []}
    inp.write_text(json.dumps({"action": "allocation", "payload": {"healthy_nodes": []}}))
    r = subprocess.run([*BLOCKS, "policy", "run", str(policy), "--input", str(inp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no nodes" in r.stderr
