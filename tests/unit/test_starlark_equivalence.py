"""The Starlark twin of builtin:binpack places exactly like the Python built-in on the same
inventories (random ones, seeded), through the same PolicyRuntime."""

from __future__ import annotations

import random
from typing import Any

import pytest

from aios_blocks.handlers.controller import payload
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.errors import PolicyFailed

from .views import EXAMPLES, gpu, node

STAR = str(EXAMPLES / "binpack.star")


def inventory(rng: random.Random) -> dict[str, dict[str, Any]]:
    nodes = {}
    for n in range(rng.randint(1, 12)):
        gpus = []
        for g in range(rng.choice((0, 2, 4, 8))):
            busy = rng.random() < 0.4
            gpus.append(gpu(f"n{n}-g{g}", memory=rng.choice((40, 80)) * 1024, used=rng.choice((0, 8192)) if busy else 0,
                            instances=1 if busy else 0))
        nid = f"n{n}"
        nodes[nid] = node(nid, gpus=gpus, cpu_used=rng.choice((0.0, 8.0, 60.0)), healthy=rng.random() > 0.1)
    return nodes


async def _run(rt: PolicyRuntime, uri: str, input_data: dict[str, Any], settings: dict[str, Any]) -> Any:
    rule = {"name": "resourceAllocator", "policyRuleURI": uri, "parameters": {}, "settings": settings}
    try:
        return await rt.invoke(rule, "eq", input_data, {})
    except PolicyFailed:
        return "infeasible"


@pytest.mark.parametrize("share", [False, True])
async def test_starlark_binpack_matches_builtin_binpack(share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # what is compared is the answer, not the time: a sandbox process started on a box at load 40
    # can take past the 4 s default, and a timeout would read as "infeasible" below
    monkeypatch.setenv("AIOS_STARLARK_CALL_TIMEOUT_S", "120")
    rng = random.Random(20261123 + share)
    rt = PolicyRuntime(allow_files=True)
    compared, placed = 0, 0
    for _ in range(150):
        nodes = inventory(rng)
        needs = {"gpus": rng.choice((0, 1, 2)), "gpuMemory": rng.choice((0, 8192)), "cpu": 4, "memory": 1024}
        ir = {"blockId": "b", "minInstances": 1, "maxInstances": rng.randint(1, 6), "resources": needs, "policies": {}}
        cluster = {"id": "c1", "labels": {}}
        for action in ("dry_run", "allocation"):
            data = {"action": action, "payload": payload(ir, cluster, nodes)}
            settings = {"gpuSharing": share}
            py = await _run(rt, "builtin:binpack", data, settings)
            star = await _run(rt, STAR, {"action": action, "payload": payload(ir, cluster, nodes)}, settings)
            assert star == py, (action, needs, py, star)
            compared += 1
            placed += action == "allocation" and py != "infeasible"
    assert compared == 300
    assert placed >= 50  # most inventories can take the instance: the comparison is not vacuous
