"""Worker kinds grouped in one process (``blocks up``'s default, ``supervisor.DEFAULT_GROUPS``):
which processes a layout makes, each kind's own credentials in a group's environment, and a group
process's run (``main.run_group``) with its workers faked: a kind that fails ends the group with
an error, a stop ends every kind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.runtime import main
from aios_blocks.runtime.supervisor import (
    DEFAULT_GROUPS,
    DEFAULT_LAYOUT,
    PER_KIND_VARS,
    Supervisor,
    kind_var,
    units,
)
from aios_blocks.workers import telemetry
from aios_blocks.workers.base import Worker


def test_the_default_layout_runs_in_three_processes_and_extra_copies_in_their_own() -> None:
    # the controller alone: on two cores it places while the front process parses and selects
    assert units(DEFAULT_LAYOUT, DEFAULT_GROUPS) == [
        ("front", ("parser", "gateway", "metrics", "autoscaler", "checker", "rebalancer"), 0),
        ("serve", ("agent-sim", "executor", "mapper"), 0),
        ("controller", ("controller",), 0),
    ]
    assert {k for _, kinds, _ in units(DEFAULT_LAYOUT, DEFAULT_GROUPS) for k in kinds} == set(DEFAULT_LAYOUT)
    two = units({**DEFAULT_LAYOUT, "controller": 2, "gateway": 3}, DEFAULT_GROUPS)
    assert [u for u in two if u[0] in ("controller", "gateway")] == [
        ("gateway", ("gateway",), 1), ("gateway", ("gateway",), 2), ("controller", ("controller",), 0),
        ("controller", ("controller",), 1)]
    # a kind the layout leaves out leaves its group; a group of one kind is that kind's own process
    some = units({"parser": 1, "gateway": 0, "controller": 1, "executor": 1, "metrics": 1, "checker": 0}, DEFAULT_GROUPS)
    assert some == [("front", ("parser", "metrics"), 0), ("executor", ("executor",), 0), ("controller", ("controller",), 0)]
    # without groups: a process per kind and copy, as before
    assert units({"parser": 1, "controller": 2}, None) == [("parser", ("parser",), 0), ("controller", ("controller",), 0),
                                                          ("controller", ("controller",), 1)]
    # a kind in no group runs alone
    assert units({"parser": 1, "gateway": 1}, {"g": ("parser",)}) == [("parser", ("parser",), 0), ("gateway", ("gateway",), 0)]


def _role_env(kind: str) -> dict[str, str]:
    return {"AIOS_NATS_URL": f"nats://{kind}:pw-{kind}@h:4222", "AIOS_REDIS_URL": "redis://aios:pw@h:6379/0",
            "AIOS_EVENT_KEY": f"key-{kind}", "AIOS_NATS_CA": "/ca.pem"}


def test_a_group_gets_each_kinds_own_credentials_suffixed_and_none_unsuffixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_NATS_URL", "nats://admin:admin-pw@h:4222")
    monkeypatch.setenv("AIOS_NATS_URL_CHECKER", "nats://stale@h:4222")  # the caller's: not passed on
    sup = Supervisor("nats://admin:admin-pw@h:4222", "redis://admin:pw@h:6379/0", role_env=_role_env)
    env = sup.env(("parser", "agent-sim"))
    for name in PER_KIND_VARS:
        assert name not in env
    assert env["AIOS_NATS_URL_PARSER"] == "nats://parser:pw-parser@h:4222"
    assert env["AIOS_NATS_URL_AGENT_SIM"] == "nats://agent-sim:pw-agent-sim@h:4222"
    assert env["AIOS_EVENT_KEY_AGENT_SIM"] == "key-agent-sim" and env["AIOS_NATS_CA"] == "/ca.pem"
    assert "AIOS_NATS_URL_CHECKER" not in env and "admin-pw" not in " ".join(env.values())
    assert main.group_urls(["parser", "agent-sim"], env) == {
        "parser": ("nats://parser:pw-parser@h:4222", "redis://aios:pw@h:6379/0", "key-parser"),
        "agent-sim": ("nats://agent-sim:pw-agent-sim@h:4222", "redis://aios:pw@h:6379/0", "key-agent-sim"),
    }
    # one kind: its role's URLs unsuffixed, as a worker always had them
    one = sup.env(("parser",))
    assert one["AIOS_NATS_URL"] == "nats://parser:pw-parser@h:4222" and one["AIOS_EVENT_KEY"] == "key-parser"
    # no role_env (servers given by URL): every kind the supervisor's URLs
    plain = Supervisor("nats://h:4222", "redis://h:6379/0").env(("parser", "gateway"))
    assert plain["AIOS_NATS_URL_GATEWAY"] == "nats://h:4222" and plain["AIOS_REDIS_URL_PARSER"] == "redis://h:6379/0"


def test_group_urls_fall_back_to_the_unsuffixed_ones_and_name_what_is_missing() -> None:
    env = {"AIOS_NATS_URL": "nats://h", "AIOS_REDIS_URL": "redis://h", "AIOS_NATS_URL_GATEWAY": "nats://gw@h"}
    assert main.group_urls(["parser", "gateway"], env) == {"parser": ("nats://h", "redis://h", None),
                                                           "gateway": ("nats://gw@h", "redis://h", None)}
    with pytest.raises(KeyError, match="AIOS_REDIS_URL_PARSER"):
        main.group_urls(["parser"], {"AIOS_NATS_URL": "nats://h"})
    assert kind_var("AIOS_EVENT_KEY", "agent-sim") == "AIOS_EVENT_KEY_AGENT_SIM"


def test_pids_and_logs_of_a_kind_are_its_processes() -> None:
    sup = Supervisor("n", "r", log_dir="/logs")
    sup.kinds = {("core", 0): ("parser", "controller"), ("controller", 1): ("controller",)}
    assert sup.log_file("controller") == "/logs/core-0.log" and sup.log_file("controller", 1) == "/logs/controller-1.log"
    assert sup.log_file("parser") == "/logs/core-0.log"
    with pytest.raises(KeyError):
        sup.log_file("parser", 1)


class _SleepySupervisor(Supervisor):
    """Its processes sleep instead of running workers (what is watched is the same ``Popen``)."""

    def _spawn(self, key: tuple[str, int]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_a_worker_that_dies_is_started_again_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a SIGKILLed worker was replaced without a word: nothing on blocks up's terminal, nothing in its log
    sup = _SleepySupervisor("n", "r", layout={"controller": 1}, log_dir=str(tmp_path)).start()
    try:
        first = sup.procs[("controller", 0)]
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sup.procs[("controller", 0)] is first:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
        assert sup.restarts == 1
    finally:
        sup.stop()
    err = capsys.readouterr().err
    assert "worker process controller-0 exited with signal SIGKILL; started again (restart 1)" in err, err
    lines = [json.loads(line) for line in (tmp_path / "controller-0.log").read_text().splitlines()]
    assert [(d["event"], d["process"], d["kinds"], d["exit_code"], d["restarts"]) for d in lines] == [
        ("supervisor.restart", "controller-0", ["controller"], -signal.SIGKILL, 1)]


# -- a group process's run, with fake workers ---------------------------------------------------------
@dataclass
class FakeWorker:
    kind: str
    settings: Any
    closed: bool = False

    async def close(self) -> None:
        self.closed = True


@dataclass
class Rig:
    opened: dict[str, FakeWorker] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    urls: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    fail_open: str = ""
    crash: str = ""
    served: list[tuple[str, list[str] | None]] = field(default_factory=list)


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    r = Rig()

    async def open_(nats_url: str, redis_url: str, name: str, settings: Any = None) -> FakeWorker:
        r.urls[name] = (nats_url, redis_url, settings.event_key if settings else None)
        if name == r.fail_open:
            raise ConnectionError(f"{name} refused")
        w = r.opened[name] = FakeWorker(name, settings)
        return w

    async def run_kind(w: FakeWorker, kind: str, cluster: str | None, stop: asyncio.Event) -> None:
        if kind == r.crash:
            await asyncio.sleep(0.05)
            raise RuntimeError(f"{kind} broke")
        await stop.wait()
        r.stopped.append(kind)

    async def serve(w: Any, kind: str, cluster: str | None, stop: asyncio.Event, kinds: list[str] | None = None) -> None:
        r.served.append((kind, kinds))
        await stop.wait()

    monkeypatch.setattr(Worker, "open", open_)
    monkeypatch.setattr(main, "_run_kind", run_kind)
    monkeypatch.setattr(telemetry, "serve", serve)
    return r


URLS = {k: (f"nats://{k}@h", f"redis://{k}@h", f"key-{k}") for k in ("parser", "gateway", "controller")}


async def test_a_group_runs_each_kind_as_its_own_worker_until_stopped(rig: Rig) -> None:
    stop = asyncio.Event()
    run = asyncio.create_task(main.run_group(["parser", "gateway", "controller"], URLS, stop=stop))
    while len(rig.opened) < 3 or not rig.served:
        await asyncio.sleep(0.01)
    assert rig.urls == URLS  # each kind its own URLs and event key
    assert rig.served == [("parser+gateway+controller", ["parser", "gateway", "controller"])]  # one /metrics
    stop.set()  # what SIGTERM/SIGINT do
    await asyncio.wait_for(run, 5)
    assert sorted(rig.stopped) == ["controller", "gateway", "parser"]
    assert all(w.closed for w in rig.opened.values())


async def test_a_kind_that_crashes_stops_the_others_and_fails_the_group(rig: Rig) -> None:
    rig.crash = "gateway"
    with pytest.raises(main.KindStopped, match="gateway"):
        await asyncio.wait_for(main.run_group(["parser", "gateway", "controller"], URLS, stop=asyncio.Event()), 5)
    assert sorted(rig.stopped) == ["controller", "parser"] and all(w.closed for w in rig.opened.values())


async def test_a_kind_that_cannot_start_fails_the_group(rig: Rig) -> None:
    rig.fail_open = "controller"
    with pytest.raises(main.KindStopped, match="controller"):
        await asyncio.wait_for(main.run_group(["parser", "gateway", "controller"], URLS, stop=asyncio.Event()), 5)
    assert set(rig.opened) == {"parser", "gateway"} and all(w.closed for w in rig.opened.values())


async def test_a_kind_whose_run_ends_on_its_own_fails_the_group(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    async def quits(w: FakeWorker, kind: str, cluster: str | None, stop: asyncio.Event) -> None:
        if kind != "parser":
            await stop.wait()

    monkeypatch.setattr(main, "_run_kind", quits)
    with pytest.raises(main.KindStopped, match="parser stopped on its own"):
        await asyncio.wait_for(main.run_group(["parser", "gateway"], URLS, stop=asyncio.Event()), 5)


async def test_a_group_refuses_unknown_or_repeated_kinds() -> None:
    with pytest.raises(ValueError, match="unknown"):
        await main.run_group(["parser", "nope"], {})
    with pytest.raises(ValueError, match="twice"):
        await main.run_group(["parser", "parser"], {})


async def test_only_the_kinds_that_read_the_inventory_take_its_hints() -> None:
    """One hint per reservation: a kind that never reads the inventory must not take them (each
    would be delivered to it and decoded for nothing); one that does must, or its view goes stale."""
    from pathlib import Path

    import fakeredis

    from aios_blocks import workers
    from aios_blocks.bus import subjects
    from aios_blocks.policies.runtime import PolicyRuntime
    from aios_blocks.state.inventory import Inventory
    from aios_blocks.state.store import Store
    from aios_blocks.testing import MemoryBus
    from aios_blocks.workers.base import INVENTORY_KINDS

    assert INVENTORY_KINDS == {"gateway", "controller"}
    pkg = Path(workers.__file__).parent.parent
    for module in ("workers/parser", "agent/fleet", "workers/executor", "workers/checker", "workers/collector", "workers/autoscaler"):
        assert ".inventory" not in (pkg / f"{module}.py").read_text(), f"{module} reads the inventory: add its kind"
    for inventory in (True, False):
        bus = MemoryBus()
        store = Store(fakeredis.aioredis.FakeRedis(decode_responses=True))
        w = Worker(bus, store, Inventory(store), PolicyRuntime(), "k")  # type: ignore[arg-type]
        await w._watch_hints(inventory=inventory)
        taken = {pattern for pattern, _ in bus._subs}
        assert (subjects.INVENTORY_ALL in taken) is inventory and subjects.POLICY_UPDATED_ALL in taken
        await store.close()


async def test_a_kind_settles_its_heap_once_started_and_before_it_takes_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_kind`` freezes what lives once the kind has started (the warmed inventory
    included) before its consumers run: a full collection in a burst no longer walks it."""
    import gc

    from aios_blocks.workers import base, parser

    order: list[str] = []
    monkeypatch.setattr(parser, "bindings", lambda w: [])
    monkeypatch.setattr(main, "settle_heap", lambda: order.append("settle"))

    async def consumers(w: Any, binds: Any, stop: asyncio.Event) -> None:
        order.append("consumers")

    monkeypatch.setattr(base, "run_consumers", consumers)
    await main._run_kind(FakeWorker("parser", None), "parser", None, asyncio.Event())  # type: ignore[arg-type]
    assert order == ["settle", "consumers"]
    before = gc.get_freeze_count()
    kept = [{"n": i} for i in range(100)]
    try:
        monkeypatch.undo()
        main.settle_heap()
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()
