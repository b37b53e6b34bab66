"""The typed records of the spec's JSON and of the seed-shaped policy payloads
(``schemas/records.py``, ``schemas/policy_io.py``) name exactly the fields their builders write,
and a ``Wire[...]`` field decodes and describes itself exactly as the plain JSON object it was."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aios_blocks.schemas import policy_io
from aios_blocks.schemas.records import (
    JobClusterRecord,
    LaunchRecord,
    LinkRecord,
    PolicyRule,
    ProbeRecord,
    TopologyRecord,
    Wire,
)


class _Plain(msgspec.Struct):
    obj: dict[str, Any] = {}


class _Typed(msgspec.Struct):
    obj: Wire[LaunchRecord] = {}


def test_a_wire_field_decodes_and_describes_itself_as_the_plain_object() -> None:
    """What is decoded keeps the fields the record does not name and values of any type (no
    validation), and the JSON Schema (AsyncAPI) is the plain object's."""
    raw = b'{"obj":{"command":["x"],"stopGraceS":"not a number","unnamed":{"a":[1,2.5,null]}}}'
    assert msgspec.json.decode(raw, type=_Typed).obj == msgspec.json.decode(raw, type=_Plain).obj
    assert msgspec.json.decode(raw, type=_Typed).obj["unnamed"] == {"a": [1, 2.5, None]}  # type: ignore[typeddict-item]
    assert msgspec.json.encode(msgspec.json.decode(raw, type=_Typed)) == raw
    plain, typed = msgspec.json.schema(_Plain), msgspec.json.schema(_Typed)
    assert plain["$defs"]["_Plain"]["properties"] == typed["$defs"]["_Typed"]["properties"]


def test_spec_records_name_every_field_of_their_models() -> None:
    from aios_blocks.schemas.records import SidecarConsumesRecord, SidecarRecord
    from aios_blocks.schemas.spec import JobClusterSpec, Launch, Probe, Sidecar, SidecarConsumes
    from aios_blocks.schemas.spec import PolicyRule as PolicyRuleModel
    from aios_blocks.schemas.topology import GpuLink, GpuTopology

    assert set(Launch.model_fields) == set(LaunchRecord.__annotations__)
    assert set(Launch().model_dump()) == set(LaunchRecord.__annotations__)
    assert set(Probe.model_fields) == set(ProbeRecord.__annotations__)
    assert set(GpuLink.model_fields) == set(LinkRecord.__annotations__)
    assert set(GpuTopology.model_fields) == set(TopologyRecord.__annotations__)
    assert set(JobClusterSpec.model_fields) == set(JobClusterRecord.__annotations__)
    assert set(Sidecar.model_fields) == set(SidecarRecord.__annotations__)
    assert set(SidecarConsumes.model_fields) == set(SidecarConsumesRecord.__annotations__)
    # the rule as the IR keeps it, plus the version a caller may pin
    assert set(PolicyRuleModel.model_fields) | {"version"} == set(PolicyRule.__annotations__)


def test_health_check_input_has_exactly_the_named_fields() -> None:
    from aios_blocks.handlers import stability

    rec = {"node": "n1", "endpoint": "http://n1:1", "state": "ready", "since": 1.0}
    entry = stability.instance_input("i1", rec, 5.0, None, [], 0)  # type: ignore[arg-type]
    agent = stability.agent_input("i1", "n1", "http://n1:1", "failed", "exit 1")
    assert set(entry) | {"agent"} == set(policy_io.HealthInstance.__annotations__)
    assert set(agent) | {"age_s"} == set(policy_io.HealthInstance.__annotations__)
    assert set(entry["passive"]) == set(policy_io.Passive.__annotations__)
    assert set(entry["progress"]) == set(policy_io.Progress.__annotations__)
    data = stability.payload("b1", [entry], 1.0, 1)
    assert set(data) == set(policy_io.HealthCheckInput.__annotations__)
    assert set(data["payload"]) == set(policy_io.HealthCheckPayload.__annotations__)


@pytest.mark.parametrize("value, expected", [(3, 3), (2.9, 2), ("4", 4), (True, 1)])
def test_as_int_is_int_of_a_json_value(value: Any, expected: int) -> None:
    assert policy_io.as_int(value) == int(value) == expected


@pytest.mark.parametrize("value", [None, [1], {"a": 1}])
def test_as_int_and_as_float_raise_what_int_and_float_raise(value: Any) -> None:
    for mine, builtin in ((policy_io.as_int, int), (policy_io.as_float, float)):
        with pytest.raises(TypeError) as theirs:
            builtin(value)
        with pytest.raises(TypeError, match=str(theirs.value).replace("(", r"\(").replace(")", r"\)")):
            mine(value)
    with pytest.raises(ValueError):
        policy_io.as_float("x")
    assert policy_io.as_float("0.5") == 0.5


