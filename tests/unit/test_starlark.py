"""Starlark policies (``policies.starlark_runtime``): the seed-000 form against the Python classes,
the LXD ``instance_placement`` form (seed 004) as a resourceAllocator, and the sandbox limits.
Payloads come from ``handlers.controller.payload`` over ``state.store.node_view`` node views."""

from __future__ import annotations

import copy
import gc
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.handlers.controller import payload
from aios_blocks.policies import contract, runtime
from aios_blocks.policies.runtime import PolicyRuntime, TrackingDict
from aios_blocks.policies.starlark_runtime import (
    MAX_CALLSTACK,
    Limits,
    StarlarkError,
    attribute_reads_as_keys,
    compile_policy,
    instance_resources,
    member_resources,
    member_state,
)
from aios_blocks.schemas.errors import PolicyFailed

from .views import EXAMPLES, GIB, busy_gpu, free_gpus, gpu, make_ir, node, nodes_of

HERE = Path(__file__).parent / "starlark_policies"
CLUSTER = {"id": "c1", "labels": {}}
MiB = 1024 * 1024


def load(name: str, limits: Limits | None = None) -> type:
    path = HERE / f"{name}.star"
    if not path.exists():  # binpack and LXD most-free-memory are the shipped examples
        path = EXAMPLES / f"{name}.star"
    return compile_policy(path.read_text(), name, limits)


def inline(source: str, limits: Limits | None = None, settings: dict[str, Any] | None = None) -> Any:
    return compile_policy(source, "inline", limits)("b1.rule", settings or {}, {})


def res_input(action: str, ir: dict[str, Any], nodes: dict[str, Any], instances: dict[str, Any] | None = None,
              **extra: Any) -> dict[str, Any]:
    return {"action": action, "payload": payload(ir, CLUSTER, nodes, instances, **extra)}


# -- seed 000: the cluster selector example, Python vs Starlark -----------------------------------


class ClusterSelectorPolicyRule:
    """Seed 000's example clusterAllocator, as printed there (minus the debug print)."""

    def __init__(self, rule_id, settings, parameters):
        self.rule_id = rule_id
        self.settings = settings
        self.parameters = parameters

    def eval(self, parameters, input_data, context):
        if input_data["action"] == "selection":
            filter_result = input_data["filter_result"]
            if len(filter_result) == 0:
                raise Exception("no results found in the filter")
            result = {}
            result["clusters"] = filter_result
            return result
        if input_data["action"] == "post_dry_run":
            selected_clusters = input_data["clusters"]
            highest_index = 0
            current_highest = -1
            idx = 0
            for entry in selected_clusters:
                score_data = entry["score_data"]
                if score_data["score"] > current_highest:
                    current_highest = score_data["score"]
                    highest_index = idx
                idx += 1
            return selected_clusters[highest_index]


def cluster_entries(n: int) -> list[dict[str, Any]]:
    return [
        {"cluster_id": f"c{i}", "id": f"c{i}", "labels": {"zone": f"z{i % 2}"}, "metrics": {"gpus_free": 3 * i, "cpu_free": 1.5}}
        for i in range(n)
    ]


def scored(scores: list[float]) -> list[dict[str, Any]]:
    return [
        {**e, "score_data": {"score": s, "node_info": {"node_id": f"n{i}", "gpus": [f"g{i}"]}}}
        for i, (e, s) in enumerate(zip(cluster_entries(len(scores)), scores, strict=True))
    ]


@pytest.mark.parametrize(
    "input_data",
    [
        {"action": "selection", "filter_result": cluster_entries(3)},
        {"action": "selection", "filter_result": ["c1", "c2"]},
        {"action": "post_dry_run", "clusters": scored([0.2, 0.9, 0.5])},
        {"action": "post_dry_run", "clusters": scored([0.7, 0.7, 0.1])},  # tie: the first wins
        {"action": "post_dry_run", "clusters": scored([0.0])},
    ],
)
def test_seed_cluster_selector_matches_the_python_example(input_data: dict[str, Any]) -> None:
    py = ClusterSelectorPolicyRule("b1.clusterAllocator", {}, {})
    star = load("cluster_selector")("b1.clusterAllocator", {}, {})
    expected = py.eval({}, copy.deepcopy(input_data), {})
    got = star.eval({}, copy.deepcopy(input_data), {})
    assert got == expected
    contract.check(input_data["action"], got)


