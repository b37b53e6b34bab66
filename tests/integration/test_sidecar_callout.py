"""Side-cars on an external NATS: a user per block through auth callout (docs/security.md
"Side-cars on your own NATS: auth callout"). A separate nats-server plays the operator's own
server: config-file accounts that we do not rewrite, JetStream, and the ``auth_callout`` block
``blocks sidecar-auth init`` prints. The service (``runtime.sidecar_callout``) answers its callouts
and a node agent's grant requests; block A's side-car user makes, pulls and acks its own durable on
``AIOS_OUTPUTS`` and reaches nothing of block B's; a wrong or missing credential is refused, and
the service says why; the configured users (the admin, the agent) log in without the service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from aios_blocks.bus import event_ids, subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.nats_bus import connect as nats_connect
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import nats_binary
from aios_blocks.runtime.sidecar_callout import (
    CALLOUT_ACCOUNT,
    XKEY_HEADER,
    CalloutSidecarUsers,
    Registry,
    SidecarAuthService,
    config_block,
    service_user_conf,
    xkey_public,
)
from aios_blocks.schemas.events import BlockStatusReport, Parsed, SidecarCommand

from .test_sidecar_users import raw

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class External:
    url: str  # no credentials
    reg: Registry
    proc: subprocess.Popen[bytes]

    def as_(self, user: str, password: str) -> str:
        return auth.with_userinfo(self.url, user, password)


@pytest.fixture
def external(tmp_path: Path) -> Iterator[External]:
    """The operator's server: the system's users in account AIOS (the admin, the service, node
    agent n1 with its grant rights), the callout block as printed, JetStream."""
    reg = Registry.load(tmp_path / "sidecar-auth")
    port = _free_port()
    agent = auth.permissions("agent", node="n1")
    assert agent is not None
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
        f"accounts {{\n  AIOS: {{ jetstream: enabled, users: [\n    {{user: admin, password: apw}},\n"
        f"    {service_user_conf('spw')},\n    {{user: agent-n1, password: npw, permissions: {agent.conf()}}}\n  ]}}\n"
        f"  {CALLOUT_ACCOUNT}: {{}}\n}}\n"
        + config_block(reg.issuer, xkey_public(reg.xkey_private)))
    proc = subprocess.Popen([nats_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "nats.log", "wb"))
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        assert proc.poll() is None, (tmp_path / "nats.log").read_text()
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.05)
    try:
        yield External(f"nats://127.0.0.1:{port}", reg, proc)
    finally:
        proc.terminate()
        proc.wait(10)


async def _refused(url: str) -> str:
    """The error of a login the server refuses."""
    try:
        nc = await nats.connect(servers=[url], allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)
    except Exception as exc:
        return str(exc)
    await nc.close()
    return ""


async def test_a_blocks_sidecar_reaches_only_its_own_outputs_on_an_external_server(external: External) -> None:
    admin = await nats.connect(external.as_("admin", "apw"), inbox_prefix="_INBOX.admin")
    service = await nats_connect(external.as_("sidecar-auth", "spw"), "test/sidecar-auth")
    svc = SidecarAuthService(service, external.reg)
    await svc.start()
    agent = await nats_connect(external.as_("agent-n1", "npw"), "test/agent-n1")
    ab = Bus(await nats_connect(external.as_("admin", "apw"), "test/admin"), "test/admin", event_key=event_ids.new_key())
    buses: list[Bus] = [ab]
    a = None
    try:
        ajs = admin.jetstream(timeout=10)
        await ab.ensure_stream()
        for bid in ("ba", "bb"):
            await ajs.publish(f"aios.output.{bid}.ok", json.dumps({"block_id": bid}).encode())

        async def started(bid: str, name: str, node: str = "n1") -> int:
            """The controller's start command for the side-car, stored: its stream sequence."""
            return int((await ab.emit(E.node_sidecar_start, SidecarCommand(bid, 1, "c1", node, name))).seq)

        seq = {(bid, name): await started(bid, name) for bid, name in (("ba", "store"), ("bb", "store"), ("a", "b-x"),
                                                                       ("a-b", "x"))}
        elsewhere = await started("bb", "alert", "n2")
        # the agent asks the service for each block's side-car user (its private inbox gets it),
        # naming the stored command it runs
        users = CalloutSidecarUsers(agent, asyncio.get_running_loop(), external.url)

        def grant(bid: str, name: str, at: int) -> Any:
            return asyncio.to_thread(users.grant, bid, name, "n1", at)

        url_a, url_b = await grant("ba", "store", seq["ba", "store"]), await grant("bb", "store", seq["bb", "store"])
        assert auth.url_user(url_a) == "sidecar-ba" and auth.url_user(url_b) == "sidecar-bb"
        assert await grant("ba", "store", seq["ba", "store"]) == url_a  # the same again
        await grant("a", "b-x", seq["a", "b-x"])
        with pytest.raises(RuntimeError, match="is block a's already"):  # one durable name, two blocks
            await grant("a-b", "x", seq["a-b", "x"])
        # only what a stored command sent to this node
        for bid, name, at, why in (("ba", "alert", 0, "no node.sidecar.start command named"),
                                   ("bb", "store", seq["ba", "store"], "does not start side-car 'store' of block 'bb'"),
                                   ("ba", "store", seq["bb", "store"], "does not start side-car 'store' of block 'ba'"),
                                   ("bb", "alert", elsewhere, "on node 'n1'"),
                                   ("bb", "alert", 10**6, "no stored command at sequence 1000000")):
            with pytest.raises(RuntimeError, match=why):
                await grant(bid, name, at)
        assert sorted(external.reg.blocks) == ["a", "ba", "bb"] and external.reg.blocks["bb"]["names"] == ["store"]

        for u in (url_a, url_b):
            buses.append(Bus(await nats_connect(u, "test/sidecar"), "test/sidecar", event_key=event_ids.new_key()))
        a_bus, b_bus = buses[1:]
        for bus, bid in ((a_bus, "ba"), (b_bus, "bb")):  # as the SDK does
            await bus.ensure_sidecar_consumer(subjects.sidecar(bid, "store"), 5, 30.0)
        puller = await a_bus.js.pull_subscribe_bind(durable=subjects.sidecar_durable("ba", "store"),
                                                    stream=subjects.STREAM_OUTPUTS)
        (msg,) = await puller.fetch(1, timeout=10)
        assert msg.subject == "aios.output.ba.ok"
        await msg.ack_sync()

        a = await raw(url_a)
        so, theirs = subjects.STREAM_OUTPUTS, subjects.sidecar_durable("bb", "store")
        mine = subjects.sidecar_durable("ba", "store")
        for subject in (f"$JS.API.CONSUMER.CREATE.{so}.{theirs}.aios.output.bb.>",
                        f"$JS.API.CONSUMER.CREATE.{so}.{mine}.aios.output.bb.>",
                        f"$JS.API.CONSUMER.DURABLE.CREATE.{so}.{mine}", f"$JS.API.CONSUMER.CREATE.{so}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{so}.{theirs}", f"$JS.API.CONSUMER.INFO.{so}.{theirs}",
                        f"$JS.API.CONSUMER.DELETE.{so}.{theirs}", f"$JS.ACK.{so}.{theirs}.1.2.2.0.0",
                        "aios.block.bb.sidecar.store.alert", "aios.dlq.sidecar-bb-store.aios.output.bb.ok",
                        "aios.output.bb.dlq.store.ok", "aios.output.bb.ok", "$SYS.REQ.USER.AUTH", subjects.node_sidecar_grant("n1")):
            await a.nc.publish(subject, b"{}")
            assert await a.denied(subject), subject
        for subject in ("aios.output.bb.>", "aios.output.>", "_INBOX.sidecar-bb.>", "_INBOX.agent-n1.>", ">"):
            await a.nc.subscribe(subject)
            assert await a.denied(subject, "subscription"), subject
        assert (await ajs.consumer_info(so, theirs)).num_pending == 1  # B's output still waits for B

        # the server's requests carry the password encrypted to the service's xkey: a user allowed to
        # listen on the callout subject (here the admin) reads no password
        pw_a = url_a.split("@")[0].rsplit(":", 1)[1]
        seen = await admin.subscribe("$SYS.REQ.USER.AUTH")
        await admin.flush()
        assert await asyncio.to_thread(auth.nats_login, url_a)
        req = await seen.next_msg(timeout=10)
        assert req.data.startswith(b"xkv1") and pw_a.encode() not in req.data
        assert (req.headers or {}).get(XKEY_HEADER, "").startswith("X")
        await seen.unsubscribe()
        # wrong or missing credentials: refused by the server, the reason in the service's log
        for url, why in ((external.as_("sidecar-ba", "nope"), "wrong password for 'sidecar-ba'"),
                         (external.as_("sidecar-bb", pw_a), "wrong password for 'sidecar-bb'"),
                         (external.as_("sidecar-zz", pw_a), "'sidecar-zz' is no running block's side-car user"),
                         (external.as_("agent-n1", "nope"), "'agent-n1' is no running block's side-car user"),
                         (external.url, "no user name")):
            assert "authorization violation" in (await _refused(url)).lower(), url
            assert any(why in r for r in svc.refused), (why, svc.refused)
        # the block goes with its last node: its password no longer logs in
        assert await asyncio.to_thread(users.release, "ba", "n1") is True
        assert "authorization violation" in (await _refused(url_a)).lower()
        assert await asyncio.to_thread(auth.nats_login, url_b)
    finally:
        if a is not None:
            await a.nc.close()
        for bus in buses:
            await bus.close()
        await svc.stop()
        for nc in (agent, service, admin):
            await nc.close()


