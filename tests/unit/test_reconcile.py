"""The reconciler's pure decisions and the suspect-node rule (``handlers.reconcile``), the exclusion
of suspect / avoided nodes from a plan (``handlers.controller.plan``, ``workers.controller.excluded``)
and the replacement's node to avoid (``handlers.lifecycle``); docs/reliability.md "Reconciler",
docs/health.md "Suspect nodes"."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from aios_blocks.handlers import controller as hc
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers import reconcile as rc
from aios_blocks.handlers.effects import Replace
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.schemas.events import InstanceEvent, InstanceVerdict
from aios_blocks.workers.controller import excluded

from .views import free_gpus, make_ir, node

BACKOFF = rc.Backoff(base_s=2.0, cap_s=10.0)


def block(bid: str = "b", status: str = "ready", lo: int = 1, hi: int = 3, desired: int = 0, **insts: str) -> rc.BlockSize:
    """``insts``: iid -> status."""
    return rc.BlockSize(bid, 4, status, "c1", lo, hi, desired, {iid: {"status": s, "node": "n1"} for iid, s in insts.items()})


def test_a_ready_block_below_its_minimum_is_asked_for_with_the_reason() -> None:
    out = rc.decide([block(lo=2, **{"b-0": "running"})], {}, 100.0, BACKOFF)
    (ask,) = out.asks
    assert (ask.block_id, ask.gen, ask.target) == ("b", 4, 2)
    assert ask.reason.startswith("1 live (1 running) < minInstances 2") and "attempt 1" in ask.reason
    assert out.memory == {"b": rc.Memory(since=100.0, attempts=1, next_at=102.0, request_id=ask.request_id)}
    assert out.dropped == [] and "b" in out.short


def test_starting_counts_removing_does_not() -> None:
    assert rc.decide([block(lo=2, **{"b-0": "running", "b-1": "starting"})], {}, 0.0, BACKOFF).asks == []
    (ask,) = rc.decide([block(lo=2, **{"b-0": "running", "b-1": "removing"})], {}, 0.0, BACKOFF).asks
    assert ask.target == 2


def test_asks_are_spaced_by_an_exponential_backoff_up_to_its_cap() -> None:
    mem: dict[str, rc.Memory] = {}
    asked_at: list[float] = []
    t = 0.0
    while t <= 60.0:
        out = rc.decide([block()], mem, t, BACKOFF)
        if out.asks:
            asked_at.append(t)
        mem = out.memory
        t += 0.5
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    assert gaps[:4] == [2.0, 4.0, 8.0, 10.0] and set(gaps[3:]) == {10.0}  # 2, 4, 8, then the cap
    assert mem["b"].attempts == len(asked_at)
    # inside its wait: no ask, the memory kept as it is, and why
    out = rc.decide([block()], mem, mem["b"].next_at - 1, BACKOFF)
    assert out.asks == [] and out.memory == mem and "next ask in 1.0 s" in out.short["b"]


def test_each_attempt_has_its_own_request_id_and_the_same_memory_gives_the_same_one() -> None:
    first = rc.decide([block()], {}, 10.0, BACKOFF)
    again = rc.decide([block()], {}, 10.0, BACKOFF)  # another copy from the same (empty) memory, same time
    assert first.asks[0].request_id == again.asks[0].request_id
    second = rc.decide([block()], first.memory, 12.0, BACKOFF)
    assert second.asks[0].request_id != first.asks[0].request_id
    # a copy that takes over from the stored memory repeats the same id (deduplicated by the stream)
    taken_over = rc.decide([block()], first.memory, 12.0, BACKOFF)
    assert taken_over.asks[0].request_id == second.asks[0].request_id


def test_converged_gone_and_not_ready_blocks_drop_their_memory() -> None:
    mem = {"b": rc.Memory(since=1.0, attempts=3, next_at=50.0), "gone": rc.Memory(since=1.0), "p": rc.Memory(since=1.0)}
    out = rc.decide([block(**{"b-0": "running"}), block("p", status="placing")], mem, 60.0, BACKOFF)
    assert out.asks == [] and out.memory == {} and out.dropped == ["b", "gone", "p"]


@pytest.mark.parametrize("status", ["placing", "deleting", "failed", "deleted"])
def test_only_ready_blocks_are_driven(status: str) -> None:
    assert rc.decide([block(status=status)], {}, 0.0, BACKOFF).asks == []


def test_a_block_without_a_cluster_or_scaled_to_zero_is_left_alone() -> None:
    no_cluster = rc.BlockSize("b", 1, "ready", "", 1, 1, 0, {})
    assert rc.decide([no_cluster, block("z", lo=0, hi=2)], {}, 0.0, BACKOFF).asks == []


def test_the_target_keeps_a_larger_desired_count_within_max() -> None:
    (ask,) = rc.decide([block(lo=1, hi=3, desired=2)], {}, 0.0, BACKOFF).asks
    assert ask.target == 2
    (ask,) = rc.decide([block(lo=1, hi=3, desired=9)], {}, 0.0, BACKOFF).asks
    assert ask.target == 3


# -- suspect nodes ---------------------------------------------------------------------------------
NOW = 1000.0


def test_a_node_whose_probed_instances_all_fail_and_whose_agent_is_silent_is_suspect() -> None:
    rows = [("n1", "a", 3, False, "refused"), ("n1", "b", 2, False, "refused"), ("n2", "c", 5, False, "x")]
    got = rc.suspicion(rows, {"n1": NOW - 4, "n2": NOW - 0.5}, NOW, threshold=2, silence_s=3.0)
    assert list(got.mark) == ["n1"] and "all 2 probed instance(s)" in got.mark["n1"] and "no heartbeat for 4.0 s" in got.mark["n1"]
    assert got.clear == []  # n2: its instance fails but its agent beats: not the node


def test_one_passing_probe_or_too_few_failures_or_no_heartbeat_record_is_not_suspect() -> None:
    silent = {"n1": NOW - 10}
    assert rc.suspicion([("n1", "a", 3, False, ""), ("n1", "b", 0, True, "")], silent, NOW, 2, 3.0) == rc.Suspicion({}, ["n1"])
    assert rc.suspicion([("n1", "a", 3, False, ""), ("n1", "b", 1, False, "")], silent, NOW, 2, 3.0).mark == {}
    # a node that never sent a heartbeat (the simulated fleet) cannot be judged
    assert rc.suspicion([("n1", "a", 9, False, "")], {"n1": None}, NOW, 2, 3.0).mark == {}
    assert rc.suspicion([("", "a", 9, False, "")], {}, NOW, 2, 3.0) == rc.Suspicion({}, [])


def test_a_marked_node_whose_agent_beats_again_is_cleared() -> None:
    got = rc.suspicion([], {"n1": NOW - 0.2, "n2": NOW - 20}, NOW, 2, 3.0, marked=["n1", "n2"])
    assert got == rc.Suspicion({}, ["n1"])


# -- exclusion from a plan -------------------------------------------------------------------------
def test_excluded_names_the_avoided_and_suspect_nodes_of_this_cluster_in_node_order() -> None:
    nodes = {"n1": {}, "n2": {}, "n3": {}}
    assert excluded(nodes, {"n3": "suspect: x", "other": "suspect: y"}, "n1") == {
        "n1": "the node the replaced instance is moved off", "n3": "suspect: x"}
    assert list(excluded(nodes, {"n2": "suspect: x"}, "n2")) == ["n2"]
    assert "suspect: x" in excluded(nodes, {"n2": "suspect: x"}, "n2")["n2"]
    assert excluded(nodes, {}, "") == {} and excluded(nodes, {}, "gone") == {}


def _nodes() -> dict[str, dict[str, Any]]:
    return {nid: node(nid, "c1", gpus=free_gpus(1, prefix=f"{nid}-g")) for nid in ("n1", "n2")}


async def test_plan_leaves_excluded_nodes_out_and_tells_the_policy_why() -> None:
    seen: list[dict[str, Any]] = []

    async def invoke(data: dict[str, Any]) -> Any:
        seen.append(data)
        offered = sorted(data["payload"]["cluster_metrics"]["nodes"])
        return {"node_id": offered[0], "gpus": [f"{offered[0]}-g0"]}

    ir = make_ir(bid="b", resources={"gpus": 1, "cpu": 1, "memory": 1})
    why = {"n1": "the node the replaced instance is moved off"}
    (p,) = await hc.plan(ir, {"id": "c1", "labels": {}}, _nodes(), "reassignment", ["b-1"], invoke, excluded_nodes=why)
    assert p["node"] == "n2"
    assert seen[-1]["payload"]["excluded_nodes"] == why and "n1" not in seen[-1]["payload"]["cluster_metrics"]["nodes"]
    # nothing excluded: no such field (the input of every other plan is unchanged)
    await hc.plan(ir, {"id": "c1", "labels": {}}, _nodes(), "scale", ["b-2"], invoke, excluded_nodes={})
    assert "excluded_nodes" not in seen[-1]["payload"]
    with pytest.raises(PlacementFailed):  # every node excluded: nothing to choose from
        await hc.plan(ir, {"id": "c1", "labels": {}}, _nodes(), "scale", ["b-3"], _refuse, excluded_nodes={"n1": "x", "n2": "y"})


async def _refuse(data: dict[str, Any]) -> Any:
    from aios_blocks.schemas.errors import PolicyFailed

    assert data["payload"]["cluster_metrics"]["nodes"] == {}
    raise PolicyFailed("resourceAllocator", "scale", "no node")


# -- the replacement avoids the node it leaves -----------------------------------------------------
def _view() -> lc.View:
    return lc.View({"gen": 7, "status": "ready", "ir": {"minInstances": 1}},
                   {"b-0": {"node": "n1", "cluster": "c1", "gpus": ["g0"], "status": "running"}})


def test_every_replacement_names_the_node_its_instance_leaves() -> None:
    _, effects = lc.on_fault(InstanceEvent("b", 7, "b-0", "n1", [], "exit 1"), "failed", _view(), 5)
    assert effects == [Replace("b", 7, "c1", "b-0", "instance b-0 failed: exit 1", "b-0:failed", avoid_node="n1")]
    _, effects = lc.on_verdict(InstanceVerdict("b", 7, "b-0", "n1", "replace", "probes failed", 1.0, "builtin:x", "1"), _view(), 5)
    assert [e.avoid_node for e in effects if isinstance(e, Replace)] == ["n1"]
    effects = lc.on_removed(InstanceEvent("b", 7, "b-0", "n1", [], "lost"), _view())
    assert [e.avoid_node for e in effects if isinstance(e, Replace)] == ["n1"]
