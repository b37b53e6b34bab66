"""``blocks trace replay --online --in-process`` (trace/online.py) on hand-made workloads: a
high-priority arrival preempts, the victim waits and returns after the preemptor departs; the
queue's order with and without priorities; no cascades; determinism for a seed."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from typer.testing import CliRunner

from aios_blocks.cli.main import app
from aios_blocks.trace import online
from aios_blocks.trace.inventory import node_from_row
from aios_blocks.trace.workload import Task


def nodes(*gpus: int) -> list:
    return [node_from_row({"sn": f"n{i}", "cpu_milli": 64000, "memory_mib": 262144, "gpu": g, "model": "V100M32"}, "trace", "t")
            for i, g in enumerate(gpus)]


def task(name: str, qos: str, created: float, duration: float, gpus: int = 1) -> online.Timed:
    return online.Timed(Task(name, 1000, 1024, gpus, 1000, "", qos), created, duration)


def sim(ns: list, timed: list[online.Timed], mode: online.Mode, seed: int = 42) -> online.Sim:
    s = online.Sim(ns, timed, mode, online.DEFAULT_POLICY, seed, 0, online.HEAD, online.MIN_DELTA, "hand")
    asyncio.run(s.run())
    return s


def test_a_high_priority_arrival_preempts_and_the_victim_returns_after_it() -> None:
    timed = [task("be", "BE", 0, 100), task("ls", "LS", 10, 20)]
    s = sim(nodes(1), timed, online.Mode.PREEMPTION)
    r = s.res.as_dict()
    assert (r["preemptions"], r["victims"], r["cascades"]) == (1, 1, 0)
    assert s.jobs["ls"].first_wait == 0  # placed at its arrival, on the victim's GPU
    be = s.jobs["be"]
    assert be.victim_times == 1 and be.start == 30  # it waited for the preemptor to leave, then ran again
    assert r["gpu_s_lost"] == 10.0  # one GPU for the 10 s it had run
    assert r["pending_end"] == 1 and r["freed_over_bound"] == 0  # at the last arrival the victim waits
    # without preemption the latency-sensitive task waits for the best-effort one to finish
    s = sim(nodes(1), timed, online.Mode.NO_PREEMPTION)
    assert s.jobs["ls"].first_wait == 90 and s.res.preemptions == 0 and s.res.gpu_s_lost == 0


def test_priority_order_versus_fifo() -> None:
    timed = [task("a", "BE", 0, 10), task("b", "BE", 1, 10), task("c", "LS", 2, 10)]
    prio = sim(nodes(1), timed, online.Mode.NO_PREEMPTION)
    assert prio.jobs["c"].first_wait == 8 and prio.jobs["b"].first_wait == 19  # the LS task goes first
    fifo = sim(nodes(1), timed, online.Mode.FIFO)
    assert fifo.jobs["b"].first_wait == 9 and fifo.jobs["c"].first_wait == 18  # by age only
    assert fifo.res.preemptions == 0


def test_a_victim_never_preempts_in_turn() -> None:
    # ls (2 GPUs) fits only on n0, held by a Burstable and a BE task: both go; the Burstable
    # victim would fit on n1 by evicting the BE task there, but a preempted block waits instead
    # (a 2-GPU task first fills n0 so that be-b lands on n1; then bu and be-a fill n0)
    timed = [task("big", "BE", 0, 1, gpus=2), task("be-b", "BE", 0, 100), task("bu", "Burstable", 2, 100),
             task("be-a", "BE", 3, 100), task("ls", "LS", 10, 20, gpus=2)]
    s = sim(nodes(2, 1), timed, online.Mode.PREEMPTION)
    assert s.res.cascades == 0
    assert s.jobs["bu"].victim_times == 1 and s.jobs["be-b"].victim_times == 0
    assert s.jobs["bu"].start == 30  # back when the preemptor left, not by evicting be-b
    assert s.res.preemptions == 1


def workload(seed: int, n: int = 40) -> list[online.Timed]:
    rng = random.Random(seed)
    return [task(f"t{i:03d}", rng.choice(["LS", "BE", "Burstable"]), rng.uniform(0, 100), rng.uniform(5, 50),
                 gpus=rng.choice([1, 1, 2])) for i in range(n)]


def test_deterministic_for_a_seed_and_no_cascades() -> None:
    ns = nodes(2, 2, 4)
    a = sim(ns, workload(7), online.Mode.PREEMPTION).res.as_dict()
    b = sim(ns, workload(7), online.Mode.PREEMPTION).res.as_dict()
    assert a == b
    assert a["preemptions"] > 0 and a["cascades"] == 0 and a["freed_over_bound"] == 0
    assert a["placed"] >= 40


def test_cli_online(tmp_path: Path) -> None:
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,1,V100M32\n")
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
        "be,1000,1024,1,1000,,BE,Running,0,100\nls,1000,1024,1,1000,,LS,Running,10,30\n")
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), "--in-process",
                                 "--online", "--json", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [d["mode"] for d in data] == ["preemption"]
    assert data[0]["preemptions"] == 1 and data[0]["cascades"] == 0
    assert "preemptions 1" in r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), "--in-process",
                                 "--online", "--no-preemption", "--fifo", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert [(d["mode"], d["preemptions"]) for d in json.loads(out.read_text())] == [("no-preemption", 0), ("fifo", 0)]
