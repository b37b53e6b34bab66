"""GPU topology end to end (issue 38, docs/topology.md): a simulated node registered with the
`nvlink-pairs-4` profile (`blocks node add --gpu-topology`) shows it in `blocks node get`; two
2-GPU blocks land on its two NVLink pairs (without the topology, the allocator's own order would
split a pair for one of them) and `blocks explain` says the tier each got and the best the node
had. Real NATS JetStream and Redis, real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import System
from .test_agent import Agents, running_on
from .test_cli import blocks

PAIRS = [{"tp-n0-g0", "tp-n0-g1"}, {"tp-n0-g2", "tp-n0-g3"}]


async def test_two_2gpu_blocks_land_on_the_nvlink_pairs_and_explain_says_so(system: System) -> None:
    for args in (("cluster", "add", "tp"), ("node", "add", "tp-n0", "--cluster", "tp", "--gpu-topology", "nvlink-pairs-4")):
        r = blocks(system, *args)
        assert r.returncode == 0, r.stderr
    r = blocks(system, "node", "get", "tp-n0", "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert len(view["gpus"]) == 4 and view["topology"]["profile"] == "nvlink-pairs-4"
    r = blocks(system, "node", "get", "tp-n0")
    assert r.returncode == 0 and "profile nvlink-pairs-4" in r.stdout and "NV4" in r.stdout and "HOST_BRIDGE" in r.stdout, r.stdout

    got = []
    for bid in ("tp-x", "tp-b"):  # binpack alone gives tp-x GPUs 1,2 (its tie-break order)
        _, kind, env = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": bid,
                                                     "minInstances": 1, "maxInstances": 1, "resources": {"gpus": 2}})
        assert kind == "ready", env
        (inst,) = (await system.client.store.instances(bid)).values()
        got.append(set(inst["gpus"]))
        assert got[-1] in PAIRS, got
        r = blocks(system, "explain", bid, "--json")
        assert r.returncode == 0, r.stderr
        (placed,) = json.loads(r.stdout)["instances"].values()
        assert placed["topology"] == {"tier": "NVLINK", "best": "NVLINK"}, placed
        r = blocks(system, "explain", bid)
        assert "GPU link tier NVLINK (best the node had free: NVLINK)" in r.stdout, r.stdout
    assert sorted(got, key=sorted) == PAIRS, got


def _agent(system: System, tmp_path: Path, nid: str, profile: str) -> subprocess.Popen[bytes]:
    """`blocks agent` with the process runtime and a topology profile (as test_agent's agents, as the node's own user)."""
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url}
    env.pop("AIOS_REDIS_URL", None)
    if system.servers is not None:
        env.update(system.servers.agent_env(nid))
    with open(tmp_path / f"agent-{nid}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", nid, "--cluster", "tpa", "--runtime", "process",
             "--gpu-topology", profile, "--cpu", "8", "--memory", "16384", "--heartbeat-s", "0.5",
             "--agent-dir", str(tmp_path / "agent")],
            env=env, stdout=log, stderr=log, start_new_session=True,
        )


async def test_an_agent_process_reports_its_profile_and_its_instance_process_gets_a_pair(system: System, tmp_path: Path) -> None:
    """`blocks agent --runtime process --gpu-topology nvlink-pairs-4` (4 simulated GPUs): its
    registration carries the topology; with GPU 0 held by a 1-GPU block, a 2-GPU instance's
    process runs with the free NVLink pair in its environment (the allocator alone splits one: 1,3)."""
    a = Agents(system, "process", tmp_path)
    a.procs["tpa-n0"] = _agent(system, tmp_path, "tpa-n0", "nvlink-pairs-4")
    try:
        await a.wait_registered("tpa-n0")
        meta = await system.client.store.node_meta("tpa-n0")
        assert meta is not None and meta["spec"]["topology"]["profile"] == "nvlink-pairs-4"
        assert [g["id"] for g in meta["spec"]["gpus"]] == [f"GPU-tpa-n0-{i}" for i in range(4)]
        comp = a.component()
        await system.client.add_component(comp)
        gpus = []
        for bid, n in (("tpa-one", 1), ("tpa-two", 2)):
            _, kind, ev = await system.submit_and_wait({"blockComponentURI": comp["componentURI"], "blockId": bid, "minInstances": 1,
                                                        "maxInstances": 1, "resources": {"gpus": n}}, timeout=150)
            assert kind == "ready", ev
            (inst,) = (await system.client.store.instances(bid)).values()
            gpus.append(inst["gpus"])
        assert len(gpus[0]) == 1
        pair = sorted(gpus[1])
        assert pair in (["GPU-tpa-n0-0", "GPU-tpa-n0-1"], ["GPU-tpa-n0-2", "GPU-tpa-n0-3"]) and gpus[0][0] not in pair, gpus
        (proc,) = [i for i in await running_on(a, "tpa-n0") if i.block_id == "tpa-two"]
        seen = await a.environment(proc)
        assert sorted(seen["AIOS_GPUS"].split(",")) == pair
    finally:
        a.stop_all()
        for inst in await a.runtime().list("tpa-n0"):
            await a.runtime().stop(inst.handle, 0)
