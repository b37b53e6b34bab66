"""The GPU trace's requests in the block spec (docs/trace.md): ``gpuShare`` in thousandths beside
``gpuMemory``, ``gpuModels`` as a hard constraint, both checked by the capacity code."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from aios_blocks.policies import capacity
from aios_blocks.schemas.sharing import sharing_problems
from aios_blocks.schemas.spec import ResourceNeeds


def _node(models: list[str], share_free: list[int] | None = None) -> dict[str, Any]:
    return {"node_id": "n", "healthy": True, "cpu": 8.0, "cpu_free": 8.0, "memory": 1024, "memory_free": 1024, "labels": {},
            "gpus": [{"id": f"g{i}", "model": m, "memory": 16384, "memory_used": 0, "memory_free": 16384,
                      "instances": 0, "exclusive": False, "share_free": (share_free or [1000] * len(models))[i]}
                     for i, m in enumerate(models)]}


def test_gpu_share_is_thousandths_and_left_out_when_unset() -> None:
    assert ResourceNeeds(gpus=1, gpuShare=0.46).gpuShare == 0.46
    with pytest.raises(ValidationError, match="thousandths"):
        ResourceNeeds(gpus=1, gpuShare=0.4605)
    with pytest.raises(ValidationError):
        ResourceNeeds(gpus=1, gpuShare=1.5)
    assert ResourceNeeds(gpus=1).model_dump() == {"gpus": 1, "gpuMemory": 0, "cpu": 0.0, "memory": 0}
    assert ResourceNeeds(gpus=1, gpuShare=0.2, gpuModels=["T4"]).model_dump()["gpuModels"] == ["T4"]


def test_sharing_is_bounded_by_a_share_without_a_memory_figure() -> None:
    rule = {"settings": {"gpuSharing": True}}
    assert sharing_problems(rule, {"gpus": 1, "gpuMemory": 0})  # neither bound: refused
    assert sharing_problems(rule, {"gpus": 1, "gpuMemory": 0, "gpuShare": 0.3}) == []


def test_capacity_checks_share_and_models() -> None:
    needs = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 0, "gpuShare": 0.5}
    node = _node(["T4", "T4"], share_free=[400, 600])
    assert [g["id"] for g in capacity.node_fits(node, needs, True) or []] == ["g1"]
    capacity.take(node, ["g1"], needs, True)
    assert node["gpus"][1]["share_free"] == 100 and capacity.node_fits(node, needs, True) is None
    assert capacity.why_not(node, needs, True) == "0 usable GPUs < 1"
    v100 = {"gpus": 1, "cpu": 1, "memory": 0, "gpuModels": ["V100M16", "V100M32"]}
    assert capacity.node_fits(_node(["T4"]), v100, False) is None
    assert capacity.why_not(_node(["T4"]), v100, False) == "no GPU of model V100M16|V100M32 (gpuModels)"
    assert [g["id"] for g in capacity.node_fits(_node(["T4", "V100M32"]), v100, False) or []] == ["g1"]
    # shapes differ by share and models (memoised fits are per shape), and not otherwise
    base = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 0}
    assert capacity.shape(base, True) == (1, 0, 1, 0, True)
    assert capacity.shape(needs, True) != capacity.shape({**needs, "gpuShare": 0.4}, True)


def test_a_sharing_instance_is_told_its_compute_share() -> None:
    from aios_blocks.agent.node_agent import instance_env
    from aios_blocks.handlers.controller import env_for

    def ir(share: bool, resources: dict[str, Any]) -> dict[str, Any]:
        return {"blockId": "b", "resources": resources,
                "policies": {"resourceAllocator": {"settings": {"gpuSharing": share}}}}

    env = env_for(ir(True, {"gpus": 1, "gpuMemory": 0, "gpuShare": 0.455}), "b-0", ["g0"])
    assert env["AIOS_GPU_SHARE"] == "0.455" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "46"  # rounded up
    assert instance_env(env, {}, {})["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "46"
    assert env_for(ir(True, {"gpus": 1, "gpuShare": 0.001}), "b-0", ["g0"])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    for no_share in (ir(False, {"gpus": 1, "gpuShare": 0.5}), ir(True, {"gpus": 1, "gpuMemory": 100})):
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env_for(no_share, "b-0", ["g0"])
