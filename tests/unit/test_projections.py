"""Projections (``projections.base``): the catalog index gives ``catalog.parse``'s answer, and
the completeness rules: the fold names every stored event (folded, or ignored on purpose), and
the CLI has a one-line description for every event. Each rule is shown failing for an event
added to the catalog without its line."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aios_blocks.projections import INDEX, Fact, Projection, on, stored_events
from aios_blocks.recovery.fold import Fold
from aios_blocks.schemas import catalog
from aios_blocks.schemas.catalog import EVENTS, E, Event, Role
from aios_blocks.schemas.events import BlockStatusReport


def _example(e: Event[Any]) -> str:
    return e.subject(**{t: ("x.y" if t == "subject" else "v1") for t in e.tokens})


def unfolded(events: tuple[Event[Any], ...]) -> list[str]:
    """Stored events the fold neither folds nor ignores."""
    return [e.name for e in events if e.stored and e not in Fold.handlers and e not in Fold.ignores]


#: an event a contributor adds to the catalog and forgets to fold
NEW = Event("block.paused", "aios.block.{bid}.paused", BlockStatusReport, (Role.CONTROLLER,), "the block is paused",
            id_rule="{block_id}:{gen}:paused")


def test_the_index_parses_every_subject_as_the_catalog_does() -> None:
    subjects = [_example(e) for e in EVENTS] + [
        "aios.dlq.cons.aios.block.b1.ready", "aios.block.b1.dry_run.deadline", "aios.output.b1.ok", "nats.x", "aios",
    ]
    for s in subjects:
        want, got = catalog.parse(s), INDEX.parse(s)
        assert (want and (want[0].name, want[1])) == (got and (got[0].name, got[1])), s


def test_the_fold_names_every_stored_event() -> None:
    missing = unfolded(EVENTS)
    assert not missing, f"stored events the fold does not name: {missing}: fold each in recovery/fold.py (@on) or add it to fold.IGNORED"
    assert not set(Fold.handlers) & set(Fold.ignores)


def test_an_event_added_without_its_fold_line_is_named() -> None:
    assert [n for n in unfolded((*EVENTS, NEW)) if n not in unfolded(EVENTS)] == ["block.paused"]


def test_a_projection_cannot_both_handle_and_ignore_an_event() -> None:
    with pytest.raises(TypeError, match=r"block\.ready"):
        class Both(Projection):
            ignores = frozenset({E.block_ready})

            @on(E.block_ready)
            def ready(self, m: Fact[BlockStatusReport]) -> None: ...


def test_a_projection_gets_the_typed_payload_tokens_and_position() -> None:
    seen: list[Fact[Any]] = []

    class Ready(Projection):
        @on(E.block_ready, E.block_failed)
        def ended(self, m: Fact[BlockStatusReport]) -> None:
            seen.append(m)

    p = Ready()
    body = msgspec.json.encode({"id": "i", "type": "t", "time": "2026-01-01T00:00:00Z",
                                "data": {"block_id": "b1", "gen": 3, "status": "ready"}})
    assert p.feed("aios.block.b1.ready", body, 7, 1.5)
    assert not p.feed("aios.block.b1.parsed", body, 8)  # not handled: skipped, not decoded
    assert not p.feed("aios.block.b1.failed", b'{"data": {"gen": "x"}}', 9)  # does not decode: skipped
    assert p.undecodable == 1
    m = seen[0]
    assert (m.event, m.tokens, m.seq, m.ts, m.time) == (E.block_ready, {"bid": "b1"}, 7, 1.5, "2026-01-01T00:00:00Z")
    assert isinstance(m.data, BlockStatusReport) and m.data.gen == 3
    assert p.feed_doc("aios.block.b1.failed", {"data": {"block_id": "b1", "gen": 4, "status": "failed", "reason": "r"}})
    assert seen[1].data.reason == "r"


def test_every_stored_event_is_one_the_fold_can_meet() -> None:
    assert {e.name for e in stored_events()} == {e.name for e in EVENTS if e.stored}


def undescribed(events: tuple[Event[Any], ...]) -> list[str]:
    """Events with no line for the CLI (no method of ``Lines``, not in ``lines.PLAIN``) or no
    one-line meaning in the catalog."""
    from aios_blocks.projections.lines import Lines

    return [e.name for e in events if e not in Lines.handlers or not e.meaning or "\n" in e.meaning]


def test_every_event_has_a_one_line_description_for_the_cli() -> None:
    missing = undescribed(EVENTS)
    assert not missing, f"events without a CLI line: {missing}: give each a method in projections/lines.py or add it to lines.PLAIN"


def test_an_event_added_without_its_cli_line_is_named() -> None:
    assert [n for n in undescribed((*EVENTS, NEW)) if n not in undescribed(EVENTS)] == ["block.paused"]


def test_a_line_reads_the_payload_struct_and_says_when_it_does_not_decode() -> None:
    from aios_blocks.projections.lines import line

    ok = {"block_id": "b1", "gen": 2, "instance_id": "b1-0", "node_id": "n1", "gpus": ["g1"], "endpoint": "http://h:1"}
    assert line("aios.block.b1.instance.b1-0.added", {"data": ok}) == (
        "instance.b1-0.added", "node=n1 gpus=['g1'] at http://h:1", "cyan")
    assert line("aios.block.b1.failed", {"data": {"block_id": "b1", "gen": 2, "status": "failed", "reason": "no room"}}) == (
        "failed", "no room", "red")
    assert line("aios.block.b1.ready", {"data": {"gen": "two"}}) == ("ready", "(its data is not a BlockStatusReport)", "green")
    assert line("aios.dlq.exec.aios.block.b1.ready", {"data": {}}) == ("dlq.ready", "(its data is not a DeadLetter)", "green")


def test_a_blocks_dead_letter_is_a_line_of_its_replay_saying_who_gave_up_and_why() -> None:
    # `blocks replay B` left out the block's dead letters: a create the parser gave up on, then
    # replayed once fixed, showed a gap between `submitted` and `parsed`; and their line said
    # "aios.block.B.create" with no detail
    from aios_blocks.projections.lines import line

    letter = {"subject": "aios.block.b1.create", "consumer": "parser", "error": "ResponseError: WRONGTYPE", "deliveries": 5,
              "stream_seq": 9, "data": "{}"}
    assert line("aios.dlq.parser.aios.block.b1.create", {"data": letter}) == (
        "dlq.create", "dead letter: parser gave up after 5 deliveries: ResponseError: WRONGTYPE", "cyan")


def test_an_events_kind_is_its_subject_after_the_entity_from_the_catalog() -> None:
    from aios_blocks.projections.lines import kind_of

    for e in EVENTS:
        s = _example(e)
        assert kind_of(s) == s.split(".", 3)[3], e.name  # what the CLI and the tests always called it


def test_a_run_of_alike_policy_calls_is_one_line_and_a_count() -> None:
    # a 100-instance gang's allocation printed 67 "policy resourceAllocator.allocation ..." lines
    # under one event in `blocks submit --wait` / watch / replay
    from aios_blocks.projections.lines import line

    def call(us: int, error: str = "") -> dict[str, object]:
        return {"block_id": "b1", "kind": "resourceAllocator", "policy": "resourceAllocator", "uri": "builtin:binpack",
                "version": None, "action": "allocation", "input_digest": "d", "duration_us": us, "error": error}

    data = {"block_id": "b1", "gen": 2, "step": "allocation", "reason": "no room",
            "decisions": [call(100), *[call(10)] * 65, call(5, "raised RuntimeError: no room")]}
    _, detail, _ = line("aios.block.b1.allocation.failed", {"data": data})
    assert detail.splitlines() == [
        "no room",
        "    policy resourceAllocator.allocation builtin:binpack 100µs",
        "    policy resourceAllocator.allocation builtin:binpack x65 more alike, 650µs in all",
        "    policy resourceAllocator.allocation builtin:binpack 5µs error=raised RuntimeError: no room",
    ]
    few = {**data, "decisions": [call(1), call(2), call(3)]}  # up to RUN alike calls: each on its line
    assert len(line("aios.block.b1.allocation.failed", {"data": few})[1].splitlines()) == 4


def test_a_skipped_dry_run_says_so_in_the_replay() -> None:
    # `blocks replay` showed the gateway's stand-in answer for a round's one candidate as
    # "dry_run cluster=c1 score=1.0", as if the cluster had scored the block 1: a block of 30
    # instances of which 22 fit read as a perfect fit, then failed its allocation (explain said
    # "dry run skipped")
    from aios_blocks.projections.lines import line

    skipped = {"block_id": "b1", "cluster_id": "c1", "gen": 2, "score": 1.0,
               "skipped": "dry run skipped: c1 is the only candidate"}
    asked = {"block_id": "b1", "cluster_id": "c2", "gen": 2, "score": 0.5}
    data = {"block_id": "b1", "gen": 2, "cluster_id": "c1", "scores": {"c1": 1.0, "c2": 0.5}, "answers": [skipped, asked]}
    _, detail, _ = line("aios.block.b1.post_dry_run", {"data": data})
    assert "    dry_run cluster=c1 score=1.0 (dry run skipped: c1 is the only candidate)" in detail.splitlines()
    assert "    dry_run cluster=c2 score=0.5" in detail.splitlines()
