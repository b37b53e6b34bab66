"""Security of the embedded setup on real servers: every role's denials (NATS permissions, Redis
ACLs), private inboxes, node agents added at run time, TLS, and secrets never in logs or output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import redis.asyncio as aioredis
import structlog
from nats.aio.client import Client as NC
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from aios_blocks.bus import event_ids, subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.nats_bus import connect as nats_connect
from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import kind_var
from aios_blocks.schemas.events import Dangling, Heartbeat
from aios_blocks.state.store import Store
from aios_blocks.workers.base import Worker
from aios_blocks.workers.health import HealthMonitor

from .conftest import COMPONENT, Conn, System

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServers]:
    s = EmbeddedServers(data_dir=tmp_path_factory.mktemp("secure"), auth=True).start()
    try:
        yield s
    finally:
        s.stop()


async def stored(admin: Bus, subject: str, stream: str = subjects.STREAM) -> bool:
    try:
        await admin.js.get_last_msg(stream, subject)
        return True
    except NotFoundError:
        return False


@pytest.fixture
async def admin(servers: EmbeddedServers) -> AsyncIterator[Bus]:
    bus = await Bus.open(servers.nats_url)
    yield bus
    await bus.close()


# -- NATS: each role's denials ----------------------------------------------------------------------
async def test_upstream_publisher_may_only_publish_block_creates(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    up = await connect(servers.endpoints.nats_url("upstream"))
    ack = await up.nc.jetstream().publish("aios.block.up-1.create", b'{"blockComponentURI": "x"}')
    # creates are kept as sent in AIOS_INTAKE (the parser stores each in AIOS as a submitted CloudEvent)
    assert ack.stream == subjects.STREAM_INTAKE and await stored(admin, "aios.block.up-1.create", subjects.STREAM_INTAKE)
    for subject in ("aios.block.up-1.delete", "aios.block.up-1.ready", "aios.cluster.c1.allocation",
                    "aios.node.n1.instance.create", "aios.policy.p.updated", "aios.dlq.parser.x"):
        await up.nc.publish(subject, b"{}")
        assert await up.denied(subject), subject
        assert not await stored(admin, subject), subject
    # no reading of events nor of other users' reply subjects
    for subject in ("aios.>", "aios.block.*.create", "_INBOX.>", "_INBOX.controller.>"):
        await up.nc.subscribe(subject)
        assert await up.denied(subject, "subscription"), subject
    # no JetStream API: the stream survives a delete attempt
    await up.nc.publish(f"$JS.API.STREAM.DELETE.{subjects.STREAM}", b"")
    assert await up.denied(f"$JS.API.STREAM.DELETE.{subjects.STREAM}")
    assert (await admin.js.stream_info(subjects.STREAM)).config.name == subjects.STREAM


async def test_an_upstream_publishers_burst_of_creates_is_stored_in_atomic_batches(servers: EmbeddedServers, admin: Bus) -> None:
    """``Client.create``'s path (``Bus.emit_together``) as the upstream role, which may not read
    the stream's config: creates gathered at once are stored as atomic batches (the batch
    headers and the commit's reply need nothing more than publishing creates), each ack its own."""
    from aios_blocks.bus.catalog import E

    up = await Bus.open(servers.endpoints.nats_url("upstream"), event_key="0f" * 16)
    try:
        bids = [f"up-burst-{i}" for i in range(30)]
        acks = await asyncio.gather(*(up.emit_together(E.block_create, {"blockComponentURI": "x", "blockId": b},
                                                       msg_id=f"create:{b}", bid=b) for b in bids))
        batches = set()
        for b, ack in zip(bids, acks, strict=True):
            msg = await admin.js.get_msg(subjects.STREAM_INTAKE, ack.seq)
            assert msg.subject == f"aios.block.{b}.create" and json.loads(msg.data)["data"]["blockId"] == b
            batches.add((msg.headers or {}).get("Nats-Batch-Id"))
        assert len(batches) == 1 and None not in batches and not up._no_atomic
    finally:
        await up.close()


async def test_node_agent_publishes_only_its_own_node_and_instance_facts(
    servers: EmbeddedServers, admin: Bus, connect: Any
) -> None:
    pid = servers.procs[0].pid
    url = auth.ensure_agent(servers.data_dir, "n1")
    assert servers.procs[0].pid == pid and servers.procs[0].poll() is None  # added by reload, no restart
    ag = await connect(url)
    js = ag.nc.jetstream(timeout=5)
    for subject in ("aios.node.n1.registered", "aios.node.n1.instance.dangling", "aios.block.b1.instance.i1.added",
                    "aios.block.b1.instance.i1.failed"):
        await js.publish(subject, b"{}")
        assert await stored(admin, subject), subject
    for subject in ("aios.node.n2.registered", "aios.node.n2.heartbeat", "aios.node.n2.instance.dangling",
                    "aios.node.n1.instance.create", "aios.node.n1.health", "aios.block.b1.ready",
                    "aios.block.b1.create", "aios.block.b1.instance.i1.stolen", "aios.cluster.c1.inventory"):
        await ag.nc.publish(subject, b"{}")
        assert await ag.denied(subject), subject
        assert not await stored(admin, subject), subject
    for subject in ("aios.block.>", "aios.node.n2.instance.create", "aios.node.*.expected", "_INBOX.>", "_INBOX.agent-n2.>"):
        await ag.nc.subscribe(subject)
        assert await ag.denied(subject, "subscription"), subject

    # JetStream: its own durable only (create, bind, fetch, ack) - not another node's, not a worker's
    await Bus(ag.nc).ensure_consumer(subjects.agent("n1"))
    await admin.publish_raw(subjects.node_command("n1", "instance.create"), b"{}", msg_id="sec-cmd-n1")
    await admin.publish_raw(subjects.node_command("n2", "instance.create"), b"{}", msg_id="sec-cmd-n2")
    sub = await js.pull_subscribe_bind(durable="agent-n1", stream=subjects.STREAM)
    msgs = await sub.fetch(10, timeout=5)
    assert [m.subject for m in msgs] == ["aios.node.n1.instance.create"]
    await msgs[0].ack()
    for api in (f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM}.agent-n2",
                f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.parser",
                f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_INTAKE}.parser",
                f"$JS.API.CONSUMER.DELETE.{subjects.STREAM}.agent-n2",  # its own it may replace, no other
                f"$JS.API.STREAM.PURGE.{subjects.STREAM}"):
        await ag.nc.publish(api, b"{}")
        assert await ag.denied(api), api
    with pytest.raises(NotFoundError):
        await admin.js.consumer_info(subjects.STREAM, "agent-n2")
    assert (await admin.js.consumer_info(subjects.STREAM_INTAKE, "parser")).num_waiting == 0


