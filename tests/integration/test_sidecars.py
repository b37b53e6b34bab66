"""Side-cars on real servers (docs/sidecars.md): a real node agent (process runtime) runs the echo
instance and the example SQLite side-car; the real executor publishes every task output to
``AIOS_OUTPUTS``; the side-car stores each one once, survives SIGKILL and a NATS restart without
losing one, dead-letters what its handler keeps refusing, and goes with its block."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.js.errors import NotFoundError

from aios_blocks.agent.runtime_process import ProcessRuntime
from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth
from aios_blocks.runtime.auth import url_user
from aios_blocks.runtime.embedded import free_port

from .conftest import COMPONENT, System
from .test_agent import Agents, until
from .test_executor_http_auth import upstream_header

pytestmark = pytest.mark.integration

NODE = "sidecar-n1"
CLUSTER = "sidecar-c1"
STORE = [sys.executable, "-m", "aios_blocks.examples.sidecars.sqlite_store"]


@pytest.fixture
def http_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The executor's HTTP ingress (tasks keep flowing while NATS restarts). Before ``system``."""
    port = free_port()
    monkeypatch.setenv("AIOS_EXECUTOR_HTTP_PORT", str(port))
    monkeypatch.setenv("AIOS_SIDECAR_RESTART_S", "0.2")
    return port


@contextlib.asynccontextmanager
async def node_agent(system: System, tmp_path: Path, standalone: bool = False) -> AsyncIterator[Agents]:
    a = Agents(system, "process", tmp_path)
    rt = ProcessRuntime()
    try:
        a.start(NODE, cluster=CLUSTER, standalone=standalone)
        await a.wait_registered(NODE)
        yield a
    finally:
        a.stop_all()
        for _ in range(2):  # leave no instance or side-car behind on the host
            for inst in await rt.list(NODE):
                await rt.stop(inst.handle, 0)
            await asyncio.sleep(0.3)


