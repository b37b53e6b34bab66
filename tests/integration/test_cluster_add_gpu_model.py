"""`blocks cluster add --node-type A100` makes A100 GPUs. Found following the README as a
stranger: the nodes it made were of type A100 with GPUs of model `sim-h100`, so a block asking for
`gpuModels: [A100]` found none."""

from __future__ import annotations

import json

from .conftest import System
from .test_cli_flags import _data_dir, cli


async def test_the_node_type_is_the_gpu_model_unless_one_is_given(system: System) -> None:
    d = _data_dir(system)
    assert cli("cluster", "add", "ta", "--nodes", "1", "--gpus", "1", "--node-type", "A100", "--data-dir", d).returncode == 0
    assert cli("cluster", "add", "tb", "--nodes", "1", "--gpus", "1", "--node-type", "L4", "--gpu-model", "NVIDIA-L4",
               "--data-dir", d).returncode == 0
    assert cli("cluster", "add", "tc", "--nodes", "1", "--gpus", "1", "--data-dir", d).returncode == 0
    r = cli("node", "list", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    models = {n["node_id"]: (n["node_type"], [g["model"] for g in n["gpus"]]) for n in json.loads(r.stdout)}
    assert models == {"ta-n0": ("A100", ["A100"]), "tb-n0": ("L4", ["NVIDIA-L4"]), "tc-n0": ("sim-h100", ["sim-h100"])}, models
    _, kind, env = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "wants-a100",
                                                 "minInstances": 1, "maxInstances": 1, "resources": {"gpuModels": ["A100"]}})
    assert kind == "ready", env
    assert {i["node"] for i in (await system.client.store.instances("wants-a100")).values()} == {"ta-n0"}