async def test_node_agent_users_survive_a_server_restart(tmp_path: Path, connect: Any) -> None:
    s = EmbeddedServers(data_dir=tmp_path, auth=True).start()
    try:
        url = auth.ensure_agent(s.data_dir, "gpu-7")
        assert auth.ensure_agent(s.data_dir, "gpu-7") == url  # idempotent: same credentials
        s.stop()
        s.start()
        ag = await connect(url)
        await ag.nc.jetstream(timeout=5).publish("aios.node.gpu-7.registered", b"{}")
        with pytest.raises(ValueError):
            auth.ensure_agent(s.data_dir, "gpu.7")  # a node id is a subject token
    finally:
        s.stop()


async def test_observer_reads_events_and_state_but_writes_nothing(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    ep = servers.endpoints
    await admin.publish_raw("aios.block.obs-1.ready", b'{"x": 1}', msg_id="obs-1-ready")
    redis_admin = Store.open(servers.redis_url)
    await redis_admin.r.hset("aios:block:obs-1", mapping={"status": "ready"})
    observer_redis = ep.redis_url("observer")
    assert observer_redis is not None
    client = await Client.open(ep.nats_url("observer"), observer_redis)
    try:
        history = await client.history("obs-1")
        assert [s for s, _, _ in history] == ["aios.block.obs-1.ready"]
        # account info (the Node client's jetstreamManager() asks it first) and `blocks check` /
        # `blocks state digest --stream`, which read the stream through a consumer (named: the
        # only kind an observer may make; an unnamed one timed out after 10 s)
        assert (await client.bus.nc.request("$JS.API.INFO", b"", timeout=5)).data.startswith(b"{")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AIOS_")},
               "AIOS_NATS_URL": ep.nats_url("observer"), "AIOS_REDIS_URL": observer_redis}
        for args in (("state", "digest", "--stream"), ("check", "--live", "--json")):
            r = await asyncio.to_thread(subprocess.run, [str(BIN / "blocks"), *args], env=env, capture_output=True,
                                        text=True, timeout=60)
            assert "timeout" not in r.stderr.lower() and "Traceback" not in r.stderr, (args, r.stderr)
            assert r.returncode in (0, 1) and r.stdout.strip(), (args, r.returncode, r.stderr)
        assert (await client.store.get_block("obs-1"))["status"] == "ready"
        with pytest.raises(NoPermissionError):
            await client.store.r.hset("aios:block:obs-1", "status", "failed")
        with pytest.raises(NoPermissionError):
            await client.store.r.flushall()
    finally:
        await client.close()
        await redis_admin.close()

    ob = await connect(ep.nats_url("observer"))
    await ob.nc.publish("aios.block.obs-1.create", b"{}")
    assert await ob.denied("aios.block.obs-1.create")
    for api in (f"$JS.API.CONSUMER.DELETE.{subjects.STREAM}.parser", f"$JS.API.STREAM.DELETE.{subjects.STREAM}",
                f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.gateway", f"$JS.ACK.{subjects.STREAM}.parser.1.1.1.1.1.1"):
        await ob.nc.publish(api, b"{}")
        assert await ob.denied(api), api
    # a worker's consumer is out of reach: creating one under its name is refused too
    for api in (f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM}.lifecycle",
                f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}.controller.aios.>"):
        await ob.nc.publish(api, b"{}")
        assert await ob.denied(api), api


async def test_observers_keep_durable_and_ephemeral_consumers_of_their_own(servers: EmbeddedServers, admin: Bus,
                                                                             connect: Any) -> None:
    """What docs/security.md promises observers, with nats-py as a third-party client: pull and
    push, durable and ephemeral; never a worker's consumer."""
    ep = servers.endpoints
    await admin.publish_raw("aios.block.obs-2.ready", b'{"x": 2}', msg_id="obs-2-ready")
    ob = await connect(ep.nats_url("observer"))
    js = ob.nc.jetstream(timeout=5)
    subject = "aios.block.obs-2.>"
    # named after its user (observer_1 .. observer_32: docs/security.md "Observers: a user each")
    durable = await js.pull_subscribe(subject, durable="observer_11", stream=subjects.STREAM)
    # ephemeral ones are named too (the unnamed create is refused: see below; nats-py's
    # pull_subscribe names an ephemeral one itself, so it is made first, then bound)
    await js.add_consumer(subjects.STREAM, ConsumerConfig(name="observer_12", filter_subject=subject, inactive_threshold=30))
    ephemeral = await js.pull_subscribe_bind("observer_12", stream=subjects.STREAM)
    for sub in (durable, ephemeral):
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.subject == "aios.block.obs-2.ready"
        await msg.ack()
    got: dict[str, asyncio.Future[Any]] = {"push-durable": asyncio.get_running_loop().create_future(),
                                           "push-ephemeral": asyncio.get_running_loop().create_future()}

    def cb(name: str) -> Any:
        async def on(msg: Any) -> None:
            if not got[name].done():
                got[name].set_result(msg.subject)
            await msg.ack()
        return on

    await js.subscribe(subject, durable="observer_13", cb=cb("push-durable"), stream=subjects.STREAM)
    await js.subscribe(subject, cb=cb("push-ephemeral"), stream=subjects.STREAM,
                       config=ConsumerConfig(name="observer_14", inactive_threshold=30))
    for name, fut in got.items():
        assert await asyncio.wait_for(fut, 10) == "aios.block.obs-2.ready", name
    info = await admin.js.consumer_info(subjects.STREAM, "observer_11")
    assert info.num_ack_pending == 0 and info.delivered.stream_seq > 0  # its own durable, acked
    await js.delete_consumer(subjects.STREAM, "observer_11")  # and removable by it
    for name in ("observer_12", "observer_13", "observer_14"):
        await js.delete_consumer(subjects.STREAM, name)
    # workers' consumers are untouched: their pending counts did not move, nothing was taken
    # (the parser's is on AIOS_INTAKE, the creates as sent, where observers have no rights at all)
    st = {"parser": subjects.STREAM_INTAKE, "lifecycle": subjects.STREAM}
    before = {d: (await admin.js.consumer_info(st[d], d)).num_pending for d in ("parser", "lifecycle")}
    for d in ("parser", "lifecycle"):
        stolen = await js.pull_subscribe_bind(d, stream=st[d])
        with pytest.raises(nats.errors.TimeoutError):  # the server drops the denied pull request
            await stolen.fetch(1, timeout=2)
    for d in ("parser", "lifecycle"):
        assert (await admin.js.consumer_info(st[d], d)).num_pending == before[d]
    assert await ob.denied(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_INTAKE}.parser")
    assert await ob.denied(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.lifecycle")
    # the unnamed create names its consumer in the body, which permissions cannot see: with it an
    # observer could narrow a worker's filter or make it expire. It is refused; the worker's is intact.
    parser_before = (await admin.js.consumer_info(subjects.STREAM_INTAKE, "parser")).config
    body = {"stream_name": subjects.STREAM_INTAKE, "config": {"name": "parser", "filter_subjects": ["aios.block.none.create"],
                                                      "inactive_threshold": 1_000_000_000, "ack_policy": "explicit"}}
    with pytest.raises(nats.errors.TimeoutError):
        await ob.nc.request(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}", json.dumps({**body, "stream_name": subjects.STREAM}).encode(),
                            timeout=2)
    assert await ob.denied(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}")
    with pytest.raises(nats.errors.TimeoutError):  # nor on AIOS_INTAKE, under any name
        await ob.nc.request(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_INTAKE}.parser", json.dumps(body).encode(), timeout=2)
    parser_after = (await admin.js.consumer_info(subjects.STREAM_INTAKE, "parser")).config
    assert parser_after.filter_subjects == parser_before.filter_subjects and not parser_after.inactive_threshold


