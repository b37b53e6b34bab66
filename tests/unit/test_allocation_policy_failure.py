"""A resourceAllocator that gives no answer at allocation (times out, returns the wrong shape,
cannot be loaded) fails that step once, with the policy's error as the block's reason: it was sent
back through selection for every round (``AIOS_SELECTION_ROUNDS``, 3), each round calling it again
on the same cluster and failing the same way, before the block went pending. A cluster that could
not take the gang (room taken since its dry_run, a lost reservation race) is still re-selected, and
so is a policy that raised: raising is how a seed-shaped resourceAllocator (examples/first_fit.py)
and the built-ins say that nothing fits (docs/architecture.md "Re-selection")."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import allocation as al
from aios_blocks.schemas.errors import PlacementFailed, PolicyFailed
from aios_blocks.schemas.events import ReassignRequest
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

from .views import busy_gpu, free_gpus, invoker, make_ir, node, nodes_of

CLUSTER = {"id": "c1", "labels": {}}

#: binpack, but at {ACTION} (allocation: after its dry_run chose the cluster): {MODE}
FAILS_AT_ALLOCATION = """
import time

from aios_blocks.policies.builtin.resource import BinPackPolicy


class FailsAtAllocation(BinPackPolicy):
    def eval(self, parameters, input_data, context):
        if input_data["action"] == "{ACTION}":
            if "{MODE}" == "shape":
                return {"node": "n0"}
            if "{MODE}" == "ghost":  # the framework refuses these choices: no such node, 0 GPUs of 1
                return {"node_id": "ghost", "gpus": []}
            if "{MODE}" == "taken":  # 2 GPUs of 1, not of the node, twice the same
                return {"node_id": "c1-n0", "gpus": ["c1-n0-g7", "c1-n0-g7"]}
            if "{MODE}" == "slow":
                time.sleep(0.5)
            else:
                raise RuntimeError("no GPU map for this cluster")
        return super().eval(parameters, input_data, context)
