"""A planned remove of an instance that serves HTTP waits the drain grace before stopping it (the
mapper marks it ``draining`` on the same command; executors must see that before it stops
listening); an eviction or an instance without an endpoint does not wait."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aios_blocks.agent import node_agent as na
from aios_blocks.agent.gpus import detect
from aios_blocks.agent.runtime_sim import SimRuntime
from aios_blocks.schemas.spec import Node


class Journal:
    def __init__(self) -> None:
        self.steps: list[str] = []


def make_agent(tmp_path: Path, journal: Journal, grace: float) -> na.NodeAgent:
    node = Node(id="n1", cluster="c1")
    cfg = na.AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False,
                         workdirs=False, probes=False, drain_grace_s=grace)
    rt = SimRuntime(start_delay_s=0, state_dir=tmp_path / "sim")
    agent = na.NodeAgent(None, rt, detect(None, "n1"), cfg)  # type: ignore[arg-type]

    async def fact(bid: str, gen: int, iid: str, kind: str, reason: str, gpus: list[str], **kw: Any) -> None:
        journal.steps.append(f"{kind}:{iid}")

    agent._fact = fact  # type: ignore[method-assign]
    return agent


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    seen: list[float] = []
    real = na.asyncio.sleep

    async def sleep(delay: float, *a: Any) -> None:
        seen.append(delay)
        await real(0)

    monkeypatch.setattr(na.asyncio, "sleep", sleep)
    return seen


@pytest.mark.parametrize(
    ("endpoint", "reason", "waits"),
    [
        ("http://127.0.0.1:9", "reassigned to b1-i9", True),
        ("http://127.0.0.1:9", "block deleted", True),
        ("http://127.0.0.1:9", "evicted: node n1 lost", False),
        ("", "reassigned to b1-i9", False),
    ],
)
async def test_a_planned_remove_of_a_serving_instance_waits_the_grace(
    tmp_path: Path, sleeps: list[float], endpoint: str, reason: str, waits: bool
) -> None:
    journal = Journal()
    agent = make_agent(tmp_path, journal, grace=0.25)
    agent.meta["b1-i0"] = {"block_id": "b1", "gen": 1, "endpoint": endpoint}
    await agent.remove("b1", 1, "b1-i0", reason)
    assert (0.25 in sleeps) is waits
    assert journal.steps == ["removed:b1-i0"]  # always answered, grace or not
    assert "b1-i0" not in agent.meta


async def test_no_grace_configured_never_waits(tmp_path: Path, sleeps: list[float]) -> None:
    journal = Journal()
    agent = make_agent(tmp_path, journal, grace=0)
    agent.meta["b1-i0"] = {"block_id": "b1", "gen": 1, "endpoint": "http://127.0.0.1:9"}
    await agent.remove("b1", 1, "b1-i0", "block deleted")
    assert sleeps == [] and journal.steps == ["removed:b1-i0"]
