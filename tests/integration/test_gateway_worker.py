"""The gateway worker's decisions (``workers/gateway.py``) on real NATS JetStream and Redis, called
in-process: a gather's timer (``on_due``: wait, ask the silent clusters again, or decide), the
decision (``_decide``: one per round, the chosen cluster's allocation or the block's failure, the
answers it decided on), the timer loop's claims (``fire_due``) and a stale round decided by nobody."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.cli.client import Client
from aios_blocks.settings import Settings
from aios_blocks.workers import gateway
from aios_blocks.workers.base import Worker

from ..unit.views import make_ir
from .conftest import worker_rig

pytestmark = pytest.mark.integration

BID = "gw-1"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "gateway", Settings(dry_run_deadline_s=5, dry_run_patience_s=60), ["c0", "c1"]) as got:
        yield got


async def _round(w: Worker, deadline: float, status: str = "selecting", attempt: int = 1) -> None:
    """A block in selection round ``attempt`` with a gather over c0 and c1 due at ``deadline``."""
    ir = make_ir(bid=BID)
    await w.store.create_block(BID, 1, "d", {"status": status, "ir": ir, "attempt": str(attempt)})
    await w.store.gather_open(BID, 1, attempt, ["c0", "c1"], deadline, at=3)


def _answer(cid: str, score: float, error: str = "") -> dict[str, Any]:
    return {"block_id": BID, "gen": 1, "cluster_id": cid, "score": score, "node_info": {}, "error": error, "attempt": 1}


async def _events(client: Client, tail: str) -> list[dict[str, Any]]:
    return [e["data"] for s, e, _ in await client.history(BID, idle=0.2) if s.endswith("." + tail)]


async def _stored(client: Client, subject: str) -> int:
    info = await client.bus.js.stream_info(subjects.STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_before_its_deadline_the_timer_waits_until_then(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    deadline = time.time() + 3600
    await _round(w, deadline)
    at = await gateway.on_due(w, BID, 1, 1)
    assert at is not None and time.time() < at <= deadline + 0.001
    assert await _events(client, "post_dry_run") == []
    assert await gateway.on_due(w, "nowhere", 1, 1) is None  # no gather: nothing to decide


async def test_past_its_deadline_with_no_answer_the_silent_clusters_are_asked_again(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    asked: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_query(msg: Any) -> None:
        await asked.put({"subject": msg.subject, **msgspec.json.decode(msg.data)["data"]})

    await client.bus.nc.subscribe("aios.cluster.*.dry_run", cb=on_query)
    await client.bus.nc.flush()
    await _round(w, time.time() - 1)
    await w.store.gather_add(BID, 1, 1, "c0", {**_answer("c0", 0.0), "error": "busy"})  # no usable answer
    at = await gateway.on_due(w, BID, 1, 1)
    assert at is not None and at > time.time()  # waits on, within its patience
    async with asyncio.timeout(10):
        q = await asked.get()
    # only the cluster that never answered, the same request (its round and the state it started from)
    assert (q["subject"], q["block_id"], q["attempt"], q["at"]) == ("aios.cluster.c1.dry_run", BID, 1, 3)
    assert asked.empty() and await _events(client, "post_dry_run") == []


async def test_past_deadline_and_patience_the_round_fails_naming_who_never_answered(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _round(w, time.time() - 120)  # deadline and patience (60 s) both over
    assert await gateway.on_due(w, BID, 1, 1) is None
    (post,) = await _events(client, "post_dry_run")
    assert post["cluster_id"] == "" and sorted(post["missing"]) == ["c0", "c1"]
    (failed,) = await _events(client, "failed")
    assert "no answer in time" in failed["reason"] and "c0" in failed["reason"] and "c1" in failed["reason"]
    assert (await w.store.get_block(BID) or {})["status"] == "failed"
    assert await w.store.gather_read(BID, 1, 1) == {"expected": [], "deadline": 0.0, "results": {}, "decided": None, "at": 0}


async def test_a_usable_answer_past_the_deadline_decides_and_requests_the_allocation(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _round(w, time.time() - 1)
    await w.store.gather_add(BID, 1, 1, "c1", _answer("c1", 1.0))
    assert await gateway.on_due(w, BID, 1, 1) is None
    (post,) = await _events(client, "post_dry_run")
    assert post["cluster_id"] == "c1" and post["missing"] == ["c0"] and post["scores"] == {"c0": 0.0, "c1": 1.0}
    # the answers it decided on travel with it (a replay checks the decision against them)
    assert [(a["cluster_id"], a["score"]) for a in post["answers"]] == [("c1", 1.0)]
    block = await w.store.get_block(BID) or {}
    assert (block["status"], block["cluster"]) == ("allocating", "c1")
    assert await _stored(client, subjects.cluster_command("c1", "allocation")) == 1
    # decided again (a redelivery, a second gateway copy): nothing more
    await gateway._decide(w, BID, 1, 1, "complete")
    assert len(await _events(client, "post_dry_run")) == 1


async def test_a_round_the_block_has_left_is_decided_by_nobody(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _round(w, time.time() - 1, attempt=2)  # the block is in round 2; round 1's timer fires late
    await w.store.gather_open(BID, 1, 1, ["c0"], time.time() - 1)
    await w.store.gather_add(BID, 1, 1, "c0", {**_answer("c0", 1.0)})
    await gateway._decide(w, BID, 1, 1, "deadline")
    assert await _events(client, "post_dry_run") == []
    assert (await w.store.get_block(BID) or {})["status"] == "selecting"


async def test_a_decider_that_lost_the_claim_decides_nothing(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _round(w, time.time() - 1)
    await w.store.gather_add(BID, 1, 1, "c0", _answer("c0", 1.0))
    assert (await w.store.gather_decide_read(BID, 1, 1, "complete"))[0]  # another copy claimed it
    await gateway._decide(w, BID, 1, 1, "deadline")
    assert await _events(client, "post_dry_run") == []
    assert (await w.store.get_block(BID) or {})["status"] == "selecting"
    assert (await w.store.gather_read(BID, 1, 1))["decided"] == "complete"  # still the other's to finish


async def test_the_timer_loop_claims_each_due_round_once(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await _round(w, time.time() - 1)
    await w.store.gather_add(BID, 1, 1, "c0", _answer("c0", 0.5))
    n, _ = await gateway.fire_due(w)
    assert n == 1
    assert [p["cluster_id"] for p in await _events(client, "post_dry_run")] == ["c0"]
    assert await gateway.fire_due(w) == (0, None)  # decided: its timer is gone, none left


def test_answers_skip_what_a_recovered_gather_holds_as_bare_scores() -> None:
    g = {"expected": ["c0", "c1", "c2"], "results": {"c0": _answer("c0", 1.0), "c1": 0.5, "c2": {"score": "x"}}}
    assert [a.cluster_id for a in gateway._answers(BID, 1, 1, g)] == ["c0"]
