"""User Python policies in child processes (AIOS_PYTHON_POLICY_SANDBOX=process, the default): a
call past its limit is stopped (its process killed and replaced), one that kills its own process
fails its step only, and the worker's next calls run. In threads, such a call spun for ever: its
thread (and a share of the GIL) was lost until the worker restarted, and 16 of them stopped every
Python policy of that worker (tests/unit/test_policy_runtime.py keeps thread mode's own tests)."""

from __future__ import annotations

import concurrent.futures
import operator
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aios_blocks.policies import sandbox
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.errors import PolicyFailed

from .test_policy_runtime import Registry, rule, src

PID = "import os\n" + src("if input_data.get('spin'):\n    while True:\n        pass\nreturn {'node_id': str(os.getpid()), 'gpus': []}")
GOOD = src("print('placing', input_data['payload'])\nreturn {'node_id': 'n1', 'gpus': []}")


@pytest.fixture
def pool() -> Iterator[sandbox.SandboxPool]:
    """A fresh ``python`` pool of 2 processes for the test (the worker's is shared)."""
    p = sandbox.SandboxPool(workers=2, memory_mb=0, what="policy")
    before = sandbox._shared.get("python")
    sandbox._shared["python"] = p
    try:
        yield p
    finally:
        p.close()
        if before is None:
            sandbox._shared.pop("python", None)
        else:
            sandbox._shared["python"] = before


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()


async def call(rt: PolicyRuntime, name: str, rule_id: str = "b1.r", **inp: Any) -> Any:
    return await rt.invoke(rule(f"registry:{name}"), rule_id, {"action": "allocation", **inp}, {})


async def fails(rt: PolicyRuntime, name: str, rule_id: str = "b1.r", **inp: Any) -> PolicyFailed:
    with pytest.raises(PolicyFailed) as info:
        await call(rt, name, rule_id, **inp)
    return info.value


async def test_a_spinning_policy_is_stopped_at_its_limit_and_its_process_is_gone(pool: sandbox.SandboxPool) -> None:
    reg = Registry()
    reg.put("spin", PID)
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.5)
    assert rt.python_sandbox == "process"  # the default
    pid = int((await call(rt, "spin"))["node_id"])
    assert pid != os.getpid() and pid in pool.pids()
    exc = await fails(rt, "spin", spin=True)
    assert exc.reason == "timed out after 0.5s (its process was stopped)"
    assert (exc.kind, exc.no_answer) == ("timed_out", True)
    assert rt.overrunning == 0
    assert not alive(pid) and pid not in pool.pids()  # the CPU it held is free: no process runs it
    again = int((await call(rt, "spin"))["node_id"])  # the same instance, built again in a new process
    assert again != pid and again in pool.pids()


async def test_after_twenty_runaway_calls_a_normal_call_still_runs(pool: sandbox.SandboxPool) -> None:
    reg = Registry()
    reg.put("spin", PID)
    reg.put("good", GOOD)
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.25)
    for i in range(21):  # more runaways than the thread pool's 16 threads
        exc = await fails(rt, "spin", f"b{i}.r", spin=True)
        assert exc.kind == "timed_out", exc.reason
    assert rt.overrunning == 0 and len(pool.pids()) <= pool.workers
    trace: dict[str, Any] = {}
    got = await rt.invoke(rule("registry:good"), "g.r", {"action": "allocation", "payload": 7}, {}, trace)
    assert got == {"node_id": "n1", "gpus": []}
    assert trace["logs"] == [["print", "placing 7"]]  # its print lines still come back


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("os._exit(3)", "its process died (exit code 3)"),
        ("import ctypes\nctypes.string_at(0)", "its process died (signal SIGSEGV)"),
    ],
)
async def test_a_policy_that_kills_its_process_fails_its_step_only(pool: sandbox.SandboxPool, body: str, reason: str) -> None:
    reg = Registry()
    reg.put("die", "import os\n" + src(body))
    reg.put("good", GOOD)
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=5)
    exc = await fails(rt, "die")
    assert exc.reason == reason and exc.kind == "raised"
    assert await call(rt, "good", payload=1) == {"node_id": "n1", "gpus": []}
    exc = await fails(rt, "die")  # built again in the new process, and dies again
    assert exc.reason == reason