async def test_a_grant_of_a_start_command_the_stream_later_undid_is_refused(external: External) -> None:
    """A stored start command no longer grants once a later stored event undid it: its block deleted,
    re-created (another generation) or its side-car stopped on that node. Events of other blocks,
    other side-cars, other nodes and the controller's ``parsed`` again of the same generation leave
    a grant valid; so does a start sent after the stop."""
    service = await nats_connect(external.as_("sidecar-auth", "spw"), "test/sidecar-auth")
    svc = SidecarAuthService(service, external.reg)
    await svc.start()
    agent = await nats_connect(external.as_("agent-n1", "npw"), "test/agent-n1")
    ab = Bus(await nats_connect(external.as_("admin", "apw"), "test/admin"), "test/admin", event_key=event_ids.new_key())
    try:
        await ab.ensure_stream()

        async def emit(event: Any, payload: Any, qualifier: str = "", msg_id: str | None = None) -> int:
            return int((await ab.emit(event, payload, qualifier=qualifier, msg_id=msg_id)).seq)

        def start(bid: str, name: str, gen: int = 1, node: str = "n1", again: bool = False) -> Any:
            msg_id = f"{bid}:{gen}:sidecar.start:{name}:again" if again else None  # not a duplicate of the first
            return emit(E.node_sidecar_start, SidecarCommand(bid, gen, "c1", node, name), msg_id=msg_id)

        def stop(bid: str, name: str, gen: int = 1, node: str = "n1") -> Any:
            return emit(E.node_sidecar_stop, SidecarCommand(bid, gen, "c1", node, name, {}, "deleted"), node)

        users = CalloutSidecarUsers(agent, asyncio.get_running_loop(), external.url)

        def grant(bid: str, name: str, at: int) -> Any:
            return asyncio.to_thread(users.grant, bid, name, "n1", at)

        s_del, s_new, s_stop, s_keep = (await start("bdel", "store"), await start("bnew", "store"),
                                        await start("bstop", "store"), await start("bkeep", "store"))
        s_keep2 = await start("bkeep", "alert")
        await emit(E.block_deleted, BlockStatusReport("bdel", 1, "deleted"))
        await emit(E.block_parsed, Parsed("bnew", 2, {}))
        await stop("bstop", "store")
        # none of these undoes bkeep's side-cars on n1
        await emit(E.block_parsed, Parsed("bkeep", 1, {}, 1))  # back to selection, same generation
        await stop("bkeep", "store", node="n2")
        await stop("bkeep", "other")
        await emit(E.block_deleted, BlockStatusReport("bother", 1, "deleted"))
        await grant("bkeep", "store", s_keep)
        await grant("bkeep", "alert", s_keep2)
        for bid, at, why in (("bdel", s_del, f"block 'bdel' was deleted \\(sequence \\d+\\) after the start command "
                                             f"at sequence {s_del}"),
                             ("bnew", s_new, "block 'bnew' was re-created \\(generation 2"),
                             ("bstop", s_stop, "side-car 'store' of block 'bstop' was stopped on node 'n1'")):
            with pytest.raises(RuntimeError, match=why):
                await grant(bid, "store", at)
            assert any(why.split(" \\(")[0] in r for r in svc.refused), (why, svc.refused)
        assert sorted(external.reg.blocks) == ["bkeep"]
        # the side-car started again after its stop (and the new generation's start) are granted
        await grant("bstop", "store", await start("bstop", "store", again=True))
        await grant("bnew", "store", await start("bnew", "store", gen=2))
        assert sorted(external.reg.blocks) == ["bkeep", "bnew", "bstop"]
    finally:
        await ab.close()
        await svc.stop()
        for nc in (agent, service):
            await nc.close()


