"""The trace's QoS -> priority classes (issue 36): Guaranteed, LS > Burstable > BE."""

from __future__ import annotations

from aios_blocks.schemas.ir import priority_of as ir_priority
from aios_blocks.trace import qos
from aios_blocks.trace.workload import Task


def test_guaranteed_and_ls_above_burstable_above_be_by_more_than_the_delta() -> None:
    p = {q: qos.priority_of(q) for q in ("Guaranteed", "LS", "Burstable", "BE")}
    assert p["Guaranteed"] == p["LS"] > p["Burstable"] > p["BE"]
    assert p["LS"] - p["Burstable"] >= 10 and p["Burstable"] - p["BE"] >= 10


def test_unknown_or_missing_qos_gets_the_default_class() -> None:
    assert qos.class_of("") == qos.class_of(None) == qos.class_of("Weird") == qos.BURSTABLE
    assert [c["name"] for c in qos.records() if c["default"]] == [qos.BURSTABLE]
    assert qos.class_of("be") == qos.class_of("BestEffort") == qos.BEST_EFFORT


def test_a_tasks_label_maps_to_a_class_the_ir_accepts() -> None:
    classes = {c["name"]: c for c in qos.records()}
    task = Task("t", 1000, 1024, 1, 1000, qos="LS")
    name = qos.class_of_labels({"qos": task.qos})
    assert ir_priority(name, classes) == (qos.LATENCY_SENSITIVE, 1000)
    assert ir_priority(None, classes) == (qos.BURSTABLE, 100)