def test_seed_cluster_selector_raises_like_the_python_example_on_an_empty_filter() -> None:
    star = load("cluster_selector")("b1.clusterAllocator", {}, {})
    with pytest.raises(Exception, match="no results found in the filter"):
        ClusterSelectorPolicyRule("r", {}, {}).eval({}, {"action": "selection", "filter_result": []}, {})
    with pytest.raises(StarlarkError, match=r"fail: no results found in the filter \(at cluster_selector.star:10:") as ei:
        star.eval({}, {"action": "selection", "filter_result": []}, {})
    assert ei.value.line == 10


async def test_starlark_class_runs_inside_policy_runtime_with_contract_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(runtime.BUILTINS, "starlark:cluster-selector", load("cluster_selector"))
    monkeypatch.setitem(runtime.BUILTINS, "starlark:bad", compile_policy(
        'def eval(p, i, c):\n    c["seen"] = i["action"]\n    return {"clusters": "nope"}\n', "bad"))
    rt = PolicyRuntime(timeout_s=5)
    ok = await rt.invoke({"name": "clusterAllocator", "policyRuleURI": "starlark:cluster-selector"}, "b1.clusterAllocator",
                         {"action": "post_dry_run", "clusters": scored([0.1, 0.8])})
    assert ok["cluster_id"] == "c1"
    ctx = TrackingDict({"keep": 1})
    with pytest.raises(PolicyFailed, match="wrong return shape"):
        await rt.invoke({"name": "clusterAllocator", "policyRuleURI": "starlark:bad"}, "b1.clusterAllocator",
                        {"action": "selection", "filter_result": []}, ctx)
    assert ctx.changes() == ({"seen": "selection"}, [])


# -- seed 000 form: a Starlark resourceAllocator --------------------------------------------------


def test_starlark_binpack_dry_run_and_allocation_shapes() -> None:
    nodes = nodes_of(node("n1", gpus=free_gpus(1)), node("n2", gpus=[gpu("h0", 40 * GIB), gpu("h1", 80 * GIB)]),
                     node("n3", gpus=free_gpus(4, "k"), healthy=False))
    ir = make_ir(max_instances=4)
    inst = load("binpack")("b1.resourceAllocator", {}, {})
    ctx: dict[str, Any] = {}
    before = copy.deepcopy(nodes)

    dry = inst.eval({}, res_input("dry_run", ir, nodes), ctx)
    contract.check("dry_run", dry)
    assert dry["selection_score_data"]["score"] == pytest.approx(0.75)  # 3 healthy free GPUs, 4 wanted
    assert dry["selection_score_data"]["node_info"] == {"node_id": "n1", "gpus": ["g0"]}  # fuller node first
    assert ("info", "dry_run placed 3 of 4") in inst.logs

    alloc = inst.eval({}, res_input("allocation", ir, nodes), ctx)
    contract.check("allocation", alloc)
    assert alloc == {"node_id": "n1", "gpus": ["g0"]}
    nodes["n1"] = node("n1", gpus=[busy_gpu("g0")])
    alloc = inst.eval({}, res_input("scale", ir, nodes), ctx)
    assert alloc == {"node_id": "n2", "gpus": ["h0"]}  # the smaller GPU first
    assert ctx == {"calls": 3}
    assert nodes["n2"] == before["n2"]  # the script mutated its own copy only


def test_starlark_binpack_without_capacity_fails_with_its_message() -> None:
    inst = load("binpack")("b1.resourceAllocator", {}, {})
    nodes = nodes_of(node("n1", gpus=[busy_gpu("g0")]))
    with pytest.raises(StarlarkError, match="no healthy node can host the instance"):
        inst.eval({}, res_input("allocation", make_ir(), nodes), {})
    dry = inst.eval({}, res_input("dry_run", make_ir(max_instances=2), nodes), {})
    assert dry == {"selection_score_data": {"score": 0.0, "node_info": {}, "placeable": 0}}


# -- seed 004: LXD instance_placement scriptlets ---------------------------------------------------


