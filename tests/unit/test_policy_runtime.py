"""PolicyRuntime: loading (builtin, module:Class, registry, files), the time limit, the shape
contract, and the context a policy sees. A failing policy fails its step with PolicyFailed only."""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.policies import contract
from aios_blocks.policies.builtin.resource import BinPackPolicy
from aios_blocks.policies.runtime import (
    BUILTINS,
    POLICY_THREADS,
    PolicyRuntime,
    TrackingDict,
    policy_class_from_source,
    registry_name,
)
from aios_blocks.schemas.errors import PolicyFailed


def src(body: str, name: str = "P") -> str:
    """A seed-shaped policy class whose eval body is ``body``."""
    return (
        f"class {name}:\n"
        "    def __init__(self, rule_id, settings, parameters):\n"
        "        self.rule_id, self.settings, self.parameters = rule_id, settings, parameters\n"
        "    def eval(self, parameters, input_data, context):\n"
        + textwrap.indent(textwrap.dedent(body), " " * 8)
        + "\n"
    )


#: A policy that "sleeps" 5 s: it waits on the event it finds in its context, which the test sets
#: once it is done, so the abandoned worker thread ends promptly instead of holding up the run.
#: (Thread mode, AIOS_PYTHON_POLICY_SANDBOX=thread: an Event does not cross into a policy process;
#: process mode's time limit: tests/unit/test_python_policy_sandbox.py.)
SLEEPER = src("context['release'].wait(5)\nreturn {'node_id': 'n1', 'gpus': []}")


class Registry:
    """An in-memory policy registry with the lookup signature the runtime expects."""

    def __init__(self) -> None:
        self.versions: dict[str, list[str]] = {}
        self.calls: list[tuple[str, int | None]] = []

    def put(self, name: str, source: str) -> int:
        self.versions.setdefault(name, []).append(source)
        return len(self.versions[name])

    async def lookup(self, name: str, version: int | None) -> dict[str, Any] | None:
        self.calls.append((name, version))
        history = self.versions.get(name)
        if not history:
            return None
        v = version if version is not None else len(history)
        if not 1 <= v <= len(history):
            return None
        return {"source": history[v - 1], "version": v, "language": "python"}


def rule(uri: str, name: str = "resourceAllocator", **kw: Any) -> dict[str, Any]:
    return {"name": name, "policyRuleURI": uri, "parameters": {}, "settings": {}, **kw}


async def failed(
    rt: PolicyRuntime, r: dict[str, Any], input_data: dict[str, Any], context: dict[str, Any] | None = None
) -> PolicyFailed:
    with pytest.raises(PolicyFailed) as info:
        await rt.invoke(r, "b1.rule", input_data, context or {})
    return info.value


# -- failures become PolicyFailed ---------------------------------------------------------------------

GOOD = {
    "selection": {"clusters": ["c1"]},
    "post_dry_run": {"cluster_id": "c1"},
    "dry_run": {"selection_score_data": {"score": 0.5, "node_info": {}}},
    "allocation": {"node_id": "n1", "gpus": ["g0"]},
    "scale": {"node_id": "n1", "gpus": []},
    "reassignment": {"node_id": "n2", "gpus": ["g1", "g2"]},
}

BAD = {
    "selection": [None, {}, {"clusters": "c1"}, {"clusters": [3]}, {"clusters": [{"name": "c1"}]}, ["c1"]],
    "post_dry_run": [None, 3, {}, {"cluster_id": 7}, {"score": 1.0}, ["c1"]],
    "dry_run": [
        None,
        {},
        {"score": 0.5},
        {"selection_score_data": {}},
        {"selection_score_data": {"score": "0.5"}},
        {"selection_score_data": {"score": True}},
        {"selection_score_data": {"score": 1.5}},
        {"selection_score_data": {"score": -0.1}},
        {"selection_score_data": {"score": float("nan")}},
        {"selection_score_data": {"score": float("inf")}},
        {"selection_score_data": {"score": 0.5, "node_info": []}},
    ],
    "allocation": [None, {}, {"node_id": ""}, {"node_id": 3}, {"node_id": "n1", "gpus": "g0"}, {"node_id": "n1", "gpus": [0]}],
    "scale": [{"gpus": ["g0"]}, {"node_id": None, "gpus": []}],
    "reassignment": [{"node_id": "n1", "gpus": [None]}, "n1"],
}


