"""A node id is one node in every cluster (its subjects, the node index, the stream's fold):
``blocks node add``, ``blocks cluster add --nodes`` and ``blocks cluster import`` refuse an id another
cluster holds (exit 1, nothing registered). They registered it again: the stream's fold moved the
node to the new cluster while Redis kept it in both, and ``blocks check`` found the two apart."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from .conftest import System


async def test_a_node_id_held_by_another_cluster_is_refused(system: System, tmp_path: Path) -> None:
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}

    async def cli(*args: str) -> tuple[int, str]:  # the real entry point: its one-line refusals
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aios_blocks.cli", *args], env=env,
                                    capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout + r.stderr

    assert (await cli("cluster", "add", "c1", "--nodes", "2", "--gpus", "1"))[0] == 0
    code, out = await cli("node", "add", "c1-n0", "--cluster", "c2", "--gpus", "1")
    assert code == 1 and "c1-n0 (in c1) already registered in another cluster" in out, out
    csv = tmp_path / "nodes.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nc1-n1,8000,65536,1,T4\nfresh,8000,65536,1,T4\n")
    code, out = await cli("cluster", "import", str(csv), "--cluster", "c3")
    assert code == 1 and "c1-n1 (in c1)" in out, out
    assert set(await system.client.store.clusters()) == {"c1"}  # nothing registered: not c2, not c3
    assert await system.client.store.node_cluster("fresh") is None
    assert (await cli("node", "add", "c1-n0", "--cluster", "c1", "--gpus", "1"))[0] == 0  # its own cluster: an update
    code, out = await cli("check")
    assert code == 0 and "invariants hold" in out, out


async def test_a_node_added_to_a_cluster_that_does_not_exist_is_refused(system: System) -> None:
    """`blocks node add n9 --cluster c11` (a typo of c1) registered a new cluster c11 with its one
    node, unsaid: `blocks cluster add` is how a cluster is made; the node is refused (exit 1) with
    the known clusters and that command, and nothing is registered."""
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}
    run = [sys.executable, "-m", "aios_blocks.cli"]
    r = await asyncio.to_thread(subprocess.run, [*run, "cluster", "add", "c1"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = await asyncio.to_thread(subprocess.run, [*run, "node", "add", "n9", "--cluster", "c11", "--gpus", "1"], env=env,
                                capture_output=True, text=True, timeout=60)
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1 and "no cluster 'c11' (known: c1)" in said and "blocks cluster add c11" in said, said
    assert set(await system.client.store.clusters()) == {"c1"} and await system.client.store.node_cluster("n9") is None
    r = await asyncio.to_thread(subprocess.run, [*run, "node", "add", "n9", "--cluster", "c1", "--gpus", "1"], env=env,
                                capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and await system.client.store.node_cluster("n9") == "c1", r.stdout + r.stderr
