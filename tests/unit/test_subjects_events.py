"""The subject catalog (everything under ``aios.``, durable consumers that never share a message)
and the CloudEvents envelope."""

from __future__ import annotations

import datetime as dt
import inspect
import itertools
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import subjects
from aios_blocks.schemas import events
from aios_blocks.schemas.errors import SpecError


def tokens_overlap(a: list[str], b: list[str]) -> bool:
    """True when some subject matches both NATS patterns (``*`` one token, ``>`` one or more)."""
    if not a or not b:
        return not a and not b
    if a[0] == ">":
        return len(b) >= 1
    if b[0] == ">":
        return len(a) >= 1
    if a[0] == "*" or b[0] == "*" or a[0] == b[0]:
        return tokens_overlap(a[1:], b[1:])
    return False


def overlap(a: str, b: str) -> bool:
    return tokens_overlap(a.split("."), b.split("."))


def matches(pattern: str, subject: str) -> bool:
    assert "*" not in subject and ">" not in subject
    return overlap(pattern, subject)


def test_overlap_helper() -> None:
    assert overlap("aios.block.*.create", "aios.block.b1.create")
    assert overlap("aios.>", "aios.block.b1.create")
    assert overlap("aios.block.*.>", "aios.block.*.instance.*.added")
    assert not overlap("aios.block.*.create", "aios.block.*.created")
    assert not overlap("aios.block.*.delete", "aios.block.*.instance.*.removed")
    assert not overlap("aios.>", "aios")
    assert not overlap("aios.block.*", "aios.block.b.c")


# -- every subject is under aios. ---------------------------------------------------------------------

SAMPLE_SUBJECTS = [
    subjects.block_create("b1"),
    *(subjects.block_event("b1", e) for e in ("parsed", "rejected", "selection", "post_dry_run", "placement", "ready",
                                             "failed", "deleted", "delete", "scale.failed", "reassignment.failed", "submitted",
                                             "allocation.failed")),
    *(subjects.instance_event("b1", "b1-0", e) for e in ("added", "removed", "failed", "unhealthy")),
    subjects.node_dangling("n1"), subjects.node_registered("n1"), subjects.node_health("n1"),
    *(subjects.cluster_command("c1", c) for c in ("allocation", "scale", "reassignment")),
    *(subjects.node_command("n1", c) for c in ("instance.create", "instance.remove")),
    subjects.block_event("b1", "decision"),
    subjects.policy_updated("p"),
    subjects.dead_letter("parser", "aios.block.b1.create"),
]


@pytest.mark.parametrize("subject", SAMPLE_SUBJECTS)
def test_every_subject_is_under_aios_and_in_the_stream(subject: str) -> None:
    assert subject.startswith("aios.")
    assert all(subject.split("."))  # no empty tokens
    # creates are kept as sent in AIOS_INTAKE (the parser stores each in AIOS as submitted)
    intake = subject == subjects.block_create("b1")
    assert any(matches(p, subject) for p in subjects.STREAM_SUBJECTS) != intake
    assert any(matches(p, subject) for p in subjects.INTAKE_STREAM_SUBJECTS) == intake


def test_every_builder_in_the_module_produces_an_aios_subject() -> None:
    builders = [
        f for name, f in inspect.getmembers(subjects, inspect.isfunction)
        if f.__module__ == subjects.__name__ and name not in ("controller", "agent", "catalog", "event_type", "matches", "consumer", "uri_digest", "sidecar", "sidecar_durable")
    ]
    assert len(builders) >= 9
    for f in builders:
        args = [f"x{i}" for i, p in enumerate(inspect.signature(f).parameters.values()) if p.default is p.empty]
        assert f(*args).startswith("aios."), f.__name__


def test_pattern_constants_catalog_and_consumers_are_under_aios() -> None:
    patterns = [subjects.DLQ_ALL, subjects.INVENTORY_ALL, subjects.POLICY_UPDATED_ALL, subjects.block_all(), subjects.block_all("b1")]
    patterns += [p for spec in all_consumers() for p in spec.filters]
    patterns += [s for s, _, _ in subjects.catalog()]
    for p in patterns:
        assert p.startswith("aios."), p
    assert all(p.startswith("aios.") for p in subjects.STREAM_SUBJECTS)