@pytest.fixture
async def agents(http_port: int, system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    async with node_agent(system, tmp_path) as a:
        yield a


@pytest.fixture
async def standalone_agent(http_port: int, system: System, tmp_path: Path) -> AsyncIterator[Agents]:
    """`blocks agent --data-dir` next to the running system, as docs/agents.md runs it: no NATS
    setting in its environment (it logs in as its node's user from the data dir)."""
    if system.servers is None or not system.servers.auth:
        pytest.skip("needs the embedded servers with login required")
    async with node_agent(system, tmp_path, standalone=True) as a:
        yield a


def echo_component(**extra: Any) -> dict[str, Any]:
    comp = dict(COMPONENT, componentURI="aios://test/echo-sidecars", image="")
    comp["resources"] = {"gpus": 0, "gpuMemory": 0, "cpu": 0.5, "memory": 128}
    probe = {"type": "http", "port": "http", "path": "/health", "intervalS": 0.5, "failureThreshold": 3, "startTimeoutS": 30}
    comp["launch"] = {"command": [sys.executable, "-m", "aios_blocks.examples.echo"], "ports": ["http"], "probe": probe,
                      "stopGraceS": 2}
    comp.update(extra)
    return comp


def store_sidecar(db: Path, name: str = "store", **over: Any) -> dict[str, Any]:
    return {"name": name, "command": STORE, "parameters": {"path": str(db)}, "ackWaitS": 2, "stopGraceS": 1, **over}


async def place(c: Client, bid: str, sidecars: list[dict[str, Any]], n: int = 2) -> None:
    await c.add_component(echo_component())
    await c.submit({"blockComponentURI": "aios://test/echo-sidecars", "blockId": bid, "minInstances": n, "maxInstances": n,
                    "sidecars": sidecars})
    kind, env = await c.wait(bid, 120)
    assert kind == "ready", env
    maps = InstanceMaps(c.bus)

    async def mapped() -> bool:
        m, _ = await maps.get(bid)
        return bool(m) and m.get("outputs") is True and sum(1 for i in m["instances"].values() if i["state"] == "ready") == n

    await until(mapped, 60, "the instance map with outputs on")


async def sidecars_running(bid: str) -> list[Any]:
    return [i for i in await ProcessRuntime().list(NODE) if i.is_sidecar and i.block_id == bid and i.running]


def stored(db: Path) -> dict[str, dict[str, Any]]:
    if not db.exists():
        return {}
    with sqlite3.connect(db, timeout=10) as conn:
        conn.row_factory = sqlite3.Row
        try:
            return {r["task_id"]: dict(r) for r in conn.execute("SELECT * FROM outputs")}
        except sqlite3.OperationalError:  # the table is not there yet
            return {}


async def http_task(http: aiohttp.ClientSession, port: int, bid: str, n: int) -> tuple[int, str]:
    tid = f"t{n}-{uuid.uuid4().hex[:6]}"
    try:
        async with http.post(f"http://127.0.0.1:{port}/blocks/{bid}/tasks", json={"n": n},
                             headers={"Aios-Task-Id": tid}, timeout=aiohttp.ClientTimeout(total=10)) as r:
            await r.read()
            assert r.headers["Aios-Task-Id"] == tid
            return r.status, tid
    except (aiohttp.ClientError, TimeoutError):
        return 0, tid


async def test_a_sidecar_stores_every_output_once_through_sigkill_and_goes_with_its_block(agents: Agents, tmp_path: Path) -> None:
    c = agents.system.client
    db = tmp_path / "outputs.db"
    bid = "sc-store"
    await place(c, bid, [store_sidecar(db)])
    (first,) = await until(lambda: sidecars_running(bid), 60, "the side-car running")
    assert first.labels["aios.sidecar.name"] == "store"

    # N tasks over NATS; the side-car is SIGKILLed halfway (the agent starts it again)
    answers: list[tuple[int, bytes, dict[str, str]]] = []
    for n in range(60):
        answers.append(await c.task(bid, json.dumps({"n": n}).encode(), headers={"Aios-Task-Id": f"k{n}"}))
        if n == 30:
            os.killpg(int(first.handle.split("-")[0]), signal.SIGKILL)
    assert all(s == 200 for s, _, _ in answers), [s for s, _, _ in answers]
    assert [h["Aios-Task-Id"] for _, _, h in answers] == [f"k{n}" for n in range(60)]
    want = {f"k{n}" for n in range(60)}
    await until(lambda: _async(set(stored(db)) >= want), 90, "every output stored")
    rows = stored(db)
    assert set(rows) == want  # each task id once (the primary key; redeliveries were deduplicated)
    assert all(r["block_id"] == bid and r["status"] == 200 and r["outcome"] == "ok" for r in rows.values())
    assert json.loads(rows["k7"]["output"])["output"] == {"n": 7}
    (again,) = await sidecars_running(bid)
    assert again.handle != first.handle  # restarted by its agent

    # deleting the block stops the side-car and deletes its consumer
    durable = subjects.sidecar_durable(bid, "store")
    assert await c.bus.js.consumer_info(subjects.STREAM_OUTPUTS, durable)
    await c.delete(bid)
    await until(lambda: _sidecar_gone(c, bid, durable), 60, "the side-car stopped and its consumer deleted")


async def test_a_failing_handler_dead_letters_each_output_with_the_reason_after_max_deliver(agents: Agents, tmp_path: Path) -> None:
    c = agents.system.client
    db = tmp_path / "refusing.db"
    bid = "sc-dlq"
    # the echo answer always holds "output": the handler refuses every one
    await place(c, bid, [store_sidecar(db, name="refuse", maxDeliver=2, parameters={"path": str(db), "failOn": "output"})], n=1)
    await until(lambda: sidecars_running(bid), 60, "the side-car running")
    status, _, _ = await c.task(bid, b'{"bad": 1}', headers={"Aios-Task-Id": "bad-1"})
    assert status == 200  # a side-car's failure never touches the task
    # an output is the users' data: its dead letter stays with the outputs, in AIOS_OUTPUTS
    # (catalog output.dlq), not in AIOS with the workers' dead letters, where observers read
    dlq = E.output_dead_letter.subject(bid=bid, name="refuse", outcome="ok")

    async def letter() -> Any:
        try:
            return await c.bus.js.get_last_msg(subjects.STREAM_OUTPUTS, dlq)
        except NotFoundError:
            return None

    msg = await until(letter, 60, "the dead letter")
    dead = json.loads(msg.data)["data"]
    assert dead["consumer"] == f"sidecar-{bid}-refuse" and dead["deliveries"] == 2
    assert dead["subject"] == f"aios.output.{bid}.ok"
    assert "RuntimeError: refusing outputs that contain 'output'" in dead["error"] and "after 2 deliveries" in dead["error"]
    assert '"task_id":"bad-1"' in dead["data"]
    assert stored(db) == {}
    with pytest.raises(NotFoundError):  # where it went before
        await c.bus.js.get_last_msg(subjects.STREAM, subjects.dead_letter(f"sidecar-{bid}-refuse", f"aios.output.{bid}.ok"))
    if agents.system.servers is None:
        return  # your own servers: no observer user to check
    # the admin's dead-letter listing shows it ...
    listed = await _blocks_json("dlq", "--json", "--data-dir", str(agents.system.data_dir))
    mine = [d for d in listed if d["subject"] == dlq]
    assert len(mine) == 1 and mine[0]["stream"] == subjects.STREAM_OUTPUTS, listed
    assert mine[0]["event"]["data"]["error"] == dead["error"]
    table = await _blocks("dlq", "--data-dir", str(agents.system.data_dir))
    assert "AIOS_OUTPUTS" in table and f"sidecar-{bid}-refuse" in table, table
    # ... and an observer's consumers on AIOS and on its mirror AIOS_OBSERVE (every event, aios.>)
    # never get it: it is not in the streams they may read
    seen = await _observer_reads(agents.system.servers.endpoints.nats_url("observer"))
    assert seen[subjects.STREAM] and seen[subjects.STREAM_OBSERVE], seen  # they do read the events
    for stream, got in seen.items():
        assert not [s for s, d in got if s.startswith("aios.dlq.") or b"bad-1" in d], (stream, got)


async def _blocks(*args: str) -> str:
    """``blocks ARGS`` as the admin runs it next to ``blocks up`` (no server URL in its environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")} | {"COLUMNS": "200"}
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aios_blocks.cli", *args], env=env,
                                capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout


async def _blocks_json(*args: str) -> list[dict[str, Any]]:
    """``blocks ARGS`` (``--json``): one JSON document a line."""
    return [json.loads(line) for line in (await _blocks(*args)).splitlines() if line.strip()]


async def _observer_reads(url: str) -> dict[str, list[tuple[str, bytes]]]:
    """Every stored message an observer's consumer with filter ``aios.>`` gets, on ``AIOS`` (an
    ephemeral pull consumer) and on ``AIOS_OBSERVE`` (an ordered one), each named after the
    observer's user (the only names it may use: docs/security.md "Observers: a user each")."""
    import nats
    from nats.js.api import ConsumerConfig

    from aios_blocks.bus.nats_bus import security_options

    nc = await nats.connect(servers=[url], allow_reconnect=False, connect_timeout=5, **security_options(url))
    out: dict[str, list[tuple[str, bytes]]] = {subjects.STREAM: [], subjects.STREAM_OBSERVE: []}
    try:
        js = nc.jetstream(timeout=10)
        await js.add_consumer(subjects.STREAM, ConsumerConfig(name="observer_31", filter_subject="aios.>", inactive_threshold=30))
        pull = await js.pull_subscribe_bind("observer_31", stream=subjects.STREAM)
        while True:
            try:
                msgs = await pull.fetch(256, timeout=2)
            except nats.errors.TimeoutError:
                break
            for m in msgs:
                out[subjects.STREAM].append((m.subject, m.data))
                await m.ack()
        mirror = (await js.stream_info(subjects.STREAM)).state.last_seq
        async with asyncio.timeout(30):  # the mirror caught up with AIOS
            while (await js.stream_info(subjects.STREAM_OBSERVE)).state.last_seq < mirror:
                await asyncio.sleep(0.1)
        ordered = await js.subscribe("aios.>", stream=subjects.STREAM_OBSERVE, ordered_consumer=True,
                                     config=ConsumerConfig(name="observer_32"))
        while True:
            try:
                m = await ordered.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                break
            out[subjects.STREAM_OBSERVE].append((m.subject, m.data))
        await ordered.unsubscribe()
        for st, name in ((subjects.STREAM, "observer_31"), (subjects.STREAM_OBSERVE, "observer_32")):
            await js.delete_consumer(st, name)
    finally:
        await nc.close()
    return out


