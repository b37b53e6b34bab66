"""Tenants as NATS accounts (docs/security.md "Tenants"), on the real servers and workers, with
nats-py clients in their DEFAULT configuration (their own ``_INBOX``, no prefix): a tenant
creates, scales, sends tasks to, watches and deletes its own blocks, and nothing of another's.
Hostile cases: tenant B asks for A's block, reads A's replies, forges system events, speaks for A,
reaches the system's stream; per-tenant limits (connections, stream bytes) refuse
with a reason and cost nobody else anything."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.errors import Error as NatsError
from nats.js.errors import APIError, NotFoundError

from aios_blocks.bus import subjects
from aios_blocks.runtime import auth
from aios_blocks.runtime import tenants as tn

from .conftest import System
from .test_create_cloudevents import stored
from .test_pending_queue import status_of

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True
SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 3}


def create(bid: str, **extra: Any) -> bytes:
    return json.dumps({"specversion": "1.0", "id": f"ext-{bid}", "source": "urn:tenant", "type": "io.aios.block.create",
                       "datacontenttype": "application/json", "data": {**SPEC, **extra}}).encode()


HEADERS = {"Content-Type": "application/cloudevents+json"}


async def login(data_dir: Path, tenant: str, user: str = tn.FIRST_USER, **options: Any) -> nats.NATS:
    """A tenant's client as a stranger would connect: the credentials file, nats-py's defaults."""
    creds = json.loads(auth.credentials_path(data_dir, tenant, user).read_text())
    return await nats.connect(creds["url"], user=creds["user"], password=creds["password"], **options)


class Seen:
    """Every message a client's subscription got."""

    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def on(self, msg: Any) -> None:
        self.subjects.append(msg.subject)

    async def until(self, subject: str, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while subject not in self.subjects:
                await asyncio.sleep(0.05)


async def blocks(*args: str) -> str:
    """The ``blocks`` command, as run next to ``blocks up`` (no server URL in its environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, (args, out.decode(), err.decode())
    return out.decode()


async def replay(nc: nats.NATS, stream: str) -> list[str]:
    """Every subject a stream of the client's account holds, in order."""
    js = nc.jetstream(timeout=10)
    last = (await js.stream_info(stream)).state.last_seq
    return [(await js.get_msg(stream, seq)).subject for seq in range(1, last + 1)]


def status(msg: Any) -> int:
    return int((msg.headers or {}).get("Aios-Status", "200"))


async def test_a_default_client_of_a_tenant_runs_its_block_and_nothing_of_anothers(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("tc", nodes=2, gpus=4)
    for t in ("ta", "tb"):
        new, path = auth.add_tenant(system.data_dir, t)
        assert new and oct(path.stat().st_mode & 0o777) == "0o600"
    a, b = await login(system.data_dir, "ta"), await login(system.data_dir, "tb")
    seen_a, seen_b, b_all = Seen(), Seen(), Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await b.subscribe(">", cb=b_all.on)  # everything tenant B's account carries
        await a.flush()
        await b.flush()
        # a stream of its own keeps its blocks' events for a replay (events only: docs/security.md "Tenants")
        await a.jetstream(timeout=10).add_stream(name="MY_EVENTS", subjects=list(tn.REPLAYABLE), max_bytes=1024 * 1024)
        # create with the default inbox: the PubAck comes back (its seq is the block's gen)
        ack = await a.jetstream(timeout=10).publish("aios.block.ta-b1.create", create("ta-b1"), headers=HEADERS)
        assert ack.stream == subjects.STREAM_INTAKE and ack.seq > 0
        await seen_a.until("aios.block.ta-b1.ready")
        block = await c.store.get_block("ta-b1")
        assert block is not None and block["ir"]["labels"]["tenant"] == "ta"  # charged to ta's quota

        # a task, the default way: request/reply on the client's own inbox
        reply = await a.request("aios.block.ta-b1.task", b'{"n": 7}', timeout=60)
        assert status(reply) == 200 and msgspec.json.decode(reply.data)["output"] == {"n": 7}, reply.headers

        # scale to 2, then one more: tenant requests, answered with the request's id
        reply = await a.request("aios.block.ta-b1.scale", b'{"target": 2}', timeout=30)
        assert status(reply) == 200 and msgspec.json.decode(reply.data)["target"] == 2, reply.headers
        async with asyncio.timeout(60):
            while len(await c.store.instances("ta-b1")) != 2:
                await asyncio.sleep(0.1)
        assert "aios.block.ta-b1.scale.target" in seen_a.subjects
        # beyond maxInstances: the answer says what the block will reach, not only what was asked
        reply = await a.request("aios.block.ta-b1.scale", b'{"target": 1000}', timeout=30)
        answer = msgspec.json.decode(reply.data)
        assert status(reply) == 200 and answer["target"] == 1000, reply.headers
        hi = block["ir"]["maxInstances"]
        assert answer["clamped"] == hi and answer["note"] == f"1000 lowered to maxInstances {hi}", answer
        reply = await a.request("aios.block.ta-b1.scale", b'{"target": 2}', timeout=30)
        assert status(reply) == 200 and msgspec.json.decode(reply.data)["clamped"] == 2

        # B: A's block is "no block of yours", whatever B asks; nothing changes
        for ask, body in (("task", b"{}"), ("scale", b'{"target": 3}'), ("scale", b""), ("delete", b"")):
            reply = await b.request(f"aios.block.ta-b1.{ask}", body, timeout=30)
            assert status(reply) == 404 and "no block ta-b1" in reply.headers["Aios-Error"], (ask, reply.headers)
        # B's create of A's id: its own refusal comes to B, A hears nothing of it
        await b.jetstream(timeout=10).publish("aios.block.ta-b1.create", create("ta-b1"), headers=HEADERS)
        await seen_b.until("aios.block.ta-b1.rejected")
        # B labelling its block as A's: refused
        await b.jetstream(timeout=10).publish("aios.block.tb-b2.create", create("tb-b2", labels={"tenant": "ta"}),
                                             headers=HEADERS)
        await seen_b.until("aios.block.tb-b2.rejected")

        # A deletes its block
        reply = await a.request("aios.block.ta-b1.delete", b"", timeout=30)
        assert status(reply) == 200, reply.headers
        await seen_a.until("aios.block.ta-b1.deleted")
        kept = await replay(a, "MY_EVENTS")
        assert {"aios.block.ta-b1.ready", "aios.block.ta-b1.deleted"} <= set(kept), kept
        assert all(k.startswith("aios.block.ta-b1.") for k in kept) and "aios.block.ta-b1.rejected" not in kept
    finally:
        await a.close()
        await b.close()
    assert len(await c.store.instances("ta-b1")) == 0
    # A saw only its block's events, B none of them but its own refusals
    assert all(s.startswith("aios.block.ta-b1.") for s in seen_a.subjects), seen_a.subjects
    assert "aios.block.ta-b1.rejected" not in seen_a.subjects
    # B: its own requests (its account's subjects, once each as it sent them) and its create's answers
    mine = Counter(s.removeprefix("aios.block.ta-b1.") for s in seen_b.subjects if s.startswith("aios.block.ta-b1."))
    assert mine == Counter({"scale": 2, "task": 1, "delete": 1, "create": 1, "submitted": 1, "rejected": 1}), mine
    assert Counter(s for s in b_all.subjects if s.startswith("aios.block.ta-b1.")) == Counter(
        {f"aios.block.ta-b1.{k}": n for k, n in mine.items()})


async def test_a_hostile_tenant_reaches_nothing_of_another_or_of_the_system(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("th", nodes=1, gpus=2)
    auth.add_tenant(system.data_dir, "victim")
    # through the command, as an operator would: limits, and its credentials file's path as JSON
    out = await blocks("tenant", "add", "evil", "--max-connections", "2", "--max-stream-bytes", str(1024 * 1024),
                       "--max-pending-creates", "2", "--json", "--data-dir", str(system.data_dir))
    made = json.loads(out)
    assert made["user"] == "evil.main" and made["account"] == "tenant-evil" and made["new"] is True
    assert Path(made["credentials"]) == auth.credentials_path(system.data_dir, "evil", "main")
    assert os.stat(made["credentials"]).st_mode & 0o777 == 0o600
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    victim = await login(system.data_dir, "victim")
    evil = await login(system.data_dir, "evil", error_cb=on_error)
    evil_all = Seen()
    try:
        await evil.subscribe(">", cb=evil_all.on)  # every subject of its account, inboxes included
        await evil.flush()
        # the victim's create and task replies travel in the victim's account only
        await victim.jetstream(timeout=10).publish("aios.block.v-b1.create", create("v-b1"), headers=HEADERS)
        kind, _ = await c.wait("v-b1", 60)
        assert kind == "ready"
        assert status(await victim.request("aios.block.v-b1.task", b"{}", timeout=60)) == 200

        # forged system events and another tenant's subjects: refused by the account's permissions
        forged = ("aios.block.v-b1.ready", "aios.block.v-b1.deleted", "aios.tenant.victim.block.v-b1.delete",
                  "aios.tenant.victim.event.v-b1.failed", "aios.node.th-n0.heartbeat", "aios.cluster.th.scale")
        for subject in forged:
            await evil.publish(subject, b"{}")
        await evil.flush()
        async with asyncio.timeout(10):
            while sum("permissions violation for publish" in e.lower() for e in errors) < len(forged):
                await asyncio.sleep(0.05)
        # nothing of it in the system's stream, and the victim's block is untouched
        kept = [s for _, s, _, _ in await stored(system) if s.startswith("aios.block.v-b1.")]
        assert kept.count("aios.block.v-b1.ready") == 1 and "aios.block.v-b1.deleted" not in kept
        block = await c.store.get_block("v-b1")
        assert block is not None and block["status"] == "ready"

        # the system's streams do not exist in its account: no info, no consumer, no message
        ejs = evil.jetstream(timeout=5)
        for stream in (subjects.STREAM, subjects.STREAM_INTAKE, subjects.STREAM_OBSERVE):
            with pytest.raises(NotFoundError):
                await ejs.stream_info(stream)
            with pytest.raises(NotFoundError):
                await ejs.add_consumer(stream, durable_name="steal")
            with pytest.raises(NotFoundError):
                await ejs.get_msg(stream, 1)

        # its own stream, within its bytes limit: kept; beyond: refused with the reason
        with pytest.raises(APIError) as too_big:
            await ejs.add_stream(name="MINE", subjects=list(tn.REPLAYABLE), max_bytes=10 * 1024 * 1024)
        assert "insufficient storage resources" in str(too_big.value), too_big.value
        await ejs.add_stream(name="MINE", subjects=list(tn.REPLAYABLE), max_bytes=512 * 1024)

        # connections: the account's limit (2) refuses the third, with the reason; others unaffected
        extra = await login(system.data_dir, "evil")
        with pytest.raises(NatsError, match="maximum account active connections exceeded"):
            await login(system.data_dir, "evil", allow_reconnect=False, max_reconnect_attempts=0)
        await extra.close()
        other = await login(system.data_dir, "victim")
        await other.close()

        # pending creates: two that wait for capacity (2 GPUs each, 1 free), the third refused with the reason
        ejs10 = evil.jetstream(timeout=10)
        for n in range(2):
            await ejs10.publish(f"aios.block.e-p{n}.create", create(f"e-p{n}", minInstances=2, maxInstances=2),
                                headers=HEADERS)
            await status_of(system, f"e-p{n}", "pending")
        await ejs10.publish("aios.block.e-p2.create", create("e-p2"), headers=HEADERS)
        kind, env = await c.wait("e-p2", 60)
        message = json.dumps(env["data"])
        assert kind == "rejected" and "creates pending" in message and "--max-pending-creates" in message, env
        # ... which costs the victim nothing: its create is taken and placed (1 GPU is free)
        await victim.jetstream(timeout=10).publish("aios.block.v-b2.create", create("v-b2", maxInstances=1),
                                                   headers=HEADERS)
        assert (await c.wait("v-b2", 60))[0] == "ready"
    finally:
        await evil.close()
        await victim.close()
    # it read nothing of the victim's: no reply, no event, no inbox traffic
    assert not any("v-b" in s for s in evil_all.subjects), evil_all.subjects


async def test_a_block_id_used_again_by_another_tenant_tells_the_first_nothing(system: System) -> None:
    """Tenant A deletes its block; tenant B creates one with the same id: every event of B's block
    goes to B, none to A (the relay reads the owner of the event's generation)."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("tr", nodes=1, gpus=2)
    auth.add_tenant(system.data_dir, "first")
    auth.add_tenant(system.data_dir, "second")
    a, b = await login(system.data_dir, "first"), await login(system.data_dir, "second")
    seen_a, seen_b = Seen(), Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await a.flush()
        await b.flush()
        await a.jetstream(timeout=10).publish("aios.block.reused.create", create("reused"), headers=HEADERS)
        await seen_a.until("aios.block.reused.ready")
        assert status(await a.request("aios.block.reused.delete", b"", timeout=30)) == 200
        await seen_a.until("aios.block.reused.deleted")
        before = len(seen_a.subjects)
        await b.jetstream(timeout=10).publish("aios.block.reused.create", create("reused"), headers=HEADERS)
        await seen_b.until("aios.block.reused.ready")
        # B's block answers B's requests and not A's any more
        assert status(await b.request("aios.block.reused.task", b"{}", timeout=60)) == 200
        assert status(await a.request("aios.block.reused.task", b"{}", timeout=30)) == 404
        assert status(await b.request("aios.block.reused.delete", b"", timeout=30)) == 200
        await seen_b.until("aios.block.reused.deleted")
    finally:
        await a.close()
        await b.close()
    late = [s for s in seen_a.subjects[before:] if not s.endswith((".task",))]  # (A's own request)
    assert late == [], late
    block = await c.store.get_block("reused")
    assert block is not None and block["ir"]["labels"]["tenant"] == "second"


async def test_the_default_tenant_may_not_label_a_block_as_a_tenant_with_an_account(system: System) -> None:
    """The legacy ``upstream`` user (the default tenant) publishes ``aios.block.B.create`` with any
    labels: a ``tenant`` label naming a tenant with an account is rejected (the block would be
    charged to its quota and answer its requests); a label naming no account is a quota group of
    the default tenant and stays; the admin makes a tenant's block on ``aios.tenant.T.block.B.create``."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("tl", nodes=1, gpus=4)
    await blocks("tenant", "add", "owner", "--data-dir", str(system.data_dir))  # the account, and its limit in Redis
    ep = system.servers.endpoints
    up = await nats.connect(ep.nats_url("upstream"), inbox_prefix="_INBOX.upstream")
    admin = await nats.connect(ep.nats_url("admin"), inbox_prefix="_INBOX.admin")
    owner = await login(system.data_dir, "owner")
    seen = Seen()
    try:
        await owner.subscribe("aios.block.>", cb=seen.on)
        await owner.flush()
        ujs = up.jetstream(timeout=10)
        await ujs.publish("aios.block.u-fake.create", create("u-fake", labels={"tenant": "owner"}), headers=HEADERS)
        kind, env = await c.wait("u-fake", 60)
        assert kind == "rejected" and "account of its own" in json.dumps(env["data"]), env
        assert status(await owner.request("aios.block.u-fake.delete", b"", timeout=30)) == 404
        # a label that names no account: the default tenant's quota group, as before tenants
        await ujs.publish("aios.block.u-group.create", create("u-group", labels={"tenant": "team-x"}), headers=HEADERS)
        assert (await c.wait("u-group", 60))[0] == "ready"
        block = await c.store.get_block("u-group")
        assert block is not None and block["ir"]["labels"]["tenant"] == "team-x"
        # the admin may make a tenant's block: on the subject the tenant's account maps its creates to
        await admin.jetstream(timeout=10).publish("aios.tenant.owner.block.a-made.create", create("a-made"),
                                                  headers=HEADERS)
        await seen.until("aios.block.a-made.ready")
        block = await c.store.get_block("a-made")
        assert block is not None and block["ir"]["labels"]["tenant"] == "owner"
        assert status(await owner.request("aios.block.a-made.task", b"{}", timeout=60)) == 200
        # the upstream user may not: that subject is not one it may publish
        errors: list[str] = []

        async def note(exc: Exception) -> None:
            errors.append(str(exc))

        up2 = await nats.connect(ep.nats_url("upstream"), inbox_prefix="_INBOX.upstream", error_cb=note)
        await up2.publish("aios.tenant.owner.block.u-sneak.create", create("u-sneak"))
        await up2.flush()
        async with asyncio.timeout(10):
            while not any("permissions violation for publish" in e.lower() for e in errors):
                await asyncio.sleep(0.05)
        await up2.close()
    finally:
        await up.close()
        await admin.close()
        await owner.close()
    assert await c.store.get_block("u-sneak") is None
    # the owner heard nothing of either default block (but its own request on u-fake)
    assert [s for s in seen.subjects if "u-fake" in s or "u-group" in s] == ["aios.block.u-fake.delete"], seen.subjects


async def test_a_block_id_another_tenant_holds_is_refused_without_a_word_of_that_block(system: System) -> None:
    """Block ids are one namespace: tenant B's create of an id A's live block holds is rejected,
    telling B only that the id is taken (not the block's status, not whose); A's block is untouched
    and A hears nothing. A pending create of A's that A deleted, whose id B then took while it
    waits, is not counted against A's pending-create limit."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("ti", nodes=1, gpus=1)
    for t in ("ia", "ib"):
        await blocks("tenant", "add", t, "--max-pending-creates", "1", "--data-dir", str(system.data_dir))
    a, b = await login(system.data_dir, "ia"), await login(system.data_dir, "ib")
    seen_a, seen_b = Seen(), Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await a.flush()
        await b.flush()
        ajs, bjs = a.jetstream(timeout=10), b.jetstream(timeout=10)
        await ajs.publish("aios.block.held.create", create("held", maxInstances=1), headers=HEADERS)
        await seen_a.until("aios.block.held.ready")
        before = await c.store.get_block("held")
        assert before is not None
        heard = len(seen_a.subjects)
        await bjs.publish("aios.block.held.create", create("held", maxInstances=1), headers=HEADERS)
        await seen_b.until("aios.block.held.rejected")
        after = await c.store.get_block("held")
        assert after is not None and after["status"] == "ready" and after["gen"] == before["gen"]
        assert after["ir"]["labels"]["tenant"] == "ia"
        rejected = [env for s, env, _ in await c.history("held", idle=0.2) if s.endswith(".rejected")]
        assert len(rejected) == 1
        words = json.dumps(rejected[0]["data"])
        assert "is taken" in words and "status" not in words and "ready" not in words and "tenant ia" not in words, words
        assert seen_a.subjects[heard:] == [], seen_a.subjects[heard:]  # A heard nothing of B's try
        assert status(await a.request("aios.block.held.task", b"{}", timeout=60)) == 200

        # A's create that waits (2 instances, 1 GPU), deleted; B takes its id, and waits too
        await ajs.publish("aios.block.wait1.create", create("wait1", minInstances=2, maxInstances=2), headers=HEADERS)
        await status_of(system, "wait1", "pending")
        assert status(await a.request("aios.block.wait1.delete", b"", timeout=30)) == 200
        await status_of(system, "wait1", "deleted")
        await bjs.publish("aios.block.wait1.create", create("wait1", minInstances=2, maxInstances=2), headers=HEADERS)
        await seen_b.until("aios.block.wait1.submitted")
        await status_of(system, "wait1", "pending")
        # A's limit (1) is not spent by B's block: A's next create waits too, it is not refused
        await ajs.publish("aios.block.wait2.create", create("wait2", minInstances=2, maxInstances=2), headers=HEADERS)
        await status_of(system, "wait2", "pending")
    finally:
        await a.close()
        await b.close()
