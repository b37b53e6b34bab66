"""The rebalancer on real servers (issue 38, docs/rebalance.md): ``blocks rebalance --dry-run
--json`` lists the moves that make room for a pending block on a fragmented cluster and changes
nothing; with the moves' mechanics, a pending block that fits after one move is placed through
that move before anyone is preempted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import System
from .test_plan import _settled
from .test_priority_cli import blocks


@pytest.fixture(autouse=True)
def _walker_moves(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The dry run's test: neither the queue walker nor the rebalancer worker may ask for a move
    themselves (max 0 moves); the CLI passes --max-moves. Set before the fixture starts the workers."""
    if "dry_run" in request.node.name or "no_moves" in request.node.name:
        monkeypatch.setenv("AIOS_REBALANCE_MAX_MOVES", "0")
    if "worker" in request.node.name:  # its rounds often, no cooldown
        monkeypatch.setenv("AIOS_REBALANCE_INTERVAL_S", "0.5")
        monkeypatch.setenv("AIOS_REBALANCE_COOLDOWN_S", "0")
    yield


SPREAD = [{"name": "resourceAllocator", "policyRuleURI": "builtin:spread"}]


def spec(bid: str, gpus: int, **extra: Any) -> dict[str, Any]:
    return {"blockComponentURI": "aios://test/model", "blockId": bid, "minInstances": 1, "maxInstances": 1,
            "resources": {"gpus": gpus}, "policyRulesSpec": SPREAD, **extra}


async def _status(system: System, bid: str, want: str, timeout: float = 60) -> dict[str, Any]:
    for _ in range(int(timeout / 0.2)):
        b = await system.client.store.get_block(bid)
        if b is not None and b.get("status") == want:
            return b
        await asyncio.sleep(0.2)
    raise AssertionError(f"{bid} never {want}: {await system.client.store.get_block(bid)}")


async def _fragmented(system: System) -> dict[str, str]:
    """Two nodes of 4 GPUs, one 1-GPU block on each (spread), and a 4-GPU block that fits on
    neither (3 free each): it waits. The small blocks' nodes."""
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=4)
    where = {}
    for bid in ("s1", "s2"):
        _, kind, _ = await system.submit_and_wait(spec(bid, 1))
        assert kind == "ready"
        (inst,) = (await c.store.instances(bid)).values()
        where[bid] = inst["node"]
    assert len(set(where.values())) == 2, where
    return where


async def test_rebalance_dry_run_lists_the_move_and_changes_nothing(system: System) -> None:
    where = await _fragmented(system)
    await system.client.submit(spec("p", 4))
    await _status(system, "p", "pending")
    before = await _settled(system)

    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--json", "--max-moves", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] is True and out["requested"] == 0
    (move,) = out["moves"]
    assert move["cluster"] == "c1" and move["block_id"] in ("s1", "s2") and move["gpus_freed"] == 1.0
    assert move["from"] == where[move["block_id"]] and move["to"] != move["from"]
    assert "makes room for pending p" in move["reason"]
    (c1,) = out["clusters"]
    assert c1["for"] == "p" and c1["trigger"] == "manual" and c1["fragmentation"]["ratio"] > 0
    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--max-moves", "2")
    assert r.returncode == 0 and "dry run: 1 move(s), nothing requested" in r.stdout, r.stdout + r.stderr
    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--json", "--max-moves", "0")
    assert json.loads(r.stdout)["moves"] == []
    # nothing was published, reserved or written: not a message, not a byte of Redis
    assert await _settled(system) == before
    assert (await system.client.store.get_block("p") or {})["status"] == "pending"