def test_lxd_most_free_memory_targets_the_member_with_most_free_ram() -> None:
    nodes = nodes_of(
        node("n1", gpus=free_gpus(2), memory=200 * GIB, mem_used=150 * GIB, cpu_used=3),
        node("n2", gpus=[gpu("h0", 80 * GIB), gpu("h1", 24 * GIB), busy_gpu("h2")], memory=200 * GIB, mem_used=10 * GIB),
        node("n3", gpus=free_gpus(2, "k"), memory=900 * GIB, healthy=False),  # most free, but unhealthy
        node("n4", gpus=[busy_gpu("z0")], memory=900 * GIB),  # most free, but no GPU left
    )
    inst = load("lxd_most_free_memory")("b1.resourceAllocator", {}, {})
    out = inst.eval({}, res_input("allocation", make_ir(), nodes), {})
    contract.check("allocation", out)
    assert out == {"node_id": "n2", "gpus": ["h1"]}  # the usable GPU with the least free memory
    assert inst.logs == [
        ("info", f"n1 - free memory: {50 * 1024}MB, load: [3.0, 3.0, 3.0]"),
        ("info", f"n2 - free memory: {190 * 1024}MB, load: [0.0, 0.0, 0.0]"),
        ("info", "targeting n2 for new instance b1"),
    ]


def test_lxd_dry_run_places_max_instances_on_a_working_copy() -> None:
    # n1 has a little more free memory; each placement takes 1024 MiB, so the targets alternate
    nodes = nodes_of(
        node("n1", gpus=free_gpus(2), memory=100_000, mem_used=0),
        node("n2", gpus=free_gpus(1, "h"), memory=100_000, mem_used=500),
    )
    before = copy.deepcopy(nodes)
    inst = load("lxd_most_free_memory")("b1.resourceAllocator", {}, {})
    out = inst.eval({}, res_input("dry_run", make_ir(max_instances=4), nodes), {})
    contract.check("dry_run", out)
    assert out == {"selection_score_data": {"score": 0.75, "node_info": {"node_id": "n1", "gpus": ["g0"]}}}
    targets = [m for lvl, m in inst.logs if m.startswith("targeting")]
    assert targets == [
        "targeting n1 for new instance b1-0",
        "targeting n2 for new instance b1-1",
        "targeting n1 for new instance b1-2",
    ]
    assert nodes == before


def test_lxd_reject_by_name_rejects_and_otherwise_sets_the_first_candidate() -> None:
    nodes = nodes_of(node("n2", gpus=free_gpus(1, "h")), node("n1", gpus=free_gpus(1)))
    inst = load("lxd_reject_by_name")("b1.resourceAllocator", {}, {})
    ir = make_ir()
    assert inst.eval({}, res_input("allocation", ir, nodes), {}) == {"node_id": "n1", "gpus": ["g0"]}
    assert inst.logs == [("info", "instance_placement started: b1")]

    instances = {"foo": {"node": "n1", "gpus": ["g0"]}}
    with pytest.raises(StarlarkError, match="placement rejected: Invalid name"):
        inst.eval({}, res_input("reassignment", ir, nodes, instances, instance_id="foo", pod_name="foo"), {})
    assert inst.logs == [("info", "instance_placement started: foo"), ("error", "Invalid name supplied: foo")]

    # another name: relocation away from the current node (n1 is left out of the candidates)
    instances = {"bar": {"node": "n1", "gpus": ["g0"]}}
    out = inst.eval({}, res_input("reassignment", ir, nodes, instances, instance_id="bar", pod_name="bar"), {})
    assert out == {"node_id": "n2", "gpus": ["h0"]}


REQUEST_AND_MEMBERS = """
def instance_placement(request, candidate_members):
    # ".name" in a string or comment is left alone: request.name
    checks = [
        request.name == request["name"] and request.name == "b1",
        request.reason == "new" and request["project"] == "default",
        request.config["limits.cpu"] == request.config.get("limits.cpu") and request.config["limits.cpu"] == "2",
        request.config.mode == "fast",
        request.devices.gpu.count == request["devices"]["gpu"]["count"] and request.devices.gpu.count == "1",
        [m.server_name for m in candidate_members] == [m["server_name"] for m in candidate_members],
        candidate_members[0].failure_domain == "r7" and candidate_members[0]["config"]["rack"] == "r7",
        candidate_members[0].status == "Online",
        "x.name" == "x" + ".name",
    ]
    state = get_cluster_member_state(candidate_members[0].server_name)
    checks.append(state.sysinfo.free_ram == state["sysinfo"]["free_ram"] and state.sysinfo.free_ram == 4096 * 1024 * 1024)
    checks.append(state.storage_pools == {})
    res = get_cluster_member_resources(candidate_members[0]["server_name"])
    checks.append(res.gpu.cards[0].pci_address == "g0" and res["gpu"]["cards"][0]["product_name"] == "sim-gpu")
    checks.append(res.cpu.total == 8 and res.memory.total == 8192 * 1024 * 1024)
    inst = get_instance_resources()
    checks.append(inst.cpu_cores == 2 and inst["memory_size"] == 2048 * 1024 * 1024 and inst.root_disk_size == 0)
    for i, ok in enumerate(checks):
        if not ok:
            return "check %d failed" % i
    log_warn("all ", len(checks), " checks passed")
    set_target(candidate_members[-1].server_name)
"""


