"""``blocks trace replay --in-process`` on a 20-node sample of the GPU trace (docs/trace.md): the
artifact's protocol through the controller's own planning code, its figures, determinism per
seed, and the command's output."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli import trace as trace_cli
from aios_blocks.cli.main import app
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.replay import ANCHOR_NAMES, DEFAULT_POLICY, policy_uri, replay
from aios_blocks.trace.workload import load_tasks

DATA = Path(__file__).parent / "data" / "trace"


@pytest.fixture(scope="module")
def sample() -> tuple[list, list]:
    return load_nodes(DATA / "nodes.csv", "s"), load_tasks(DATA / "pods.csv")


@pytest.mark.parametrize("policy", [*ANCHOR_NAMES, "builtin:binpack"])
def test_replay_figures_and_determinism_per_seed(sample: tuple[list, list], policy: str) -> None:
    nodes, tasks = sample
    a = asyncio.run(replay(nodes, tasks, policy, seed=42)).as_dict()
    b = asyncio.run(replay(nodes, tasks, policy, seed=42)).as_dict()
    assert a["alloc_curve"] == b["alloc_curve"] and a["frag_curve"] == b["frag_curve"] and a["failures"] == b["failures"]
    assert (a["nodes"], a["gpus"], a["policy"], a["seed"]) == (20, 107, policy, 42)
    assert a["placed"] + a["failed"] == a["blocks"] and a["placed"] > 0
    assert sum(a["failures"].values()) == a["failed"]
    curve = [a["alloc_curve"][str(k)] for k in range(1, 130)]
    assert curve == sorted(curve) and 0 < curve[0] and curve[-1] <= 100  # tasks are never deleted
    assert a["alloc_at_100"] == a["alloc_curve"]["100"] and a["alloc_at_130"] >= a["alloc_at_100"]
    assert 0 <= a["frag_at_100"] <= 100 and a["frag_at_100"] == a["frag_curve"]["100"]
    assert 129 < a["arrived_end"] <= 130


def test_another_seed_draws_another_sample(sample: tuple[list, list]) -> None:
    nodes, tasks = sample
    a = asyncio.run(replay(nodes, tasks, "builtin:best-fit", seed=42)).as_dict()
    b = asyncio.run(replay(nodes, tasks, "builtin:best-fit", seed=7)).as_dict()
    assert a["alloc_curve"] != b["alloc_curve"]


def test_the_command_prints_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["trace", "replay", str(DATA / "nodes.csv"), str(DATA / "pods.csv"), "--in-process",
                                 "--policy", "fgd", "--seed", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "builtin:fgd seed 3 on pods (20 nodes, 107 GPUs): allocation" in r.output
    assert "arrived   1- 10 %:" in r.output
    data = json.loads(out.read_text())
    assert {"alloc_at_100", "alloc_at_130", "frag_at_100", "alloc_curve", "seconds", "placements_per_s", "policy", "seed",
            "failures", "blocks"} <= set(data)
    assert data["policy"] == "builtin:fgd" and data["seed"] == 3 and len(data["alloc_curve"]) >= 129
    two = tmp_path / "two.json"
    r = CliRunner().invoke(app, ["trace", "replay", str(DATA / "nodes.csv"), str(DATA / "pods.csv"), "--in-process",
                                 "-p", "random", "-p", "best-fit", "--json", str(two)])
    assert r.exit_code == 0, r.output
    assert [d["policy"] for d in json.loads(two.read_text())] == ["builtin:random", "builtin:best-fit"]


def test_without_a_policy_the_command_replays_ours(tmp_path: Path) -> None:
    # fgd-plus is the default GPU placement policy of the replay (docs/trace.md "Our policy")
    assert DEFAULT_POLICY == policy_uri(trace_cli.DEFAULT_POLICY) == "builtin:fgd-plus"
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["trace", "replay", str(DATA / "nodes.csv"), str(DATA / "pods.csv"), "--in-process",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "builtin:fgd-plus seed 42 on pods" in r.output and json.loads(out.read_text())["policy"] == "builtin:fgd-plus"


def test_the_command_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    args = ["trace", "replay", str(DATA / "nodes.csv"), str(DATA / "pods.csv")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "give --in-process" in r.output and "--live" in r.output
    bad = tmp_path / "pods.csv"
    bad.write_text("name,cpu_milli\np,1\n")
    r = CliRunner().invoke(app, ["trace", "replay", str(DATA / "nodes.csv"), str(bad), "--in-process"])
    assert r.exit_code == 2 and "CSV header lacks" in r.output
    r = CliRunner().invoke(app, [*args, "--in-process", "--plot", str(tmp_path / "p.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.exit_code == 2 and "--plot needs matplotlib" in r.output
    else:
        assert r.exit_code == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_the_trace_the_docs_name_says_where_to_get_it_where_it_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # from an installed wheel (or outside the repository) the docs' command said only "cannot read
    # bench/traces/openb-2023/openb_node_list_gpu_node.csv: No such file or directory"
    monkeypatch.chdir(tmp_path)
    nodes, pods = (f"{trace_cli.TRACE_DIR}/openb_node_list_gpu_node.csv", f"{trace_cli.TRACE_DIR}/openb_pod_list_default.csv")
    for args in (["trace", "replay", nodes, pods, "--in-process"], ["cluster", "import", nodes, "--cluster", "openb"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and f"cannot read {nodes}" in r.output, r.output
        assert "not in the wheel" in r.output and "alibaba/clusterdata" in r.output, r.output
    r = CliRunner().invoke(app, ["trace", "replay", "nope.csv", pods, "--in-process"])  # any other file: just that
    assert r.exit_code == 2 and "cannot read nope.csv" in r.output and "wheel" not in r.output