def test_heartbeats_and_requests_are_not_stored() -> None:
    # a stored request subject would be answered by the stream's PubAck before the responder; hints
    # only invalidate caches: storing them cost an fsync per reservation
    for subject in (subjects.node_heartbeat("n1"), subjects.node_expected("n1"), subjects.cluster_inventory("c1")):
        assert not any(matches(p, subject) for p in subjects.STREAM_SUBJECTS), subject
    for subject in (subjects.node_dangling("n1"), subjects.node_registered("n1"), subjects.node_health("n1"),
                    subjects.instance_event("b", "i", "failed")):
        assert any(matches(p, subject) for p in subjects.STREAM_SUBJECTS), subject


def test_event_types_are_namespaced() -> None:
    assert subjects.event_type("block.parsed") == "io.aios.block.parsed"


def test_block_wildcards_follow_one_block() -> None:
    mine = subjects.block_all("b1")
    assert matches(mine, subjects.block_event("b1", "ready"))
    assert matches(mine, subjects.instance_event("b1", "i", "added"))
    assert not matches(mine, subjects.block_event("b2", "ready"))
    assert not matches(mine, subjects.cluster_command("b1", "dry_run"))


def test_catalog_patterns_are_what_the_builders_produce() -> None:
    built = {
        subjects.block_create("{bid}"),
        *(subjects.block_event("{bid}", e) for e in ("parsed", "rejected", "selection", "dry_run.result",
                                                      "post_dry_run", "allocation.failed",
                                                      "placement", "ready", "failed", "scale.failed",
                                                      "reassignment.failed", "delete", "deleted")),
        *(subjects.cluster_command("{cid}", c) for c in ("dry_run", "allocation", "scale", "reassignment")),
        subjects.cluster_inventory("{cid}"),
        *(subjects.node_command("{nid}", c) for c in ("instance.create", "instance.remove")),
        *(subjects.instance_event("{bid}", "{iid}", e) for e in ("added", "removed")),
        subjects.policy_updated("{name}"),
        subjects.dead_letter("{consumer}", "{subject}"),
    }
    listed = [s for s, _, _ in subjects.catalog()]
    assert built <= set(listed), built - set(listed)  # every subject the builders make is documented
    assert len(listed) == len(set(listed))


# -- consumers ----------------------------------------------------------------------------------------


def all_consumers() -> list[subjects.ConsumerSpec]:
    return [subjects.PARSER, subjects.GATEWAY, subjects.controller(), subjects.LIFECYCLE, subjects.agent()]


@pytest.mark.parametrize(
    ("a", "b"),
    list(itertools.combinations(all_consumers(), 2)),
    ids=lambda s: s.durable,
)
def test_consumer_filters_do_not_overlap(a: subjects.ConsumerSpec, b: subjects.ConsumerSpec) -> None:
    for fa, fb in itertools.product(a.filters, b.filters):
        assert not overlap(fa, fb), f"{a.durable} {fa} overlaps {b.durable} {fb}"


@pytest.mark.parametrize("spec", [*all_consumers(), subjects.controller("c1"), subjects.agent("n1")], ids=lambda s: s.durable)
def test_filters_within_one_consumer_are_disjoint(spec: subjects.ConsumerSpec) -> None:
    assert spec.filters
    for fa, fb in itertools.combinations(spec.filters, 2):
        assert not overlap(fa, fb), f"{spec.durable}: {fa} overlaps {fb}"


def test_durable_names_are_unique() -> None:
    names = [c.durable for c in [*all_consumers(), subjects.controller("c1"), subjects.agent("n1")]]
    assert len(names) == len(set(names))


def test_per_cluster_controller_and_per_node_agent_are_scoped() -> None:
    c1 = subjects.controller("c1")
    assert c1.durable == "controller-c1"
    assert any(matches(f, subjects.cluster_command("c1", "allocation")) for f in c1.filters)
    assert not any(matches(f, subjects.cluster_command("c2", "allocation")) for f in c1.filters)
    others = [s for s in all_consumers() if s.durable != "controller"]
    for spec in others:
        for fa, fb in itertools.product(c1.filters, spec.filters):
            assert not overlap(fa, fb)
    n1 = subjects.agent("n1")
    assert any(matches(f, subjects.node_command("n1", "instance.create")) for f in n1.filters)
    assert not any(matches(f, subjects.node_command("n2", "instance.create")) for f in n1.filters)


