"""A block left below its minimum is driven back (issue 32, item 1), on real NATS JetStream and
Redis with the real worker processes and two real simulated agents (``blocks agent --runtime sim``):

cluster c5 of two L4 nodes, an indivisible virtual cluster of one of them, a block min=max=1 in it;
the member's agent is SIGKILLed (its simulated instances die with it). The health checker's
``replace`` must not put the replacement back on the dead node (it is suspect: every instance on
it fails its probes), the heartbeat eviction's reassignment may fail while the virtual cluster is
being refilled with the spare node, and the reconciler must then bring the block back to one
running instance, on the spare node.

With no node left to take it, the block is marked *short* (docs/reliability.md "Short blocks"):
its record, ``blocks get``/``list``/``explain``, the console's fold, the controllers' gauge and one
``block.degraded``; whole again when a node joins, with one ``block.restored``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aios_blocks.console.projection import blocks_page
from aios_blocks.projections.explain import explain
from aios_blocks.recovery.invariants import check
from aios_blocks.recovery.rebuild import fold_stream
from aios_blocks.state.vcluster import VClusterStore
from aios_blocks.state.views import short_of

from .conftest import System
from .test_cli import BLOCKS, ROOT, blocks
from .test_vcluster import create

NODE_TIMEOUT_S = 6.0


class SimAgents:
    """``blocks agent --runtime sim`` processes, one per node, as the issue's reproduction ran them."""

    def __init__(self, system: System, base: Path):
        self.system, self.base = system, base
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, nid: str, cluster: str) -> None:
        env = {**os.environ, "AIOS_NATS_URL": self.system.supervisor.nats_url}
        env.pop("AIOS_REDIS_URL", None)
        if self.system.servers is not None:
            env.update(self.system.servers.agent_env(nid))
        with open(self.base / f"agent-{nid}.log", "ab") as log:
            self.procs[nid] = subprocess.Popen(
                [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", nid, "--cluster", cluster,
                 "--runtime", "sim", "--sim-gpus", "2", "-l", "nodeType=L4", "--heartbeat-s", "1",
                 "--cpu", "8", "--memory", "16384", "--agent-dir", str(self.base / "agent")],
                env=env, stdout=log, stderr=log, start_new_session=True,
            )

    def kill(self, nid: str) -> None:
        self.procs[nid].send_signal(signal.SIGKILL)
        self.procs[nid].wait(10)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


@pytest.fixture
def fast_node_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before ``system``: the worker processes inherit it."""
    monkeypatch.setenv("AIOS_NODE_TIMEOUT_S", str(NODE_TIMEOUT_S))


@pytest.fixture
async def agents(fast_node_timeout: None, system: System, tmp_path: Path) -> AsyncIterator[SimAgents]:
    a = SimAgents(system, tmp_path)
    try:
        yield a
    finally:
        a.stop_all()


async def until(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        out = await fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.2)


async def _stored(system: System, bid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(s, env) for s, env, _ in await system.client.history(bid)]


async def test_block_below_its_minimum_after_its_node_dies_comes_back_on_the_spare_node(agents: SimAgents) -> None:
    system = agents.system
    c = system.client
    for nid in ("c5-a", "c5-b"):
        agents.start(nid, "c5")

    async def registered() -> bool:
        return all([await c.store.node_meta(n) for n in ("c5-a", "c5-b")])

    await until(registered, 90, "both agents registered")
    ok, out = await create(c, "v5", "c5", {"L4": 1})
    assert ok, out
    rec = await VClusterStore(c.store).get("v5")
    assert rec is not None
    (member,) = rec.nodes
    spare = "c5-b" if member == "c5-a" else "c5-a"
    # the checker's replace comes before the node's heartbeat timeout (the order of events)
    checker = {"name": "stabilityChecker", "policyRuleURI": "builtin:probe-threshold",
               "settings": {"failureThreshold": 1, "restartThreshold": 2, "maxRestarts": 0, "startupGraceS": 1}}
    bid, kind, env = await system.submit_and_wait({
        "blockComponentURI": "aios://test/model", "blockId": "b5", "minInstances": 1, "maxInstances": 1,
        "virtualClusterId": "v5", "policyRulesSpec": [{"values": checker}],
    }, timeout=90)
    assert kind == "ready", env
    (first,) = (await c.store.instances(bid)).values()
    assert first["node"] == member

    agents.kill(member)

    async def back_on_spare() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 1 and all(i["status"] == "running" and i["node"] == spare for i in insts.values())

    await until(back_on_spare, 120, f"one running instance of {bid} on the spare node {spare}")
    block = await c.store.get_block(bid)
    assert block is not None and block["status"] == "ready"
    # no replacement was ever placed on the dead node after the kill
    x = explain(await _stored(system, bid))
    placed_on_member = [iid for iid, i in x["instances"].items() if i.get("node") == member and i.get("action") != "allocation"]
    assert placed_on_member == [], x["instances"]
    rep = await check(c.bus, c.store, expected={bid})
    assert rep.ok, rep.violations


async def _short_gauge(system: System) -> float:
    """``aios_reconciler_short_blocks`` over the controllers' /metrics: the largest (the lease
    holder's; the others say 0)."""
    values: list[float] = []
    async with aiohttp.ClientSession() as http:
        for t in await system.client.store.metrics.targets("controller"):
            async with http.get(t["url"]) as resp:
                text = await resp.text()
            values += [float(line.split()[-1]) for line in text.splitlines() if line.startswith("aios_reconciler_short_blocks ")]
    assert values, "no controller serves aios_reconciler_short_blocks"
    return max(values)


