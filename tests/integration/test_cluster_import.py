"""`blocks cluster import` (docs/trace.md): a real inventory registered through the front door,
each node with its own CPUs, memory, GPUs and model, and placed on as such."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import System
from .test_cli_flags import _data_dir, cli

CSV = """sn,cpu_milli,memory_mib,gpu,model
imp-p100,64000,262144,2,P100
imp-cpu,32000,131072,0,nan
imp-v100,96000,786432,8,V100M32
"""


async def test_import_registers_each_node_with_its_own_capacity_and_places_by_it(system: System, tmp_path: Path) -> None:
    d = _data_dir(system)
    path = tmp_path / "nodes.csv"
    path.write_text(CSV)
    r = cli("cluster", "import", str(path), "--cluster", "imp", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["nodes"], info["gpus"], info["new_cluster"], info["registered"]) == (3, 10, True, True)
    r = cli("node", "list", "--cluster", "imp", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    nodes = {n["node_id"]: n for n in json.loads(r.stdout)}
    assert {nid: (n["node_type"], n["cpu"], n["memory"], len(n["gpus"])) for nid, n in nodes.items()} == {
        "imp-p100": ("P100", 64.0, 262144, 2), "imp-cpu": ("cpu", 32.0, 131072, 0), "imp-v100": ("V100M32", 96.0, 786432, 8)}
    assert {g["memory"] for g in nodes["imp-v100"]["gpus"]} == {32768}
    # 20 GiB of GPU memory: only a V100M32 holds it (a P100 has 16 GiB)
    _, kind, env = await system.submit_and_wait({
        "blockComponentURI": "aios://test/model", "blockId": "imp-big", "minInstances": 1, "maxInstances": 1,
        "resources": {"gpus": 1, "gpuMemory": 20480, "cpu": 1, "memory": 1024}})
    assert kind == "ready", env
    insts = await system.client.store.instances("imp-big")
    assert [i["node"] for i in insts.values()] == ["imp-v100"]
    # a bad file: exit 2 with the line and why, nothing registered
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\nimp-x,1000,1024,1,H100\n")
    r = cli("cluster", "import", str(path), "--cluster", "imp2", "--data-dir", d)
    assert r.returncode == 2 and "line 2: unknown GPU model 'H100'" in r.stderr