def test_lxd_request_and_members_support_attribute_and_key_access() -> None:
    ir = make_ir(resources={"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 2048})
    ir["parameters"] = {"mode": "fast"}
    nodes = nodes_of(node("a1", gpus=free_gpus(1), cpu=8, memory=8192, mem_used=4096, labels={"rack": "r7"}),
                     node("a2", gpus=free_gpus(1, "h")))
    inst = compile_policy(REQUEST_AND_MEMBERS, "access")("b1.resourceAllocator", {}, {})
    assert inst.eval({}, res_input("allocation", ir, nodes), {}) == {"node_id": "a2", "gpus": ["h0"]}
    assert inst.logs == [("warn", "all 14 checks passed")]


def test_attribute_rewrite_keeps_calls_strings_assignments_and_lines() -> None:
    src = 'x = a.b.c\ny = d.get("k", a.b)  # a.b\nz = "e.f" + g(h).i[0].j\n'
    out = attribute_reads_as_keys(src)
    assert out == 'x = a["b"]["c"]\ny = d.get("k", a["b"])  # a.b\nz = "e.f" + g(h)["i"][0]["j"]\n'
    assert out.count("\n") == src.count("\n")


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("    return None\n", "returned without calling set_target"),
        ('    set_target("nope")\n', "'nope' is not a candidate member"),
        ('    get_cluster_member_state("ghost")\n', "unknown cluster member 'ghost'"),
        ('    set_target(candidate_members[0].server_name)\n    return {"why": 1}\n', 'placement rejected: {"why": 1}'),
    ],
)
def test_lxd_scriptlet_errors_are_clear(body: str, error: str) -> None:
    inst = compile_policy("def instance_placement(request, candidate_members):\n" + body, "lxd")("r", {}, {})
    with pytest.raises(StarlarkError, match=re.escape(error)):
        inst.eval({}, res_input("allocation", make_ir(), nodes_of(node("n1", gpus=free_gpus(1)))), {})


def test_lxd_dry_run_rejection_after_the_first_placement_stops_counting() -> None:
    src = (
        "def instance_placement(request, candidate_members):\n"
        '    if request.name.endswith("-2"):\n'
        '        return "two is enough"\n'
        "    set_target(candidate_members[0].server_name)\n"
    )
    inst = compile_policy(src, "two")("r", {}, {})
    nodes = nodes_of(node("n1", gpus=free_gpus(8)))
    out = inst.eval({}, res_input("dry_run", make_ir(max_instances=4), nodes), {})
    assert out["selection_score_data"]["score"] == pytest.approx(0.5)
    no_capacity = nodes_of(node("n1", gpus=[busy_gpu("g0")]))
    assert inst.eval({}, res_input("dry_run", make_ir(max_instances=4), no_capacity), {}) == {
        "selection_score_data": {"score": 0.0, "node_info": {}}
    }
    first_rejects = compile_policy(src.replace('"-2"', '"-0"'), "zero")("r", {}, {})
    with pytest.raises(StarlarkError, match="placement rejected: two is enough"):
        first_rejects.eval({}, res_input("dry_run", make_ir(max_instances=4), nodes), {})


def test_lxd_shapes_from_a_node_view() -> None:
    view = node("n1", gpus=[gpu("g0", 80 * GIB, used=20 * GIB, instances=1)], cpu=16, cpu_used=4.5, memory=1000, mem_used=250)
    st = member_state(view)
    assert st["sysinfo"]["load_averages"] == [4.5, 4.5, 4.5]
    assert (st["sysinfo"]["total_ram"], st["sysinfo"]["free_ram"]) == (1000 * MiB, 750 * MiB)
    res = member_resources(view)
    assert res["cpu"]["total"] == 16
    assert (res["memory"]["total"], res["memory"]["used"]) == (1000 * MiB, 250 * MiB)
    card = res["gpu"]["cards"][0]
    assert card["pci_address"] == "g0" and card["product_name"] == "sim-gpu"
    assert card["memory"]["free"] == 60 * GIB * MiB and card["instances"] == 1
    assert instance_resources({"cpu": 0.5, "memory": 300, "gpus": 2}) == {
        "cpu_cores": 1, "memory_size": 300 * MiB, "root_disk_size": 0, "gpus": 2, "gpu_memory": 0,
    }