def test_autoscale_input_has_exactly_the_named_fields() -> None:
    """``handlers.autoscale.policy_input`` builds the named fields; an instance is its record's
    status and node over the collector's sample, the block's metrics its sample and history."""
    from aios_blocks.handlers import autoscale
    from aios_blocks.schemas.records import BlockSample, InstanceSample

    data = autoscale.policy_input("b1", {}, {}, 1, 1, 3, autoscale.State())
    assert set(data) == set(policy_io.AutoscaleInput.__annotations__)
    assert set(data["payload"]) == set(policy_io.AutoscalePayload.__annotations__)
    assert set(policy_io.AutoscaleInstance.__annotations__) == {"status", "node"} | set(InstanceSample.__annotations__)
    assert set(policy_io.AutoscaleMetrics.__annotations__) == {"history"} | set(BlockSample.__annotations__)


def test_route_input_names_what_the_executor_sends() -> None:
    from aios_blocks.executor.engine import InlinePolicy

    seen: list[Any] = []

    class Spy:
        def eval(self, parameters: Any, input_data: Any, context: Any) -> Any:
            seen.append(input_data)
            return {"instance_id": "i1"}

    task = {"method": "POST", "path": "/", "bytes": 1, "idempotent": False, "content_type": ""}
    assert InlinePolicy(Spy(), "spy").choose("b1", task, [{"id": "i1", "inflight": 0}]) == "i1"  # type: ignore[arg-type]
    assert set(seen[0]) == set(policy_io.RouteInput.__annotations__)
    assert set(seen[0]["payload"]) == set(policy_io.RoutePayload.__annotations__)


def test_the_adapt_table_the_index_and_adaptive_terms_have_exactly_the_named_fields() -> None:
    from aios_blocks.policies import affinity
    from aios_blocks.schemas.records import AdaptiveTerm, AdaptNode, AdaptTable, AffinityIndex

    table = affinity.adapt({"i0": {"node": "n1", "latency_p50_ms": 10.0}, "i1": {"node": "n2", "latency_p50_ms": 30.0}})  # type: ignore[typeddict-item]
    assert set(table) == set(AdaptTable.__annotations__)
    assert all(set(row) == set(AdaptNode.__annotations__) for row in table["nodes"].values())
    index = affinity.add_to_index(affinity.empty_index(), "b", "b-0", "n1", "r1")
    assert set(index) | {"adapt", "gpus"} == set(AffinityIndex.__annotations__)
    nodes = {"n1": {"node_id": "n1", "labels": {"rack": "1"}, "gpus": []}}
    terms = [{"category": "Topology", "strength": "Adaptive", "anti": False, "target_type": "RackId", "target": "1"}]
    affinity.annotate(nodes, terms, {**index, "adapt": table})  # type: ignore[arg-type]
    assert all(set(t) == set(AdaptiveTerm.__annotations__) for t in nodes["n1"]["affinity"]["adaptive"])  # type: ignore[index]


def test_placement_payload_parts_have_exactly_the_named_fields() -> None:
    """The cluster entry and metrics (``handlers.gateway``), a sample's info (``policies.sampling``)
    and a scale_down candidate (``handlers.scaling.candidates``), in the order the input keeps."""
    from aios_blocks.handlers import gateway, scaling
    from aios_blocks.policies.sampling import Sample
    from aios_blocks.schemas.records import (
        ClusterEntry,
        ClusterFigures,
        ClusterMetrics,
        SampleInfo,
        ScaleDownCandidate,
    )

    entry = gateway.cluster_entry({"id": "c1", "labels": {}}, {})
    assert set(entry) | {"score_data", "missing"} == set(ClusterEntry.__annotations__)
    assert set(entry["metrics"]) | {"affinity_score"} == set(ClusterFigures.__annotations__)
    assert set(gateway.cluster_metrics({})) | {"affinity_score", "sample", "affinity_index"} == set(ClusterMetrics.__annotations__)
    info = Sample({}, 1, 1, 1, 1, True, unsatisfiable="x").info()
    assert set(info) == set(SampleInfo.__annotations__)
    recs = {"i1": {"node": "n1", "gpus": ["g0"], "status": "running", "since": 1.0}, "i2": {"node": "n2", "status": "starting"}}
    sample = {"inflight": 1.0, "running": 2.0, "waiting": 0.0, "rate": 3.0}
    cands = scaling.candidates(recs, {"i1": sample}, 5.0)  # type: ignore[arg-type, dict-item]
    assert all(list(c) == list(ScaleDownCandidate.__annotations__) for c in cands)
    assert cands[0]["load"] == 1.0 and cands[1]["load"] is None and cands[1]["inflight"] is None


async def test_a_registry_record_has_exactly_the_fields_policy_source_names() -> None:
    """``Store.policy_get`` (what ``PolicyRuntime`` compiles): the head has ``updated``, an older
    version only the named required fields."""
    import fakeredis

    from aios_blocks.state.registry import PolicyRecords

    reg = PolicyRecords()
    reg.r = fakeredis.FakeAsyncRedis(decode_responses=True)
    await reg.policy_put("p", "x = 1", "python")
    await reg.policy_put("p", "x = 2", "starlark")
    head, old = await reg.policy_get("p"), await reg.policy_get("p", 1)
    assert head is not None and old is not None
    assert set(head) == set(policy_io.PolicySource.__annotations__) and head["version"] == 2
    assert set(old) | {"updated"} == set(policy_io.PolicySource.__annotations__) and old["source"] == "x = 1"


