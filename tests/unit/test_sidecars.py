"""Side-cars (docs/sidecars.md) without servers: the spec field and its errors, the IR, the
controller's start/stop commands through the in-memory system, the executor's output buffer and
the SDK's dedupe / retry / dead-letter decisions."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import pytest

from aios_blocks import sidecar
from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E, Emit
from aios_blocks.executor.outputs import OutputPublisher, encode_output, task_id_of
from aios_blocks.handlers import mapper
from aios_blocks.schemas.errors import SpecInvalid
from aios_blocks.schemas.events import TaskOutput, envelope
from aios_blocks.schemas.ir import block_create_IR
from aios_blocks.schemas.spec import Component
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

from .test_ir import COMPONENT, spec

STORE = {"name": "store", "command": ["python", "-m", "aios_blocks.examples.sidecars.sqlite_store"], "parameters": {"path": "x.db"}}
ALERT = {"name": "alert", "image": "aios/alert:1", "consumes": {"event": "outputs", "status": "error"}, "maxDeliver": 3}


def errors_of(doc: dict[str, Any], comp: dict[str, Any] | None = None) -> dict[str, str]:
    with pytest.raises(SpecInvalid) as exc:
        block_create_IR(doc, comp or COMPONENT, "b1")
    return {e.path: e.message for e in exc.value.errors}


# -- the spec ---------------------------------------------------------------------------------------
def test_sidecars_are_inherited_from_the_component_and_merged_by_name() -> None:
    comp = {**COMPONENT, "sidecars": [STORE, ALERT]}
    ir = block_create_IR(spec(), comp, "b1")
    assert [s["name"] for s in ir["sidecars"]] == ["store", "alert"] and ir["outputs"] is True
    assert ir["sidecars"][0] == {**STORE, "image": "", "consumes": {"event": "outputs", "status": "any"}, "env": {},
                                 "maxDeliver": 5, "ackWaitS": 30.0, "replicas": 1, "stopGraceS": 10.0}
    assert ir["sidecars"][1]["consumes"] == {"event": "outputs", "status": "error"}
    # the block replaces one by name and adds another
    mine = {"name": "store", "command": ["my-store"], "maxDeliver": 2}
    extra = {"name": "audit", "command": ["audit"], "consumes": "outputs"}
    ir = block_create_IR(spec(sidecars=[mine, extra]), comp, "b1")
    assert [(s["name"], s["command"], s["maxDeliver"]) for s in ir["sidecars"]] == [
        ("store", ["my-store"], 2), ("alert", [], 3), ("audit", ["audit"], 5)]


def test_no_sidecars_means_no_outputs_unless_asked() -> None:
    ir = block_create_IR(spec(), COMPONENT, "b1")
    assert ir["sidecars"] == [] and ir["outputs"] is False
    assert block_create_IR(spec(outputs=True), COMPONENT, "b1")["outputs"] is True
    assert block_create_IR(spec(), {**COMPONENT, "outputs": True}, "b1")["outputs"] is True
    assert block_create_IR(spec(outputs=False), {**COMPONENT, "outputs": True}, "b1")["outputs"] is False


def test_every_problem_of_a_bad_sidecar_list_is_reported_with_its_path() -> None:
    bad = [
        {"name": "no runnable"},
        {"name": "ok", "command": ["x"], "consumes": "logs", "maxDeliver": 0, "ackWaitS": 0.1},
        {"name": "ok", "command": ["y"], "env": {"AIOS_NATS_URL": "x", "1bad": "y"}, "replicas": 99, "colour": "red"},
        {"name": "fine", "image": "i", "consumes": {"event": "outputs", "status": "sometimes"}},
    ]
    errs = errors_of(spec(sidecars=bad, minInstances=5, maxInstances=1))
    assert "$.minInstances" in errs  # reported together with the side-car problems
    assert "$.sidecars[0].name" in errs and "letters" not in errs["$.sidecars[0].name"]  # pattern mismatch
    assert "$.sidecars[1].consumes.event" in errs and "'outputs'" in errs["$.sidecars[1].consumes.event"]
    assert "$.sidecars[1].maxDeliver" in errs and "$.sidecars[1].ackWaitS" in errs
    assert "reserved" in errs["$.sidecars[2].env"] and "'1bad'" in errs["$.sidecars[2].env"]
    assert "$.sidecars[2].replicas" in errs and errs["$.sidecars[2].colour"] == "unknown field"
    assert "$.sidecars[3].consumes.status" in errs


def test_a_sidecar_needs_an_image_or_a_command_and_a_unique_name() -> None:
    errs = errors_of(spec(sidecars=[{"name": "a"}]))
    assert any("needs an image or a command" in m for m in errs.values()), errs
    errs = errors_of(spec(sidecars=[{"name": "a", "command": ["x"]}, {"name": "a", "image": "y"}]))
    assert errs == {"$.sidecars[1].name": "side-car name 'a' is used twice (also at index 0)"}
    with pytest.raises(ValueError, match="used twice"):
        Component.model_validate({**COMPONENT, "sidecars": [STORE, STORE]})
    errs = errors_of(spec(sidecars=[{"name": "a", "command": ["x"], "env": {"AIOS_X": "1"}}]))
    assert "reserved" in errs["$.sidecars[0].env"]


def test_a_repeated_sidecar_name_is_reported_with_the_lists_other_problems() -> None:
    """The names were checked only when every side-car was valid otherwise: fixing the reported
    problems then brought a new one to light."""
    errs = errors_of(spec(sidecars=[{"name": "store", "command": ["x"], "env": {"AIOS_X": "1"}}, {"name": "other"},
                                    {"name": "store", "command": ["y"], "maxDeliver": 0}]))
    assert "reserved" in errs["$.sidecars[0].env"] and "needs an image or a command" in errs["$.sidecars[1]"]
    assert "$.sidecars[2].maxDeliver" in errs
    assert errs["$.sidecars[2].name"] == "side-car name 'store' is used twice (also at index 0)"


def test_the_instance_map_says_whether_outputs_are_published() -> None:
    block = {"gen": 1, "ir": {"sidecars": [STORE], "inputProtocol": {}}}
    assert mapper.block_fields(block)["outputs"] is True
    assert mapper.block_fields({"gen": 1, "ir": {}})["outputs"] is False


# -- placement and deletion, in memory ----------------------------------------------------------------
async def test_sidecars_start_with_the_gang_on_a_node_of_its_cluster_and_stop_with_the_block() -> None:
    async with MemorySystem.open() as s:
        await s.add_component(sidecars=[STORE, {**ALERT, "replicas": 2}])
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 3})
        await s.run()
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready"
        starts = s.bus.events(E.node_sidecar_start)
        assert sorted(x["name"] for x in starts) == ["alert", "store"]
        insts = await s.store.instances(bid)
        nodes = {i["node"] for i in insts.values()}
        assert {x["node_id"] for x in starts} <= nodes and block["sidecar_node"] in nodes
        assert all(x["cluster_id"] == "c1" and x["gen"] == block["gen"] for x in starts)
        # the simulated fleet runs them (one record per copy), apart from the instances
        fleet_agent = next(iter(a for a in _fleet_agents(s) if a.node_id == block["sidecar_node"]))
        assert fleet_agent.sidecars is not None and sorted(fleet_agent.sidecars.copies) == [
            f"sc-{bid}-alert-0", f"sc-{bid}-alert-1", f"sc-{bid}-store-0"]
        await s.delete(bid)
        await s.run()
        assert (await s.store.get_block(bid))["status"] == "deleted"  # type: ignore[index]
        stops = s.bus.events(E.node_sidecar_stop)
        assert sorted(x["name"] for x in stops) == ["alert", "store"]
        assert all(x["node_id"] == block["sidecar_node"] and x["reason"] == "block deleted" for x in stops)
        assert fleet_agent.sidecars.copies == {}
        assert sorted(s.bus.deleted_consumers) == [("AIOS_OUTPUTS", f"sidecar-{bid}-alert"), ("AIOS_OUTPUTS", f"sidecar-{bid}-store")]


async def test_a_block_without_sidecars_starts_none() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=2)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1})
        await s.run()
        await s.delete(bid)
        await s.run()
        assert s.bus.events(E.node_sidecar_start) == [] and s.bus.events(E.node_sidecar_stop) == []


def _fleet_agents(s: MemorySystem) -> list[Any]:
    # the agent-sim binding's handler closes over its Fleet: reach it through the router
    for spec_, handler in s.bindings:
        if spec_.durable == "agent-sim":
            route = next(r for r in handler.routes if r.event is E.node_sidecar_start)  # type: ignore[attr-defined]
            return list(route.handler.__self__.agents.values())  # type: ignore[attr-defined]
    raise AssertionError("no agent-sim binding")


# -- the executor's output buffer ----------------------------------------------------------------------
class _Bus:
    def __init__(self) -> None:
        self.sent: list[Emit] = []
        self.down = False

    async def emit_all(self, effects: list[Emit]) -> list[Any]:
        if self.down:
            raise ConnectionError("nats away")
        self.sent.extend(effects)
        return []


def test_task_ids_come_from_the_caller_or_are_made() -> None:
    assert task_id_of({"Aios-Task-Id": "job-1:a.b"}) == ("job-1:a.b", "")
    made, problem = task_id_of({})
    assert len(made) == 32 and problem == ""
    assert task_id_of({"Aios-Task-Id": "a b"})[1].startswith("Aios-Task-Id must be")
    assert task_id_of({"Aios-Task-Id": "x" * 129})[1]


def test_large_and_binary_outputs_are_cut_and_encoded() -> None:
    assert encode_output(b'{"a": 1}', 100) == ('{"a": 1}', "utf-8", False)
    text, enc, cut = encode_output(b"x" * 50, 10)
    assert (text, enc, cut) == ("x" * 10, "utf-8", True)
    text, enc, cut = encode_output(b"\xff\x00\x01", 10)
    assert enc == "base64" and base64.b64decode(text) == b"\xff\x00\x01" and not cut
    text, enc, cut = encode_output("é".encode() * 10, 5)  # a character cut at the limit: still text
    assert enc == "utf-8" and cut and text == "éé"


async def test_outputs_are_buffered_while_nats_is_away_then_published_and_dropped_beyond_the_buffer() -> None:
    bus = _Bus()
    pub = OutputPublisher(bus, Settings(outputs_buffer=5, outputs_max_msg_bytes=1024))
    bus.down = True
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    for n in range(8):  # never blocks, never raises
        pub.offer("b1", f"t{n}", "b1-0", 200 if n % 2 else 500, b'{"n": %d}' % n + b"." * 2000, "application/json", gen=3)
    assert pub.dropped == 3 and pub.pending == 5
    await asyncio.sleep(0.3)
    assert bus.sent == [] and pub.retried > 0
    bus.down = False
    async with asyncio.timeout(5):
        while pub.pending:
            await asyncio.sleep(0.02)
    stop.set()
    await task
    outs = [e.payload for e in bus.sent]
    assert [o.task_id for o in outs] == [f"t{n}" for n in range(5)]
    assert [e.subject() for e in bus.sent][:2] == ["aios.output.b1.error", "aios.output.b1.ok"]
    assert {e.logical_id() for e in bus.sent} == {f"output:b1:t{n}" for n in range(5)}
    assert all(o.truncated and o.size > 2000 and len(o.output) == 1024 and o.gen == 3 for o in outs)


# -- the SDK's decisions ---------------------------------------------------------------------------
def _event(task_id: str, gen: int = 1, text: str = "hello") -> bytes:
    out = TaskOutput("b1", task_id, "b1-0", 200, text, "utf-8", "text/plain", len(text), False, 1.0, "ok", gen)
    return envelope(f"output:b1:{task_id}", "test", E.block_output.type, "aios.output.b1.ok", out)


async def test_the_sdk_dedupes_by_task_id_retries_then_dead_letters() -> None:
    cfg = sidecar.Config("b1", "store", gen=1, max_deliver=3)
    calls: list[str] = []
    failing = {"bad"}

    def handler(out: sidecar.Output, ctx: sidecar.Context) -> None:
        calls.append(out.task_id)
        if out.task_id in failing:
            raise ValueError("db is down")

    p = sidecar.Processor(cfg, handler)
    assert (await p.process(_event("t1"), 1)).action == "ack"
    assert (await p.process(_event("t1"), 2)).action == "ack"  # redelivered (its ack was lost): not run again
    assert calls == ["t1"] and p.duplicates == 1
    v1, v2 = await p.process(_event("bad"), 1), await p.process(_event("bad"), 2)
    assert (v1.action, v2.action) == ("retry", "retry") and v2.delay > v1.delay > 0
    v3 = await p.process(_event("bad"), 3)
    assert v3.action == "dead_letter" and "ValueError: db is down" in v3.reason and "after 3 deliveries" in v3.reason
    failing.clear()  # a handler that recovers before the limit
    assert (await p.process(_event("bad"), 2)).action == "ack"
    assert (await p.process(_event("old", gen=7), 1)).action == "ack" and "old" not in calls  # another generation
    malformed = await p.process(b"{not json", 1)
    assert malformed.action == "dead_letter" and "malformed" in malformed.reason


async def test_async_handlers_see_the_output_and_can_alert() -> None:
    cfg = sidecar.Config("b1", "alert", parameters={"pattern": "x"})
    seen: list[Any] = []

    async def handler(out: sidecar.Output, ctx: sidecar.Context) -> None:
        seen.append((out.task_id, out.text, out.deliveries, ctx.parameters))
        ctx.alert("found it", out.task_id)

    p = sidecar.Processor(cfg, handler)
    assert (await p.process(_event("t9", text="héllo"), 2)).action == "ack"
    assert seen == [("t9", "héllo", 2, {"pattern": "x"})]
    assert [(a.task_id, a.message) for a in p.ctx.alerts] == [("t9", "found it")]


def test_seen_is_bounded_and_config_comes_from_the_agents_environment() -> None:
    s = sidecar.Seen(limit=3)
    for t in "abcd":
        s.add(t)
    assert len(s) == 3 and "a" not in s and "d" in s
    spec = {"name": "store", "maxDeliver": 4, "ackWaitS": 12, "consumes": {"event": "outputs", "status": "ok"},
            "parameters": {"path": "/x.db"}}
    cfg = sidecar.Config.from_env({"AIOS_BLOCK_ID": "b1", "AIOS_GEN": "3", "AIOS_SIDECAR": msgspec.json.encode(spec).decode(),
                                   "AIOS_NATS_URL": "nats://h:1"})
    assert (cfg.block_id, cfg.name, cfg.gen, cfg.max_deliver, cfg.ack_wait_s, cfg.status, cfg.nats_url) == (
        "b1", "store", 3, 4, 12.0, "ok", "nats://h:1")
    assert cfg.parameters == {"path": "/x.db"} and cfg.durable == "sidecar-b1-store"
    assert subjects.sidecar("b1", "store", "ok").filters == ("aios.output.b1.ok",)
    assert subjects.sidecar("b1", "store").filters == ("aios.output.b1.*",)
    with pytest.raises(SystemExit, match="AIOS_SIDECAR"):
        sidecar.Config.from_env({"AIOS_BLOCK_ID": "b1"})


# -- the examples ------------------------------------------------------------------------------------
def _output(task_id: str, text: str, status: int = 200) -> sidecar.Output:
    return sidecar.Output("b1", task_id, "b1-0", status, text.encode(), "application/json", len(text), False, 1.0,
                          "ok" if status < 400 else "error", 1)


def test_the_example_block_spec_is_valid_for_an_echo_component() -> None:
    from pathlib import Path

    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"
    doc = yaml.safe_load((examples / "sidecar_block.yaml").read_text())
    comp = Component.model_validate(yaml.safe_load((examples / "echo_component.yaml").read_text())).model_dump()
    ir = block_create_IR(doc, comp, doc["blockId"])
    assert [s["name"] for s in ir["sidecars"]] == ["store", "alert"] and ir["outputs"]


def test_the_sqlite_example_stores_each_task_once_and_can_refuse(tmp_path: Any) -> None:
    import sqlite3

    from aios_blocks.examples.sidecars.sqlite_store import Store

    store = Store({"path": str(tmp_path / "o.db"), "failOn": "boom"})
    ctx = sidecar.Context(sidecar.Config("b1", "store"))
    store(_output("t1", '{"a": 1}'), ctx)
    store(_output("t1", '{"a": 1}'), ctx)  # delivered again: one row
    store(_output("t2", "x", 500), ctx)
    with pytest.raises(RuntimeError, match="boom"):
        store(_output("t3", "boom"), ctx)
    rows = sqlite3.connect(tmp_path / "o.db").execute("SELECT task_id, status, outcome, output FROM outputs ORDER BY task_id").fetchall()
    assert rows == [("t1", 200, "ok", '{"a": 1}'), ("t2", 500, "error", "x")]
    with pytest.raises(SystemExit, match="plain SQL name"):
        Store({"path": str(tmp_path / "p.db"), "table": "x; drop"})


def test_the_alert_example_alerts_on_matches_only(tmp_path: Any) -> None:
    import json

    from aios_blocks.examples.sidecars.alert import Alerter

    alerter = Alerter({"pattern": r"(?i)error\b", "file": str(tmp_path / "a.jsonl")})
    ctx = sidecar.Context(sidecar.Config("b1", "alert"))
    alerter(_output("t1", "all good"), ctx)
    alerter(_output("t2", "an ERROR happened"), ctx)
    assert [a.task_id for a in ctx.alerts] == ["t2"] and "ERROR" in ctx.alerts[0].message
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [x["task_id"] for x in lines] == ["t2"] and lines[0]["match"] == "ERROR"
    with pytest.raises(SystemExit, match="not a valid regex"):
        Alerter({"pattern": "("})
    with pytest.raises(SystemExit, match="required"):
        Alerter({})


# -- the agent's side of it (simulated runtime) --------------------------------------------------------
class _Consumers:
    def __init__(self) -> None:
        self.deleted: list[tuple[str, str]] = []

    async def delete_consumer(self, stream: str, durable: str) -> bool:
        self.deleted.append((stream, durable))
        return True


async def test_an_agent_runs_restarts_and_stops_sidecars_and_ignores_a_late_start(tmp_path: Any) -> None:
    from aios_blocks.agent.runtime_sim import SimRuntime
    from aios_blocks.agent.sidecars import SidecarManager
    from aios_blocks.schemas.events import SidecarCommand
    from aios_blocks.schemas.spec import Sidecar

    rt = SimRuntime(start_delay_s=0)
    bus = _Consumers()
    m = SidecarManager(bus, rt, "n1", tmp_path, nats_url="nats://sidecar@h:1", restart_s=0.05)
    sc = Sidecar.model_validate({**STORE, "replicas": 2}).model_dump()
    cmd = SidecarCommand("b1", 4, "c1", "n1", "store", sc)
    await m.start(cmd)
    await m.start(cmd)  # redelivered: the same two copies
    assert sorted(m.copies) == ["sc-b1-store-0", "sc-b1-store-1"]
    running = [i for i in await rt.list("n1") if i.running]
    assert len(running) == 2 and all(i.is_sidecar and i.gen == 4 for i in running)
    env = m.env(cmd, Sidecar.model_validate(sc), 1)
    assert env["AIOS_NATS_URL"] == "nats://sidecar@h:1" and env["AIOS_BLOCK_ID"] == "b1" and env["AIOS_SIDECAR_COPY"] == "1"
    assert (tmp_path / "sidecars" / "sc-b1-store-0" / "parameters.json").exists()
    # a copy that exits is started again
    first = m.copies["sc-b1-store-0"].handle
    rt.crash(first)
    async with asyncio.timeout(5):
        while not (st := await rt.status(m.copies["sc-b1-store-0"].handle)) or not st.running:
            await asyncio.sleep(0.05)
    # stop: every copy, the consumer, the working directories; a start that comes late is ignored
    await m.stop(SidecarCommand("b1", 4, "c1", "n1", "store", sc, "block deleted"))
    assert m.copies == {} and [i for i in await rt.list("n1") if i.running] == []
    assert bus.deleted == [("AIOS_OUTPUTS", "sidecar-b1-store")]
    assert not (tmp_path / "sidecars" / "sc-b1-store-0").exists()
    await m.start(cmd)
    assert m.copies == {}
    await m.start(SidecarCommand("b1", 5, "c1", "n1", "store", sc))  # the next generation of the id runs
    assert sorted(m.copies) == ["sc-b1-store-0", "sc-b1-store-1"]
    m.shutdown()


async def test_a_sidecar_that_exits_is_logged_with_its_last_output(tmp_path: Any) -> None:
    """A crash-looping side-car (a module that is not installed, a bad parameter) said only its exit
    code in the agent's log: its output, the reason, was in a working directory the user never saw."""
    import sys

    from structlog.testing import capture_logs

    from aios_blocks.agent.runtime_process import ProcessRuntime, process_scope
    from aios_blocks.agent.sidecars import SidecarManager
    from aios_blocks.schemas.events import SidecarCommand
    from aios_blocks.schemas.spec import Sidecar

    rt = ProcessRuntime(scope=process_scope(tmp_path))
    m = SidecarManager(_Consumers(), rt, "n1", tmp_path, nats_url="nats://sidecar@h:1", restart_s=30)
    sc = Sidecar.model_validate({"name": "crashy", "command": [
        sys.executable, "-c", "import sys; print('starting'); print('boom: no database at /nope'); sys.exit(3)"]}).model_dump()
    with capture_logs() as logs:
        await m.start(SidecarCommand("b1", 1, "c1", "n1", "crashy", sc))
        try:
            async with asyncio.timeout(10):
                while not any(e["event"] == "sidecar.exited" for e in logs):
                    await asyncio.sleep(0.05)
        finally:
            await m.stop(SidecarCommand("b1", 1, "c1", "n1", "crashy", sc, "test over"))
            m.shutdown()
    exited = next(e for e in logs if e["event"] == "sidecar.exited")
    assert exited["exit_code"] == 3 and "boom: no database at /nope" in exited["output"], exited
