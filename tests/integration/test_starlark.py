"""Starlark policies (seed-000 form and LXD scriptlets) through real workers, registry and CLI."""

from __future__ import annotations

import json
from pathlib import Path

from aios_blocks.cli.client import decisions_of
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import System
from .test_cli import BLOCKS, blocks

UNIT = Path(__file__).resolve().parents[1] / "unit" / "starlark_policies"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SPIN = """
def eval(parameters, input_data, context):
    n = 0
    for i in range(1000000000):
        for j in range(1000000000):
            n += 1
    return {"node_id": "never", "gpus": []}
"""


def _spec(bid: str, uri: str) -> dict:
    return {
        "blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
        "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": uri}}],
    }


async def test_lxd_scriptlet_places_on_most_free_memory_and_logs_into_replay(system: System) -> None:
    c = system.client
    await c.add_cluster(Cluster(id="c0"))
    for n, mem in enumerate((64, 512, 128)):  # GiB
        await c.add_node(Node(id=f"c0-n{n}", cluster="c0", memory=mem * 1024, gpus=[Gpu(id=f"c0-n{n}-g0")]))
    r = blocks(system, "policy", "add", "lxd-mem", str(EXAMPLES / "lxd_most_free_memory.star"))
    assert r.returncode == 0, r.stderr
    bid, kind, env = await system.submit_and_wait(_spec("lxd-1", "registry:lxd-mem"))
    assert kind == "ready", env
    assert next(iter((await c.store.instances(bid)).values()))["node"] == "c0-n1"
    logs = [line for s, e, _ in await c.history(bid) for d in decisions_of(s, e.get("data")) for line in d["logs"]]
    assert ["info", "targeting c0-n1 for new instance lxd-1"] in logs, logs
    r = blocks(system, "replay", bid)
    assert "[info] targeting c0-n1 for new instance lxd-1" in r.stdout


async def test_runaway_starlark_fails_its_step_and_the_worker_lives(system: System, tmp_path: Path) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=2)
    spin = tmp_path / "spin.star"
    spin.write_text(SPIN)
    assert blocks(system, "policy", "add", "spin", str(spin)).returncode == 0
    _, kind, env = await system.submit_and_wait(_spec("spin-1", "registry:spin"))
    assert kind == "failed"
    assert "time limit exceeded" in env["data"]["reason"], env["data"]["reason"]
    _, kind, _ = await system.submit_and_wait({**_spec("after-spin", "builtin:binpack")})
    assert kind == "ready"
    assert system.supervisor.restarts == 0


def test_policy_run_lxd_prints_target_or_rejection(tmp_path: Path) -> None:
    import subprocess

    args = {
        "request": {"name": "foo", "project": "default", "reason": "new", "config": {}, "devices": {}},
        "candidate_members": [{"server_name": "m1"}, {"server_name": "m2"}],
        "member_state": {
            "m1": {"sysinfo": {"free_ram": 1 << 30, "load_averages": [0.1, 0.1, 0.1]}},
            "m2": {"sysinfo": {"free_ram": 8 << 30, "load_averages": [0.5, 0.4, 0.3]}},
        },
    }
    f = tmp_path / "args.json"
    f.write_text(json.dumps(args))
    r = subprocess.run([*BLOCKS, "policy", "run", str(EXAMPLES / "lxd_most_free_memory.star"), "--kind", "lxd", "--input", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"target": "m2"}
    r = subprocess.run([*BLOCKS, "policy", "run", str(UNIT / "lxd_reject_by_name.star"), "--kind", "lxd", "--input", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "placement rejected" in r.stderr, r.stderr


HOG = """
def eval(parameters, input_data, context):
    big = list(range(400000000))
    return {"node_id": "never", "gpus": [str(len(big))]}
"""


async def test_memory_hog_scriptlet_fails_its_step_and_the_worker_lives(system: System, tmp_path: Path) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=2)
    hog = tmp_path / "hog.star"
    hog.write_text(HOG)
    assert blocks(system, "policy", "add", "hog", str(hog)).returncode == 0
    _, kind, env = await system.submit_and_wait(_spec("hog-1", "registry:hog"), timeout=90)
    assert kind == "failed"
    reason = env["data"]["reason"]
    assert "out of memory" in reason or "memory limit" in reason, reason
    _, kind, _ = await system.submit_and_wait(_spec("after-hog", "builtin:binpack"))
    assert kind == "ready"
    assert system.supervisor.restarts == 0