def test_the_lxd_shapes_have_exactly_the_named_fields() -> None:
    """What an ``instance_placement`` scriptlet sees (seed 004), built from a node view."""
    from aios_blocks.policies.lxd_shapes import (
        cluster_member,
        instance_resources,
        member_resources,
        member_state,
        placement_request,
    )
    from aios_blocks.schemas import lxd

    view = {"node_id": "n1", "labels": {"rack": "r1"}, "healthy": True, "cpu": 8.0, "cpu_free": 6.0,
            "memory": 1024, "memory_free": 512,
            "gpus": [{"id": "g0", "model": "NVIDIA A100", "memory": 40960, "memory_used": 0, "memory_free": 40960,
                      "instances": 0, "exclusive": False, "share_free": 1000}]}
    assert set(cluster_member(view)) == set(lxd.ClusterMember.__annotations__)  # type: ignore[arg-type]
    state = member_state(view)  # type: ignore[arg-type]
    assert set(state) == set(lxd.MemberState.__annotations__) and set(state["sysinfo"]) == set(lxd.SysInfo.__annotations__)
    res = member_resources(view)  # type: ignore[arg-type]
    assert set(res) == set(lxd.MemberResources.__annotations__)
    assert set(res["gpu"]["cards"][0]) == set(lxd.GpuCard.__annotations__)
    assert set(res["memory"]) == set(lxd.MemoryResources.__annotations__)
    assert set(instance_resources({"gpus": 1, "memory": 10})) == set(lxd.InstanceResources.__annotations__)
    req = placement_request({"blockId": "b1", "resources": {"gpus": 1}}, {"instance_id": "b1-0"}, "allocation")
    assert set(req) == set(lxd.PlacementRequest.__annotations__)
    assert set(req["source"]) == set(lxd.InstanceSource.__annotations__)


def test_capacity_totals_are_the_named_fields_in_their_order() -> None:
    from aios_blocks.policies import capacity
    from aios_blocks.schemas.records import Totals

    view = {"node_id": "n1", "healthy": True, "cpu": 8.0, "cpu_free": 6.12345, "memory": 1024, "memory_free": 512,
            "gpus": [{"id": "g0", "memory": 100, "memory_used": 0, "memory_free": 100, "instances": 0, "exclusive": False}]}
    t = capacity.totals({"n1": view})  # type: ignore[dict-item]
    assert list(t) == list(Totals.__annotations__) == list(capacity.TOTAL_KEYS)
    assert t == {"gpus": 1, "gpus_free": 1, "gpu_memory_free": 100, "cpu_free": 6.123, "memory_free": 512, "healthy_node_count": 1}
    assert all(type(v) is int for k, v in t.items() if k != "cpu_free")


def test_an_inventory_summary_has_the_named_fields() -> None:
    from aios_blocks.trace.inventory import InventorySummary, parse_nodes, summary

    nodes = parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn1,8000,1024,2,T4\n", "c1")
    added = {"gpu_topology_nodes", "new_cluster", "registered"}  # by blocks cluster import
    assert set(summary(nodes)) == set(InventorySummary.__annotations__) - added


def test_the_spec_models_see_the_open_objects_they_always_saw() -> None:
    """``Wire[JSONObject]`` fields of the pydantic spec models validate and describe themselves as
    ``dict[str, Any]`` (any JSON value kept as given, the same JSON Schema)."""
    from aios_blocks.schemas.spec import BlockSpec, Component, PolicyRule, Sidecar

    for model, names in ((PolicyRule, ("parameters", "settings")), (Sidecar, ("parameters",)),
                         (Component, ("componentInitData", "componentParameters", "componentInputProtocol")),
                         (BlockSpec, ("blockInitData", "initSettings", "parameters"))):
        for name in names:
            assert model.model_fields[name].annotation in (dict[str, Any], dict[str, Any] | None), (model, name)
    rule = PolicyRule.model_validate({"name": "loadBalancer", "policyRuleURI": "builtin:round-robin",
                                      "parameters": {"a": [1, 2.5, None, {"b": True}]}})
    assert rule.model_dump()["parameters"] == {"a": [1, 2.5, None, {"b": True}]}


def test_a_quota_report_row_has_exactly_the_named_fields() -> None:
    from aios_blocks.policies import quota as qp
    from aios_blocks.schemas.priority import Quota

    q = Quota.model_validate({"tenant": "t1", "nominal": {"A100": {"gpus": 4}}})
    rows = qp.report({"t1": q}, [qp.Holding("b1", "t1", {"A100": {"gpus": 2.0}})])
    assert rows and all(list(r) == list(qp.QuotaRow.__annotations__) for r in rows)
