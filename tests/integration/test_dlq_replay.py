"""``blocks dlq replay`` on real NATS and Redis (docs/reliability.md "Dead letters"): a message whose
handler keeps failing (the runner's scenario: a cause outside the message, here a flag standing for a
full disk) is dead-lettered; once the cause is fixed, ``blocks dlq replay ID`` (the real command, its
own process) puts the original back on its subject and the same consumer handles it (its effect
seen), with the same body and event id and a message id of its own; ``blocks dlq`` shows it
replayed; a second replay is refused (exit 1) unless ``--force``; ``--dry-run`` sends nothing; a
letter whose original the stream dropped goes from the letter's copy; one whose consumer is gone is
refused."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.runner import ConsumerRunner, Delivery, RunnerOptions
from aios_blocks.runtime.embedded import EmbeddedServers

from .conftest import System
from .test_agent import Agents

pytestmark = pytest.mark.integration

DURABLE = "dlq-replay-test"
BAD = "aios.cluster.dlq-replay.reassignment"
OTHER = "aios.cluster.dlq-replay.scale"


async def blocks(servers: EmbeddedServers, *args: str) -> tuple[int, str, str]:
    """``blocks ARGS`` as an operator runs it: its own process, the admin's URLs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")} | {
        "AIOS_NATS_URL": servers.nats_url, "AIOS_REDIS_URL": servers.redis_url, "COLUMNS": "250"}
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aios_blocks.cli", *args], env=env,
                                capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


async def listed(servers: EmbeddedServers) -> dict[int, dict[str, Any]]:
    rc, out, errs = await blocks(servers, "dlq", "--json")
    assert rc == 0, errs
    return {d["seq"]: d for d in map(json.loads, out.splitlines()) if d["stream"] == subjects.STREAM}


