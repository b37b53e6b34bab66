"""Simulated instances that serve (agent/sim_serve.py, runtime_sim.py): real HTTP on
127.0.0.1, behaviour from the block's settings, gone when stopped, served again after a restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aios_blocks.agent.runtime import LaunchSpec
from aios_blocks.agent.runtime_sim import SimRuntime
from aios_blocks.agent.sim_serve import SimBehaviour, SimServer
from aios_blocks.instance.metrics import parse_text


def test_behaviour_comes_from_init_settings_and_parameters_parameters_win() -> None:
    b = SimBehaviour.from_env({
        "initSettings": json.dumps({"sim": {"serviceTimeMs": 20, "failureRate": 0.5, "maxConcurrency": 4}}),
        "parameters": json.dumps({"sim.serviceTimeMs": 5, "sim.failureRate": 7}),  # clamped to 1
        "inputProtocol": json.dumps({"path": "/v1/completions"}),
    })
    assert b == SimBehaviour("/v1/completions", 0.005, 0.0, 1.0, 4)
    assert SimBehaviour.from_env({"initSettings": "{bad", "parameters": '{"sim": {"serviceTimeMs": "x"}}'}) == SimBehaviour()
    # one instance of the block slower than the others (routing benchmarks), by index or by id
    params = json.dumps({"sim": {"serviceTimeMs": 10, "instances": {"0": {"serviceTimeMs": 100}, "blk-2": {"failureRate": 1}}}})
    of = {iid: SimBehaviour.from_env({"parameters": params, "AIOS_INSTANCE_ID": iid}) for iid in ("blk-0", "blk-1", "blk-2")}
    assert [of[i].service_time_s for i in sorted(of)] == [0.1, 0.01, 0.01]
    assert [of[i].failure_rate for i in sorted(of)] == [0, 0, 1]


async def test_instances_share_one_server_and_answer_by_their_own_port() -> None:
    server = SimServer()
    try:
        a = await server.add("a", SimBehaviour(service_time_s=0.01))
        b = await server.add("b", SimBehaviour(path="/run", failure_rate=1.0))
        assert a.port != b.port and await server.add("a", SimBehaviour()) is a  # idempotent per id
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{a.port}/infer", json={"q": 1}) as r:
                assert r.status == 200 and await r.json() == {"instance_id": "a", "output": {"q": 1}}
            async with http.post(f"http://127.0.0.1:{b.port}/run", json={}) as r:
                assert r.status == 500 and (await r.json())["instance_id"] == "b"
            async with http.post(f"http://127.0.0.1:{a.port}/infer", json={"stream": 3}) as r:
                assert [json.loads(line)["chunk"] async for line in r.content] == [0, 1, 2]
            async with http.get(f"http://127.0.0.1:{a.port}/health") as r:
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{b.port}/metrics") as r:
                m = parse_text(await r.text())
            assert m["aios_instance_requests_total"] == 1 and m["aios_instance_errors_total"] == 1
            assert a.metrics.requests == 2 and a.metrics.errors == 0
            assert a.metrics.latency_sum >= 0.02  # two tasks of 10 ms service time

            await server.remove("b")
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(f"http://127.0.0.1:{b.port}/health", timeout=aiohttp.ClientTimeout(total=5)):
                    pass
    finally:
        await server.close()


async def test_a_task_meant_for_another_instance_is_refused_421_unrun() -> None:
    """A port that served i-old now serves i-new: a task an executor still sends for i-old
    (Aios-Instance) is answered 421, not run, not counted."""
    server = SimServer()
    try:
        inst = await server.add("i-new", SimBehaviour())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{inst.port}/infer", json={"q": 1}, headers={"Aios-Instance": "i-old"}) as r:
                assert r.status == 421 and r.headers["Aios-Instance"] == "i-new"
                assert "not i-old" in (await r.json())["error"]
            assert inst.metrics.requests == 0
            for headers in ({"Aios-Instance": "i-new"}, {}):
                async with http.post(f"http://127.0.0.1:{inst.port}/infer", json={"q": 2}, headers=headers) as r:
                    assert r.status == 200 and await r.json() == {"instance_id": "i-new", "output": {"q": 2}}
            assert inst.metrics.requests == 2
            # an executor's scrape of the queue figures, named the same way: not the other's figures
            for path in ("/metrics", "/health"):  # and the checker's probe
                async with http.get(f"http://127.0.0.1:{inst.port}" + path, headers={"Aios-Instance": "i-old"}) as r:
                    assert r.status == 421 and "not i-old" in (await r.json())["error"], path
            async with http.get(f"http://127.0.0.1:{inst.port}/health", headers={"Aios-Instance": "i-new"}) as r:
                assert r.status == 200
            for headers in ({"Aios-Instance": "i-new"}, {}):
                async with http.get(f"http://127.0.0.1:{inst.port}/metrics", headers=headers) as r:
                    assert r.status == 200 and "aios_instance_" in await r.text()
    finally:
        await server.close()


async def test_an_instance_s_start_and_stop_go_through_no_aiohttp_site() -> None:
    """An instance is served by the event loop's server on its own socket, not by an aiohttp
    site: a site registers in the runner's list of sites, which every site's start and stop scan
    (a cost per instance that grew with the instances served: docs/trace.md "The simulated fleet's
    start"). Each instance still serves HTTP, a removed one refuses, ``close`` stops every one."""
    server = SimServer()
    try:
        insts = [await server.add(f"i{k}", SimBehaviour()) for k in range(3)]
        runner = server._runner
        assert runner is not None and runner.sites == set()  # old code: one site per instance
        assert all(i.server is not None and i.server.is_serving() for i in insts)
        async with aiohttp.ClientSession() as http:
            for i in insts:
                async with http.get(f"http://127.0.0.1:{i.port}/health") as r:
                    assert r.status == 200 and (await r.json())["instance_id"] == i.instance_id
            await server.remove("i1")
            assert not insts[1].server.is_serving()  # type: ignore[union-attr]
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(f"http://127.0.0.1:{insts[1].port}/health", timeout=aiohttp.ClientTimeout(total=5)):
                    pass
            async with http.get(f"http://127.0.0.1:{insts[2].port}/health") as r:
                assert r.status == 200
    finally:
        await server.close()
    assert not any(i.server.is_serving() for i in insts)  # type: ignore[union-attr]


async def test_any_free_port_is_bound_without_reuseaddr_a_recorded_one_with_it(monkeypatch: Any) -> None:
    """A port of its own is the kernel's bind(0) without SO_REUSEADDR: with it, Linux looks in the
    lower half of the ephemeral range only, and past ~7,000 instances of a process each bind searched
    every port (1.5-2 ms: docs/trace.md "The simulated fleet's start"). A recorded port (a restart)
    is bound again with it, so its old connections in TIME_WAIT do not block it; and every listening
    socket has it once bound (before listen), so the connections it accepts inherit it and that
    restart's bind over their TIME_WAIT succeeds (tests/integration/test_agent_restart_inventory.py)."""
    import socket

    from aios_blocks.agent import sim_serve

    at_bind: dict[int, int] = {}

    class Recording(socket.socket):
        def bind(self, address: Any) -> None:
            at_bind[address[1]] = self.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            super().bind(address)

    monkeypatch.setattr(sim_serve.socket, "socket", Recording)
    server = SimServer()
    try:
        own = await server.add("own", SimBehaviour())
        with socket.socket() as probe:  # a free port, as a restored instance's recorded one
            probe.bind(("127.0.0.1", 0))
            recorded = probe.getsockname()[1]
        again = await server.add("again", SimBehaviour(), port=recorded)
        assert again.port == recorded
        assert at_bind == {0: 0, recorded: 1}  # bind(0) without the flag, the recorded port with it
        for inst in (own, again):
            assert inst.server is not None
            (sock,) = inst.server.sockets
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) != 0, inst.instance_id
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{inst.port}/health") as r:
                assert r.status == 200
    finally:
        await server.close()