async def test_no_output_is_lost_when_nats_restarts_mid_run(agents: Agents, http_port: int, tmp_path: Path) -> None:
    system = agents.system
    assert system.servers is not None
    c = system.client
    db = tmp_path / "restart.db"
    bid = "sc-restart"
    await place(c, bid, [store_sidecar(db)])
    await until(lambda: sidecars_running(bid), 60, "the side-car running")
    answered: list[str] = []
    stop = asyncio.Event()

    async def load(k: int) -> None:
        n = 0
        async with aiohttp.ClientSession(headers=upstream_header(system.data_dir)) as http:  # the port asks who
            while not stop.is_set():
                status, tid = await http_task(http, http_port, bid, k * 100_000 + n)
                n += 1
                if status == 200:
                    answered.append(tid)
                await asyncio.sleep(0.01)

    loaders = [asyncio.create_task(load(k)) for k in range(3)]
    await until(lambda: _async(len(answered) >= 10), 60, "tasks answered before the restart")
    before = len(answered)
    await asyncio.to_thread(system.servers.restart_nats)  # every client reconnects
    await until(lambda: _async(len(answered) >= before + 10), 60, "tasks answered after the restart")
    stop.set()
    await asyncio.gather(*loaders)
    want = set(answered)
    await until(lambda: _async(set(stored(db)) >= want), 120, "every answered task's output stored")
    assert set(stored(db)) == want


