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