def _named(stored: list[tuple[str, dict[str, Any]]], tail: str) -> list[dict[str, Any]]:
    return [env for s, env in stored if s.endswith(tail)]


@pytest.fixture
def quick_reconciler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before ``system``: short waits between the reconciler's asks, so the test sees several."""
    monkeypatch.setenv("AIOS_RECONCILE_RESYNC_S", "2")
    monkeypatch.setenv("AIOS_RECONCILE_BACKOFF_S", "1")
    monkeypatch.setenv("AIOS_RECONCILE_MAX_BACKOFF_S", "4")
    monkeypatch.setenv("AIOS_NODE_SUSPECT_TTL_S", "300")  # the dead node's mark outlives its last renewal here


async def test_block_short_with_no_capacity_says_why_and_comes_back_when_a_node_does(
    quick_reconciler: None, agents: SimAgents,
) -> None:
    """The only L4 node dies: the eviction's reassignment finds no node (final), the block is
    ``ready`` with no instance. The reconciler keeps asking, spaced by its backoff, and each ask
    and its failure are stored with the reason (``blocks explain``); when a spare L4 node joins,
    the virtual cluster is refilled with it and the next ask places the block there."""
    system = agents.system
    c = system.client
    agents.start("c5-a", "c5")

    async def registered(nid: str) -> bool:
        return await c.store.node_meta(nid) is not None

    await until(lambda: registered("c5-a"), 90, "c5-a registered")
    ok, out = await create(c, "v5", "c5", {"L4": 1})
    assert ok, out
    bid, kind, env = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "b6",
                                                   "minInstances": 1, "maxInstances": 1, "virtualClusterId": "v5"}, timeout=90)
    assert kind == "ready", env
    agents.kill("c5-a")

    async def asked_and_refused() -> dict[str, Any] | None:
        x = explain(await _stored(system, bid))
        asks = [t for t in x["targets"] if t["source"] == "reconciler"]
        refused = [f for f in x["failures"] if f["step"] == "scale"]
        return x if len(asks) >= 3 and refused and not await c.store.instances(bid) else None

    x = await until(asked_and_refused, 90, "the reconciler's asks and their failures")
    block = await c.store.get_block(bid)
    assert block is not None and block["status"] == "ready"
    asks = [t for t in x["targets"] if t["source"] == "reconciler"]
    # each ask says why, and they are spaced by the backoff (attempt n, then n + 1...), not repeated per pass
    assert all("< minInstances 1" in t["reason"] for t in asks), asks
    attempts = [int(t["reason"].split("(attempt ")[1].split(";")[0]) for t in asks]
    assert attempts == list(range(1, len(asks) + 1)), asks
    assert len({t["request_id"] for t in asks}) == len(asks)
    refused = [f["reason"] for f in x["failures"] if f["step"] == "scale"]
    assert refused and all("no healthy node can host" in r for r in refused), refused
    # short: its record says so (a condition beside the status, which stays ready), with the reason
    async def marked() -> dict[str, Any] | None:
        b = await c.store.get_block(bid)
        return short_of(b.get("short")) if b and b["status"] == "ready" else None

    short = await until(marked, 30, f"{bid} marked short")
    assert (short["live"], short["min_instances"]) == (0, 1) and "failed: " in short["reason"], short
    assert "no healthy node" in short["reason"], short
    r = blocks(system, "get", bid)
    assert r.returncode == 0 and "b6: ready (short 0/1 since " in " ".join(r.stdout.split()), r.stdout + r.stderr
    r = blocks(system, "list", "--json")
    (row,) = [b for b in json.loads(r.stdout) if b["id"] == bid]
    assert row["status"] == "ready" and row["short"]["live"] == 0 and row["short"]["since"] == short["since"], row
    # the table: the condition beside the status, its why in the reason column (not a status cell
    # dozens of lines tall beside an empty reason)
    r = await asyncio.to_thread(subprocess.run, [*BLOCKS, "list"], capture_output=True, text=True, timeout=90, cwd=ROOT, env={
        **os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url, "COLUMNS": "1000"})
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("│ b6 ")]
    cells = [cell.strip() for cell in line.strip("│").split("│")]
    assert re.fullmatch(r"ready \(short 0/1 since \d\d:\d\d:\d\d\)", cells[1]), cells
    assert "no healthy node" in cells[4] and "failed: " in cells[4], cells
    assert (await _short_gauge(system)) == 1
    # announced once however many passes and asks follow
    n_asks = len(asks)
    await until(lambda: _more_asks(system, bid, n_asks + 2), 60, "two more asks of the reconciler")
    stored = await _stored(system, bid)
    (degraded,) = _named(stored, ".degraded")
    assert degraded["data"]["since"] == short["since"] and degraded["data"]["min_instances"] == 1
    assert _named(stored, ".restored") == []
    x = explain(stored)
    (spell,) = x["short"]
    assert spell["restored"] == "" and spell["live"] == 0, spell
    # the console (the stream's fold) shows it too
    (crow,) = [b for b in blocks_page(await fold_stream(c.bus), q=bid)["rows"] if b["id"] == bid]
    assert crow["status"] == "ready" and crow["short"].startswith("short 0/1 since "), crow

    # the dead node was suspect (every instance on it failing, its agent silent) before its heartbeat timed out
    r = blocks(system, "node", "list", "--json")
    assert r.returncode == 0, r.stderr
    (dead,) = [n for n in json.loads(r.stdout) if n["node_id"] == "c5-a"]
    assert dead["suspect"] and "fail their health probes" in dead["suspect"]["reason"], dead

    agents.start("c5-b", "c5")

    async def back_on_spare() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 1 and all(i["status"] == "running" and i["node"] == "c5-b" for i in insts.values())

    await until(back_on_spare, 90, f"one running instance of {bid} on the new node c5-b")

    async def whole_again() -> list[dict[str, Any]]:
        b = await c.store.get_block(bid)
        return _named(await _stored(system, bid), ".restored") if b and "short" not in b else []

    (restored,) = await until(whole_again, 30, f"{bid} whole again: its mark cleared, block.restored")
    assert restored["data"]["since"] == short["since"] and restored["data"]["live"] == 1, restored
    stored = await _stored(system, bid)
    assert len(_named(stored, ".degraded")) == 1
    (spell,) = explain(stored)["short"]
    assert spell["restored"] and "1 live >= minInstances 1" in spell["restored_reason"], spell
    r = blocks(system, "get", bid)
    assert "b6: ready" in " ".join(r.stdout.split()) and "short" not in r.stdout, r.stdout
    assert (await _short_gauge(system)) == 0
    (crow,) = [b for b in blocks_page(await fold_stream(c.bus), q=bid)["rows"] if b["id"] == bid]
    assert crow["short"] == "", crow
    rep = await check(c.bus, c.store, expected={bid})
    assert rep.ok, rep.violations


async def _more_asks(system: System, bid: str, n: int) -> bool:
    x = explain(await _stored(system, bid))
    return len([t for t in x["targets"] if t["source"] == "reconciler"]) >= n
