"""``blocks dlq replay``'s decisions apart from NATS (``bus.dlq``): which letters a selection takes
(ids, filters, --all, refused when replayed before unless --force), where a copy goes, what it
carries (the original's headers less JetStream's, an id of its own per letter and attempt), when
the letter's own copy of the body may stand in for the original; only the admin may mark a replay
(the catalog's publishers); the command refuses a selection of nothing before it connects."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from aios_blocks.bus import dlq as dl
from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.runtime import auth
from aios_blocks.schemas.roles import NATS_USERS


def letter(stream: str, seq: int, subject: str = "aios.block.b1.parsed", consumer: str = "gateway",
           error: str = "RuntimeError: policy raised", stored: str = "2026-11-30T10:00:00.000Z", data: str = '{"x":1}',
           headers: dict[str, str] | None = None) -> dl.Letter:
    where = (E.output_dead_letter.subject(bid="b1", name="s", outcome="ok") if stream == subjects.STREAM_OUTPUTS
             else subjects.dead_letter(consumer, subject))
    return dl.Letter(stream, seq, stored, where, {
        "id": f"dlq:{consumer}:{seq * 10}",
        "data": {"subject": subject, "consumer": consumer, "error": error, "deliveries": 5, "stream_seq": seq * 10,
                 "data": data, "headers": headers or {}},
    })


LETTERS = [
    letter("AIOS", 5),
    letter("AIOS", 7, subject="aios.cluster.c1.allocation", consumer="controller-c1", error="TimeoutError: redis",
           stored="2026-11-30T12:00:00.000Z"),
    letter("AIOS_OUTPUTS", 5, subject="aios.output.b1.ok", consumer="sidecar-b1-s", error="OSError: disk full"),
]


def keys(letters: list[dl.Letter]) -> list[str]:
    return [lt.key for lt in letters]


def test_nothing_said_selects_nothing_and_all_takes_every_letter() -> None:
    with pytest.raises(ValueError, match="--all for every one"):
        dl.select(LETTERS, [], dl.Filter(), False, {})
    assert keys(dl.select(LETTERS, [], dl.Filter(), True, {}).chosen) == ["AIOS:5", "AIOS:7", "AIOS_OUTPUTS:5"]


def test_ids_by_seq_stream_seq_or_event_id_each_once_and_an_ambiguous_or_missing_one_is_named() -> None:
    sel = dl.select(LETTERS, ["7", "AIOS_OUTPUTS:5", "dlq:gateway:50", "AIOS:7", "5", "99", "AIOS:99"], dl.Filter(), False, {})
    assert keys(sel.chosen) == ["AIOS:7", "AIOS_OUTPUTS:5", "AIOS:5"]
    assert sel.missing == [("5", "5 names more than one dead letter: say which, AIOS:5 or AIOS_OUTPUTS:5"),
                           ("99", "no dead letter 99 (blocks dlq lists them)"),
                           ("AIOS:99", "no dead letter AIOS:99 (blocks dlq lists them)")]


def test_filters_by_subject_consumer_reason_and_since_narrow_ids_too() -> None:
    def by(flt: dl.Filter, refs: list[str] | None = None) -> list[str]:
        return keys(dl.select(LETTERS, refs or [], flt, False, {}).chosen)

    assert by(dl.Filter(subject="aios.output.")) == ["AIOS_OUTPUTS:5"]
    assert by(dl.Filter(consumer="controller")) == ["AIOS:7"]
    assert by(dl.Filter(reason="DISK FULL")) == ["AIOS_OUTPUTS:5"]  # any case
    assert by(dl.Filter(since=dl.stored_epoch("2026-11-30T11:00:00Z"))) == ["AIOS:7"]
    assert by(dl.Filter(consumer="gateway", reason="policy")) == ["AIOS:5"]
    assert by(dl.Filter(consumer="gateway"), ["AIOS:7", "AIOS:5"]) == ["AIOS:5"]
    assert by(dl.Filter(subject="nothing-like-it")) == []


def test_a_letter_replayed_before_is_refused_unless_forced_and_says_by_whom() -> None:
    mark = {"stream": "AIOS", "seq": 5, "by": "ops@h1", "at": 1_700_000_000.0, "replay_stream": "AIOS", "replay_seq": 901,
            "attempt": 1}
    replays = dl.replays_by_letter([mark, {"stream": "AIOS", "seq": 5, "attempt": 2, "replay_seq": 950,
                                           "replay_stream": "AIOS", "by": "ops@h2", "at": 1_700_000_100.0}])
    assert [m["attempt"] for m in replays["AIOS:5"]] == [1, 2] and "AIOS_OUTPUTS:5" not in replays
    sel = dl.select(LETTERS, ["AIOS:5"], dl.Filter(), False, replays)
    assert sel.chosen == [] and len(sel.refused) == 1
    why = sel.refused[0][1]
    assert why.startswith("already replayed by ops@h2 at ") and "as AIOS:950 (attempt 2); --force replays it again" in why
    assert keys(dl.select(LETTERS, ["AIOS:5"], dl.Filter(), False, replays, force=True).chosen) == ["AIOS:5"]
    # --all skips it, the others go
    sel = dl.select(LETTERS, [], dl.Filter(), True, replays)
    assert keys(sel.chosen) == ["AIOS:7", "AIOS_OUTPUTS:5"] and keys([lt for lt, _ in sel.refused]) == ["AIOS:5"]


def test_the_copy_goes_to_the_stream_that_stores_its_subject_now_and_an_unknown_subject_is_refused() -> None:
    assert dl.target(LETTERS[0]) == ("AIOS", "aios.block.b1.parsed")
    assert dl.target(LETTERS[2]) == ("AIOS_OUTPUTS", "aios.output.b1.ok")
    assert dl.target(letter("AIOS", 3, subject="aios.block.b1.create", consumer="parser")) == ("AIOS_INTAKE", "aios.block.b1.create")
    # an output dead-lettered in AIOS by a version before output.dlq: back to AIOS_OUTPUTS, where outputs are
    old = dl.Letter("AIOS", 9, "2026-01-01T00:00:00Z", "aios.dlq.sidecar-b1-s.aios.output.b1.ok",
                    {"data": {"subject": "aios.output.b1.ok", "consumer": "sidecar-b1-s", "data": "x"}})
    assert dl.target(old) == ("AIOS_OUTPUTS", "aios.output.b1.ok") and old.sidecar and LETTERS[2].sidecar
    assert not LETTERS[0].sidecar
    with pytest.raises(dl.Refused, match=r"aios.block.b1.renamed_step is no event of this version's catalog"):
        dl.target(letter("AIOS", 3, subject="aios.block.b1.renamed_step"))
    with pytest.raises(dl.Refused, match="core NATS, stored by no stream"):
        dl.target(letter("AIOS", 3, subject="aios.hint.c1.inventory"))


def test_the_copy_keeps_the_originals_headers_but_jetstreams_and_has_an_id_per_letter_and_attempt() -> None:
    lt = LETTERS[0]
    original = {"Nats-Msg-Id": "k1:abc", "Nats-Expected-Last-Sequence": "3", "Content-Type": "application/cloudevents+json",
                "traceparent": "00-1-2-01", "Aios-Replay-Of": "AIOS:1"}
    h = dl.replay_headers(original, lt, "k1:new")
    assert h == {"Content-Type": "application/cloudevents+json", "traceparent": "00-1-2-01", "Nats-Msg-Id": "k1:new",
                 "Aios-Replay-Of": "AIOS:5", "Aios-Replay-Seq": "50"}  # the original's sequence (the letter's stream_seq)
    # a copy's letter: the first original's sequence goes on (every copy is a copy of it); a publisher's own
    # Aios-Replay-Seq on a message that is no copy is not taken
    assert dl.replay_headers({**original, "Aios-Replay-Seq": "7"}, lt, "k1:new")["Aios-Replay-Seq"] == "7"
    assert dl.replay_headers({"Aios-Replay-Seq": "7"}, lt, "k1:new")["Aios-Replay-Seq"] == "50"
    assert dl.replay_msg_id(lt, 1) == "replay:AIOS:5:1" != dl.replay_msg_id(lt, 2)
    assert dl.replay_msg_id(LETTERS[2], 1) == "replay:AIOS_OUTPUTS:5:1"  # not the same letter as AIOS:5


def test_the_letters_own_copy_stands_in_only_when_whole_and_the_text_it_was() -> None:
    from aios_blocks.bus.runner import DLQ_DATA_CHARS
    from aios_blocks.sidecar import DLQ_DATA_BYTES

    assert dl.letter_body(letter("AIOS", 1, data='{"x":1}')) == b'{"x":1}'
    with pytest.raises(dl.Refused, match="kept only the first part"):
        dl.letter_body(letter("AIOS", 1, data="x" * DLQ_DATA_CHARS))
    assert dl.letter_body(letter("AIOS", 1, data="x" * (DLQ_DATA_BYTES + 10)))  # a worker's keeps more than a side-car's
    with pytest.raises(dl.Refused, match="kept only the first part"):
        dl.letter_body(letter("AIOS_OUTPUTS", 1, subject="aios.output.b1.ok", consumer="sidecar-b1-s", data="x" * DLQ_DATA_BYTES))
    with pytest.raises(dl.Refused, match="not UTF-8"):
        dl.letter_body(letter("AIOS", 1, data="ab\ufffd"))


def test_only_the_admin_may_mark_a_replay() -> None:
    """The mark (and the copies of every subject) are the admin's: no other user may publish it."""
    assert E.dlq_replayed.publishers == (auth.roles.Role.ADMIN,)
    mark = E.dlq_replayed.subject(stream="AIOS", seq="5")
    for role in NATS_USERS:
        perms = auth.permissions(role, "n1" if role == "agent" else None)
        if perms is None:
            assert role == "admin"
            continue
        assert not any(subjects.matches(p, mark) for p in perms.publish), role
    assert not subjects.matches(subjects.DLQ_ALL, mark)  # never listed as a dead letter itself