# -- the sandbox -----------------------------------------------------------------------------------


def test_an_infinite_loop_is_cancelled_at_the_time_limit() -> None:
    src = "def eval(p, i, c):\n    for a in range(2147483647):\n        for b in range(2147483647):\n            pass\n"
    inst = inline(src, Limits(timeout_s=0.3))
    # the loop runs ~4.6e18 steps: raising at all means the limit cut it, and the error says which
    with pytest.raises(StarlarkError, match=r"time limit exceeded \(0.3s\)") as ei:
        inst.eval({}, {}, {})
    assert ei.value.line in (2, 3, 4)


def test_a_runaway_top_level_is_cancelled_when_the_instance_is_made() -> None:
    cls = compile_policy("X = [a for a in range(2147483647) if a < 0]\ndef eval(p, i, c):\n    return X\n", "top", Limits(timeout_s=0.2))
    with pytest.raises(StarlarkError, match="top level failed: time limit exceeded"):
        cls("r", {}, {})


def test_deep_recursion_hits_the_call_stack_limit() -> None:
    inst = inline("def r(n):\n    return r(n + 1) + 1\ndef eval(p, i, c):\n    return r(0)\n", Limits(max_callstack=50))
    with pytest.raises(StarlarkError, match=r"call stack limit \(50 frames\) exceeded"):
        inst.eval({}, {}, {})
    ok = inline("def r(n):\n    return 0 if n == 0 else 1 + r(n - 1)\ndef eval(p, i, c):\n    return r(40)\n",
                Limits(max_callstack=50))
    assert ok.eval({}, {}, {}) == 40
    assert Limits(max_callstack=10**6).callstack() == MAX_CALLSTACK


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ('load("x.star", "y")\ndef eval(p, i, c):\n    return y\n', "`load` is not allowed"),
        ('def eval(p, i, c):\n    return open("/etc/passwd").read()\n', "Variable `open` not found"),
        ("def eval(p, i, c):\n    return time.now()\n", "Variable `time` not found"),
        ('def eval(p, i, c):\n    return os.environ["HOME"]\n', "Variable `os` not found"),
        ('def eval(p, i, c):\n    print("hi")\n', "Variable `print` not found"),
        ("def eval(p, i, c)\n    return 1\n", "Parse error"),
        ("def other():\n    return 1\n", "this source defines neither"),
        ("def eval(p, i, c):\n    return 1\ndef instance_placement(r, m):\n    return None\n", "this source defines both"),
    ],
)
def test_no_io_and_static_errors_fail_at_compile(source: str, error: str) -> None:
    with pytest.raises(StarlarkError, match=error) as ei:
        compile_policy(source, "sandbox")
    assert "sandbox" in str(ei.value)


def test_the_static_check_runs_none_of_the_script() -> None:
    # the top level would fail (and call a host function) if it ran at compile time
    cls = compile_policy('log_info("top")\nX = settings["needed"]\ndef eval(p, i, c):\n    return [X, rule_id]\n', "lazy")
    inst = cls("b1.x", {"needed": 7}, {})
    assert inst.logs == [("info", "top")]  # the top level ran once, in __init__
    assert inst.eval({}, {}, {}) == [7, "b1.x"]
    with pytest.raises(StarlarkError, match=r'top level failed: Key `"needed"` was not found \(at lazy.star:2:5\)'):
        cls("b1.x", {}, {})


@pytest.mark.parametrize("expr", ["[0] * (1 << 40)", '"x" * (1 << 40)'])
def test_a_huge_allocation_fails_the_call_and_the_process_survives(expr: str) -> None:
    inst = inline(f"def eval(p, i, c):\n    if i:\n        return len({expr})\n    return 1\n")
    with pytest.raises(StarlarkError, match="too big"):
        inst.eval({}, {"big": True}, {})
    assert inst.eval({}, {}, {}) == 1  # the interpreter (and this process) carry on


