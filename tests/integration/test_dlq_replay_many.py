"""``blocks dlq replay`` over more letters than one window (``bus.dlq.WINDOW``) on real NATS, the
command in its own process (docs/dead-letters.md "Many letters"): each window's copies are
published together, in the letters' order, their acks awaited together, and only then their
marks; every letter keeps what a replay of it alone gets (its body, a message id of its own per
letter and attempt, its mark, its progress line), and a letter refused in the middle of a
window is listed without stopping the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import dlq as dl
from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import DeadLetter

from .test_dlq_replay import blocks

pytestmark = pytest.mark.integration

DURABLE = "dlq-many"
SUBJECT = "aios.cluster.dlq-many.reassignment"


async def _letter(bus: Bus, i: int, seq: int, consumer: str = DURABLE, subject: str = SUBJECT) -> Any:
    """A dead letter as the consumer runner stores it, of the original at ``seq``."""
    letter = DeadLetter(subject=subject, consumer=consumer, error="No space left on device", deliveries=5, stream_seq=seq,
                        data=json.dumps({"id": f"evt-{i}"}), headers={"Content-Type": "application/json"})
    return await bus.emit(E.dead_letter, letter, consumer=consumer, subject=subject)


async def test_many_letters_go_a_window_at_a_time_copies_then_marks_each_in_order_and_every_failure_listed(
        tmp_path: Path) -> None:
    n = dl.WINDOW + 44  # two windows
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        await bus.ensure_consumer(subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-many.*",)))
        originals = [await bus.publish_raw(SUBJECT, json.dumps({"id": f"evt-{i}"}).encode(), msg_id=f"evt-{i}")
                     for i in range(n)]
        letters, stored = [], []
        for i, a in enumerate(originals):
            letters.append(await _letter(bus, i, int(a.seq)))
            stored.append(letters[-1])
            if i == 100:  # in the first window: a letter whose consumer is gone, one whose subject is no more
                gone = await _letter(bus, 9001, int(originals[3].seq), consumer="no-such-consumer")
                renamed = await _letter(bus, 9002, 999_999, subject="aios.cluster.dlq-many.renamed_step")
                stored += [gone, renamed]
        rc, out, errs = await blocks(servers, "dlq", "replay", "--all", "--json")
        rows = [json.loads(line) for line in out.splitlines()]
        assert rc == 1, (rc, errs[-2000:])
        # one line per letter, in the order stored (progress), every refusal among them with its reason
        assert [r["letter"] for r in rows] == [f"AIOS:{a.seq}" for a in stored]
        refused = {r["letter"]: r["reason"] for r in rows if r["outcome"] != "replayed"}
        rows = [r for r in rows if r["outcome"] == "replayed"]
        assert set(refused) == {f"AIOS:{gone.seq}", f"AIOS:{renamed.seq}"}, refused
        assert "its consumer no-such-consumer is no longer on AIOS" in refused[f"AIOS:{gone.seq}"]
        assert "is no event of this version's catalog" in refused[f"AIOS:{renamed.seq}"]
        ids = await bus.ids()
        copies, marks = [], []
        for i, (row, a) in enumerate(zip(rows, letters, strict=True)):
            assert row["outcome"] == "replayed" and row["attempt"] == 1, row
            copy = await bus.js.get_msg(subjects.STREAM, int(row["replay"].split(":")[1]))
            # its body (so its event id), a message id of its own per letter and attempt
            assert copy.subject == SUBJECT and json.loads(copy.data) == {"id": f"evt-{i}"}
            assert copy.headers["Nats-Msg-Id"] == ids.wire(f"replay:AIOS:{a.seq}:1")
            assert copy.headers[dl.REPLAY_OF] == f"AIOS:{a.seq}" and copy.headers[dl.REPLAY_SEQ] == str(originals[i].seq)
            mark = await bus.js.get_last_msg(subjects.STREAM, E.dlq_replayed.subject(stream="AIOS", seq=str(a.seq)))
            assert json.loads(mark.data)["data"]["replay_seq"] == copy.seq
            copies.append(copy.seq)
            marks.append(mark.seq)
        # the copies stored in the letters' order; a window's copies all stored before its marks
        # (one letter at a time stored copy, mark, copy, mark)
        assert copies == sorted(copies)
        first, second = slice(0, dl.WINDOW - 2), slice(dl.WINDOW - 2, n)  # the first window held the 2 refused too
        assert max(copies[first]) < min(marks[first]) and max(marks[first]) < min(copies[second]), (copies[:3], marks[:3])
        assert max(copies[second]) < min(marks[second])
        # replayed once: a second --all skips them all (and refuses the two again)
        before = (await bus.js.stream_info(subjects.STREAM)).state.last_seq
        rc, out, errs = await blocks(servers, "dlq", "replay", "--all")
        assert rc == 1 and f"0 replayed, 2 refused, {n} skipped: replayed before" in " ".join(out.split()), (out, errs)
        assert (await bus.js.stream_info(subjects.STREAM)).state.last_seq == before
    finally:
        await bus.close()
        servers.stop()


async def test_letters_a_replay_cannot_read_or_send_with_nats_gone_are_each_listed_failed(tmp_path: Path) -> None:
    """NATS gone under a replay: each letter is its own ``failed`` result with the error (the others
    of its window too), not the end of the command with a traceback, and nothing is stored."""
    import msgspec

    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    gone = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        await bus.ensure_consumer(subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-many.*",)))
        letters = []
        for i in range(4):
            a = await bus.publish_raw(SUBJECT, json.dumps({"id": f"evt-{i}"}).encode(), msg_id=f"evt-{i}")
            # two with their originals in the stream (read first), two from the letter's copy (sent at once)
            seq = int(a.seq) if i < 2 else 0
            letter = DeadLetter(subject=SUBJECT, consumer=DURABLE, error="disk full", deliveries=5, stream_seq=seq,
                                data=json.dumps({"id": f"evt-{i}"}))
            ack = await bus.emit(E.dead_letter, letter, consumer=DURABLE, subject=SUBJECT, qualifier=str(i))
            letters.append((dl.Letter(subjects.STREAM, int(ack.seq), "", subjects.dead_letter(DURABLE, SUBJECT),
                                      {"id": f"dlq:{DURABLE}:{seq}:{i}", "data": msgspec.to_builtins(letter)}), 1))
        before = (await bus.js.stream_info(subjects.STREAM)).state.last_seq
        await gone.nc.close()
        for force in (False, True):  # with --force, the letters' copies need no read: their publishes fail
            results = [r async for r in dl.replay_many(gone, letters, "ops@host", force=force)]
            assert [r.outcome for r in results] == ["failed"] * 4, [(r.outcome, r.reason) for r in results]
            assert all("ConnectionClosed" in r.reason for r in results), [r.reason for r in results]
        assert (await bus.js.stream_info(subjects.STREAM)).state.last_seq == before
    finally:
        await gone.close()
        await bus.close()
        servers.stop()
