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

    g = _gather({"expected": '["c1"]', "deadline": "5.5", "r:c1": '{"score": 1.0}', "decided": "t", "at": "7",
                 "selection": '{"block_id": "b"}'})
    assert set(g) == set(GatherRecord.__annotations__) and g["results"] == {"c1": {"score": 1.0}}
    assert g["selection"] == '{"block_id": "b"}'
    # a round that asked its dry_runs keeps no selection in its gather (only a skipped one does)
    assert "selection" not in _gather({"expected": '["c1"]', "deadline": "5.5", "decided": "t", "at": "7"})


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


def test_decision_record_names_every_field_of_a_decision() -> None:
    """``DecisionRecord`` is ``schemas.events.Decision`` as JSON: a field added to the struct
    without its name here fails (``recovery.inputs`` and ``blocks explain``/``policy test`` read it)."""
    from aios_blocks.schemas.events import Decision
    from aios_blocks.schemas.records import DecisionGiven, DecisionRecord, ReplayedDecision

    assert {f.name for f in msgspec.structs.fields(Decision)} == set(DecisionRecord.__annotations__)
    assert set(ReplayedDecision.__annotations__) - set(DecisionRecord.__annotations__) == {"input_check", "state_seq"}
    assert set(DecisionGiven.__annotations__) == {"block_metrics", "excluded_nodes"}


def test_policy_test_report_has_the_fields_its_records_name() -> None:
    """``handlers.policy_test.compare`` builds its report, its changes and its exact replays with
    the fields ``Report``/``Change``/``ExactReplay`` name."""
    import asyncio

    from aios_blocks.handlers import policy_test as pt

    recorded = [
        {"block_id": "b1", "action": "allocation", "output": {"node_id": "n1", "gpus": ["g0"]}, "input": {"action": "allocation"}},
        {"block_id": "b2", "action": "preempt", "output": {"victims": {}}, "input": {"action": "preempt"}},
        {"block_id": "b3", "action": "allocation", "input": None},
    ]

    async def run(input_data: dict[str, object]) -> object:
        return {"node_id": "n2", "gpus": ["g1"]} if input_data["action"] == "allocation" else {"victims": {"b9": ["i1"]}}

    report = asyncio.run(pt.compare(recorded, run))  # type: ignore[arg-type]
    assert set(report) == set(pt.Report.__annotations__)
    assert report["changes"] and all(set(c) == set(pt.Change.__annotations__) for c in report["changes"])
    assert report["replays"] and all(set(r) == set(pt.ExactReplay.__annotations__) for r in report["replays"])


def test_the_collector_samples_have_the_fields_their_records_name() -> None:
    """``metrics.window.Windows.tick`` builds a block's and an instance's sample with exactly the
    fields ``BlockSample``/``InstanceSample`` name (the kv-cache figure only when reported)."""
    from aios_blocks.metrics.scrape import ExecBlock, InstanceReading
    from aios_blocks.metrics.window import BlockInput, Windows
    from aios_blocks.schemas.records import BlockSample, InstanceSample

    w = Windows(span_s=10)
    page = InstanceReading(running=1, waiting=2, kv_cache_usage_perc=0.5, requests=10, errors=0)
    tick = {"b1": BlockInput("c1", {"i1": {"state": "ready", "node": "n1"}}, {"i1": page}, ExecBlock())}
    w.tick(1.0, tick)
    (block, insts), = w.tick(2.0, tick).values()
    assert set(block) == set(BlockSample.__annotations__)
    assert set(insts["i1"]) == set(InstanceSample.__annotations__)


def test_metrics_targets_and_target_groups_have_the_fields_their_records_name() -> None:
    """A worker's announced target (``workers.telemetry.target_of``), the Prometheus target groups
    and scrape jobs (``metrics.promconfig``) and a remote-write receiver's status."""
    import yaml

    from aios_blocks.metrics import promconfig
    from aios_blocks.metrics.remote_write import ReceiverStatus, RemoteWrite
    from aios_blocks.schemas.records import MetricsTarget
    from aios_blocks.workers.telemetry import target_of

    target = target_of("front", ["parser", "gateway"], "c1", "http://127.0.0.1:9100/metrics")
    assert set(target) == set(MetricsTarget.__annotations__)
    groups = promconfig.worker_targets([target]) + promconfig.instance_targets(
        {"b1": {"instances": {"i1": {"endpoint": "http://10.0.0.1:8000", "node": "n1", "state": "ready"}}}}, {"b1": "c1"})
    assert len(groups) == 2 and all(set(g) == set(promconfig.TargetGroup.__annotations__) for g in groups)
    for sd in (None, "http://127.0.0.1:9200"):
        jobs = yaml.safe_load(promconfig.config(sd, groups, groups))["scrape_configs"]
        assert jobs and all(set(j) <= set(promconfig.ScrapeJob.__annotations__) for j in jobs)
    (status,) = RemoteWrite(["http://127.0.0.1:1/api/v1/write"]).status().values()
    assert set(status) == set(ReceiverStatus.__annotations__)


def test_passive_counts_name_every_field_of_an_outlier_snapshot() -> None:
    """``executor.outlier.Outliers.snapshot`` (what the health checker merges) builds exactly the
    fields ``PassiveCounts`` names."""
    from aios_blocks.executor.outlier import Outliers
    from aios_blocks.schemas.records import PassiveCounts

    snap = Outliers().snapshot({"i1": {"id": "i1", "inflight": 1}}, now=5.0)
    assert set(snap["i1"]) == set(PassiveCounts.__annotations__)


def test_security_options_name_what_the_connection_gets() -> None:
    """``bus.connection.security_options`` sets only the ``nats.connect`` options ``SecurityOptions``
    names (a CA would add ``tls``)."""
    from aios_blocks.bus.connection import SecurityOptions, security_options
    from aios_blocks.settings import Settings

    opts = security_options("nats://u:p@127.0.0.1:4222", None, Settings(nats_creds="/x.creds", nats_ca=None))
    assert opts == {"inbox_prefix": "_INBOX.u", "user_credentials": "/x.creds"}
    assert set(opts) | {"tls"} == set(SecurityOptions.__annotations__)
