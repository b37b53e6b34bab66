"""``python -m bench.trace_vs_ray``'s machinery on a few trace nodes (docs/trace.md "Live vs Ray"):
our side through real NATS JetStream, Redis and workers (one at a time, then a window of creates
in flight), Ray's on a local Ray when ray is installed (``make bench-peer`` installs it; CI does
not). Counts and outcomes are asserted, never speed."""

from __future__ import annotations

import importlib.util

import pytest

from aios_blocks.trace import live
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.workload import load_tasks
from bench import trace_vs_ray as tv

from .conftest import System

NODES = 24


def _trace() -> tuple[list, list]:
    return load_nodes(tv.NODES, live.CLUSTER)[:NODES], load_tasks(tv.PODS)


@pytest.mark.timeout(300)
async def test_our_side_decides_every_task_one_at_a_time_and_pipelined(system: System) -> None:
    nodes, tasks = _trace()
    got = await tv.ours_on(system.client, nodes, tasks, tv.POLICY, 42, lat=4, burst=40, window=8, timeout=120)
    assert got["timed"] == 4 and got["p50_ms"] > 0
    # the reservation's event comes before ready: create -> placement is the shorter
    assert 0 < got["placement_p50_ms"] <= got["p50_ms"] and got["placement_p99_ms"] <= got["p99_ms"]
    assert got["burst_decided"] == 40 and got["burst_placed"] + got["burst_failed"] == 40
    assert got["burst_placed"] > 0 and got["per_s"] > 0
    # every block placed by the system holds its reservation: the state agrees with the outcomes
    warm, one_by_one, many = tv.phases(nodes, tasks, tv.POLICY, 42, 4, 40)
    placed = await live.read_back(system.client, [t.name for t in [warm, *one_by_one, *many]])
    assert sum(1 for t in many if t.name in placed) == got["burst_placed"]
    assert len(placed) == (warm.name in placed) + 4 - got["one_by_one_failed"] + got["burst_placed"]


@pytest.mark.timeout(300)
def test_ray_side_places_the_same_shapes_as_groups() -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (`make bench-peer` installs it)")
    nodes, tasks = _trace()
    got = tv.ray_side(nodes, tasks, tv.POLICY, 42, 3, 20)
    assert got["timed"] + got["one_by_one_failed"] == 3
    assert got["burst_decided"] == 20 and 0 < got["burst_placed"] <= 20 and got["per_s"] > 0


@pytest.mark.timeout(300)
async def test_the_step_breakdown_times_every_step_of_a_create(system: System) -> None:
    """``python -m bench.trace_steps``: each step's event, after the create, for blocks created one
    at a time; a first round with one candidate asks no dry_run (docs/trace.md "Live vs Ray")."""
    from bench import trace_steps

    nodes, tasks = _trace()
    got = await trace_steps.steps_on(system.client, nodes, tasks, tv.POLICY, 42, lat=3, timeout=120)
    assert got["timed"] == 3 and got["p50_ms"] > 0
    steps = got["steps"]
    for step in ("block.create", "block.parsed", "block.selection", "block.post_dry_run", "cluster.allocation",
                 "block.placement", "node.instance.create", "block.instance.added", "block.ready"):
        assert steps[step]["blocks"] >= 1, (step, steps)
    assert "cluster.dry_run" not in steps and "block.dry_run.result" not in steps
    assert steps["block.create"]["median_ms"] <= steps["block.ready"]["median_ms"]
    assert trace_steps.step_of("aios.block.b-1.instance.b-1-0.added", "b-1") == "block.instance.added"
