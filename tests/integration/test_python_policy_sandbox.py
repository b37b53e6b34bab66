"""A registry Python policy that spins for ever, through the controller on real NATS JetStream and
Redis and real worker processes: its process is stopped at the time limit, its block fails with
that reason, and the same controller (no restart) places the next block with a good policy. In
threads, such a call held its thread and a share of the worker's CPU until the worker restarted."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import System
from .test_cli import blocks
from .test_policies import LAST

SPIN = """
class Spin:
    def __init__(self, rule_id, settings, parameters):
        pass

    def eval(self, parameters, input_data, context):
        while True:
            pass
"""


@pytest.fixture
def short_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_POLICY_TIMEOUT_S", "1")  # inherited by the worker processes


def _spec(bid: str, policy: str) -> dict:
    return {
        "blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
        "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": f"registry:{policy}"}}],
    }


async def test_a_spinning_policy_fails_its_block_and_the_worker_places_the_next(
        short_limit: None, system: System, tmp_path: Path) -> None:
    c = system.client
    await c.add_sim_cluster("c0", nodes=2, gpus=1)
    for name, source in (("spin", SPIN), ("picker", LAST)):
        f = tmp_path / f"{name}.py"
        f.write_text(source)
        r = blocks(system, "policy", "add", name, str(f))
        assert r.returncode == 0, r.stderr

    bid, kind, env = await system.submit_and_wait(_spec("spin-1", "spin"), timeout=90)
    assert kind == "failed", env
    assert "timed out after 1s (its process was stopped)" in str(env), env

    bid, kind, env = await system.submit_and_wait(_spec("good-1", "picker"))
    assert kind == "ready", env
    assert next(iter((await c.store.instances(bid)).values()))["node"] == "c0-n1"
    assert system.supervisor.restarts == 0  # the same controller process placed it