async def test_a_task_hung_on_a_stopped_instance_is_cut_after_the_grace() -> None:
    # a restarted or replaced instance's hung task kept its requester waiting for its whole time
    # limit (60 s): a stopping process's task is cut when the SIGKILL after its grace would come
    import time

    server = SimServer()
    try:
        hung = await server.add("h", SimBehaviour(service_time_s=600))
        async with aiohttp.ClientSession() as http:
            async def call() -> float:
                t0 = time.monotonic()
                with pytest.raises(aiohttp.ClientError):
                    async with http.post(f"http://127.0.0.1:{hung.port}/infer", json={}) as r:
                        await r.read()
                return time.monotonic() - t0

            task = asyncio.ensure_future(call())
            await asyncio.sleep(0.2)
            await server.remove("h", grace_s=0.3)
            assert await asyncio.wait_for(task, 10) < 10  # cut after the grace, not after 600 s
    finally:
        await server.close()


async def test_max_concurrency_makes_tasks_wait_and_reports_them_waiting() -> None:
    server = SimServer()
    try:
        inst = await server.add("q", SimBehaviour(service_time_s=0.3, max_concurrency=1))
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{inst.port}/infer"
            calls = [asyncio.create_task(http.post(url, json={})) for _ in range(3)]
            async with asyncio.timeout(5):
                while inst.metrics.waiting != 2:
                    await asyncio.sleep(0.01)
            assert inst.metrics.running == 1 and inst.metrics.kv_cache_usage == 1.0
            async with http.get(f"http://127.0.0.1:{inst.port}/metrics") as r:
                m = parse_text(await r.text())
            assert m["aios_instance_requests_waiting"] == 2 and m["aios_instance_kv_cache_usage_perc"] == 1.0
            for resp in await asyncio.gather(*calls):
                assert resp.status == 200
                resp.release()
        assert (inst.metrics.running, inst.metrics.waiting, inst.metrics.requests) == (0, 0, 3)
    finally:
        await server.close()


async def test_the_sim_runtime_reports_the_endpoint_and_serves_again_after_a_restart(tmp_path: Path) -> None:
    spec = LaunchSpec("b-0", "b", "n1", 1, env={"parameters": json.dumps({"sim": {"serviceTimeMs": 1}})})
    first = SimRuntime(start_delay_s=0, state_dir=tmp_path, server=SimServer())
    inst = await first.start(spec)
    assert inst.endpoint.startswith("http://127.0.0.1:")
    await first.server.close()  # type: ignore[union-attr]  # the agent process ends; the "engine" keeps its files
    second = SimRuntime(start_delay_s=0, state_dir=tmp_path, server=SimServer())
    try:
        (found,) = await second.list("n1")
        assert found.endpoint == inst.endpoint  # the same port again
        async with aiohttp.ClientSession() as http, http.post(f"{found.endpoint}/infer", json=1) as r:
            assert r.status == 200 and (await r.json())["output"] == 1
        assert second.server is not None and second.server.by_id["b-0"].behaviour.service_time_s == 0.001
        await second.stop(found.handle, 0)
        assert second.server.by_id == {}
    finally:
        await second.close()