@pytest.mark.parametrize(
    ("subject", "durable"),
    [
        (subjects.block_create("b1"), "parser"),
        (subjects.block_event("b1", "parsed"), "gateway"),
        (subjects.cluster_command("c1", "allocation"), "controller"),
        (subjects.cluster_command("c1", "scale"), "controller"),
        (subjects.cluster_command("c1", "reassignment"), "controller"),
        (subjects.instance_event("b1", "b1-0", "added"), "lifecycle"),
        (subjects.instance_event("b1", "b1-0", "removed"), "lifecycle"),
        (subjects.block_event("b1", "delete"), "lifecycle"),
        (subjects.node_command("n1", "instance.create"), "agent-sim"),
        (subjects.node_command("n1", "instance.remove"), "agent-sim"),
    ],
)
def test_each_command_is_consumed_by_exactly_one_durable(subject: str, durable: str) -> None:
    owners = [c.durable for c in all_consumers() if any(matches(f, subject) for f in c.filters)]
    assert owners == [durable]


def test_a_query_is_not_stored_and_one_queue_group_takes_it() -> None:
    subject = subjects.cluster_command("c1", "dry_run")
    assert not any(matches(f, subject) for f in subjects.STREAM_SUBJECTS)
    assert not any(matches(f, subject) for c in all_consumers() for f in c.filters)
    assert [c.durable for c in all_consumers() if any(matches(f, subject) for f in c.core_filters)] == ["controller"]
    c1 = subjects.controller("c1")
    assert any(matches(f, subject) for f in c1.core_filters)
    assert not any(matches(f, subjects.cluster_command("c2", "dry_run")) for f in c1.core_filters)


def test_a_dry_run_answer_is_not_stored_and_the_gateways_queue_group_takes_it() -> None:
    subject = subjects.block_event("b1", "dry_run.result")
    assert not any(matches(f, subject) for f in subjects.STREAM_SUBJECTS)
    assert not any(matches(f, subject) for c in all_consumers() for f in c.filters)
    assert [c.durable for c in all_consumers() if any(matches(f, subject) for f in c.core_filters)] == ["gateway"]


@pytest.mark.parametrize(
    "subject",
    [
        subjects.block_event("b1", "ready"),
        subjects.block_event("b1", "failed"),
        subjects.block_event("b1", "placement"),
        subjects.block_event("b1", "rejected"),
        subjects.block_event("b1", "deleted"),
        subjects.block_event("b1", "decision"),
        subjects.cluster_inventory("c1"),
        subjects.policy_updated("p"),
        subjects.dead_letter("parser", "x"),
    ],
)
def test_outcome_events_are_not_consumed_by_any_durable(subject: str) -> None:
    assert not any(matches(f, subject) for c in all_consumers() for f in c.filters)


# -- CloudEvents envelope -----------------------------------------------------------------------------


def test_envelope_has_the_cloudevents_attributes() -> None:
    raw = events.envelope("b1:1:parsed", "/aios/parser", "io.aios.block.parsed", "aios.block.b1.parsed", {"k": 1})
    doc = msgspec.json.decode(raw)
    assert doc["specversion"] == "1.0"
    assert doc["id"] == "b1:1:parsed"
    assert doc["source"] == "/aios/parser"
    assert doc["type"] == "io.aios.block.parsed"
    assert doc["subject"] == "aios.block.b1.parsed"
    assert doc["datacontenttype"] == "application/json"
    assert doc["data"] == {"k": 1}
    t = dt.datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
    assert doc["time"].endswith("Z") and t.tzinfo is not None
    assert abs((dt.datetime.now(dt.UTC) - t).total_seconds()) < 60


def test_now_iso_is_utc_rfc3339() -> None:
    stamp = events.now_iso()
    assert stamp.endswith("Z") and "+" not in stamp
    assert dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).utcoffset() == dt.timedelta(0)


ROUND_TRIP: list[Any] = [
    events.Parsed("b1", 7, {"blockId": "b1", "policies": {}}, attempt=2),
    events.Rejected("b1", 7, [SpecError("$.minInstances", "too big"), SpecError("$.x", "unknown field")]),
    events.Selection("b1", 7, ["c1", "c2"], {"c3": "labels do not match region=eu"}, "builtin:cluster-rank", 1),
    events.DryRunRequest("b1", 7, "c1", {"blockId": "b1"}),
    events.DryRunResult("b1", 7, "c1", 0.5, {"node_id": "n1", "gpus": ["g0"]}, placeable=2, error=""),
    events.PostDryRun("b1", 7, "c1", {"c1": 0.5, "c2": 0.0}, missing=["c2"], errors={"c3": "boom"}),
    events.AllocationRequest("b1", 7, "c1", attempt=1),
    events.ScaleRequest("b1", "c1", "req-1", {"qps": 3}),
    events.ReassignRequest("b1", "c1", "req-2", "b1-0", reason="unhealthy"),
    events.PlacementMade("b1", 7, "c1", "allocation", [events.Placement("b1-0", "n1", ["g0", "g1"])], attempts=2),
    events.InstanceCommand("b1", 7, "c1", "b1-0", "n1", ["g0"], image="img", env={"A": "1"}),
    events.InstanceEvent("b1", 7, "b1-0", "n1", ["g0"], reason="started"),
    events.BlockStatusReport("b1", 7, "ready", cluster_id="c1", instances=["b1-0"]),
    events.DeleteRequest("b1", "req-3"),
    events.StepFailed("b1", 7, "scale", "no capacity", "req-1"),
    events.Decision("b1", "resourceAllocator", "resourceAllocator", "registry:p", 3, "allocation", "d1g3st",
                    output={"node_id": "n1", "gpus": ["g0"]}, duration_us=120, input={"action": "allocation"}),
    events.DeadLetter("aios.block.b1.create", "parser", "boom", 5, 42, "{}", {"Nats-Msg-Id": "x"}),
]


