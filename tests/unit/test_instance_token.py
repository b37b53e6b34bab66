"""The token per instance (``runtime.instance_key``): its derivation, the key's file, the instance
SDK's check (a real aiohttp server), the simulated fleet's, the executor's headers, and that no
environment variable of the chain is logged or shown. The whole chain on real servers, a real
agent and a real instance: ``tests/integration/test_instance_token.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from aios_blocks.agent.sim_serve import SimBehaviour, SimServer
from aios_blocks.executor.dispatch import Task as DispatchTask
from aios_blocks.instance import Context, InstanceApp, Task, web_app
from aios_blocks.runtime import instance_key as ik
from aios_blocks.schemas.protocol import unauthorized
from aios_blocks.settings import Settings

K = "ab" * 32


def test_the_token_is_derived_from_the_node_key_which_is_derived_from_k() -> None:
    kn = ik.node_key(K, "n1")
    assert ik.token(K, "n1", "b-0") == ik.instance_token(kn, "b-0")  # the executor's == the agent's
    assert len(kn) == 64 and kn != K and ik.node_key(K, "n2") != kn and ik.node_key("cd" * 32, "n1") != kn
    tokens = {ik.token(K, n, i) for n in ("n1", "n2") for i in ("b-0", "b-1")}
    assert len(tokens) == 4 and kn not in tokens  # per node and instance; no step stands for another
    assert ik.token(K, "n1", "b-0") == ik.token(K, "n1", "b-0")  # no state: the same each time
    # no confusion between (node, instance) pairs whose texts run together
    assert ik.token(K, "n1", "1-b") != ik.token(K, "n11", "-b")


def test_the_key_file_is_made_once_0600_and_the_agent_gets_only_its_node_key(tmp_path: Path) -> None:
    assert ik.read(tmp_path) is None and ik.agent_env(tmp_path, "n1") == {} and ik.executor_env(tmp_path) == {}
    key = ik.ensure(tmp_path)
    assert len(key) == 64 and ik.ensure(tmp_path) == key == ik.read(tmp_path)
    assert ik.path(tmp_path) == tmp_path.resolve() / "auth" / "instance-key"
    assert os.stat(ik.path(tmp_path)).st_mode & 0o777 == 0o600
    assert ik.executor_env(tmp_path) == {"AIOS_INSTANCE_KEY": key}
    assert ik.agent_env(tmp_path, "n1") == {"AIOS_INSTANCE_NODE_KEY": ik.node_key(key, "n1")}


def test_the_check_is_constant_time_and_names_no_value() -> None:
    assert unauthorized("", None) == "" and unauthorized("", "x") == ""  # no own token: anyone's
    assert unauthorized("t0k", "t0k") == ""
    for got in (None, "", "t0", "t0kk", "T0K", "é"):
        why = unauthorized("t0k", got)
        assert why.startswith("unauthorized") and "t0k" not in why


def test_settings_and_context_never_show_the_keys() -> None:
    s = Settings(instance_key=K, instance_node_key="cd" * 32)
    assert K not in repr(s) and "cd" * 32 not in repr(s)
    ctx = Context.from_env({"AIOS_INSTANCE_ID": "b-0", "AIOS_INSTANCE_TOKEN": "sekrit"})
    assert ctx.token == "sekrit" and "sekrit" not in repr(ctx)
    assert Context.from_env({}).token == ""


def test_the_executor_never_passes_a_callers_token_on() -> None:
    t = DispatchTask.of("POST", "/infer", b"", {"Aios-Instance-Token": "forged", "aios-instance": "x", "X-A": "1"}, 5)
    assert t.headers == {"X-A": "1"}


async def _serve(app: InstanceApp) -> TestServer:
    server = TestServer(web_app(app))
    await server.start_server()
    return server


async def _ask(http: aiohttp.ClientSession, url: str, headers: dict[str, str], method: str = "POST") -> tuple[int, Any]:
    async with http.request(method, url, json={"n": 1}, headers=headers) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def test_the_sdk_refuses_401_unrun_without_its_token_and_keeps_health_and_metrics_open() -> None:
    ran: list[Any] = []

    async def h(task: Task, ctx: Context) -> Any:
        ran.append(task.json())
        return {"ok": True}

    token = ik.token(K, "n1", "b-0")
    app = InstanceApp(h, context=Context.from_env({"AIOS_INSTANCE_ID": "b-0", "AIOS_INSTANCE_TOKEN": token}))
    await app.start()
    server = await _serve(app)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Aios-Instance-Token": "wrong"}, {"Aios-Instance-Token": ik.token(K, "n1", "b-1")},
                            {"aios-instance-token": token[:-1]}):
                status, body = await _ask(http, f"{base}/infer", headers)
                assert status == 401 and "Aios-Instance-Token" in body["error"] and token not in json.dumps(body), headers
            assert (await _ask(http, f"{base}/other", {}, "GET"))[0] == 401  # any path but the open two
            # meant for another instance: 421 first (the executor tries another), not 401
            status, _ = await _ask(http, f"{base}/infer", {"Aios-Instance": "b-9", "Aios-Instance-Token": token})
            assert status == 421
            for path in ("/health", "/metrics"):
                assert (await _ask(http, base + path, {}, "GET"))[0] == 200, path
            assert ran == [] and app.metrics.system.requests == 0  # nothing run, nothing counted
            for name in ("Aios-Instance-Token", "aios-instance-token"):
                assert (await _ask(http, f"{base}/infer", {name: token, "Aios-Instance": "b-0"})) == (200, {"ok": True})
    finally:
        await server.close()
    assert ran == [{"n": 1}, {"n": 1}]


async def test_an_instance_without_a_token_takes_any_callers_task_as_before() -> None:
    app = InstanceApp(lambda task, ctx: {"ok": True}, context=Context.from_env({"AIOS_INSTANCE_ID": "b-0"}))
    await app.start()
    server = await _serve(app)
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Aios-Instance-Token": "anything"}):
                assert (await _ask(http, f"http://127.0.0.1:{server.port}/infer", headers))[0] == 200
    finally:
        await server.close()


async def test_a_simulated_instance_checks_its_token_as_the_sdk_does() -> None:
    server = SimServer()
    try:
        token = ik.token(K, "n1", "b-0")
        inst = await server.add("b-0", SimBehaviour(), token=token)
        open_ = await server.add("b-1", SimBehaviour())  # started without one (an older agent)
        assert token not in repr(inst)
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{inst.port}"
            for headers in ({}, {"Aios-Instance-Token": "wrong"}):
                assert (await _ask(http, f"{base}/infer", headers))[0] == 401
            assert (await _ask(http, f"{base}/infer", {"Aios-Instance": "b-9"}))[0] == 421
            for path in ("/health", "/metrics"):
                assert (await _ask(http, base + path, {}, "GET"))[0] == 200
            assert inst.metrics.requests == 0
            assert (await _ask(http, f"{base}/infer", {"Aios-Instance-Token": token}))[0] == 200
            assert (await _ask(http, f"http://127.0.0.1:{open_.port}/infer", {}))[0] == 200
    finally:
        await server.close()