"""


def _policy(mode: str, action: str = "allocation") -> str:
    return FAILS_AT_ALLOCATION.replace("{MODE}", mode).replace("{ACTION}", action)


def _failing(exc: Exception) -> Any:
    async def invoke(data: dict[str, Any]) -> Any:
        raise exc

    return invoke


@pytest.mark.parametrize("left_out", [{}, {"n1": "suspect: probes"}])
@pytest.mark.parametrize("kind", ["wrong_shape", "timed_out", "load", "raised"])
async def test_a_policy_that_gave_no_answer_is_marked_so_through_the_plan(left_out: dict[str, str], kind: str) -> None:
    ir = make_ir(resources={"gpus": 1, "cpu": 1, "memory": 10})
    snap = al.Snapshot(CLUSTER, nodes_of(node("n0", gpus=free_gpus(2)), node("n1", gpus=free_gpus(2))), suspects=left_out)
    failed = PolicyFailed("resourceAllocator", "allocation", "wrong return shape: ...", kind)
    with pytest.raises(PlacementFailed) as err:
        await al.plan_allocation(snap, al.Request(ir, "c1", "allocation", ("b1-0",)), _failing(failed))
    assert err.value.reason.startswith("policy 'resourceAllocator' (allocation) failed: wrong return shape")
    assert err.value.policy == (kind != "raised")
    assert al.after_failure(err.value, 0, 3) == ("reselect" if kind == "raised" else "fail")


async def test_a_cluster_without_room_is_not_the_policy_s_failure() -> None:
    ir = make_ir(resources={"gpus": 2, "cpu": 1, "memory": 10})
    snap = al.Snapshot(CLUSTER, nodes_of(node("n0", gpus=[busy_gpu("g0")])))
    with pytest.raises(PlacementFailed) as err:  # (binpack raises: "no healthy node can host ...")
        await al.plan_allocation(snap, al.Request(ir, "c1", "allocation", ("b1-0",)), invoker(ir, "resourceAllocator"))
    assert not err.value.policy and "no healthy node can host" in err.value.reason
    assert [al.after_failure(err.value, n, 3) for n in range(3)] == ["reselect", "reselect", "wait"]
    assert al.after_failure(PlacementFailed("reservation conflict after 3 attempts: n0 changed"), 0, 3) == "reselect"


@pytest.mark.parametrize("mode", ["shape", "slow"])
async def test_a_resource_allocator_that_gives_no_answer_at_allocation_fails_the_block_once_with_its_error(mode: str) -> None:
    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, dry_run_deadline_s=5.0, policy_timeout_s=0.2)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=2)
        await s.store.policy_put("fails", _policy(mode), "python")
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:fails"}}]})
        await s.run()
        why = "wrong return shape: allocation must return" if mode == "shape" else "timed out after 0.2s"
        (failed,) = s.bus.events(E.block_allocation_failed, bid=bid)  # one step, not one per selection round
        assert why in failed["reason"], failed
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0]
        block = await s.store.get_block(bid) or {}
        assert block.get("status") == "failed", block
        (done,) = s.bus.events(E.block_failed, bid=bid)
        assert done["reason"].startswith(f"policy 'resourceAllocator' (allocation) failed: {why}"), done
        assert "selection rounds" not in done["reason"] and not s.bus.events(E.block_pending, bid=bid)


REFUSED = {
    "ghost": "node 'ghost' is not in this cluster; 0 GPUs chosen, block needs 1",
    "taken": "2 GPUs chosen, block needs 1; GPU(s) ['c1-n0-g7'] are not GPUs of c1-n0; the same GPU was chosen twice",
}


@pytest.mark.parametrize("mode", list(REFUSED))
async def test_a_choice_the_framework_refuses_fails_the_block_once_with_every_problem_of_it(mode: str) -> None:
    """Refused on the very snapshot the policy was given (``controller.choice_problems``): asked
    again in the next round, the same policy with the same input chooses the same. It went through
    every selection round (3 ``allocation.failed``, 3 ``parsed``) and waited in the queue."""
    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, dry_run_deadline_s=5.0)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=2)
        await s.store.policy_put("refused", _policy(mode), "python")
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:refused"}}]})
        await s.run()
        why = f"resourceAllocator allocation chose an impossible placement: {REFUSED[mode]}"
        (failed,) = s.bus.events(E.block_allocation_failed, bid=bid)  # one step, not one per selection round
        assert failed["reason"] == f"c1: {why}", failed
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0]
        assert (await s.store.get_block(bid) or {}).get("status") == "failed"
        (done,) = s.bus.events(E.block_failed, bid=bid)
        assert done["reason"] == why, done
        assert not s.bus.events(E.block_pending, bid=bid) and not await s.store.instances(bid)


async def test_a_resource_allocator_that_raises_is_still_asked_again_for_the_rounds() -> None:
    """By design: the raise may be the policy's "nothing fits here" after the room its dry_run saw
    was taken; the next rounds may choose elsewhere, then the block waits (docs/priority.md)."""
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=2)
        await s.store.policy_put("fails", _policy("raise"), "python")
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:fails"}}]})
        await s.run()
        assert len(s.bus.events(E.block_allocation_failed, bid=bid)) == 3
        assert [p["attempt"] for p in s.bus.events(E.block_parsed, bid=bid)] == [0, 1, 2]
        (pending,) = s.bus.events(E.block_pending, bid=bid)
        assert "raised RuntimeError: no GPU map for this cluster" in pending["reason"]
        assert pending["reason"].endswith("(after 3 selection rounds)"), pending


@pytest.mark.parametrize("mode", ["shape", "ghost"])
async def test_a_reassignment_whose_policy_gives_no_answer_fails_at_once_not_after_its_retries(mode: str) -> None:
    """A reassignment that finds no room is delivered again with backoff (``AIOS_REASSIGN_ATTEMPTS``,
    5: room held by instances on their way out); one whose resourceAllocator returned the wrong
    shape, or a choice the framework refuses, fails that step at once with the reason."""
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        await s.store.policy_put("fails", _policy(mode, "reassignment"), "python")
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
                              "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": "registry:fails"}}]})
        await s.run()
        assert (await s.store.get_block(bid) or {}).get("status") == "ready"
        (old,) = await s.store.instances(bid)
        await s.bus.emit(E.cluster_reassignment, ReassignRequest(bid, "c1", "re1", old, "test"))
        await s.run()  # (a deferred delivery is not waited for)
        (failed,) = s.bus.events(E.block_reassignment_failed, bid=bid)
        why = "wrong return shape: reassignment must return" if mode == "shape" else f"impossible placement: {REFUSED[mode]}"
        assert why in failed["reason"], failed
        assert not s.delayed and list(await s.store.instances(bid)) == [old]


@pytest.mark.parametrize(("source", "kind"), [
    ("raise KeyError('gpus')", "raised"),
    ("return {'node': 'n0'}", "wrong_shape"),
    ("import time\ntime.sleep(0.5)\nreturn {'node_id': 'n0', 'gpus': []}", "timed_out"),
    (None, "load"),  # not in the registry
    ("unavailable", "unavailable"),  # the registry's store did not answer
])
async def test_the_runtime_says_how_a_call_failed(source: str | None, kind: str) -> None:
    from aios_blocks.policies.runtime import PolicyRuntime

    async def lookup(name: str, version: int | None) -> Any:
        if source == "unavailable":
            raise ConnectionError("Redis is loading the dataset in memory")
        body = "\n".join("        " + line for line in (source or "").splitlines())
        return None if source is None else {"source": "class P:\n    def __init__(self, rule_id, settings, parameters):\n"
                                                      "        pass\n\n    def eval(self, parameters, input_data, context):\n"
                                                      f"{body}\n", "language": "python", "version": 1}

    rule = {"name": "resourceAllocator", "policyRuleURI": "registry:p"}
    with pytest.raises(PolicyFailed) as err:
        await PolicyRuntime(lookup=lookup, timeout_s=0.2).invoke(rule, "r", {"action": "allocation"})
    assert err.value.kind == kind and err.value.no_answer == (kind in ("wrong_shape", "timed_out", "load")), err.value
    if kind == "unavailable":
        assert "cannot read 'registry:p' from the registry: ConnectionError: Redis is loading" in err.value.reason
