"""Block labels (the GPU trace's QoS class, docs/trace.md) and ``blocks trace replay``'s choice of
mode, without servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app
from aios_blocks.schemas.errors import SpecInvalid
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.trace import live
from aios_blocks.trace import replay as rp
from aios_blocks.trace.workload import Task

from .test_ir import COMPONENT, spec

TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "openb-2023"


def test_a_block_spec_s_labels_are_in_its_ir_and_absent_ones_leave_it_as_it_was() -> None:
    assert block_create_IR({**spec(), "labels": {"qos": "LS"}}, COMPONENT, "b1")["labels"] == {"qos": "LS"}
    assert "labels" not in block_create_IR(spec(), COMPONENT, "b1")
    with pytest.raises(SpecInvalid) as exc:
        block_create_IR({**spec(), "labels": {"qos": "has space"}}, COMPONENT, "b1")
    assert any(e.path.startswith("$.labels") for e in exc.value.errors)


def test_a_task_s_block_carries_its_qos_its_share_and_its_kind_s_component() -> None:
    shared = Task("p1", 6000, 12288, 1, 460, "V100M16|V100M32", "LS")
    whole = Task("p2", 8000, 1024, 2, 1000, "", "")
    s1, s2 = live.block_spec(shared), live.block_spec(whole)
    assert s1["labels"] == {"qos": "LS"} and "labels" not in s2
    assert s1["blockComponentURI"] == live.COMPONENT_SHARED and s2["blockComponentURI"] == live.COMPONENT_WHOLE
    assert s1["resources"] == {"gpus": 1, "gpuMemory": 0, "cpu": 6.0, "memory": 12288, "gpuShare": 0.46,
                               "gpuModels": ["V100M16", "V100M32"]}
    assert s1["blockId"] == rp.block_id(shared) == "p1"
    st = rp.Setup("builtin:fgd", 7, 0, [shared, whole], [{"cpu": 6, "gpus": 1}], 2000)
    by_uri = {c["componentURI"]: c for c in live.components(st)}
    assert by_uri[live.COMPONENT_SHARED]["policies"][1]["settings"] == {"gpuSharing": True, "sampleNodes": 0}
    assert by_uri[live.COMPONENT_WHOLE]["policies"][1]["parameters"] == {"seed": 7, "workload": [{"cpu": 6, "gpus": 1}]}


@pytest.mark.parametrize("flags", [[], ["--in-process", "--live"]])
def test_replay_needs_exactly_one_mode(flags: list[str]) -> None:
    res = CliRunner().invoke(app, ["trace", "replay", str(TRACE / "openb_node_list_gpu_node.csv"),
                                   str(TRACE / "openb_pod_list_default.csv"), *flags])
    assert res.exit_code == 2 and "--in-process" in res.output and "--live" in res.output


def test_live_on_a_running_system_takes_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its blocks stay: a second run would find the first one's cluster."""
    monkeypatch.setenv("AIOS_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("AIOS_REDIS_URL", "redis://127.0.0.1:1")
    res = CliRunner().invoke(app, ["trace", "replay", str(TRACE / "openb_node_list_gpu_node.csv"),
                                   str(TRACE / "openb_pod_list_default.csv"), "--live", "--seed", "1", "--seed", "2"])
    assert res.exit_code == 2 and "2 runs asked" in res.output


def test_a_replayed_task_s_block_is_never_moved_by_the_rebalancer() -> None:
    """``--live`` = ``--in-process`` needs every block kept where it was placed: ``blocks up`` runs a
    rebalancer that moves movable instances when the cluster fragments (the replay's figures then
    depended on when its tick landed: test_trace_live failed on one seed a run). Four 1-GPU tasks
    scattered over four 4-GPU nodes, the shape the fragmentation trigger consolidates: the
    blocks as the parser stores them, read by the rebalancer's input, get no move."""
    from aios_blocks.handlers import rebalance as hr
    from aios_blocks.policies.builtin.rebalance import plan

    tasks = [Task(f"p{i}", 1000, 1024, 1, 1000) for i in range(4)]
    st = rp.Setup("builtin:fgd", 7, 0, tasks, [{"cpu": 1, "gpus": 1}], 16000)
    comp = {c["componentURI"]: c for c in live.components(st)}[live.COMPONENT_WHOLE]
    placed = [{"block_id": t.name, "status": "ready", "gen": 1, "created": 0.0,
               "ir": block_create_IR(live.block_spec(t), comp, t.name),
               "instances": {f"{t.name}-0": {"node": f"n{i}", "gpus": [f"n{i}-g0"], "status": "running"}}}
              for i, t in enumerate(tasks)]
    nodes = {f"n{i}": {"cpu_free": 63, "mem_free": 1 << 19,
                       "gpus": {f"n{i}-g{g}": {"model": "A100", "free": 0.0 if g == 0 else 1.0} for g in range(4)}}
             for i in range(4)}
    data = {"action": "rebalance", "maxMoves": 3, "trigger": "fragmentation", "pending": [],
            "cluster": {"cluster_id": live.CLUSTER, "nodes": nodes}, "movable": hr.movable(placed, nodes),
            "workload": [{"gpus": 4, "weight": 0.5}, {"gpus": 1, "weight": 0.5}]}
    assert [m["preemptible"] for m in data["movable"]] == [False] * 4
    assert plan(data)["moves"] == []
    # the same instances of movable blocks are consolidated: the case is one the rebalancer acts on
    for row in placed:
        row["ir"] = {k: v for k, v in row["ir"].items() if k != "preemptible"}
    assert len(plan({**data, "movable": hr.movable(placed, nodes)})["moves"]) == 3


def test_an_online_replay_s_block_is_preemptible_as_its_class_says() -> None:
    """The online replay's blocks wait in the queue and may be preempted (docs/priority.md): they
    keep none of the offline replay's ``queue: false`` and ``preemptible: false``."""
    from aios_blocks.trace.online import Timed
    from aios_blocks.trace.online_live import spec_of

    spec = spec_of(Timed(Task("p1", 1000, 1024, 1, 1000, "", "BE"), 0.0, 10.0))
    assert "preemptible" not in spec and "queue" not in spec and spec["priorityClass"]