async def test_a_standalone_agents_sidecars_log_in_as_their_blocks_user_and_store_outputs(standalone_agent: Agents,
                                                                                          tmp_path: Path) -> None:
    """The agent of docs/agents.md (`blocks agent` beside `blocks up`, no AIOS_NATS_URL, login
    required) makes its side-cars' block a user of its own and hands them its URL, as the agents
    started with ``agent_env`` do: they log in, consume the outputs and go with the block (and the
    user with them)."""
    c = standalone_agent.system.client
    db = tmp_path / "standalone.db"
    bid = "sc-standalone"
    await place(c, bid, [store_sidecar(db)], n=1)
    (sc,) = await until(lambda: sidecars_running(bid), 60, "the side-car running")
    env = await standalone_agent.environment(sc)
    # its block's own user (docs/security.md "Side-cars: a user per block"), made by the agent
    assert url_user(env["AIOS_NATS_URL"]) == f"sidecar-{bid}", "the side-car got no user of its block's"
    want = set()
    for n in range(5):
        status, _, _ = await c.task(bid, json.dumps({"n": n}).encode(), headers={"Aios-Task-Id": f"s{n}"})
        assert status == 200
        want.add(f"s{n}")
    await until(lambda: _async(set(stored(db)) >= want), 30, "every output stored by the side-car")
    durable = subjects.sidecar_durable(bid, "store")
    await c.delete(bid)
    await until(lambda: _sidecar_gone(c, bid, durable), 30, "the side-car stopped and its consumer deleted")
    # and its user with it (the last node running its side-cars let it go)
    await until(lambda: _async(not auth.nats_login(env["AIOS_NATS_URL"], env.get("AIOS_NATS_CA"))), 30,
                "the block's side-car user removed")


async def test_a_sidecar_that_cannot_log_in_stops_at_once_on_sigterm(system: System, tmp_path: Path) -> None:
    """A side-car whose NATS login is refused (nats-py retries the first connect forever) still
    stops on SIGTERM at once, not after its agent's stopGraceS and a SIGKILL."""
    if system.servers is None or not system.servers.auth:
        pytest.skip("needs the embedded servers with login required")
    log = tmp_path / "sidecar.log"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1", "AIOS_NATS_URL": system.servers.endpoints.nats,
           "AIOS_BLOCK_ID": "sc-nologin", "AIOS_SIDECAR": json.dumps(store_sidecar(tmp_path / "x.db"))}
    proc = _spawn(STORE, env, log, tmp_path)
    try:
        await until(lambda: _async("Authorization Violation" in log.read_text()), 20, "the refused login")
        proc.terminate()
        # it stops on the SIGTERM, cleanly (code 0, not -15), instead of retrying the login until
        # a SIGKILL; the bound is generous (the outcome is that it ends at all, not how fast)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)


async def test_a_bad_sidecar_spec_is_rejected_with_every_problem(system: System) -> None:
    c = system.client
    await c.add_component(echo_component())
    await c.submit({"blockComponentURI": "aios://test/echo-sidecars", "blockId": "sc-bad", "minInstances": 1, "maxInstances": 1,
                    "sidecars": [{"name": "x"}, {"name": "x", "command": ["y"], "maxDeliver": 0}]})
    kind, env = await c.wait("sc-bad", 60)
    assert kind == "rejected"
    errors = {e["path"]: e["message"] for e in env["data"]["errors"]}
    assert "needs an image or a command" in errors["$.sidecars[0]"]
    assert "$.sidecars[1].maxDeliver" in errors


async def _async(value: bool) -> bool:
    return value


async def _sidecar_gone(c: Any, bid: str, durable: str) -> bool:
    """The block's side-car is no longer running and its consumer is deleted."""
    if await sidecars_running(bid):
        return False
    try:
        await c.bus.js.consumer_info(subjects.STREAM_OUTPUTS, durable)
        return False
    except NotFoundError:
        return True
