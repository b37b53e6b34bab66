"""How ``blocks dlq`` and ``blocks dlq replay`` read, on real NATS (docs/dead-letters.md "Many
letters"): a window's originals are read together (``bus.dlq.stored_many``: the same
``STREAM.MSG.GET`` requests, sent at once) and give what one ``stored_at`` each gave, for an
original that is there (its bytes and headers), gone, replaced by another subject at its sequence,
never stored, or unreadable (NATS gone); a replay over such letters sends each from where it sent
it before; and a listing whose filter nothing matches ends at once, not after its idle wait."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import dlq as dl
from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.runner import DLQ_DATA_CHARS
from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import DeadLetter

from .test_dlq_replay import blocks, listed

pytestmark = pytest.mark.integration

DURABLE = "dlq-reads"
SUBJECT = "aios.cluster.dlq-reads.reassignment"
OTHER = "aios.cluster.dlq-reads.scale"


async def _originals(bus: Bus) -> dict[str, Any]:
    """Messages of every shape a letter's original may have, by name: their acks."""
    js = bus.js
    return {
        "headers": await js.publish(SUBJECT, b'{"id":"evt-h"}', headers={
            "Content-Type": "application/json", "Nats-Msg-Id": "evt-h", "X-Trace": "a: b:c", "X-Blank": "",
            "X-Padded": "  two leading blanks"}),
        "utf8": await js.publish(SUBJECT, b'{"id":"evt-u"}', headers={"Nats-Msg-Id": "evt-u", "X-Name": "caf\u00e9"}),
        "copy": await js.publish(SUBJECT, b'{"id":"evt-c"}', headers={
            "Nats-Msg-Id": "evt-c", dl.REPLAY_OF: "AIOS:1", dl.REPLAY_SEQ: "7", "Content-Type": "application/json"}),
        "bare": await js.publish(SUBJECT, b'{"id":"evt-b"}'),
        "empty": await js.publish(SUBJECT, b"", headers={"Nats-Msg-Id": "evt-e"}),
        "gone": await js.publish(SUBJECT, b'{"id":"evt-g"}', headers={"Nats-Msg-Id": "evt-g"}),
        "cut": await js.publish(SUBJECT, b'{"id":"evt-x"}', headers={"Nats-Msg-Id": "evt-x"}),
        "other": await js.publish(OTHER, b'{"id":"evt-o"}', headers={"Nats-Msg-Id": "evt-o"}),
    }