async def test_the_source_runs_in_no_worker_thread(pool: sandbox.SandboxPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A top level that spins is stopped when the source is checked; the worker's thread is free."""
    monkeypatch.setattr(sandbox, "LOAD_TIMEOUT_FLOOR_S", 0.4)  # (a build's own floor: the next test)
    reg = Registry()
    reg.put("top", "while True:\n    pass\n" + src("return {}"))
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.4)
    exc = await fails(rt, "top")
    assert exc.reason == "cannot load 'registry:top': SandboxTimeout: timed out after 0.4s (its process was stopped)"
    assert exc.kind == "load" and rt.overrunning == 0
    assert len(pool.pids()) <= pool.workers  # the one that ran it was replaced, not added to


async def test_a_build_has_more_time_than_a_short_call_limit(pool: sandbox.SandboxPool) -> None:
    """A build (the source compiled, ``__init__``) may wait for its process to start and import:
    with a short call limit (0.2 s) a busy machine failed the load ("cannot load ...
    SandboxTimeout", kind load). Builds get ``LOAD_TIMEOUT_FLOOR_S``; calls keep their limit."""
    slow_init = ("import time\nclass P:\n    def __init__(self, rule_id, settings, parameters):\n"
                 "        time.sleep(0.6)\n    def eval(self, parameters, input_data, context):\n"
                 "        if input_data.get('spin'):\n            time.sleep(2)\n        return {'node_id': 'n1', 'gpus': []}\n")
    reg = Registry()
    reg.put("slowinit", slow_init)
    rt = PolicyRuntime(lookup=reg.lookup, timeout_s=0.2)
    assert await call(rt, "slowinit", payload=1) == {"node_id": "n1", "gpus": []}
    exc = await fails(rt, "slowinit", spin=True)
    assert exc.kind == "timed_out" and "timed out after 0.2s" in exc.reason, exc


async def test_raised_wrong_shape_and_unreadable_results_keep_their_kinds(pool: sandbox.SandboxPool) -> None:
    reg = Registry()
    reg.put("boom", src("print('before')\nraise KeyError('gpus')"))
    reg.put("self", src("return self"))
    reg.put("exit", "import sys\n" + src("sys.exit(3)"))
    rt = PolicyRuntime(lookup=reg.lookup)
    trace: dict[str, Any] = {}
    with pytest.raises(PolicyFailed) as info:
        await rt.invoke(rule("registry:boom"), "r", {"action": "allocation"}, {}, trace)
    assert (info.value.reason, info.value.kind) == ("raised KeyError: 'gpus'", "raised")
    assert trace["logs"] == [["print", "before"]]
    exc = await fails(rt, "self")
    assert exc.kind == "wrong_shape" and exc.reason.startswith("unreadable result: "), exc.reason
    exc = await fails(rt, "exit")
    assert (exc.reason, exc.kind) == ("raised SystemExit: 3", "raised")


