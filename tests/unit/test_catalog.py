"""The event catalog: subjects, parsing, ids, stream subjects and routing all come from one entry
per event; the router decodes payloads into their structs and refuses unhandled events."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import EVENTS, Body, E, Emit, Role, parse, stream_subjects
from aios_blocks.bus.router import Inbound, Router
from aios_blocks.bus.runner import Delivery, Poison
from aios_blocks.schemas import events as ev
from aios_blocks.schemas.events import envelope


def sample_tokens(e: Any) -> dict[str, str]:
    return {t: ("aios.block.b1.create" if t == "subject" else f"{t}1") for t in e.tokens}


@pytest.mark.parametrize("e", EVENTS, ids=lambda e: e.name)
def test_subject_and_parse_round_trip(e: Any) -> None:
    toks = sample_tokens(e)
    subject = e.subject(**toks)
    assert subject.startswith("aios.") and "{" not in subject
    found = parse(subject)
    assert found is not None and found[0] is e and found[1] == toks
    assert e.type == "io.aios." + e.name
    assert subjects.matches(e.filter(), subject)
    # stored by exactly its own stream: AIOS for control events, AIOS_OUTPUTS for task outputs
    in_aios = any(subjects.matches(f, subject) for f in subjects.STREAM_SUBJECTS)
    in_outputs = any(subjects.matches(f, subject) for f in subjects.OUTPUT_STREAM_SUBJECTS)
    assert in_aios == (e.stored and e.stream == subjects.STREAM)
    assert in_outputs == (e.stored and e.stream == subjects.STREAM_OUTPUTS)


def test_no_two_events_share_a_subject_and_every_stored_event_is_in_the_stream() -> None:
    for e in EVENTS:
        subject = e.subject(**sample_tokens(e))
        assert [x.name for x in EVENTS if x.match(subject) is not None] == [e.name]
    assert set(stream_subjects()) >= {e.filter() for e in EVENTS if e.stored and e.stream == subjects.STREAM}
    # the outputs and their dead letters (users' data: docs/security.md), nothing else
    assert stream_subjects(subjects.STREAM_OUTPUTS) == [E.block_output.filter(), E.output_dead_letter.filter()]
    # the two streams never capture the same subject (JetStream refuses overlapping streams)
    for output in (E.block_output.subject(bid="b1", outcome="ok"), E.output_dead_letter.subject(bid="b1", name="s", outcome="ok")):
        assert not any(subjects.matches(f, output) for f in stream_subjects()), output
    # a side-car's consumer (the block's outputs, one token after the block) never takes a dead letter
    assert not subjects.matches(subjects.sidecar("b1", "s").filters[0], E.output_dead_letter.subject(bid="b1", name="s", outcome="ok"))
    assert not any(subjects.matches(f, E.node_heartbeat.subject(nid="n1")) for f in stream_subjects())


def test_a_missing_token_is_an_error_not_a_wrong_subject() -> None:
    with pytest.raises(ValueError, match="token 'bid' missing"):
        E.block_ready.subject()


def test_id_rules_resolve_from_payload_fields_and_tokens() -> None:
    st = ev.BlockStatusReport("b1", 7, "ready")
    assert Emit(E.block_ready, st).logical_id() == "b1:7:ready"
    assert Emit(E.block_ready, st).subject() == "aios.block.b1.ready"
    cmd = ev.InstanceCommand("b1", 7, "c1", "b1-0", "n3", [])
    assert Emit(E.node_instance_remove, cmd).subject() == "aios.node.n3.instance.remove"
    assert Emit(E.node_instance_remove, cmd, qualifier="n3").logical_id() == "b1:7:remove:b1-0:n3"
    reg = ev.NodeRegistered({"id": "n3"})
    assert Emit(E.node_registered, reg, {"nid": "n3"}, qualifier="op1").logical_id() == "n3:registered:op1"
    # events whose id the publisher chooses say so instead of inventing one
    with pytest.raises(ValueError, match="no id rule"):
        Emit(E.cluster_registered, ev.ClusterRegistered({}), {"cid": "c1"}).logical_id()
    assert Emit(E.cluster_registered, ev.ClusterRegistered({}), {"cid": "c1"}, msg_id="cluster:x").logical_id() == "cluster:x"


@pytest.mark.parametrize("e", [e for e in EVENTS if e.id_rule], ids=lambda e: e.name)
def test_every_id_rule_names_only_payload_fields_or_tokens(e: Any) -> None:
    import re

    names = set(re.findall(r"\{([a-z_]+)\}", e.id_rule))
    fields = set(e.payload.__struct_fields__) if e.payload is not None else set()
    assert names <= fields | set(e.tokens), (e.name, names - fields - set(e.tokens))


def test_core_events_are_never_stored_and_stored_events_have_a_publisher() -> None:
    for e in EVENTS:
        if e.body is Body.CORE:
            assert not e.stored
        assert e.publishers and all(isinstance(r, Role) for r in e.publishers)


# -- routing ----------------------------------------------------------------------------------------

def delivery(subject: str, body: bytes, deliveries: int = 1) -> Delivery:
    return Delivery(subject=subject, data=body, headers={}, deliveries=deliveries, stream_seq=42)


def test_router_decodes_into_the_payload_struct_and_passes_the_subject_tokens() -> None:
    router = Router(subjects.LIFECYCLE)
    seen: list[Inbound[Any]] = []

    async def record(m: Inbound[Any]) -> None:
        seen.append(m)

    for e in subjects.LIFECYCLE.events:
        router.add(e, record)
    spec, handler = router.binding()
    assert spec == subjects.LIFECYCLE
    fact = ev.InstanceEvent("b1", 3, "b1-0", "n1", ["g0"], "")
    subject = E.instance_failed.subject(bid="b1", iid="b1-0")
    asyncio.run(handler(delivery(subject, envelope("x", "src", E.instance_failed.type, subject, fact), deliveries=2)))
    (m,) = seen
    assert m.event is E.instance_failed and m.tokens == {"bid": "b1", "iid": "b1-0"}
    assert isinstance(m.data, ev.InstanceEvent) and m.data == fact and m.deliveries == 2 and m.stream_seq == 42


def test_router_refuses_a_consumer_without_every_handler_or_a_foreign_event() -> None:
    router = Router(subjects.GATEWAY)

    async def nop(m: Inbound[Any]) -> None:
        return None

    with pytest.raises(ValueError, match=r"does not take block\.ready"):
        router.add(E.block_ready, nop)
    router.add(E.block_parsed, nop)
    with pytest.raises(ValueError, match=r"no handler for block\.dry_run\.result"):
        router.binding()


def test_router_scoped_to_one_cluster_and_unknown_subjects_are_poison() -> None:
    spec = subjects.controller("c1")
    assert spec.filters == ("aios.cluster.c1.allocation", "aios.cluster.c1.scale",
                            "aios.cluster.c1.scale_down", "aios.cluster.c1.reassignment")
    assert spec.core_filters == ("aios.cluster.c1.dry_run",)  # the query: a queue group, not the durable
    router = Router(spec)
    got: list[str] = []

    async def on_any(m: Inbound[Any]) -> None:
        got.append(m.tokens["cid"])

    for e in spec.events:
        router.add(e, on_any)
    req = ev.AllocationRequest("b1", 1, "c1")
    subject = E.cluster_allocation.subject(cid="c1")
    asyncio.run(router(delivery(subject, envelope("x", "s", E.cluster_allocation.type, subject, req))))
    assert got == ["c1"]
    with pytest.raises(Poison, match="no handler"):
        asyncio.run(router(delivery("aios.cluster.c2.allocation", b"{}")))


def test_a_malformed_payload_is_a_decode_error_the_runner_dead_letters() -> None:
    router = Router(subjects.PARSER)
    router2 = Router(subjects.GATEWAY)

    async def nop(m: Inbound[Any]) -> None:
        return None

    for e in subjects.GATEWAY.events:
        router2.add(e, nop)
    subject = E.block_parsed.subject(bid="b1")
    bad = envelope("x", "s", E.block_parsed.type, subject, {"block_id": "b1", "gen": "not a number", "ir": {}})
    with pytest.raises(msgspec.ValidationError):
        asyncio.run(router2(delivery(subject, bad)))
    # the raw create body is handed over as bytes; the dotted-id form reaches the handler without tokens
    seen: list[Inbound[Any]] = []

    async def keep(m: Inbound[Any]) -> None:
        seen.append(m)

    router.add(E.block_create, keep)
    asyncio.run(router(delivery("aios.block.b1.create", b'{"x": 1}')))
    asyncio.run(router(delivery("aios.block.a.b.create", b"{}")))
    assert seen[0].data == b'{"x": 1}' and seen[0].tokens == {"bid": "b1"} and seen[1].tokens == {}