def test_the_command_refuses_a_selection_of_nothing_and_a_role_not_the_admin_before_it_connects(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from aios_blocks.cli.main import app

    for key in [k for k in __import__("os").environ if k.startswith("AIOS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AIOS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLUMNS", "200")
    r = CliRunner().invoke(app, ["dlq", "replay"])
    assert r.exit_code == 2 and "--all for every one" in r.output and "No servers" not in r.output, r.output
    r = CliRunner().invoke(app, ["dlq", "replay", "--since", "soon"])
    # it names both forms --since takes (it said "expected seconds or a duration", not the ISO time)
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "a duration like 30m, 2h, 1d or an ISO time like 2026-12-01T08:00:00Z" in said, r.output
    monkeypatch.setenv("AIOS_ROLE", "observer")
    r = CliRunner().invoke(app, ["dlq", "replay", "5"])
    assert r.exit_code == 1 and "only the admin replays dead letters" in r.output, r.output
    # the list too (it reads AIOS_OUTPUTS: a permissions violation, with a log line, after connecting)
    r = CliRunner().invoke(app, ["dlq"])
    assert r.exit_code == 1 and "only the admin lists dead letters" in r.output, r.output


@pytest.mark.parametrize("raw", [
    b"Content-Type: application/json\r\nNats-Msg-Id: evt-1\r\n\r\n", b"A:b\r\nA: c\r\n\r\n", b"A:  \t b  \r\n\r\n",
    b"A: x: y\r\n\r\n", b"A:\r\n\r\n", b"A: b\r\n c\r\n\r\n", b"A: caf\xc3\xa9\r\n\r\n", b"A: b\r\n", b"A: b\r\n\r\nbody",
    b"A: b\x0bc\r\n\r\n", b"A b: c\r\n\r\n", b"\r\n\r\n", b"", b"From x: y\r\n\r\n", b"A: b\rc\r\n\r\n",
])
def test_a_stored_messages_headers_read_as_nats_py_reads_them(raw: bytes) -> None:
    """``stored_many`` splits plain ``Key: value`` lines itself; what it gives is what nats-py's
    ``get_msg`` gave (the email parser's headers: the last of a key given twice, a value without
    its leading blanks), for those and for every other shape (continued lines, other bytes, a
    body after them), which go to that parser."""
    from email.parser import BytesParser

    assert dl.header_lines(raw) == dict(BytesParser().parsebytes(raw).items())


def test_header_lines_agree_with_the_email_parser_on_random_lines() -> None:
    import random
    from email.parser import BytesParser

    rng = random.Random(7)
    parts = [b"A", b"b", b":", b" ", b"\t", b"\r\n", b"\r", b"\n", b"\x0b", b"\xc3\xa9", b"From ", b"-", b"\x00", b"\r\n\r\n"]
    for _ in range(20000):
        raw = b"".join(rng.choice(parts) for _ in range(rng.randint(0, 12))) + rng.choice([b"", b"\r\n\r\n"])
        assert dl.header_lines(raw) == dict(BytesParser().parsebytes(raw).items()), raw