@pytest.mark.parametrize("data", ROUND_TRIP, ids=lambda d: type(d).__name__)
def test_events_round_trip_through_the_envelope(data: Any) -> None:
    raw = events.envelope("id-1", "/src", f"io.aios.{type(data).__name__}", "aios.block.b1.x", data)
    env = events.decode_envelope(raw)
    assert (env.id, env.source, env.type, env.subject, env.specversion, env.datacontenttype) == (
        "id-1", "/src", f"io.aios.{type(data).__name__}", "aios.block.b1.x", "1.0", "application/json",
    )
    assert events.data_as(env, type(data)) == data


def test_envelope_with_plain_dict_data_round_trips() -> None:
    data = {"block_id": "b1", "gen": 1, "attempt": 0, "deadline": 12.5}
    env = events.decode_envelope(events.envelope("i", "s", "t", "aios.block.b1.dry_run.deadline", data))
    assert env.data == data


def test_data_as_rejects_the_wrong_payload() -> None:
    env = events.decode_envelope(events.envelope("i", "s", "t", "aios.x", {"block_id": "b1"}))
    with pytest.raises(msgspec.ValidationError):
        events.data_as(env, events.Parsed)


def test_decode_envelope_rejects_non_envelopes() -> None:
    with pytest.raises(msgspec.ValidationError):
        events.decode_envelope(b'{"data": {}}')  # no id/source/type/subject/time
    with pytest.raises(msgspec.DecodeError):
        events.decode_envelope(b"not json")


def test_decode_envelope_reads_foreign_cloudevents() -> None:
    raw = (
        b'{"specversion":"1.0","id":"x","source":"/ext","type":"com.example","subject":"aios.block.b.create",'
        b'"time":"2024-01-01T00:00:00Z","datacontenttype":"application/json","data":{"a":1}}'
    )
    env = events.decode_envelope(raw)
    assert env.source == "/ext" and env.data == {"a": 1} and env.time == "2024-01-01T00:00:00Z"


# -- docs/subjects.md is generated from the catalog ------------------------------------------------
def test_docs_subjects_table_equals_the_catalog() -> None:
    from pathlib import Path

    from aios_blocks.bus import catalog_doc

    doc = Path(__file__).resolve().parents[2] / "docs" / "subjects.md"
    text = doc.read_text()
    assert catalog_doc.render_into(text) == text, "docs/subjects.md is stale: run `blocks subjects --markdown` and paste it between the catalog markers"
    for pattern, _, _ in subjects.catalog():  # every catalog subject, `decision` included
        assert f"`{pattern}`" in text


def test_catalog_doc_derives_stored_and_consumers_from_the_stream_and_the_filters() -> None:
    from aios_blocks.bus import catalog_doc

    rows = {r[0]: r for r in catalog_doc.catalog_rows()}
    assert rows["aios.node.{nid}.heartbeat"][2] == "no"  # core NATS only
    assert rows["aios.block.{bid}.decision"][2] == "yes"
    assert rows["aios.output.{bid}.{outcome}"][2] == "yes (AIOS_OUTPUTS)"
    assert rows["aios.output.{bid}.{outcome}"][3] == "sidecar-{bid}-{name}"
    assert rows["aios.block.{bid}.create"][3] == "parser"
    assert rows["aios.cluster.{cid}.allocation"][3] == "controller"
    assert rows["aios.block.{bid}.instance.{iid}.added"][3] == "lifecycle"
    assert subjects.matches("aios.block.>", "aios.block.b") and not subjects.matches("aios.block.>", "aios.block")
    assert not subjects.matches("aios.*.x", "aios.a.b.x")