async def test_a_dead_letter_replayed_after_the_fix_is_handled_by_its_consumer_once_and_marked(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    stop = asyncio.Event()
    try:
        await bus.ensure_stream()
        spec = subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-replay.*",))
        await bus.ensure_consumer(spec)
        disk_full = True
        handled: list[tuple[str, bytes, int, str]] = []
        letters: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def handler(d: Delivery) -> None:
            if disk_full:
                raise OSError("No space left on device")
            handled.append((d.subject, d.data, d.deliveries, d.headers.get("Aios-Replay-Of", "")))

        async def on_letter(msg: Any) -> None:
            await letters.put(msgspec.json.decode(msg.data))

        await bus.subscribe(f"aios.dlq.{DURABLE}.>", on_letter)
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(max_deliver=2, backoff_s=(0.05,), fetch_timeout_s=0.2))
        task = asyncio.create_task(runner.run(stop))
        body = b'{"id":"evt-1","data":{"x":1}}'
        await bus.publish_raw(BAD, body, msg_id="evt-1")
        await bus.publish_raw(OTHER, b'{"id":"evt-2"}', msg_id="evt-2")
        first = await asyncio.wait_for(letters.get(), 20)
        second = await asyncio.wait_for(letters.get(), 20)
        assert handled == []
        by_subject = {lt["data"]["subject"]: lt for lt in (first, second)}
        assert "No space left on device" in by_subject[BAD]["data"]["error"]
        seqs = {s: seq for seq, d in (await listed(servers)).items() for s in [d["event"]["data"]["subject"]]}
        bad, other = seqs[BAD], seqs[OTHER]
        assert (await listed(servers))[bad]["replayed"] == []

        # a dry run says what it would do and sends nothing
        rc, out, errs = await blocks(servers, "dlq", "replay", "--consumer", DURABLE, "--dry-run")
        assert rc == 0 and out.count("would replay") == 2 and "the original from the stream" in out, (out, errs)
        await asyncio.sleep(1.0)
        assert handled == []

        disk_full = False  # the operator fixed the cause
        rc, out, errs = await blocks(servers, "dlq", "replay", str(bad))
        assert rc == 0 and f"replayed AIOS:{bad} ({BAD} -> {DURABLE}) as AIOS:" in " ".join(out.split()), (out, errs)

        async def got(n: int) -> None:
            while len(handled) < n:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(got(1), 20)
        # the same consumer took the original again: its subject, its very bytes (so its event id), a first delivery
        assert handled == [(BAD, body, 1, f"AIOS:{bad}")]
        marks = (await listed(servers))[bad]["replayed"]
        assert len(marks) == 1 and marks[0]["attempt"] == 1 and marks[0]["source"] == "stream" and marks[0]["by"]
        copy = await bus.js.get_msg(subjects.STREAM, marks[0]["replay_seq"])
        assert copy.subject == BAD and copy.data == body
        assert copy.headers["Nats-Msg-Id"] == (await bus.ids()).wire(f"replay:AIOS:{bad}:1") != (await bus.ids()).wire("evt-1")
        mark = await bus.js.get_last_msg(subjects.STREAM, E.dlq_replayed.subject(stream="AIOS", seq=str(bad)))
        assert json.loads(mark.data)["type"] == E.dlq_replayed.type
        rc, out, _ = await blocks(servers, "dlq")
        assert f"1x, as AIOS:{marks[0]['replay_seq']}" in out, out

        # a second replay of the same letter is refused, the handler does not see it again
        rc, out, errs = await blocks(servers, "dlq", "replay", f"AIOS:{bad}")
        assert rc == 1 and "already replayed by" in errs and "--force replays it again" in " ".join(errs.split()), (out, errs)
        # --all skips it too, and replays the other letter: its original dropped by the stream meanwhile,
        # it goes from the letter's copy
        await bus.js.delete_msg(subjects.STREAM, by_subject[OTHER]["data"]["stream_seq"])
        rc, out, errs = await blocks(servers, "dlq", "replay", "--all")
        assert rc == 0 and f"replayed AIOS:{other}" in out and "from the letter's copy" in out, (out, errs)
        assert f"skipped AIOS:{bad}" in out and "1 replayed, 0 refused, 1 skipped: replayed before" in out, (out, errs)
        await asyncio.wait_for(got(2), 20)
        assert handled[1] == (OTHER, b'{"id":"evt-2"}', 1, f"AIOS:{other}")
        # --force: once more, as attempt 2
        rc, out, errs = await blocks(servers, "dlq", "replay", str(bad), "--force", "--json")
        res = json.loads(out)
        assert rc == 0 and res["outcome"] == "replayed" and res["attempt"] == 2, (out, errs)
        await asyncio.wait_for(got(3), 20)
        assert handled[2] == (BAD, body, 1, f"AIOS:{bad}") and len((await listed(servers))[bad]["replayed"]) == 2
        # a replay that fails again is a new letter, which says which letter it is a replay of
        disk_full = True
        rc, out, errs = await blocks(servers, "dlq", "replay", str(bad), "--force")
        assert rc == 0, (out, errs)
        again = await asyncio.wait_for(letters.get(), 20)
        assert again["data"]["subject"] == BAD
        rows = await listed(servers)
        assert [r["replay_of"] for r in rows.values() if r["replay_of"]] == [f"AIOS:{bad}"], rows
        rc, out, _ = await blocks(servers, "dlq")
        assert f"a replay of AIOS:{bad}" in " ".join(out.split()), out

        # the consumer gone (its block, node or cluster removed): nobody it was meant for would take it
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.js.delete_consumer(subjects.STREAM, DURABLE)
        rc, out, errs = await blocks(servers, "dlq", "replay", str(bad), "--force", "--dry-run")
        assert rc == 0, (out, errs)  # --force sends it anyway
        rc, out, errs = await blocks(servers, "dlq", "replay", "no-such-letter", "AIOS:99999")
        assert rc == 1 and "no dead letter no-such-letter" in errs and "no dead letter AIOS:99999" in errs, errs
    finally:
        stop.set()
        await bus.close()
        servers.stop()