async def test_rebalance_and_preempt_dry_runs_run_a_policy_of_the_registry(system: System, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``blocks rebalance --policy registry:NAME --dry-run`` (docs/rebalance.md, as written) and
    ``blocks preempt --dry-run --policy registry:NAME`` run the system's stored version. The CLI's
    policy runtime had no registry: both answered 'no policy registry available' (exit 1 / no plan)."""
    monkeypatch.setenv("AIOS_POLICY_TIMEOUT_S", "120")  # the CLI's own calls, on a loaded machine
    monkeypatch.setenv("AIOS_STARLARK_CALL_TIMEOUT_S", "120")
    await _fragmented(system)
    await system.client.submit(spec("p", 4))
    await _status(system, "p", "pending")
    reb, pre = tmp_path / "reb.star", tmp_path / "pre.star"
    reb.write_text('def eval(parameters, input_data, context):\n    return {"moves": [], "reason": "my rebalancer says no"}\n')
    pre.write_text('def eval(parameters, input_data, context):\n    return {"victims": {}, "reason": "my preemption says no"}\n')
    for name, f in (("my-rebalancer", reb), ("my-preemption", pre)):
        r = await asyncio.to_thread(blocks, system, "policy", "add", name, str(f))
        assert r.returncode == 0, r.stdout + r.stderr

    r = await asyncio.to_thread(blocks, system, "rebalance", "--policy", "registry:my-rebalancer", "--dry-run", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    (c1,) = json.loads(r.stdout)["clusters"]
    assert c1["error"] == "" and c1["reason"] == "my rebalancer says no", c1
    f = tmp_path / "p.json"
    f.write_text(json.dumps(spec("q", 4)))
    r = await asyncio.to_thread(blocks, system, "preempt", "--dry-run", str(f), "--cluster", "c1",
                                "--policy", "registry:my-preemption", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["output"] == {"victims": {}, "reason": "my preemption says no"}


async def test_rebalance_dry_run_json_exits_1_when_the_policy_fails(system: System) -> None:
    """--json printed the failing cluster's "error" and exited 0, where the text output exits 1."""
    await system.client.add_sim_cluster("c1", nodes=1, gpus=1)
    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--policy", "bogus")
    assert r.returncode == 1 and "the rebalancer policy failed in some cluster" in r.stderr, r.stdout + r.stderr
    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--policy", "bogus", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    (c1,) = json.loads(r.stdout)["clusters"]
    assert "unknown policyRuleURI 'bogus'" in c1["error"], c1


SHARING = [{"name": "resourceAllocator", "policyRuleURI": "builtin:spread", "settings": {"gpuSharing": True}}]


async def test_rebalance_dry_run_counts_each_gpus_memory(system: System) -> None:
    """Two nodes of one 80 GiB GPU, each shared by a 0.25 / 8 GiB block: 0.75 of each GPU's compute
    is free but only 72 GiB of its memory, and p asks 0.5 and all 80 GiB (``gpuMemory``). One move
    (the two sharers onto one GPU) makes its room. Before issue 38's fix the planner did not count
    GPU memory: the dry run said p fits without moves and listed none (p waited for good)."""
    c = system.client
    await c.add_sim_cluster("c1", nodes=2, gpus=1)
    small = {"gpus": 1, "gpuShare": 0.25, "gpuMemory": 8192}
    where = {}
    for bid in ("s1", "s2"):
        _, kind, _ = await system.submit_and_wait(spec(bid, 1, resources=small, policyRulesSpec=SHARING))
        assert kind == "ready"
        (inst,) = (await c.store.instances(bid)).values()
        where[bid] = inst["node"]
    assert len(set(where.values())) == 2, where
    await c.submit(spec("p", 1, resources={"gpus": 1, "gpuShare": 0.5, "gpuMemory": 81920}, policyRulesSpec=SHARING))
    await _status(system, "p", "pending")
    r = await asyncio.to_thread(blocks, system, "rebalance", "--dry-run", "--json", "--max-moves", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    (move,) = out["moves"]
    other = {"s1": where["s2"], "s2": where["s1"]}
    assert move["block_id"] in where and move["from"] == where[move["block_id"]] and move["to"] == other[move["block_id"]]
    assert "makes room for pending p" in move["reason"], move
    (c1,) = out["clusters"]
    assert c1["for"] == "p"


async def test_a_pending_block_is_placed_through_moves_without_preemption(system: System) -> None:
    """p (priority 1000) could preempt s1 or s2 (priority 0); one move makes room instead."""
    c = system.client
    r = await asyncio.to_thread(blocks, system, "priority-class", "add", "high", "1000")
    assert r.returncode == 0, r.stdout + r.stderr
    await _fragmented(system)
    await c.submit(spec("p", 4, priorityClass="high"))
    await _status(system, "p", "ready", timeout=90)
    history = await c.history()
    names = [s.rsplit(".", 2)[-2:] for s, _, _ in history]
    assert ["move", "completed"] in names, names
    assert not [s for s, _, _ in history if s.endswith(".preempted") or s.endswith(".preempting")]
    for bid in ("s1", "s2"):
        b = await c.store.get_block(bid)
        assert b is not None and b["status"] == "ready"
        assert [i["status"] for i in (await c.store.instances(bid)).values()] == ["running"]


async def _preemptor_bound_to_s1s_node(system: System) -> tuple[dict[str, str], list[Any]]:
    """s1 and s2 on two nodes (``_fragmented``); p (priority 1000, 4 GPUs) must run on s1's node
    (Required affinity): p ready, and the stream's history. The nodes of s1 and s2."""
    c = system.client
    r = await asyncio.to_thread(blocks, system, "priority-class", "add", "high", "1000")
    assert r.returncode == 0, r.stdout + r.stderr
    where = await _fragmented(system)
    aff = [{"category": "Topology", "strength": "Required", "target": {"type": "NodeId", "value": where["s1"]}}]
    await c.submit(spec("p", 4, priorityClass="high", affinity=aff))
    await _status(system, "p", "ready", timeout=90)
    assert [i["node"] for i in (await c.store.instances("p")).values()] == [where["s1"]]
    return where, await c.history()


async def test_a_pending_block_with_required_affinity_gets_its_room_by_a_move_not_a_preemption(system: System) -> None:
    """The queue walker's moves before preemption read p's own affinity index, so s1 moves off its
    node and p lands there. Before, the walker passed only the placed blocks' indexes: p's room was
    on no node, and s2 was preempted."""
    where, history = await _preemptor_bound_to_s1s_node(system)
    assert not [s for s, _, _ in history if s.endswith(".preempted") or s.endswith(".preempting")]
    moved = [e.get("data", e) for s, e, _ in history if s.endswith(".move.requested")]
    assert [m["block_id"] for m in moved] == ["s1"], moved
    assert [i["node"] for i in (await system.client.store.instances("s1")).values()] == [where["s2"]]


async def test_with_no_moves_a_preemptor_with_required_affinity_takes_its_victim_where_it_may_go(system: System) -> None:
    """No moves (max 0): s1 is the victim, not s2 (the younger, which the planner takes first when
    every node is offered: room p may not use; s2 was evicted for nothing and p waited for good)."""
    _, history = await _preemptor_bound_to_s1s_node(system)
    assert [s for s, _, _ in history if s.endswith(".preempted")] == ["aios.block.s1.preempted"]
    assert (await system.client.store.get_block("s2") or {}).get("status") == "ready"


async def test_the_rebalancer_worker_places_a_block_that_may_not_preempt(system: System) -> None:
    """p has priority 0: it never preempts, so the queue walker never asks for moves for it; the
    rebalancer worker's round does (its pending trigger), and p is placed through one move."""
    c = system.client
    await _fragmented(system)
    await c.submit(spec("p", 4))
    await _status(system, "p", "ready", timeout=90)
    history = await c.history()
    requested = [e.get("data", e) for s, e, _ in history if s.endswith(".move.requested")]
    assert len(requested) == 1 and requested[0]["requested_by"] == "rebalancer", requested
    assert requested[0]["reason"].startswith("pending: makes room for pending p")
    assert any(s.endswith(".move.completed") for s, _, _ in history)
    assert not [s for s, _, _ in history if s.endswith(".preempted")]
