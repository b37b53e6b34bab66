"""Hostile policies side by side with good blocks (the single-policy cases are in
tests/integration/test_policies.py and test_starlark.py; their sources are reused here): each
hostile step fails its block with a reason, the good blocks are placed, no worker dies, and the
invariants (including Redis == stream) hold."""

from __future__ import annotations

import asyncio

from ..integration.conftest import System
from ..integration.test_starlark import HOG, SPIN
from .conftest import explain, publish_create, settled_check, size, spec, wait_terminal

RAISES = (
    "class Boom:\n    def __init__(self, rule_id, settings, parameters):\n        pass\n"
    "    def eval(self, parameters, input_data, context):\n        raise RuntimeError('hostile: raised')\n"
)
WRONG_SHAPE = (
    "class Wrong:\n    def __init__(self, rule_id, settings, parameters):\n        pass\n"
    "    def eval(self, parameters, input_data, context):\n        return ['not', 'a', 'placement']\n"
)
HOSTILE = {"raises": (RAISES, "python"), "wrong": (WRONG_SHAPE, "python"), "spin": (SPIN, "starlark"), "hog": (HOG, "starlark")}


async def test_hostile_policies_fail_their_step_only(chaos: System) -> None:
    c = chaos.client
    await c.add_sim_cluster("c0", nodes=size(4, 8), gpus=8)  # room for every good block (1 GPU each)
    for name, (source, language) in HOSTILE.items():
        await c.policy_put(name, source, language)
    copies = size(1, 5)
    hostile = {
        f"h-{name}-{k}": {**spec(), "policyRulesSpec": [{"name": "resourceAllocator", "policyRuleURI": f"registry:{name}"}]}
        for name in HOSTILE for k in range(copies)
    }
    good = {f"g-{k}": spec() for k in range(size(8, 40))}
    for bid, body in [*hostile.items(), *good.items()]:
        await publish_create(c, bid, body)
    status = await wait_terminal(c, set(hostile) | set(good), timeout=size(240, 600))
    not_ready = {b: status.get(b) for b in good if status.get(b) != "ready"}
    reasons = {b: ((await c.store.get_block(b)) or {}).get("reason") for b in not_ready}
    assert not_ready == {}, reasons
    assert {b: status.get(b) for b in hostile if status.get(b) != "failed"} == {}
    for bid in hostile:
        reason = (await c.store.get_block(bid))["reason"]
        assert reason and "policy" in reason, (bid, reason)
    assert chaos.supervisor.restarts == 0
    rep = await settled_check(c, set(hostile) | set(good))
    assert rep.ok, explain(rep)
    await asyncio.sleep(0)