async def test_a_letter_whose_consumer_is_gone_is_refused(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    stop = asyncio.Event()
    try:
        await bus.ensure_stream()
        spec = subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-replay.*",))
        await bus.ensure_consumer(spec)
        letters: asyncio.Queue[bytes] = asyncio.Queue()

        async def handler(d: Delivery) -> None:
            raise RuntimeError("policy raised")

        async def on_letter(msg: Any) -> None:
            await letters.put(msg.data)

        await bus.subscribe(f"aios.dlq.{DURABLE}.>", on_letter)
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(max_deliver=1, backoff_s=(0.05,), fetch_timeout_s=0.2))
        task = asyncio.create_task(runner.run(stop))
        await bus.publish_raw(BAD, b'{"id":"evt-3"}', msg_id="evt-3")
        await asyncio.wait_for(letters.get(), 20)
        stop.set()
        await asyncio.wait_for(task, 10)
        await bus.js.delete_consumer(subjects.STREAM, DURABLE)
        before = (await bus.js.stream_info(subjects.STREAM)).state.last_seq
        rc, out, errs = await blocks(servers, "dlq", "replay", "--reason", "policy raised")
        text = " ".join(errs.split())
        assert rc == 1 and f"its consumer {DURABLE} is no longer on AIOS" in text and "--force sends it anyway" in text, (out, errs)
        assert (await bus.js.stream_info(subjects.STREAM)).state.last_seq == before  # nothing sent, nothing marked
    finally:
        stop.set()
        await bus.close()
        servers.stop()


@pytest.fixture
def executor_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The executor's HTTP ingress and the side-cars' quick restart (test_sidecars): before ``system``."""
    from aios_blocks.runtime.embedded import free_port

    port = free_port()
    monkeypatch.setenv("AIOS_EXECUTOR_HTTP_PORT", str(port))
    monkeypatch.setenv("AIOS_SIDECAR_RESTART_S", "0.2")
    return port


@pytest.fixture
async def sidecar_agents(executor_port: int, system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    from .test_sidecars import node_agent

    if system.servers is None:
        pytest.skip("needs the embedded servers (the command runs with their admin URLs)")
    async with node_agent(system, tmp_path) as a:
        yield a


async def test_an_output_a_real_sidecar_gave_up_on_is_stored_once_its_cause_is_fixed_and_it_is_replayed(
        sidecar_agents: Agents, tmp_path: Path) -> None:
    """The whole path: a real node agent runs the echo instance and the SQLite side-car; its table
    is dropped under it (the cause), so an output is retried and dead-lettered in AIOS_OUTPUTS;
    the table back (the fix), ``blocks dlq replay AIOS_OUTPUTS:SEQ`` puts the output back and the
    side-car stores it; a second replay is refused."""
    import sqlite3

    from aios_blocks.examples.sidecars.sqlite_store import SCHEMA

    from .test_agent import until
    from .test_sidecars import place, sidecars_running, store_sidecar, stored

    system = sidecar_agents.system
    assert system.servers is not None
    c, db, bid = system.client, tmp_path / "replayed.db", "sc-replay"
    await place(c, bid, [store_sidecar(db, maxDeliver=2)], n=1)
    await until(lambda: sidecars_running(bid), 60, "the side-car running")
    assert (await c.task(bid, b'{"n": 0}', headers={"Aios-Task-Id": "first"}))[0] == 200

    async def has(tid: str) -> bool:
        return tid in stored(db)

    await until(lambda: has("first"), 60, "the first output stored")
    with sqlite3.connect(db, timeout=10) as conn:
        conn.execute("DROP TABLE outputs")
    assert (await c.task(bid, b'{"n": 1}', headers={"Aios-Task-Id": "lost"}))[0] == 200
    where = E.output_dead_letter.subject(bid=bid, name="store", outcome="ok")

    async def letter() -> Any:
        from nats.js.errors import NotFoundError

        try:
            return await c.bus.js.get_last_msg(subjects.STREAM_OUTPUTS, where)
        except NotFoundError:
            return None

    msg = await until(letter, 60, "the dead letter")
    assert "no such table: outputs" in json.loads(msg.data)["data"]["error"]
    with sqlite3.connect(db, timeout=10) as conn:
        conn.execute(SCHEMA.format(table="outputs"))
    assert not await has("lost")
    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS_OUTPUTS:{msg.seq}")
    assert rc == 0 and f"replayed AIOS_OUTPUTS:{msg.seq} (aios.output.{bid}.ok -> sidecar-{bid}-store) as AIOS_OUTPUTS:" in out, (out, errs)
    await until(lambda: has("lost"), 60, "the replayed output stored")
    row = stored(db)["lost"]
    assert row["deliveries"] == 1 and json.loads(row["output"])["output"] == {"n": 1}
    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS_OUTPUTS:{msg.seq}")
    assert rc == 1 and "already replayed" in errs, (out, errs)
