"""Seed 002 §5 through the real parser worker: a block asking for Trust affinity with strength
Preferred is rejected at parse time, with that reason and its other problems, and nothing is
placed. Real NATS JetStream and Redis, real workers."""

from __future__ import annotations

from .conftest import System
from .test_affinity import _spec


async def test_preferred_trust_affinity_is_rejected_with_every_problem(system: System) -> None:
    await system.client.add_sim_cluster("c0", nodes=1, gpus=1)
    aff = [
        {"category": "Trust", "strength": "Preferred", "target": {"type": "TrustDomain", "value": "attested"}},
        {"category": "Topology", "strength": "Sometimes", "target": {"type": "RackId", "value": 1}},
    ]
    bid, kind, env = await system.submit_and_wait(_spec("trust-pref", aff))
    assert kind == "rejected", env
    errors = {(e["path"], e["message"]) for e in env["data"]["errors"]}
    assert ("$.affinity[0].strength", "strength Preferred is not allowed for category Trust in v1 (allowed: Required)") in errors
    assert any(p == "$.affinity[1].strength" and "Sometimes" in m for p, m in errors), errors
    assert await system.client.store.instances(bid) == {}