async def test_a_windows_reads_give_what_one_read_each_gave(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    gone = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        acks = await _originals(bus)
        await bus.js.delete_msg(subjects.STREAM, int(acks["gone"].seq))
        last = (await bus.js.stream_info(subjects.STREAM)).state.last_seq
        seq = {k: int(a.seq) for k, a in acks.items()}
        wanted = [(subjects.STREAM, seq[k], SUBJECT) for k in ("headers", "utf8", "copy", "bare", "empty")] + [
            (subjects.STREAM, seq["gone"], SUBJECT),  # deleted: gone
            (subjects.STREAM, seq["other"], SUBJECT),  # another subject at that sequence
            (subjects.STREAM, 0, SUBJECT),  # the letter knew of none
            (subjects.STREAM, last + 10, SUBJECT),  # never stored
            ("AIOS_NO_SUCH", 1, SUBJECT),  # no such stream
            (subjects.STREAM, seq["headers"], SUBJECT),  # the same one twice
        ]
        one_each = [await dl.stored_at(bus, *w) for w in wanted]
        together = await dl.stored_many(bus, wanted)
        assert together == one_each
        assert [h is None for h in together] == [False] * 5 + [True] * 5 + [False], together
        assert isinstance(together[0], tuple)
        body, headers = together[0]
        assert body == b'{"id":"evt-h"}' and headers["X-Trace"] == "a: b:c" and headers["X-Padded"] == "two leading blanks"
        assert together[4] == (b"", {"Nats-Msg-Id": "evt-e"}) and together[3] == (b'{"id":"evt-b"}', {})
        # 600 reads at once, in any order, sequences repeated
        many = [(subjects.STREAM, seq[k], SUBJECT) for k in ("bare", "headers", "copy", "gone") * 150]
        assert await dl.stored_many(bus, many) == [one_each[{"bare": 3, "headers": 0, "copy": 2, "gone": 5}[k]]
                                                   for k in ("bare", "headers", "copy", "gone") * 150]
        # NATS gone: each read is the error (the letter is listed failed with it), one not asked is None
        await gone.nc.close()
        with pytest.raises(Exception) as before:
            await dl.stored_at(gone, *wanted[0])
        now = await dl.stored_many(gone, wanted[:8])
        assert [type(h) for h in now] == [type(before.value)] * 7 + [type(None)], now
    finally:
        await gone.close()
        await bus.close()
        servers.stop()


async def _letter(bus: Bus, name: str, seq: int, data: str, headers: dict[str, str] | None = None) -> int:
    letter = DeadLetter(subject=SUBJECT, consumer=DURABLE, error="No space left on device", deliveries=5, stream_seq=seq,
                        data=data, headers=headers or {"Content-Type": "application/json"})
    ack = await bus.emit(E.dead_letter, letter, consumer=DURABLE, subject=SUBJECT, qualifier=name)
    return int(ack.seq)


async def test_a_replay_sends_each_letter_from_where_it_did_originals_gone_or_replaced_included(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        await bus.ensure_consumer(subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-reads.*",)))
        acks = await _originals(bus)
        seq = {k: int(a.seq) for k, a in acks.items()}
        for k in ("gone", "cut"):
            await bus.js.delete_msg(subjects.STREAM, seq[k])
        letters = {  # name: (the letter's sequence, whence its copy goes, its body)
            "headers": (await _letter(bus, "h", seq["headers"], "stale"), "stream", b'{"id":"evt-h"}'),
            "copy": (await _letter(bus, "c", seq["copy"], '{"id":"evt-c"}',
                                   {dl.REPLAY_OF: "AIOS:1", dl.REPLAY_SEQ: "7"}), "stream", b'{"id":"evt-c"}'),
            "gone": (await _letter(bus, "g", seq["gone"], '{"id":"evt-g"}'), "letter", b'{"id":"evt-g"}'),
            "replaced": (await _letter(bus, "r", seq["other"], '{"id":"evt-r"}'), "letter", b'{"id":"evt-r"}'),
            "none": (await _letter(bus, "n", 0, '{"id":"evt-n"}'), "letter", b'{"id":"evt-n"}'),
            "cut": (await _letter(bus, "x", seq["cut"], "x" * DLQ_DATA_CHARS), "", b""),
        }
        # in windows of 2: each letter's outcome and source as in one window
        rows = await listed(servers)
        chosen = [(dl.Letter(subjects.STREAM, s, rows[s]["stored"], rows[s]["subject"], rows[s]["event"]), 1)
                  for s, _, _ in letters.values()]
        for window in (2, dl.WINDOW):
            dry = [(r.outcome, r.source) async for r in dl.replay_many(bus, chosen, "ops@host", dry_run=True, window=window)]
            assert dry == [("dry-run", src) if src else ("refused", "") for _, src, _ in letters.values()], dry
        ids = await bus.ids()
        for attempt, args in ((1, ()), (2, ("--force",))):
            rc, out, errs = await blocks(servers, "dlq", "replay", "--all", "--json", *args)
            got = {r["letter"]: r for r in map(json.loads, out.splitlines())}
            assert rc == 1, (out, errs)  # the cut one is refused
            for name, (lseq, source, body) in letters.items():
                row = got[f"AIOS:{lseq}"]
                if not source:
                    assert row["outcome"] == "refused" and "kept only the first part" in row["reason"], row
                    continue
                assert (row["outcome"], row["source"], row["attempt"]) == ("replayed", source, attempt), (name, row)
                copy = await bus.js.get_msg(subjects.STREAM, int(row["replay"].split(":")[1]))
                assert copy.subject == SUBJECT and copy.data == body, (name, copy)
                assert copy.headers["Nats-Msg-Id"] == ids.wire(f"replay:AIOS:{lseq}:{attempt}"), name
                assert copy.headers[dl.REPLAY_OF] == f"AIOS:{lseq}", name
                # the first original's sequence: the copy's own for a copy, else the letter's
                first = {"copy": "7", "none": None, "replaced": str(seq["other"])}.get(name, str(seq.get(name)))
                assert copy.headers.get(dl.REPLAY_SEQ) == first, (name, copy.headers)
                if name == "headers":  # every header of the original but JetStream's own
                    assert {k: v for k, v in copy.headers.items() if k not in ("Nats-Msg-Id", dl.REPLAY_OF, dl.REPLAY_SEQ)} \
                        == {"Content-Type": "application/json", "X-Trace": "a: b:c", "X-Blank": "",
                            "X-Padded": "two leading blanks"}, copy.headers
        rows = await listed(servers)
        assert {n: len(rows[s]["replayed"]) for n, (s, _, _) in letters.items()} == {
            n: 0 if n == "cut" else 2 for n in letters}
        assert [rows[s]["replay_of"] for s, _, _ in letters.values()] == [None, "AIOS:1", None, None, None, None]
    finally:
        await bus.close()
        servers.stop()


async def test_a_listing_whose_filter_nothing_matches_ends_without_waiting_out_its_idle(tmp_path: Path) -> None:
    """No side-car's letter, no mark yet: those reads end when the consumer says it has nothing to
    deliver (they waited ``idle``, 0.5 s each, a listing's 1 s); a filter that matches still
    gets every message. (A bound far above the reads, not a timing: the idle is an hour.)"""
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    c = await Client.open(servers.nats_url, servers.redis_url)
    try:
        await c.bus.ensure_consumer(subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-reads.*",)))
        acks = await _originals(c.bus)
        for i in range(3):
            await _letter(c.bus, str(i), int(acks["bare"].seq), '{"id":"evt-b"}')
        hour = 3600.0
        assert await asyncio.wait_for(c.scan(E.dlq_replayed.filter(), hour), 60) == []
        assert await asyncio.wait_for(c.scan(E.output_dead_letter.filter(), hour, subjects.STREAM_OUTPUTS), 60) == []
        found = await asyncio.wait_for(c.dead_letters(hour), 60)
        assert [(st, e["data"]["stream_seq"]) for st, _, _, _, e in found] == [(subjects.STREAM, int(acks["bare"].seq))] * 3
    finally:
        await c.close()
        servers.stop()
