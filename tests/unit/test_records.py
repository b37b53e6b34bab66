"""The typed records (``schemas/records.py``) name every field the code keeps in them: a field
added to the IR without its name in ``BlockIR`` fails here (mypy then checks every reader of it),
and the wire keeps the IR a plain JSON object (``ir_of``/``wire_ir`` change nothing)."""

from __future__ import annotations

import msgspec

from aios_blocks.schemas.events import Parsed
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.schemas.records import BlockIR, BlockRecord, InstanceRecord, ir_of, wire_ir

from .test_ir import COMPONENT, spec
from .test_priority_ir import CLASSES


def _full_ir() -> BlockIR:
    doc = spec(priorityClass="high", preemptible=False, queue=True, maxPendingS=60, maxMoving=2,
               labels={"team": "a"}, virtualClusterId="v1", outputs=True)
    return block_create_IR(doc, dict(COMPONENT), "b1", CLASSES)


def test_every_field_of_the_ir_is_named_by_block_ir() -> None:
    ir = _full_ir()
    assert {"priorityClass", "preemptible", "queue", "maxPendingS", "maxMoving", "labels", "virtualClusterId"} <= set(ir)
    assert set(ir) - set(BlockIR.__annotations__) == set()


def test_the_wire_keeps_the_ir_as_it_is() -> None:
    ir = _full_ir()
    assert wire_ir(ir) is ir and ir_of(wire_ir(ir)) is ir
    raw = msgspec.json.encode(Parsed("b1", 1, wire_ir(ir)))
    assert msgspec.json.decode(raw, type=Parsed).ir == msgspec.json.decode(msgspec.json.encode(ir))


def test_the_records_name_the_fields_the_lifecycle_writes() -> None:
    """Fields written by the queue, the preemption, the scale-down and the agent, read by name."""
    assert {"pending_since", "pending_deadline", "preempted_by", "preempting", "sidecar_node"} <= set(BlockRecord.__annotations__)
    assert {"drain", "restarts", "since", "endpoint"} <= set(InstanceRecord.__annotations__)


def test_needs_names_every_field_of_a_resource_spec() -> None:
    from aios_blocks.schemas.records import Needs
    from aios_blocks.schemas.spec import ResourceNeeds

    assert set(ResourceNeeds.model_fields) == set(Needs.__annotations__)
    assert set(_full_ir()["resources"]) <= set(Needs.__annotations__)


def test_a_node_view_has_the_fields_node_view_names() -> None:
    """``state.nodes.node_view`` builds exactly the fields ``NodeView``/``GpuView`` name."""
    from aios_blocks.schemas.records import GpuView, NodeView
    from aios_blocks.state.nodes import node_view

    spec = {"id": "n1", "cluster": "c1", "labels": {"rack": "r1"}, "topology": {"profile": "nvlink-pairs-4"},
            "gpus": [{"id": "g0", "model": "A100", "memory": 40960}]}
    h = {"spec": msgspec.json.encode(spec).decode(), "healthy": "1", "drain": "1", "vc": "v1", "cpu": "8", "memory": "1024"}
    view = node_view(h)
    assert set(view) <= set(NodeView.__annotations__) and {"topology", "virtualCluster", "draining"} <= set(view)
    assert set(view["gpus"][0]) == set(GpuView.__annotations__)


def test_the_map_the_mapper_writes_has_the_fields_block_map_names() -> None:
    from aios_blocks.handlers import mapper
    from aios_blocks.schemas.records import BlockMap, MapEntry

    ir = _full_ir()
    ir["policies"] = {**ir["policies"], "stabilityChecker": {"name": "stabilityChecker"}}
    block: BlockRecord = {"gen": 1, "status": "ready", "cluster": "c1", "ir": ir}
    insts: dict[str, InstanceRecord] = {"b1-0": {"node": "n1", "gpus": [], "cluster": "c1", "status": "running",
                                                 "endpoint": "http://n1:9000", "since": 1.0}}
    m = mapper.from_state("b1", block, insts, 2.0)
    assert m is not None and m["instances"]
    assert set(m) <= set(BlockMap.__annotations__) and {"stabilityChecker", "minInstances", "outputs"} <= set(m)
    assert all(set(e) <= set(MapEntry.__annotations__) for e in m["instances"].values())


def test_cluster_record_names_every_field_of_a_cluster_spec() -> None:
    from aios_blocks.schemas.records import ClusterRecord
    from aios_blocks.schemas.spec import Cluster

    assert set(Cluster.model_fields) == set(ClusterRecord.__annotations__)


def test_an_executor_route_view_has_the_fields_route_view_names() -> None:
    from aios_blocks.executor.engine import InlinePolicy, Limits, Route
    from aios_blocks.policies.runtime import BUILTINS
    from aios_blocks.schemas.records import RouteView

    uri = "builtin:round-robin"
    r = Route("b", InlinePolicy(BUILTINS[uri]("b.loadBalancer", {}, {}), uri), Limits())
    r.apply({"b-0": {"node": "n1", "endpoint": "http://n1:9000", "state": "ready", "since": 1.0, "boot": "x"}}, 1, 1,
            {"n1": "x"})
    r.set_collected("b-0", {"inflight": 0})
    v = r.try_pick({})
    assert v is not None and set(v) <= set(RouteView.__annotations__) and v["state"] == "ready"


def test_a_gather_has_the_fields_gather_record_names() -> None:
    from aios_blocks.schemas.records import GatherRecord
    from aios_blocks.state.gathers import _gather

    g = _gather({"expected": '["c1"]', "deadline": "5.5", "r:c1": '{"score": 1.0}', "decided": "t", "at": "7"})
    assert set(g) == set(GatherRecord.__annotations__) and g["results"] == {"c1": {"score": 1.0}}


def test_affinity_term_names_every_field_of_an_affinity_entry() -> None:
    from aios_blocks.schemas.affinity import AffinityEntry
    from aios_blocks.schemas.records import AffinityTerm

    assert set(AffinityEntry.__struct_fields__) == set(AffinityTerm.__annotations__)
    term = msgspec.to_builtins(AffinityEntry("Resource", "Required", False, "RackId", "42"))
    assert set(term) == set(AffinityTerm.__annotations__)


def test_the_asyncapi_document_has_the_fields_its_records_name() -> None:
    """``bus.asyncapi``'s parts (channel, operation, message, example, the document) are built with
    exactly the fields their TypedDicts name; the JSON Schemas inside them stay open JSON."""
    from aios_blocks.bus import asyncapi

    doc = asyncapi.document()
    assert set(doc) == set(asyncapi.Document.__annotations__)
    assert set(doc["components"]) == set(asyncapi.Components.__annotations__)
    channels, operations = doc["channels"].values(), doc["operations"].values()
    assert set().union(*(set(c) for c in channels)) == set(asyncapi.Channel.__annotations__)
    assert set().union(*(set(o) for o in operations)) == set(asyncapi.Operation.__annotations__)
    messages = list(doc["components"]["messages"].values())
    assert set().union(*(set(m) for m in messages)) == set(asyncapi.Message.__annotations__)
    assert set().union(*(set(x) for m in messages for x in m["examples"])) == set(asyncapi.Example.__annotations__)