async def test_an_input_that_cannot_be_sent_to_its_process_is_wrong_input_not_a_raise(pool: sandbox.SandboxPool, tmp_path: Any) -> None:
    """An input the sandbox cannot pickle never reached the policy: it read as the policy having
    ``raised`` a bare ``TypeError: cannot pickle '_thread.lock' object``. It is ``wrong_input``
    (not ``no_answer``: the step is asked again, as a call that never ran is), naming the part
    that could not be sent; the policy's process is untouched and its next call runs."""
    reg = Registry()
    reg.put("good", GOOD)
    rt = PolicyRuntime(lookup=reg.lookup)
    assert await call(rt, "good", payload=1) == {"node_id": "n1", "gpus": []}
    pids = pool.pids()
    nodes = [{"id": "n1"}, {"id": "n2", "handle": threading.Lock()}]
    exc = await fails(rt, "good", payload={"nodes": nodes})
    assert (exc.kind, exc.no_answer) == ("wrong_input", False), (exc.kind, exc.reason)
    assert exc.reason == ("input_data['payload']['nodes'][1]['handle'] cannot be sent to its process: "
                          "TypeError: cannot pickle '_thread.lock' object")
    assert await call(rt, "good", payload=2) == {"node_id": "n1", "gpus": []}
    assert pool.pids() == pids
    # a Starlark scriptlet's process alike (its own pool of one process: processes=1)
    star = tmp_path / "first.star"
    star.write_text("def eval(parameters, input_data, context):\n    return {'node_id': 'n1', 'gpus': []}\n")
    own = PolicyRuntime(allow_files=True, processes=1)
    try:
        with pytest.raises(PolicyFailed) as info:
            await own.invoke(rule(str(star)), "r", {"action": "allocation", "payload": {"handle": threading.Lock()}}, {})
        assert info.value.kind == "wrong_input" and info.value.reason.startswith(
            "input_data['payload']['handle'] cannot be sent to its process: TypeError: cannot pickle"), info.value.reason
        assert await own.invoke(rule(str(star)), "r", {"action": "allocation"}, {}) == {"node_id": "n1", "gpus": []}
    finally:
        own.close()


def test_a_call_stopped_for_another_calls_overrun_runs_again_in_the_new_process() -> None:
    p = sandbox.SandboxPool(workers=1, memory_mb=0, what="policy")
    try:
        assert p.run(operator.add, (1, 2), 30) == 3  # started
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            slow = ex.submit(p.run, time.sleep, (60,), 1.0)
            time.sleep(0.2)
            queued = ex.submit(p.run, operator.add, (2, 3), 30)  # behind the sleeper, in its process
            with pytest.raises(sandbox.SandboxTimeout, match=r"timed out after 1s \(its process was stopped\)"):
                slow.result()
            assert queued.result() == 5
    finally:
        p.close()


def test_a_call_that_never_started_is_busy_and_stops_nothing() -> None:
    p = sandbox.SandboxPool(workers=1, memory_mb=0, what="policy", start_allowance_s=0.2)
    try:
        assert p.run(operator.add, (1, 2), 30) == 3
        pid = p.pids()[0]
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            slow = ex.submit(p.run, time.sleep, (1.5,), 30)
            time.sleep(0.2)
            with pytest.raises(sandbox.SandboxBusy, match="without starting: its policy process was busy"):
                p.run(operator.add, (2, 3), 0.3)
            assert slow.result() is None
        assert p.pids() == [pid]
    finally:
        p.close()


def test_a_call_given_up_before_it_started_is_still_stopped_at_its_limit() -> None:
    """Next in its process's queue it cannot be withdrawn: once it starts, its limit stops it, or
    it would hold that process (and every call routed there) for as long as it spins."""
    p = sandbox.SandboxPool(workers=1, memory_mb=0, what="policy", start_allowance_s=0.2)
    try:
        assert p.run(operator.add, (1, 2), 30) == 3
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            slow = ex.submit(p.run, time.sleep, (1.0,), 30)
            time.sleep(0.2)
            with pytest.raises(sandbox.SandboxBusy):
                p.run(time.sleep, (120,), 0.3)  # busy; it starts once the first call ends, and spins
            assert slow.result() is None
        assert p.run(operator.add, (2, 3), 5) == 5  # the sleeper was stopped: its process is free
    finally:
        p.close()


PARENT = """
import sys, time
from aios_blocks.policies import sandbox
if __name__ == "__main__":
    p = sandbox.SandboxPool(workers=1, memory_mb=0, what="policy")
    p.run(int, (), 60)
    print(p.pids()[0], flush=True)
    p.run(time.sleep, (600,), 600)
"""


def test_a_policy_process_does_not_outlive_its_worker(tmp_path: Any) -> None:
    """A worker killed (or restarted) while a call runs: its policy process exits too, rather than
    spin on with nobody to stop it."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    for _ in range(200):  # it polls its parent every second
        if not alive(child):
            break
        time.sleep(0.05)
    assert not alive(child)