async def test_without_the_service_no_sidecar_logs_in_and_configured_users_still_do(external: External) -> None:
    """The callout is the only way in for a side-car: with the service down its login is refused
    (the server's callout times out), while the configured users do not depend on the service."""
    external.reg.grant("ba", "store", "n1")
    password = external.reg.blocks["ba"]["password"]
    assert "authorization violation" in (await _refused(external.as_("sidecar-ba", password))).lower()
    for user, pw in (("admin", "apw"), ("agent-n1", "npw"), ("sidecar-auth", "spw")):
        assert await asyncio.to_thread(auth.nats_login, external.as_(user, pw)), user


async def test_a_remote_agents_sidecar_logs_in_as_its_blocks_user_and_stores_outputs(external: External,
                                                                                    tmp_path: Path) -> None:
    """The whole remote path: `blocks sidecar-auth serve` and `blocks agent` on the external server
    as their configured users, the agent with ``AIOS_SIDECAR_AUTH=callout``: it gets a start command
    from the stream, asks the service for the block's user, and runs the SQLite side-car, which logs in through the callout and stores
    its block's outputs only; the stop command stops it, deletes its consumer and lets the block go."""
    from aios_blocks.schemas.events import TaskOutput
    from aios_blocks.schemas.spec import Sidecar

    from .test_agent import until
    from .test_sidecars import STORE, stored

    admin = Bus(await nats_connect(external.as_("admin", "apw"), "test/admin"), "test/admin", event_key=event_ids.new_key())
    await admin.ensure_stream()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    state = external.reg.path.parent
    service = _spawn(tmp_path / "service.log", {**env, "AIOS_NATS_URL": external.as_("sidecar-auth", "spw")},
                     "sidecar-auth", "serve", "--state-dir", str(state))
    agent = _spawn(tmp_path / "agent.log", {**env, "AIOS_NATS_URL": external.as_("agent-n1", "npw"),
                                            "AIOS_SIDECAR_AUTH": "callout", "AIOS_SIDECAR_RESTART_S": "0.2"},
                   "agent", "--node-id", "n1", "--cluster", "c1", "--runtime", "process", "--sim-gpus", "1", "--cpu", "2",
                   "--memory", "1024", "--heartbeat-s", "0.5", "--agent-dir", str(tmp_path / "agent"))
    db = tmp_path / "outputs.db"
    spec = Sidecar.model_validate({"name": "store", "command": STORE, "parameters": {"path": str(db)}, "ackWaitS": 2,
                                   "stopGraceS": 1}).model_dump()
    cmd = SidecarCommand("ba", 1, "c1", "n1", "store", spec)
    durable = subjects.sidecar_durable("ba", "store")
    try:
        await admin.emit(E.node_sidecar_start, cmd)
        for bid, task in (("ba", "t1"), ("bb", "t2"), ("ba", "t3")):
            await admin.emit(E.block_output, TaskOutput(bid, task, f"{bid}-0", 200, "hello", gen=1))
        await until(lambda: _async(set(stored(db)) >= {"t1", "t3"}), 90,
                    f"ba's outputs stored; agent log: {(tmp_path / 'agent.log').read_text()[-3000:]}")
        assert set(stored(db)) == {"t1", "t3"} and "ba" in Registry.load(state).blocks
        await admin.emit(E.node_sidecar_stop, SidecarCommand("ba", 1, "c1", "n1", "store", spec, "deleted"))

        async def gone() -> bool:
            try:
                await admin.js.consumer_info(subjects.STREAM_OUTPUTS, durable)
                return False
            except nats.js.errors.NotFoundError:
                return "ba" not in Registry.load(state).blocks
        await until(gone, 60, "the side-car's consumer deleted and its block released")
    finally:
        for proc in (agent, service):
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
        await admin.close()


def _spawn(log_file: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    """``blocks ARGS`` in the background, its output in ``log_file``."""
    with open(log_file, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "aios_blocks.cli", *args], env=env, stdout=log, stderr=log,
                                start_new_session=True)


async def _async(value: bool) -> bool:
    return value
