"""``blocks trace replay --online --live`` (trace/online_live.py) on a small sample through the
real system (NATS JetStream, Redis, the workers): a latency-sensitive task arriving on a full GPU
preempts the best-effort one, which waits and returns once the preemptor has been deleted at the
end of its (compressed) duration; the figures come from the blocks' events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app
from aios_blocks.trace import online, online_live
from aios_blocks.trace.inventory import node_from_row
from aios_blocks.trace.workload import Task

from .conftest import System

pytestmark = pytest.mark.integration


def task(name: str, qos: str, created: float, duration: float) -> online.Timed:
    return online.Timed(Task(name, 1000, 1024, 1, 1000, "", qos), created, duration)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_QUEUE_RESYNC_S", "0.5")
    monkeypatch.setenv("AIOS_SCALE_DOWN_GRACE_S", "0")


async def test_online_live_preempts_and_the_victim_returns(quick: None, system: System) -> None:
    nodes = [node_from_row({"sn": "n0", "cpu_milli": 64000, "memory_mib": 262144, "gpu": 1, "model": "V100M32"}, "trace", "t")]
    # trace seconds; speed 10: be arrives at 0 for 1000 s (100 s wall), ls at 100 (10 s wall in: be is
    # running by then) for 20 s (2 s wall)
    timed = [task("be", "BE", 0, 1000), task("ls", "LS", 100, 20)]
    r = await online_live.replay_online_live(system.client, nodes, timed, speed=10, settle_s=8)
    assert (r["preemptions"], r["victims"], r["cascades"]) == (1, 1, 0), r
    assert r["placed"] == 2 and r["failed"] == 0, r
    be = await system.client.history("be", idle=0.2)
    kinds = [s.rsplit(".", 1)[1] for s, _, _ in be]
    assert kinds.count("preempted") == 1 and kinds.count("ready") == 2, kinds  # ready, preempted, ready again
    assert r["gpu_s_lost"] > 0 and r["pending_end"] == 0, r
    assert r["wait"]["best-effort"]["n"] == 1 and r["wait"]["latency-sensitive"]["n"] == 1


def test_cli_online_live_starts_its_own_system(quick: None, tmp_path: Path) -> None:
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,1,V100M32\n")
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
        "be,1000,1024,1,1000,,BE,Running,0,1000\nls,1000,1024,1,1000,,LS,Running,100,120\n")
    out = tmp_path / "o.json"
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), "--live",
                                 "--online", "--speed", "10", "--json", str(out)])
    assert r.exit_code == 0, r.output
    (d,) = json.loads(out.read_text())
    assert d["mode"] == "live" and d["preemptions"] == 1 and d["cascades"] == 0, d
    assert "preemptions 1 (1 victims)" in r.output
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), "--live",
                                 "--online", "--fifo"])
    assert r.exit_code == 2 and "--in-process only" in r.output