@pytest.mark.parametrize(("action", "result"), [(a, r) for a, rs in BAD.items() for r in rs])
async def test_wrong_shape_for_each_action_is_policy_failed(action: str, result: Any) -> None:
    reg = Registry()
    reg.put("p", src("return context['result']"))  # returns whatever the test puts in its context
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p"), {"action": action}, {"result": result})
    assert exc.action == action and exc.policy == "resourceAllocator"
    assert "wrong return shape" in exc.reason


@pytest.mark.parametrize(("action", "result"), list(GOOD.items()))
async def test_right_shape_for_each_action_is_returned(action: str, result: Any) -> None:
    reg = Registry()
    reg.put("p", src("return context['result']"))
    rt = PolicyRuntime(lookup=reg.lookup)
    assert await rt.invoke(rule("registry:p"), "r", {"action": action}, {"result": result}) == result


async def test_a_policy_that_raises_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", src("raise KeyError('gpus')"))
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p"), {"action": "allocation"})
    assert "raised KeyError" in exc.reason and "gpus" in exc.reason


async def test_a_policy_with_an_unknown_action_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", src("return {'node_id': 'n1'}"))
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p"), {"action": "teleport"})
    assert "unknown action" in exc.reason


async def test_a_policy_that_runs_too_long_times_out() -> None:
    """The step fails while the policy is still running: it returns only once the test releases it."""
    release, returned = threading.Event(), threading.Event()
    reg = Registry()
    reg.put("slow", src("context['release'].wait(60)\ncontext['returned'].set()\nreturn {'node_id': 'n1', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.2, python_sandbox="thread")
    try:
        exc = await failed(rt, rule("registry:slow"), {"action": "allocation"}, {"release": release, "returned": returned})
        assert "timed out" in exc.reason
        assert not returned.is_set()  # the limit freed the step; it did not wait for the policy
    finally:
        release.set()  # let the worker thread finish (the time limit frees the step, not the thread)


async def test_the_runtime_keeps_working_after_a_timeout() -> None:
    release = threading.Event()
    reg = Registry()
    reg.put("slow", SLEEPER)
    reg.put("fast", src("return {'node_id': 'fast', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.2, python_sandbox="thread")
    try:
        await failed(rt, rule("registry:slow"), {"action": "allocation"}, {"release": release})
        assert await rt.invoke(rule("registry:fast"), "r", {"action": "allocation"}) == {"node_id": "fast", "gpus": []}
    finally:
        release.set()


async def test_calls_that_overran_are_counted_and_when_they_hold_every_thread_a_new_call_says_so() -> None:
    """A Python call past its limit keeps its thread (it cannot be stopped). Found as a stranger: a
    policy spinning for ever held a worker thread with nothing said anywhere, and once such calls
    held all the pool's threads, every other Python policy call 'timed out after 5s' without
    having run. Now each overrun is counted (and logged) until its call returns, and a call that
    could not start says why."""
    import asyncio

    release = threading.Event()
    reg = Registry()
    reg.put("slow", SLEEPER)
    reg.put("fast", src("return {'node_id': 'fast', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.3, python_sandbox="thread")
    try:
        hung = await asyncio.gather(*(failed(rt, rule("registry:slow"), {"action": "allocation"}, {"release": release})
                                      for _ in range(POLICY_THREADS)))
        assert all(e.reason == "timed out after 0.3s" for e in hung), [e.reason for e in hung]
        assert all(e.no_answer for e in hung)  # its own call ran past the limit: it fails its step once
        assert rt.overrunning == POLICY_THREADS
        busy = " without starting: all 16 policy threads are still running calls that overran their time limit (16)"
        exc = await failed(rt, rule("registry:fast"), {"action": "allocation"})  # its constructor cannot run
        assert exc.reason.startswith("loading timed out after 0.3s" + busy), exc.reason
        assert (exc.kind, exc.no_answer) == ("unavailable", False)  # others' overruns: a step asked again may run it
        exc = await failed(rt, rule("registry:slow"), {"action": "allocation"}, {"release": release})  # built: its eval
        assert exc.reason.startswith("timed out after 0.3s" + busy), exc.reason
        assert (exc.kind, exc.no_answer) == ("unavailable", False)  # never started: not this call's answer
    finally:
        release.set()
    for _ in range(100):  # the overrunning calls return once released: the count goes back to 0
        if rt.overrunning == 0:
            break
        await asyncio.sleep(0.05)
    assert rt.overrunning == 0
    assert await rt.invoke(rule("registry:fast"), "r", {"action": "allocation"}) == {"node_id": "fast", "gpus": []}


@pytest.mark.parametrize(
    "uri",
    ["registry:missing", "nope.module:Cls", "builtin:nonexistent", "plain-name", "registry:p@notanumber", "missing.py"],
)
async def test_an_unloadable_policy_is_policy_failed(uri: str) -> None:
    reg = Registry()
    reg.put("p", src("return {}"))
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule(uri), {"action": "allocation"})
    assert "cannot load" in exc.reason


async def test_registry_uri_without_a_registry_is_policy_failed() -> None:
    exc = await failed(PolicyRuntime(), rule("registry:p"), {"action": "allocation"})
    assert "no policy registry" in exc.reason


@pytest.mark.parametrize(
    "source",
    [
        "class P:\n    pass\n",  # no eval
        src("return 1", "A") + "\n" + src("return 2", "B"),  # two candidates
        "this is not python",
        "raise RuntimeError('at import')\n",
    ],
)
async def test_bad_sources_are_policy_failed(source: str) -> None:
    reg = Registry()
    reg.put("p", source)
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p"), {"action": "allocation"})
    assert "cannot load" in exc.reason


async def test_non_python_registry_entries_are_refused() -> None:
    async def lookup(name: str, version: int | None) -> dict[str, Any]:
        return {"source": "package p", "version": 1, "language": "rego"}

    exc = await failed(PolicyRuntime(lookup=lookup), rule("registry:p"), {"action": "allocation"})
    assert "rego" in exc.reason


async def test_a_constructor_that_raises_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", "class P:\n    def __init__(self, r, s, p):\n        raise ValueError('bad settings')\n    def eval(self, p, i, c):\n        return None\n")
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p"), {"action": "allocation"})
    assert "bad settings" in exc.reason


async def test_a_policy_calling_sys_exit_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", "import sys\n" + src("sys.exit(3)"))
    rt = PolicyRuntime(lookup=reg.lookup)
    try:
        await rt.invoke(rule("registry:p"), "r", {"action": "allocation"})
    except PolicyFailed:
        return
    except BaseException as exc:
        pytest.fail(f"{type(exc).__name__} escaped invoke")
    pytest.fail("no error raised")


async def test_a_huge_integer_score_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", src("return {'selection_score_data': {'score': 10 ** 400}}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    try:
        await rt.invoke(rule("registry:p"), "r", {"action": "dry_run"})
    except PolicyFailed as exc:
        assert "wrong return shape" in exc.reason
        return
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__} escaped invoke")
    pytest.fail("no error raised")


async def test_a_slow_constructor_is_time_limited() -> None:
    """The step fails while the constructor still runs (it ends only once the test releases it)."""
    release, built = threading.Event(), threading.Event()
    reg = Registry()
    reg.put("p", "class P:\n    def __init__(self, r, s, p):\n        s['release'].wait(60)\n        s['built'].set()\n"
                 "    def eval(self, p, i, c):\n        return {'node_id': 'n1', 'gpus': []}\n")
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.1, python_sandbox="thread")
    try:
        with pytest.raises(PolicyFailed, match="timed out"):
            await rt.invoke(rule("registry:p", settings={"release": release, "built": built}), "r", {"action": "allocation"})
        assert not built.is_set()
    finally:
        release.set()


# -- arguments, instances and context --------------------------------------------------------------


async def test_policy_receives_the_seed_arguments() -> None:
    reg = Registry()
    reg.put(
        "p",
        src(
            """
            context['seen'] = {'rule_id': self.rule_id, 'settings': self.settings,
                               'init_parameters': self.parameters, 'parameters': parameters,
                               'input': input_data}
            return {'node_id': 'n1', 'gpus': []}
            """
        ),
    )
    ctx: dict[str, Any] = {}
    r = rule("registry:p", parameters={"k": 1}, settings={"gpuSharing": True})
    await PolicyRuntime(lookup=reg.lookup).invoke(r, "b9.resourceAllocator", {"action": "scale", "payload": {"x": 2}}, ctx)
    assert ctx["seen"] == {
        "rule_id": "b9.resourceAllocator",
        "settings": {"gpuSharing": True},
        "init_parameters": {"k": 1},
        "parameters": {"k": 1},
        "input": {"action": "scale", "payload": {"x": 2}},
    }


async def test_instances_are_reused_per_rule_and_settings() -> None:
    reg = Registry()
    reg.put(
        "counter",
        src(
            """
            self.n = getattr(self, 'n', 0) + 1
            return {'node_id': f'n{self.n}', 'gpus': []}
            """
        ),
    )
    rt = PolicyRuntime(lookup=reg.lookup)
    r = rule("registry:counter")
    got = [(await rt.invoke(r, "b1.r", {"action": "allocation"}))["node_id"] for _ in range(3)]
    assert got == ["n1", "n2", "n3"]
    # another rule id or other settings get their own instance
    assert (await rt.invoke(r, "b2.r", {"action": "allocation"}))["node_id"] == "n1"
    other = rule("registry:counter", settings={"x": 1})
    assert (await rt.invoke(other, "b1.r", {"action": "allocation"}))["node_id"] == "n1"


async def test_the_instance_cache_is_bounded_and_least_recently_used() -> None:
    reg = Registry()
    reg.put("counter", src("self.n = getattr(self, 'n', 0) + 1\nreturn {'node_id': f'n{self.n}', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup, max_instances=2)
    r = rule("registry:counter")

    async def call(rule_id: str) -> str:
        return (await rt.invoke(r, rule_id, {"action": "allocation"}))["node_id"]

    assert [await call("a"), await call("a"), await call("b")] == ["n1", "n2", "n1"]
    assert await call("a") == "n3"  # a is now the most recently used
    assert await call("c") == "n1"  # evicts b, the least recently used
    assert await call("a") == "n4"  # a survived
    assert await call("b") == "n1"  # b was evicted: a fresh instance


async def test_builtin_uris_resolve_to_the_builtin_classes() -> None:
    rt = PolicyRuntime()
    for uri, cls in BUILTINS.items():
        got, name, version = await rt.resolve(uri)
        assert (got, name, version) == (cls, uri, None)


async def test_module_class_uris_are_imported() -> None:
    cls, name, version = await PolicyRuntime().resolve("aios_blocks.policies.builtin.resource:BinPackPolicy")
    assert cls is BinPackPolicy and version is None


async def test_context_is_the_callers_dict_and_changes_are_visible() -> None:
    reg = Registry()
    reg.put("p", src("context['calls'] = context.get('calls', 0) + 1\ncontext.pop('old', None)\nreturn {'clusters': []}"))
    ctx = TrackingDict({"calls": 4, "old": "x", "keep": [1]})
    await PolicyRuntime(lookup=reg.lookup).invoke(rule("registry:p"), "r", {"action": "selection"}, ctx)
    assert ctx.changes() == ({"calls": 5}, ["old"])


# -- registry lookup, versions, forget ----------------------------------------------------------------


async def test_registry_uri_runs_the_latest_version() -> None:
    reg = Registry()
    reg.put("p", src("return {'node_id': 'v1', 'gpus': []}"))
    reg.put("p", src("return {'node_id': 'v2', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    assert (await rt.invoke(rule("registry:p"), "r", {"action": "allocation"}))["node_id"] == "v2"
    assert reg.calls == [("p", None)]


@pytest.mark.parametrize("uri", ["p.py", "policies/p.py", "/abs/dir/p.py"])
async def test_dot_py_uris_name_the_registry_entry_by_stem(uri: str) -> None:
    reg = Registry()
    reg.put("p", src("return {'node_id': 'from-registry', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    assert (await rt.invoke(rule(uri), "r", {"action": "allocation"}))["node_id"] == "from-registry"
    assert reg.calls == [("p", None)]


async def test_pinned_versions_in_the_uri_and_in_the_rule() -> None:
    reg = Registry()
    for v in (1, 2, 3):
        reg.put("p", src(f"return {{'node_id': 'v{v}', 'gpus': []}}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    assert (await rt.invoke(rule("registry:p@1"), "r", {"action": "allocation"}))["node_id"] == "v1"
    assert (await rt.invoke(rule("registry:p", version=2), "r", {"action": "allocation"}))["node_id"] == "v2"
    # the version in the URI wins over the rule's
    assert (await rt.invoke(rule("registry:p@1", version=3), "r", {"action": "allocation"}))["node_id"] == "v1"
    assert ("p", 1) in reg.calls and ("p", 2) in reg.calls and ("p", 3) not in reg.calls


async def test_a_pinned_version_is_cached_and_forget_drops_it() -> None:
    reg = Registry()
    reg.put("p", src("return {'node_id': 'old', 'gpus': []}"))
    reg.put("q", src("return {'node_id': 'q', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    r, rq = rule("registry:p@1"), rule("registry:q@1")
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "old"
    await rt.invoke(rq, "r", {"action": "allocation"})
    await rt.invoke(r, "r", {"action": "allocation"})
    assert reg.calls.count(("p", 1)) == 1  # served from the cache the second time

    reg.versions["p"][0] = src("return {'node_id': 'new', 'gpus': []}")  # the stored source changed
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "old"  # still cached
    rt.forget("p")
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "new"
    assert reg.calls.count(("p", 1)) == 2
    # forgetting p left q cached
    await rt.invoke(rq, "r", {"action": "allocation"})
    assert reg.calls.count(("q", 1)) == 1


async def test_forget_drops_policy_instances_and_their_state() -> None:
    reg = Registry()
    reg.put("p", src("self.n = getattr(self, 'n', 0) + 1\nreturn {'node_id': f'n{self.n}', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    r = rule("registry:p@1")
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "n1"
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "n2"
    rt.forget("p")
    assert (await rt.invoke(r, "r", {"action": "allocation"}))["node_id"] == "n1"


async def test_unpinned_rules_pick_up_a_new_version_on_the_next_call() -> None:
    reg = Registry()
    reg.put("p", src("return {'node_id': 'v1', 'gpus': []}"))
    rt = PolicyRuntime(lookup=reg.lookup)
    assert (await rt.invoke(rule("registry:p"), "r", {"action": "allocation"}))["node_id"] == "v1"
    reg.put("p", src("return {'node_id': 'v2', 'gpus': []}"))
    assert (await rt.invoke(rule("registry:p"), "r", {"action": "allocation"}))["node_id"] == "v2"
    assert reg.calls == [("p", None), ("p", None)]


async def test_pinned_version_missing_from_the_registry_is_policy_failed() -> None:
    reg = Registry()
    reg.put("p", src("return {}"))
    exc = await failed(PolicyRuntime(lookup=reg.lookup), rule("registry:p@7"), {"action": "allocation"})
    assert "version 7" in exc.reason


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("registry:p", ("p", None)),
        ("registry:p@12", ("p", 12)),
        ("p.py", ("p", None)),
        ("a/b/my_rule.py", ("my_rule", None)),
        ("builtin:binpack", None),
        ("pkg.mod:Cls", None),
    ],
)
def test_registry_name(uri: str, expected: tuple[str, int | None] | None) -> None:
    assert registry_name(uri) == expected


async def test_files_are_read_only_when_allowed(tmp_path: Path) -> None:
    path = tmp_path / "local_rule.py"
    path.write_text(src("return {'node_id': 'from-file', 'gpus': []}"))
    reg = Registry()
    reg.put("local_rule", src("return {'node_id': 'from-registry', 'gpus': []}"))
    r = rule(str(path))
    assert (await PolicyRuntime(allow_files=True).invoke(r, "r", {"action": "allocation"}))["node_id"] == "from-file"
    got = await PolicyRuntime(lookup=reg.lookup).invoke(r, "r", {"action": "allocation"})
    assert got["node_id"] == "from-registry"


# -- policy_class_from_source -----------------------------------------------------------------------


def test_policy_class_from_source_returns_the_one_eval_class() -> None:
    source = "import json\nclass Helper:\n    pass\n" + src("return {}", "Rule")
    cls = policy_class_from_source(source, "label.py")
    assert cls.__name__ == "Rule"
    assert cls("r", {"s": 1}, {"p": 2}).eval({}, {}, {}) == {}


def test_policy_class_from_source_ignores_imported_classes() -> None:
    source = "from collections import OrderedDict\n" + src("return {}", "Rule")
    assert policy_class_from_source(source, "x").__name__ == "Rule"


@pytest.mark.parametrize("source", ["x = 1\n", src("return 1", "A") + src("return 2", "B")])
def test_policy_class_from_source_needs_exactly_one_class(source: str) -> None:
    with pytest.raises(ValueError, match="exactly one class"):
        policy_class_from_source(source, "label")


# -- TrackingDict -----------------------------------------------------------------------------------


def test_tracking_dict_reports_nothing_when_untouched() -> None:
    d = TrackingDict({"a": 1, "b": {"x": [1, 2]}})
    d["a"] = 1  # same value written back
    assert d.changes() == ({}, [])


def test_tracking_dict_reports_new_changed_and_nested_changes() -> None:
    d = TrackingDict({"a": 1, "b": {"x": [1, 2]}, "c": "same"})
    d["a"] = 2
    d["b"]["x"].append(3)  # in-place change of a nested value
    d["new"] = {"k": "v"}
    changed, deleted = d.changes()
    assert changed == {"a": 2, "b": {"x": [1, 2, 3]}, "new": {"k": "v"}}
    assert deleted == []


def test_tracking_dict_reports_deletions() -> None:
    d = TrackingDict({"a": 1, "b": 2, "c": 3})
    del d["a"]
    d.pop("c")
    d["fresh"] = 0
    changed, deleted = d.changes()
    assert sorted(deleted) == ["a", "c"]
    assert changed == {"fresh": 0}


def test_tracking_dict_delete_then_readd_same_value_is_no_change() -> None:
    d = TrackingDict({"a": 1})
    del d["a"]
    d["a"] = 1
    assert d.changes() == ({}, [])


def test_tracking_dict_does_not_alias_the_source() -> None:
    src_dict = {"a": 1}
    d = TrackingDict(src_dict)
    d["a"] = 5
    assert src_dict == {"a": 1}


# -- contract.check -----------------------------------------------------------------------------------


MORE_GOOD = [
    ("selection", {"clusters": []}),
    ("selection", {"clusters": [{"cluster_id": "c1"}, {"id": "c2"}, "c3"]}),
    ("post_dry_run", "c1"),
    ("post_dry_run", {"id": "c1", "score_data": {"score": 1}}),
    ("dry_run", {"selection_score_data": {"score": 0}}),
    ("dry_run", {"selection_score_data": {"score": 1, "node_info": {"node_id": "n1", "gpus": ["g0"]}}}),
    ("allocation", {"node_id": "n1"}),
]


@pytest.mark.parametrize(("action", "result"), [*GOOD.items(), *MORE_GOOD])
def test_contract_accepts_good_shapes(action: str, result: Any) -> None:
    contract.check(action, result)


@pytest.mark.parametrize(("action", "result"), [(a, r) for a, rs in BAD.items() for r in rs])
def test_contract_rejects_bad_shapes(action: str, result: Any) -> None:
    with pytest.raises(contract.WrongShape):
        contract.check(action, result)


@pytest.mark.parametrize("action", ["", "dryrun", "post dry run", "assignment"])
def test_contract_rejects_unknown_actions(action: str) -> None:
    with pytest.raises(contract.WrongShape, match="unknown action"):
        contract.check(action, {"node_id": "n1", "gpus": []})


def test_contract_messages_are_short_for_huge_results() -> None:
    with pytest.raises(contract.WrongShape) as info:
        contract.check("selection", {"other": "x" * 10_000})
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(("entry", "cid"), [("c1", "c1"), ({"cluster_id": "c2"}, "c2"), ({"id": "c3"}, "c3"),
                                            ({"cluster_id": "a", "id": "b"}, "a")])
def test_cluster_id_of(entry: Any, cid: str) -> None:
    assert contract.cluster_id_of(entry) == cid


async def test_an_unknown_builtin_fails_by_name_not_as_a_missing_module() -> None:
    """A component stored before the parser refused `builtin:binpak` must not fail with
    "No module named 'builtin'" (the URI is not a module:Class)."""
    with pytest.raises(ValueError, match=r"unknown built-in policy 'builtin:binpak'; the built-ins are builtin:best-fit, builtin:binpack"):
        await PolicyRuntime().resolve("builtin:binpak")


async def test_a_shareable_builtin_is_built_once_for_every_block_and_a_stateful_one_per_block() -> None:
    """Workers call a policy under the rule id ``{blockId}.{kind}``: the built-in
    resourceAllocators (``shareable``: what they keep derives from settings and parameters) are
    built once for all blocks, as ``blocks trace replay --in-process`` uses them; the other
    built-ins (an autoscaler may keep a block's own figures) and user code stay one per block."""
    rt = PolicyRuntime(lookup=None)
    fgd = {"name": "resourceAllocator", "policyRuleURI": "builtin:fgd-plus",
           "parameters": {"workload": [{"cpu": 4, "gpus": 1, "weight": 1}]}}
    a, _, _ = await rt.instance(fgd, "b1.resourceAllocator")
    b, _, _ = await rt.instance(fgd, "b2.resourceAllocator")
    assert a is b
    other, _, _ = await rt.instance({**fgd, "parameters": {"workload": [{"cpu": 8, "gpus": 2, "weight": 1}]}}, "b3.resourceAllocator")
    assert other is not a  # other parameters, another instance
    assert all(getattr(BUILTINS[uri], "shareable", False) for uri in ("builtin:binpack", "builtin:spread", "builtin:fgd"))
    rr = {"name": "loadBalancer", "policyRuleURI": "builtin:round-robin"}  # its turn is the block's own
    x, _, _ = await rt.instance(rr, "b1.loadBalancer")
    y, _, _ = await rt.instance(rr, "b2.loadBalancer")
    assert x is not y and (await rt.instance(rr, "b1.loadBalancer"))[0] is x