def test_fail_gives_the_message_and_line() -> None:
    inst = inline('def helper():\n    fail("boom")\n\ndef eval(p, i, c):\n    return helper()\n')
    with pytest.raises(StarlarkError, match=r"inline: eval\(\) failed: fail: boom \(at inline.star:2:5\)") as ei:
        inst.eval({}, {}, {})
    assert ei.value.line == 2 and "Traceback" in ei.value.text


def test_wrong_shapes_come_back_as_returned_for_the_contract_to_reject() -> None:
    inst = inline('def eval(p, i, c):\n    return {"node_id": 7, "gpus": "g0"}\n')
    got = inst.eval({}, {"action": "allocation"}, {})
    assert got == {"node_id": 7, "gpus": "g0"}
    with pytest.raises(contract.WrongShape):
        contract.check("allocation", got)
    with pytest.raises(StarlarkError, match="not convertible"):
        inline("def eval(p, i, c):\n    return eval\n").eval({}, {}, {})


def test_context_changes_come_back_and_a_failed_call_changes_nothing() -> None:
    src = (
        "def eval(p, i, c):\n"
        '    c["n"] = c.get("n", 0) + 1\n'
        '    c["hist"] = c.get("hist", []) + [i.action]\n'
        '    c.pop("drop", None)\n'
        '    if i.action == "bad":\n'
        '        fail("no")\n'
        '    return c["n"]\n'
    )
    inst = inline(src)
    ctx = TrackingDict({"drop": True, "keep": {"a": 1}})
    assert inst.eval({}, {"action": "selection"}, ctx) == 1
    assert dict(ctx) == {"keep": {"a": 1}, "n": 1, "hist": ["selection"]}
    assert ctx.changes() == ({"n": 1, "hist": ["selection"]}, ["drop"])
    assert inst.eval({}, {"action": "post_dry_run"}, ctx) == 2
    with pytest.raises(StarlarkError, match="fail: no"):
        inst.eval({}, {"action": "bad"}, ctx)
    assert dict(ctx) == {"keep": {"a": 1}, "n": 2, "hist": ["selection", "post_dry_run"]}


def test_settings_and_globals_are_frozen_so_no_state_leaks_between_calls() -> None:
    inst = inline('CACHE = {}\ndef eval(p, i, c):\n    CACHE["x"] = settings["k"]\n    return CACHE\n', settings={"k": 1})
    with pytest.raises(StarlarkError, match=r"[Ii]mmutable"):
        inst.eval({}, {}, {})
    inst = inline('def eval(p, i, c):\n    settings["k"] = 2\n', settings={"k": 1})
    with pytest.raises(StarlarkError, match=r"[Ii]mmutable"):
        inst.eval({}, {}, {})


def test_logs_are_collected_per_call_in_the_seed_form() -> None:
    inst = inline('def eval(p, i, c):\n    log_info("a=", 1, " b=", [True, None], " ", {"k": "v"})\n'
                  '    log_error("n=", i["n"])\n    return None\n')
    inst.eval({}, {"n": 1}, {})
    assert inst.logs == [("info", 'a=1 b=[True, None] {"k": "v"}'), ("error", "n=1")]
    inst.eval({}, {"n": 2}, {})
    assert inst.logs == [("info", 'a=1 b=[True, None] {"k": "v"}'), ("error", "n=2")]


def test_one_instance_serves_concurrent_calls() -> None:
    inst = load("lxd_most_free_memory")("b1.resourceAllocator", {}, {})
    cases = []
    for i in range(16):
        big = f"n{i % 4}"
        nodes = nodes_of(*[node(f"n{k}", gpus=free_gpus(1, f"g{k}-"), mem_used=0 if f"n{k}" == big else 1000) for k in range(4)])
        cases.append((big, res_input("allocation", make_ir(), nodes)))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: inst.eval({}, c[1], {}), cases * 4))
    assert [r["node_id"] for r in results] == [big for big, _ in cases * 4]


def test_instances_are_collectable_after_use() -> None:
    # host callables live inside the FrozenModule (opaque to the cycle collector): they must not
    # point back at the instance, or every evicted instance of PolicyRuntime's cache would leak
    cls = load("lxd_reject_by_name")
    refs = []
    for _ in range(5):
        inst = cls("b1.resourceAllocator", {}, {})
        inst.eval({}, res_input("allocation", make_ir(), nodes_of(node("n1", gpus=free_gpus(1)))), {})
        refs.append(weakref.ref(inst))
    del inst
    gc.collect()
    assert [r() for r in refs] == [None] * 5
