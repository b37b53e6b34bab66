"""``blocks trace replay --online --in-process --rebalance`` (trace/online_rebalance.py) on hand-made
workloads: a 4-GPU task that fits after one move is placed at its arrival through that move (it
waits for a departure without the rebalancer); moves come before preemption; the figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from aios_blocks.cli.main import app
from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import node_from_row
from aios_blocks.trace.workload import Task


def nodes(*gpus: int) -> list:
    return [node_from_row({"sn": f"n{i}", "cpu_milli": 64000, "memory_mib": 262144, "gpu": g, "model": "V100M32"}, "trace", "t")
            for i, g in enumerate(gpus)]


def task(name: str, qos: str, created: float, duration: float, gpus: int = 1) -> online.Timed:
    return online.Timed(Task(name, 1000, 1024, gpus, 1000, "", qos), created, duration)


#: two 4-GPU nodes filled by four 2-GPU tasks; the two short ones leave a 2-GPU hole on each node
#: (the placement spreads them: checked below), then a 4-GPU task arrives
SCATTERED = [task("a", "BE", 0, 10, 2), task("b", "BE", 0.1, 1000, 2), task("f", "BE", 0.2, 10, 2),
             task("d", "BE", 0.3, 1000, 2), task("p", "BE", 20, 10, 4)]


def run(timed: list[online.Timed], mode: online.Mode, rebalance: bool) -> online.Sim:
    args = (nodes(4, 4), timed, mode, online.DEFAULT_POLICY, 42, 0, online.HEAD, online.MIN_DELTA, "hand")
    s = orb.RebalanceSim(*args) if rebalance else online.Sim(*args)
    asyncio.run(s.run())
    return s


def test_a_task_that_fits_after_one_move_is_placed_through_it() -> None:
    without = run(SCATTERED, online.Mode.NO_PREEMPTION, False)
    assert without.jobs["p"].first_wait == 980.1  # it waits for b or d to leave
    s = run(SCATTERED, online.Mode.NO_PREEMPTION, True)
    assert isinstance(s, orb.RebalanceSim) and s.moves == 1 and s.jobs["p"].first_wait == 0
    d = orb.figures(s)
    assert d["moves"] == 1 and d["moves_per_placement"] == round(1 / d["placed"], 4) and d["mode"] == "no-preemption+rebalance"
    assert d["multi_gpu_wait"]["n"] == 5 and d["multi_gpu_wait"]["p99"] == 0
    assert orb.figures(without)["multi_gpu_wait"]["p99"] == 980.1


def test_moves_come_before_preemption() -> None:
    # p is latency-sensitive: without the rebalancer it preempts a BE task; with it, one move instead
    timed = [*SCATTERED[:-1], task("p", "LS", 20, 10, 4)]
    pre = run(timed, online.Mode.PREEMPTION, False)
    assert pre.res.preemptions == 1 and pre.jobs["p"].first_wait == 0
    s = run(timed, online.Mode.PREEMPTION, True)
    assert s.res.preemptions == 0 and s.moves == 1 and s.jobs["p"].first_wait == 0 and s.res.gpu_s_lost == 0


def test_no_moves_when_nothing_waits() -> None:
    s = run(SCATTERED[:-1], online.Mode.PREEMPTION, True)
    assert s.moves == 0 and orb.figures(s)["alloc_last_third"] >= 0


def test_cli_online_rebalance(tmp_path: Path) -> None:

    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,4,V100M32\nn1,64000,262144,4,V100M32\n")
    rows = [(t.task.name, t.task.num_gpu, t.task.qos, t.created, t.created + t.duration) for t in SCATTERED]
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
        + "".join(f"{n},1000,1024,{g},1000,,{q},Running,{c},{d}\n" for n, g, q, c, d in rows))
    out = tmp_path / "o.json"
    r = CliRunner().invoke(app, ["trace", "replay", str(tmp_path / "nodes.csv"), str(tmp_path / "pods.csv"), "--in-process",
                                 "--online", "--no-preemption", "--rebalance", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [(d["mode"], d["moves"]) for d in data] == [("no-preemption", 0), ("no-preemption+rebalance", 1)]
    assert data[1]["multi_gpu_wait"]["p99"] < data[0]["multi_gpu_wait"]["p99"]
    assert "moves 1" in r.output and "multi-GPU wait" in r.output


def test_the_workers_round_is_modelled_with_its_trigger() -> None:
    """The pending trigger off (max_moves 0): only the worker's periodic round can move. Its
    trigger (``handlers.rebalance.round_trigger``) is fragmentation once p has waited
    ``frag_wait_s``: with 0, the round at p's arrival makes its room (placed at once); with the
    default 30 s, nothing until the departures (p has not waited long enough at the one round
    before them); with the round not modelled, the same wait."""
    args = (nodes(4, 4), SCATTERED, online.Mode.NO_PREEMPTION, online.DEFAULT_POLICY, 42, 0, online.HEAD, online.MIN_DELTA, "hand")

    def go(**kw: object) -> orb.RebalanceSim:
        s = orb.RebalanceSim(*args, max_moves=0, frag_moves=2, **kw)  # type: ignore[arg-type]
        asyncio.run(s.run())
        return s

    now = go(frag_threshold=0.1, frag_wait_s=0.0)
    assert now.jobs["p"].first_wait == 0 and now.moves == 1 and now.rounds.get("fragmentation") == 1
    assert go(frag_threshold=0.1).jobs["p"].first_wait == 980.1
    off = go(frag_threshold=None)
    assert off.jobs["p"].first_wait == 980.1 and off.moves == 0 and off.rounds == {}