async def test_no_observer_squats_a_future_agents_consumer_name(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    """Before node n9's agent exists its durable's name was not denied yet, and an observer could
    take it (a push consumer that expires). Observers now create only consumers named after their
    user: the squat is refused, and the agent makes its own when it comes."""
    ob = await connect(servers.endpoints.nats_url("observer"))
    squat = {"stream_name": subjects.STREAM, "config": {
        "name": "agent-n9", "deliver_subject": "_INBOX.observer.squat", "filter_subject": "aios.node.n9.>",
        "ack_policy": "none", "inactive_threshold": 3_600_000_000_000}}
    with pytest.raises(nats.errors.TimeoutError):
        await ob.nc.request(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}.agent-n9", json.dumps(squat).encode(), timeout=2)
    assert await ob.denied(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}.agent-n9")
    with pytest.raises(NotFoundError):
        await admin.js.consumer_info(subjects.STREAM, "agent-n9")
    agent = await Bus.open(auth.ensure_agent(servers.data_dir, "n9"), "aios-blocks/agent/n9")
    try:
        await agent.ensure_consumer(subjects.agent("n9"))
    finally:
        await agent.close()
    cfg = (await admin.js.consumer_info(subjects.STREAM, "agent-n9")).config
    assert not cfg.deliver_subject and not cfg.inactive_threshold and cfg.ack_policy == AckPolicy.EXPLICIT
    assert sorted(cfg.filter_subjects or []) == sorted(subjects.agent("n9").filters)
    await ob.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.agent-n9", b"{}")
    assert await ob.denied(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.agent-n9")


#: a subject no role may publish: its violation marks how far the server has answered
SENTINEL = "sentinel.no-role-publishes-this"


async def _allowed(conn: Conn, subject: str) -> bool:
    """Whether the server took the publish to ``subject`` just sent without a violation: a publish
    denied to every role is sent after it and its violation awaited (a connection's messages are
    checked, and violations reported, in order), then none may name ``subject``. (It waited the
    whole of ``denied``'s 5 s for a violation that never came.)"""
    await conn.nc.publish(SENTINEL, b"{}")
    assert await conn.denied(SENTINEL), f"{conn.user} may publish {SENTINEL}"
    needle = f'permissions violation for publish to "{subject}"'.lower()
    return not any(needle in e.lower() for e in conn.errors)


async def test_worker_roles_are_confined_to_their_own_subjects(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    ep = servers.endpoints
    parser = await connect(ep.nats_url("parser"))
    for subject in ("aios.block.w-1.ready", "aios.node.w1.instance.create", "aios.block.w-1.create"):
        await parser.nc.publish(subject, b"{}")
        assert await parser.denied(subject), subject
    await parser.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.controller", b"{}")
    assert await parser.denied(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.controller")
    gateway = await connect(ep.nats_url("gateway"))
    for subject in ("aios.node.w1.instance.create", "aios.block.w-1.placement", "aios.block.w-1.instance.i.added"):
        await gateway.nc.publish(subject, b"{}")
        assert await gateway.denied(subject), subject
    controller = await connect(ep.nats_url("controller"))
    for subject in ("aios.block.w-1.create", "aios.block.w-1.instance.i.added", "aios.node.w1.registered"):
        await controller.nc.publish(subject, b"{}")
        assert await controller.denied(subject), subject
    # any consumer name (its per-cluster durables are named at run time), but no other kind's: it
    # deleted the parser's and could pull the gateway's or ack for the parser (suppressing events)
    st = subjects.STREAM
    for subject in (f"$JS.API.CONSUMER.DELETE.{st}.{subjects.PARSER.durable}", f"$JS.API.CONSUMER.MSG.NEXT.{st}.{subjects.GATEWAY.durable}",
                    f"$JS.ACK.{st}.{subjects.PARSER.durable}.1.1.1.1.0", f"$JS.API.CONSUMER.DELETE.{st}.{subjects.MAPPER.durable}",
                    f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.{subjects.agent().durable}"):
        await controller.nc.publish(subject, b"{}")
        assert await controller.denied(subject), subject
    await controller.nc.publish(f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.controller-c9", b"{}")
    assert await _allowed(controller, f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.controller-c9")
    autoscaler = await connect(ep.nats_url("autoscaler"))  # targets and its decisions only: never a placement
    for subject in ("aios.cluster.w1.scale", "aios.node.w1.instance.create", "aios.block.w-1.ready"):
        await autoscaler.nc.publish(subject, b"{}")
        assert await autoscaler.denied(subject), subject
    await autoscaler.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.controller", b"{}")
    assert await autoscaler.denied(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.controller")
    for subject in ("aios.block.w-1.ready", "aios.node.w1.instance.create"):
        assert not await stored(admin, subject)
    # the health checker publishes its verdicts and failed ticks, nothing else (no command, no map write)
    checker = await connect(ep.nats_url("checker"))
    for subject in ("aios.node.w1.instance.restart", "aios.node.w1.instance.remove", "aios.cluster.c0.reassignment",
                    "aios.block.w-1.instance.i.failed", "$KV.aios-instances.w-1"):
        await checker.nc.publish(subject, b"{}")
        assert await checker.denied(subject), subject
    await checker.nc.publish("aios.block.w-1.instance.i.verdict", b"{}")
    assert await _allowed(checker, "aios.block.w-1.instance.i.verdict")
    for subject in ("aios.node.w1.instance.restart",):
        assert not await stored(admin, subject)
    # the executor's one event: the activator's request for a first instance of a block at zero
    executor = await connect(ep.nats_url("executor"))
    for subject in ("aios.cluster.w.scale", "aios.block.w-1.ready", "aios.block.w-1.instance.i.added"):
        await executor.nc.publish(subject, b"{}")
        assert await executor.denied(subject), subject
    await executor.nc.publish("aios.block.w-2.scale.target", b"{}")
    assert await _allowed(executor, "aios.block.w-2.scale.target")
    kv_stream = f"KV_{subjects.INSTANCE_BUCKET}"  # the bucket: made and read, never deleted or purged
    for subject in (f"$JS.API.STREAM.DELETE.{kv_stream}", f"$JS.API.STREAM.PURGE.{kv_stream}", f"$JS.API.STREAM.UPDATE.{kv_stream}"):
        await executor.nc.publish(subject, b"{}")
        assert await executor.denied(subject), subject
    assert await stored(admin, "aios.block.w-2.scale.target")


async def test_replies_reach_only_the_requester(servers: EmbeddedServers, connect: Any) -> None:
    """The controller answers an agent's ``expected`` request (allow_responses) on the agent's
    private inbox; another agent cannot listen there."""
    ep = servers.endpoints
    controller = await connect(ep.nats_url("controller"))

    async def serve(msg: Any) -> None:
        await msg.respond(b'{"instances": []}')

    await controller.nc.subscribe(subjects.EXPECTED_ALL, cb=serve)
    await controller.nc.flush()
    n1 = await connect(auth.ensure_agent(servers.data_dir, "n1"))
    reply = await n1.nc.request(subjects.node_expected("n1"), b"{}", timeout=5)
    assert reply.data == b'{"instances": []}'
    await n1.nc.publish(subjects.node_expected("n2"), b"{}")
    assert await n1.denied(subjects.node_expected("n2"))
    assert not controller.errors


async def _replay_onto(observer: Conn, stored_subject: str, deliver_subject: str, name: str) -> None:
    """What an observer can do: an ephemeral push consumer that delivers stored messages onto a core
    subject the stream does not capture (the deliver subject is in the body, which permissions
    cannot see). The server delivers once the subject has interest outside a queue group, which the
    observer provides itself (it may subscribe to ``aios.>``); the controllers' queue subscription
    then receives the messages too, each with a ``$JS.ACK.`` reply subject."""
    await observer.nc.subscribe(deliver_subject)
    await observer.nc.flush()
    config = {"name": name, "deliver_subject": deliver_subject, "filter_subject": stored_subject, "ack_policy": "none",
              "deliver_policy": "all", "inactive_threshold": 30_000_000_000}
    body = {"stream_name": subjects.STREAM, "config": config}
    reply = await observer.nc.request(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}.{name}", json.dumps(body).encode(), timeout=5)
    assert "error" not in json.loads(reply.data), reply.data


async def test_replayed_stream_messages_are_neither_heartbeats_nor_expected_requests(
    servers: EmbeddedServers, admin: Bus, connect: Any
) -> None:
    """The controller's health monitor drops a heartbeat with a reply subject and ignores an
    ``expected`` request whose reply starts with ``$JS.``; real ones still work."""
    ep = servers.endpoints
    redis_url = ep.redis_url("controller")
    assert redis_url is not None
    w = await Worker.open(ep.nats_url("controller"), redis_url, "controller")
    stop = asyncio.Event()
    monitor = asyncio.create_task(HealthMonitor(w, timeout_s=3600).run(stop))
    controller_acks: list[str] = []

    async def on_ack(msg: Any) -> None:
        controller_acks.append(msg.subject)

    await admin.nc.subscribe(f"$JS.ACK.{subjects.STREAM}.>", cb=on_ack)  # replies to replayed "requests" would land here
    try:
        await w.bus.nc.flush()
        # a heartbeat-shaped body stored by someone who may store things (upstream: block creates)
        up = await connect(ep.nats_url("upstream"))
        beat = msgspec.json.encode(Heartbeat("replayed", "c-x", 1, 1.0, 1, 1, 0))
        await up.nc.jetstream(timeout=5).publish("aios.block.hb-replay.create", beat)
        observer = await connect(ep.nats_url("observer"))
        await _replay_onto(observer, "aios.block.hb-replay.create", subjects.node_heartbeat("replayed"), "observer_21")
        await _replay_onto(observer, "aios.block.hb-replay.create", subjects.node_expected("replayed"), "observer_22")
        # a real heartbeat (plain publish, as agents send them) from a real agent user
        agent = await connect(auth.ensure_agent(servers.data_dir, "hb-real"))
        await agent.nc.publish(subjects.node_heartbeat("hb-real"), msgspec.json.encode(Heartbeat("hb-real", "c-x", 1, 1.0, 1, 1, 0)))
        reply = await agent.nc.request(subjects.node_expected("hb-real"), b"{}", timeout=5)
        assert json.loads(reply.data) == {"instances": {}}  # real requests are answered

        async def beats() -> dict[str, float]:
            return dict(await w.store.r.zrange("aios:heartbeats", 0, -1, withscores=True))

        async with asyncio.timeout(10):
            while "hb-real" not in await beats():
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # one more flush round
        assert "replayed" not in await beats()
        await admin.nc.flush()
        assert controller_acks == [], controller_acks  # the replayed request got no answer
    finally:
        stop.set()
        await monitor
        await w.close()


async def test_the_gateway_hears_no_responders_on_its_own_inbox(servers: EmbeddedServers, connect: Any) -> None:
    """A query goes out with a reply subject on the gateway's private inbox, only to hear NATS's
    *no responders*: the gateway role may subscribe there (no permission error), and the status
    arrives, so a query sent while no controller listens is sent again (``bus/queries.py``)."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import DryRunRequest

    gw = await connect(servers.endpoints.nats_url("gateway"))
    bus = Bus(gw.nc, "gateway")
    await bus.emit(E.cluster_dry_run, DryRunRequest("nobody-1", 1, "c-nobody"), cid="c-nobody")
    async with asyncio.timeout(10):
        while bus.query_sender.resent < 2:
            await asyncio.sleep(0.05)
    assert gw.errors == [], gw.errors
    bus.query_sender.close()


# -- `blocks worker` and `blocks agent` against a running `blocks up` --------------------------------
def _cli_env() -> dict[str, str]:
    """The environment of a command run next to `blocks up`: no server URLs, no role."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}


async def _reply_prefix_of(admin: NC, subject: str, start: Any, timeout: float = 60, answer: bytes | None = None) -> str:
    """The reply subject of the first request a process started by ``start()`` sends on ``subject``:
    its inbox prefix is ``_INBOX.<the NATS user it logged in as>``. ``answer``: the reply sent
    back to that request (as its responder would)."""
    got: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def cb(msg: Any) -> None:
        if not got.done():
            got.set_result(msg.reply)
            if answer is not None:
                await msg.respond(answer)

    sub = await admin.subscribe(subject, cb=cb)
    await admin.flush()
    proc = start()
    try:
        return await asyncio.wait_for(got, timeout)
    finally:
        await sub.unsubscribe()
        proc.terminate()
        await asyncio.to_thread(proc.wait, 20)


async def test_blocks_worker_connects_as_its_role(servers: EmbeddedServers, admin: Bus, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"

    def start() -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen([str(BIN / "blocks"), "worker", "parser", "--data-dir", str(servers.data_dir)],
                                    env=_cli_env(), stdout=out, stderr=out, start_new_session=True)

    reply = await _reply_prefix_of(admin.nc, f"$JS.API.CONSUMER.MSG.NEXT.{subjects.PARSER.stream}.{subjects.PARSER.durable}", start)
    assert reply.startswith("_INBOX.parser."), (reply, log.read_text()[-2000:])


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_blocks_agent_next_to_blocks_up_connects_as_its_node(tmp_path: Path, tls: bool) -> None:
    """Without AIOS_NATS_URL, `blocks agent` gets its node's own user from the data dir (added to the
    running server on first use) and the CA of a TLS server."""
    s = EmbeddedServers(data_dir=tmp_path / "d", auth=True, tls=tls).start()
    log = tmp_path / "agent.log"

    def start() -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                [str(BIN / "blocks"), "agent", "--node-id", "cli-n1", "--cluster", "c1", "--runtime", "sim", "--sim-gpus", "1",
                 "--agent-dir", str(tmp_path / "agent"), "--data-dir", str(s.data_dir)],
                env=_cli_env(), stdout=out, stderr=out, start_new_session=True,
            )

    admin_bus = Bus(await nats_connect(s.nats_url, "test/admin", s.endpoints.nats_ca))
    try:
        # answered as the controllers would (no instance expected there): unanswered, the agent sat in
        # its start-up reconcile, deaf to the SIGTERM that ends it here, for its 15 s reconcile wait
        reply = await _reply_prefix_of(admin_bus.nc, subjects.node_expected("cli-n1"), start, answer=b'{"instances": {}}')
        assert reply.startswith("_INBOX.agent-cli-n1."), (reply, log.read_text()[-2000:])
        assert "cli-n1" in auth.Secrets.load(s.data_dir, create=False).agents
        assert await stored(admin_bus, subjects.node_registered("cli-n1"))  # it published as that user
    finally:
        await admin_bus.close()
        s.stop()
    assert "Violation" not in (s.data_dir / "nats.log").read_text()


# -- Redis ------------------------------------------------------------------------------------------
async def test_redis_requires_credentials_and_confines_workers(servers: EmbeddedServers) -> None:
    ep = servers.endpoints
    anon = aioredis.from_url(ep.redis)
    with pytest.raises((AuthenticationError, ResponseError)):
        await anon.get("aios:x")
    await anon.aclose()
    bad = aioredis.from_url(auth.with_userinfo(ep.redis, "aios", "wrong-password"))
    with pytest.raises((AuthenticationError, ResponseError)):
        await bad.ping()
    await bad.aclose()
    worker_url = ep.redis_url("controller")
    assert worker_url is not None and "aios:" in worker_url
    w = aioredis.from_url(worker_url, decode_responses=True)
    try:
        assert await w.set("aios:sec:x", "1") and await w.get("aios:sec:x") == "1"
        for denied in (w.set("other:x", "1"), w.flushall(), w.config_get("*"), w.keys("*"), w.acl_list()):
            with pytest.raises(NoPermissionError):
                await denied
    finally:
        await w.aclose()
    assert ep.redis_url("upstream") is None  # no Redis at all for upstream publishers and node agents


# -- the running system ------------------------------------------------------------------------------
def _worker_users(system: System) -> dict[str, str]:
    """kind -> the NATS user (``kind:redis``: the Redis user) its process connects it as: a group
    process's per kind (``AIOS_NATS_URL_<KIND>``), and no URL of another role unsuffixed."""
    out = {}
    for key, proc in system.supervisor.procs.items():
        env = dict(
            line.split("=", 1) for line in Path(f"/proc/{proc.pid}/environ").read_bytes().decode().split("\0") if "=" in line
        )
        kinds = system.supervisor.kinds[key]
        if len(kinds) > 1:
            assert "AIOS_NATS_URL" not in env and "AIOS_REDIS_URL" not in env, kinds
        for kind in kinds:
            nats, redis = (env[kind_var(v, kind) if len(kinds) > 1 else v] for v in ("AIOS_NATS_URL", "AIOS_REDIS_URL"))
            out[kind] = auth.url_user(nats) or ""
            out[kind + ":redis"] = auth.url_user(redis) or ""
    return out


async def test_workers_run_as_their_roles_and_the_flow_needs_no_more(system: System) -> None:
    assert system.servers is not None and system.servers.auth
    users = _worker_users(system)
    for kind in ("parser", "gateway", "controller", "agent-sim", "autoscaler", "checker"):
        assert users[kind] == kind and users[kind + ":redis"] == "aios"
    await system.client.add_sim_cluster("c0", nodes=2, gpus=2)
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": COMPONENT["componentURI"], "minInstances": 2,
                                               "maxInstances": 3})
    assert kind == "ready"
    log = (system.data_dir / "nats.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]


async def test_a_responder_answers_only_an_inbox_so_no_requester_writes_through_it(system: System) -> None:
    """A responder publishes its answer through ``allow_responses``, which NATS grants for any
    reply subject the requester names. An upstream client that named a stored subject or a KV key
    as its task's reply had the executor store a forged ``ready`` or overwrite a block's instance
    map (or the system's event key); an agent did the same through the controller's ``expected``
    responder. Both now answer inboxes only."""
    assert system.servers is not None and system.servers.auth
    ep = system.servers.endpoints
    admin = system.client.bus
    up = await Bus.open(ep.nats_url("upstream"), "test/upstream")
    agent = await Bus.open(auth.ensure_agent(system.data_dir, "fn1"), "test/agent-fn1")
    try:
        # the executor serves (an unknown block is answered 404) and the controller answers `expected`
        # (its own process, which may start later: a request before it is "no responders")
        async with asyncio.timeout(60):
            while True:
                try:
                    answer = await up.nc.request(E.block_task.subject(bid="nosuch"), b"{}", timeout=2)
                    await agent.nc.request(subjects.node_expected("fn1"), b"{}", timeout=2)
                    if (answer.headers or {}).get("Aios-Status") == "404":
                        break
                except Exception:
                    await asyncio.sleep(0.2)
        forged = ["aios.block.victim.ready", "aios.block.victim2.parsed", f"$KV.{subjects.INSTANCE_BUCKET}.victim",
                  f"$KV.{event_ids.KV_BUCKET}.event"]
        for reply in forged:
            await up.nc.publish(E.block_task.subject(bid="nosuch"), b"{}", reply=reply)
        await agent.nc.publish(subjects.node_expected("fn1"), b"{}", reply="aios.block.victim3.ready")
        await agent.nc.publish(subjects.node_expected("fn1"), b"{}", reply=f"$KV.{subjects.INSTANCE_BUCKET}.victim3")
        # real requests, sent after the forged ones, are still answered
        assert (await up.nc.request(E.block_task.subject(bid="nosuch"), b"{}", timeout=10)).headers["Aios-Status"] == "404"
        assert json.loads((await agent.nc.request(subjects.node_expected("fn1"), b"{}", timeout=10)).data) == {"instances": {}}
        logs = system.data_dir / "logs"

        def refused() -> int:
            text = "".join(p.read_text() for p in logs.glob("*.log"))
            return text.count('"bus.reply_refused"') + text.count('"expected.ignored"')

        async with asyncio.timeout(30):  # each forged request was seen and refused
            while refused() < len(forged) + 2:
                await asyncio.sleep(0.2)
        for subject in ("aios.block.victim.ready", "aios.block.victim2.parsed", "aios.block.victim3.ready"):
            assert not await stored(admin, subject), subject
        for bucket, key in ((subjects.INSTANCE_BUCKET, "victim"), (subjects.INSTANCE_BUCKET, "victim3")):
            with contextlib.suppress(NotFoundError):  # no bucket at all is fine too
                kv = await admin.js.key_value(bucket)
                with pytest.raises(NotFoundError):
                    await kv.get(key)
        keys = await admin.js.key_value(event_ids.KV_BUCKET)
        assert b"error" not in (await keys.get("event")).value  # the key is still a key, not an answer
    finally:
        await up.close()
        await agent.close()


async def test_a_dangling_report_acts_only_on_the_node_of_its_subject(system: System) -> None:
    """An agent may publish only its own node's ``dangling`` subject; the controller takes the node
    from that subject, so a body naming another node cannot get that node's instance removed."""
    assert system.servers is not None
    # as `blocks agent` is started (its event key given: without one its bus asks the shared key's
    # bucket, which an agent may not read, and waits out that request before making its own)
    env = system.servers.agent_env("dn1")
    agent = await Bus.open(env["AIOS_NATS_URL"], "test/agent-dn1", event_key=env.get("AIOS_EVENT_KEY"))
    admin = system.client.bus
    try:
        lie = Dangling("dn2", "victim-0", "victim", 1, "process", "h-lie")
        await agent.publish(subjects.node_dangling("dn1"), "node.instance.dangling", lie, "dn1:dangling:lie")
        true = Dangling("dn1", "stray-0", "stray", 1, "process", "h-true")
        await agent.publish(subjects.node_dangling("dn1"), "node.instance.dangling", true, "dn1:dangling:true")
        log = system.data_dir / "logs" / os.path.basename(str(system.supervisor.log_file("controller")))  # its process's log
        async with asyncio.timeout(60):
            while not (await stored(admin, subjects.node_command("dn1", "instance.remove"))
                       and "instance.dangling_ignored" in log.read_text()):
                await asyncio.sleep(0.2)
        raw = await admin.js.get_last_msg(subjects.STREAM, subjects.node_command("dn1", "instance.remove"))
        assert json.loads(raw.data)["data"]["instance_id"] == "stray-0"  # unknown block: removed on its own node
        assert not await stored(admin, subjects.node_command("dn2", "instance.remove"))
        ignored = [json.loads(line) for line in log.read_text().splitlines() if "instance.dangling_ignored" in line]
        assert [(e["subject_node"], e["body_node"], e["instance"]) for e in ignored] == [("dn1", "dn2", "victim-0")]
    finally:
        await agent.close()


def _secrets(data_dir: Path) -> list[str]:
    s = json.loads((data_dir / "auth" / "secrets.json").read_text())
    return [v for group in ("nats", "redis", "agents") for v in s[group].values()]


def _run_briefly(argv: list[str], env: dict[str, str], refusals: int = 3, seconds: float = 60) -> str:
    """Output of a process that keeps retrying (a worker whose login is refused retries forever,
    every 0.5 s, each time with the same lines): until its parser has said it was refused
    ``refusals`` times (first attempts and retries), or ``seconds``. (It ran a fixed 6 s.)"""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(seconds, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if sum("authorization violation" in x.lower() and '"kind": "parser"' in x for x in lines) >= refusals:
                break
    finally:
        timer.cancel()
        proc.kill()
        rest, _ = proc.communicate(timeout=10)
    return "".join(lines) + (rest or "")


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def test_secrets_never_appear_in_logs_outputs_or_public_files(tmp_path: Path) -> None:
    data = tmp_path / "d"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    env["AIOS_LOG_LEVEL"] = "debug"
    up = subprocess.Popen([str(BIN / "blocks"), "up", "--data-dir", str(data)], env=env, stdout=subprocess.PIPE,  # noqa: ASYNC220
                          stderr=subprocess.STDOUT, start_new_session=True)
    outputs: list[str] = []
    try:
        assert up.stdout is not None
        first = await asyncio.wait_for(asyncio.to_thread(up.stdout.readline), 60)
        outputs.append(first.decode())
        assert first.startswith(b"up: NATS nats://admin:***@127.0.0.1:"), first
        comp = tmp_path / "comp.json"
        comp.write_text(json.dumps(COMPONENT))
        spec = tmp_path / "block.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "minInstances": 1, "maxInstances": 1,
                                    "blockId": "sec-b1"}))
        for args in (["component", "add", str(comp)], ["cluster", "add", "c1", "--nodes", "1", "--gpus", "2"],
                     ["submit", str(spec), "--wait"], ["list"], ["get", "sec-b1", "--json"], ["replay", "sec-b1"]):
            r = await asyncio.to_thread(subprocess.run, [str(BIN / "blocks"), *args, "--data-dir", str(data)], env=env,
                                        capture_output=True, text=True, timeout=120)
            outputs.append(r.stdout + r.stderr)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        # a worker given a wrong password says so without echoing it
        bad = auth.with_userinfo(auth.read_endpoints(data).nats, "parser", "WRONG-pass-0123456789")  # type: ignore[union-attr]
        said = await asyncio.to_thread(_run_briefly, [sys.executable, "-m", "aios_blocks.runtime.main", "parser"],
                                       {**env, "AIOS_NATS_URL": bad, "AIOS_REDIS_URL": "redis://127.0.0.1:1/0"})
        outputs.append(said)
        assert "authorization violation" in said.lower() and "WRONG-pass-0123456789" not in said
        # so does one kind of a group process, in lines marked with that kind
        group_env = {**env, "AIOS_REDIS_URL": "redis://127.0.0.1:1/0", kind_var("AIOS_NATS_URL", "parser"): bad,
                     kind_var("AIOS_NATS_URL", "gateway"): bad}
        said = await asyncio.to_thread(_run_briefly, [sys.executable, "-m", "aios_blocks.runtime.main", "parser+gateway"], group_env)
        outputs.append(said)
        assert "authorization violation" in said.lower() and "WRONG-pass-0123456789" not in said
        assert '"kind": "parser"' in said, said[-2000:]
        secrets = _secrets(data)
        assert len(secrets) >= 10
        ep = data / "endpoints.json"
        assert "@" not in ep.read_text() and json.loads(ep.read_text())["auth"] is True
        assert _mode(data / "auth") == 0o700 and _mode(data / "auth" / "secrets.json") == 0o600
        assert _mode(data / "nats.conf") == 0o600 and _mode(data / "redis-users.acl") == 0o600
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = await asyncio.to_thread(up.communicate, timeout=60)
        outputs.append(out.decode())
    texts = outputs + [p.read_text(errors="replace") for p in [*data.glob("*.log"), *(data / "logs").glob("*.log")]]
    assert len(list((data / "logs").glob("*.log"))) >= 3  # every worker process's (three: the kinds grouped)
    for secret in secrets:
        for text in texts:
            assert secret not in text


async def test_tls_with_the_embedded_self_signed_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = EmbeddedServers(data_dir=tmp_path, auth=True, tls=True).start()
    try:
        ep = s.endpoints
        assert ep.nats.startswith("tls://") and ep.nats_ca and json.loads((tmp_path / "endpoints.json").read_text())["nats_ca"]
        monkeypatch.setenv("AIOS_NATS_CA", ep.nats_ca)
        bus = await Bus.open(ep.nats_url("upstream"))
        try:
            await bus.publish_raw("aios.block.tls-1.create", b"{}")
        finally:
            await bus.close()
        with pytest.raises((ssl.SSLError, OSError, nats.errors.NoServersError)):  # the system CAs do not trust it
            await nats.connect(ep.nats_url("upstream"), allow_reconnect=False, connect_timeout=3,
                               tls=ssl.create_default_context())
        with pytest.raises((nats.errors.Error, OSError)):  # and plain text is refused
            await nats.connect(ep.nats_url("upstream").replace("tls://", "nats://"), allow_reconnect=False,
                               connect_timeout=3)
        assert auth.nats_login(ep.nats_url("admin"), ep.nats_ca)
        assert not auth.nats_login(auth.with_userinfo(ep.nats, "admin", "nope"), ep.nats_ca)
    finally:
        s.stop()


async def test_auth_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_AUTH", "0")
    s = EmbeddedServers(data_dir=tmp_path).start()
    try:
        assert not s.auth and "@" not in s.nats_url and "@" not in s.redis_url
        assert not (tmp_path / "auth" / "secrets.json").exists()
        bus = await Bus.open(s.nats_url)
        try:
            await bus.ensure_stream()
            await bus.publish_raw("aios.block.open-1.ready", msgspec.json.encode({}))
        finally:
            await bus.close()
        assert s.worker_env("parser") == {}
    finally:
        s.stop()


async def test_redis_without_acl_support_gets_one_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis < 6 has no ACL users: the embedded setup falls back to ``requirepass`` from a private
    file (forced here on a newer server, which honours requirepass the same way)."""
    monkeypatch.setattr(auth, "redis_supports_acl", lambda binary: False)
    s = EmbeddedServers(data_dir=tmp_path, auth=True)
    s.start_redis()
    try:
        url = s.endpoints.redis_url("controller")
        assert url is not None and url.startswith("redis://:") and url == s.redis_url
        assert _mode(tmp_path / "redis-auth.conf") == 0o600
        ps = _cmdline(s.procs[0].pid)
        assert auth.Secrets.load(tmp_path).redis["admin"] not in ps  # not visible to ps
        st = Store.open(url)
        try:
            assert await st.r.set("aios:k", "v")
        finally:
            await st.close()
        anon = aioredis.from_url(s.endpoints.redis)
        with pytest.raises((AuthenticationError, ResponseError)):
            await anon.get("aios:k")
        await anon.aclose()
    finally:
        s.stop()


async def test_a_sidecar_reads_task_outputs_and_nothing_of_the_control_stream(servers: EmbeddedServers, admin: Bus,
                                                                             connect: Any) -> None:
    """docs/sidecars.md: the ``sidecar`` user keeps its durable on AIOS_OUTPUTS, pulls and acks
    outputs, dead-letters them; it cannot touch the AIOS stream or publish a control event."""
    from aios_blocks.schemas.events import TaskOutput

    await admin.ensure_stream()
    out = TaskOutput("sec-b1", "t1", "sec-b1-0", 200, "hello", gen=1)
    await admin.emit(E.block_output, out)
    sc = await connect(servers.endpoints.nats_url("sidecar"))
    bus = Bus(sc.nc, "aios-blocks/sidecar/test", event_key=event_ids.new_key())
    spec = subjects.sidecar("sec-b1", "store")
    await bus.ensure_sidecar_consumer(spec, 3, 5)
    sub = await bus.js.pull_subscribe_bind(durable=spec.durable, stream=subjects.STREAM_OUTPUTS)
    (msg,) = await sub.fetch(1, timeout=5)
    assert b'"task_id":"t1"' in msg.data
    await msg.ack_sync()
    # an output's dead letter stays with the outputs (output.dlq, in AIOS_OUTPUTS), not in AIOS
    await sc.nc.publish(E.output_dead_letter.subject(bid="sec-b1", name="store", outcome="ok"), b"{}")
    await sc.nc.publish("aios.block.sec-b1.sidecar.store.alert", b"{}")
    await sc.nc.flush()
    assert not any("permissions violation" in e.lower() for e in sc.errors), sc.errors
    for subject in ("aios.block.sec-b1.create", "aios.block.sec-b1.delete", "aios.output.sec-b1.ok", "aios.dlq.parser.x",
                    subjects.dead_letter(spec.durable, msg.subject),
                    f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM}.parser", f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM}.mine"):
        await sc.nc.publish(subject, b"{}")
        assert await sc.denied(subject), subject
    await sc.nc.subscribe("aios.>")
    assert await sc.denied("aios.>", "subscription")


async def test_observers_join_no_queue_group_and_a_replayed_query_is_dropped(
    servers: EmbeddedServers, admin: Bus, connect: Any
) -> None:
    """The controllers' queries (``aios.cluster.*.dry_run``, core NATS) go to a queue group: an
    observer may watch them (a plain subscription) but not join the group, which would take
    queries away from the controllers. A stored message an observer replays onto the query subject
    (a push consumer's deliver subject) arrives with a ``$JS.ACK`` reply subject and is dropped by
    the controllers' runner; the gateway's own queries are handled."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.router import Inbound, Router
    from aios_blocks.bus.runner import CoreRunner, RunnerOptions
    from aios_blocks.schemas.events import DryRunRequest, envelope

    ep = servers.endpoints
    ob = await connect(ep.nats_url("observer"))
    watched: list[str] = []

    async def watch(msg: Any) -> None:
        watched.append(msg.subject)

    await ob.nc.subscribe("aios.cluster.*.dry_run", cb=watch)  # watching is allowed
    await ob.nc.subscribe("aios.cluster.*.dry_run", queue="controller")  # joining the group is not
    assert await ob.denied("aios.cluster.*.dry_run", what="subscription")
    assert any('using queue "controller"' in e for e in ob.errors), ob.errors

    controller = await Bus.open(ep.nats_url("controller"))
    gateway = await Bus.open(ep.nats_url("gateway"))
    handled: list[str] = []
    router = Router(subjects.controller())

    async def on_query(m: Inbound[DryRunRequest]) -> None:
        handled.append(m.data.block_id)

    router.add(E.cluster_dry_run, on_query)
    for e in subjects.controller().events:
        if e is not E.cluster_dry_run:
            router.add(e, on_query)
    letters: list[str] = []

    async def letter(msg: Any) -> None:
        letters.append(msg.subject)

    await admin.nc.subscribe("aios.dlq.>", cb=letter)
    stop = asyncio.Event()
    runner = CoreRunner(controller, subjects.controller(), router, RunnerOptions(fetch_timeout_s=0.2))
    task = asyncio.create_task(runner.run(stop))
    try:
        await controller.nc.flush()
        await asyncio.sleep(0.2)
        # a query-shaped body stored in AIOS (upstream's creates no longer land there as sent, but in
        # AIOS_INTAKE, which observers cannot read: here the admin stores one) ...
        subject = E.cluster_dry_run.subject(cid="c1")
        body = envelope("x", "s", E.cluster_dry_run.type, subject, DryRunRequest("replayed", 1, "c1"))
        await admin.publish_raw("aios.block.q-replay.submitted", body)
        # ... replayed by an observer onto the query subject
        with structlog.testing.capture_logs() as logs:
            await _replay_onto(ob, "aios.block.q-replay.submitted", subject, "observer_23")
            await gateway.emit(E.cluster_dry_run, DryRunRequest("genuine", 1, "c1"), cid="c1")
            async with asyncio.timeout(10):
                while "genuine" not in handled or len(watched) < 2:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        dropped = [e for e in logs if e["event"] == "query.replayed_dropped"]
        assert len(dropped) == 1 and dropped[0]["reply"].startswith("$JS.ACK."), logs
        assert handled == ["genuine"], handled
        assert letters == []  # dropped as a replay, not dead-lettered as a message nobody handles
        # the observer saw both: the genuine query, and the replay (a push delivery names the stored subject)
        assert sorted(watched) == sorted([subject, "aios.block.q-replay.submitted"]), watched
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await controller.close()
        await gateway.close()


async def test_dry_run_answers_come_only_from_controllers_and_only_gateways_take_them(
    servers: EmbeddedServers, connect: Any
) -> None:
    """A dry_run answer (``aios.block.*.dry_run.result``) is not stored: it goes over core NATS to
    the gateways' queue group, and the round's ``post_dry_run`` stores it. So no other role may
    publish one (a forged answer would decide a round), and an observer may not join the group
    (it would take answers away from the gateways)."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import DryRunResult

    ep = servers.endpoints
    ob = await connect(ep.nats_url("observer"))
    await ob.nc.subscribe("aios.block.*.dry_run.result", queue="gateway")
    assert await ob.denied("aios.block.*.dry_run.result", what="subscription")
    for role in ("upstream", "gateway", "agent-sim", "executor"):
        other = await connect(ep.nats_url(role))
        await other.nc.publish("aios.block.b1.dry_run.result", b"{}")
        assert await other.denied("aios.block.b1.dry_run.result"), role
    gw = await connect(ep.nats_url("gateway"))
    got: list[bytes] = []

    async def take(msg: Any) -> None:
        got.append(msg.data)

    await gw.nc.subscribe("aios.block.*.dry_run.result", queue="gateway", cb=take)
    await gw.nc.flush()
    controller = await Bus.open(ep.nats_url("controller"))
    try:
        await controller.emit(E.block_dry_run_result, DryRunResult("b1", 1, "c1", 0.5))
        async with asyncio.timeout(10):
            while not got:
                await asyncio.sleep(0.02)
        assert msgspec.json.decode(got[0])["data"]["cluster_id"] == "c1"
        assert not [e for e in gw.errors if "permissions violation" in e.lower()], gw.errors
    finally:
        await controller.close()
