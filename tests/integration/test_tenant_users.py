"""A tenant's users keep their tasks to themselves (docs/security.md "Tenants: an account per
user"): two users of one tenant, raw nats-py clients in their default configuration, as a third
party would connect. The second user subscribes to everything it may, makes JetStream streams that
would capture the first one's requests and replies, and still reads none of its tasks, answers,
creates, scales, deletes or history pages, and cannot get a forged answer in before the system's;
both hear the tenant's relayed block events (shared within a tenant by design)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from aios_blocks.runtime import auth
from aios_blocks.runtime import tenants as tn

from .conftest import System
from .test_tenants import HEADERS, Seen, create, login, status

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True
SECRET = b'{"prompt": "the first user\'s secret"}'


async def test_a_tenants_user_reads_nothing_of_another_users_tasks_or_replies(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    await system.client.add_sim_cluster("tu", nodes=1, gpus=2)
    auth.add_tenant(system.data_dir, "tu")
    new, path = auth.add_tenant_user(system.data_dir, "tu", "spy")
    assert new
    main, spy = await login(system.data_dir, "tu"), await login(system.data_dir, "tu", "spy")
    seen_main, spy_all, got = Seen(), Seen(), []

    async def spied(msg: Any) -> None:
        await spy_all.on(msg)
        got.append((msg.subject, msg.reply, msg.data))

    def overheard() -> list[tuple[str, str]]:
        """What the spy got of the first user's: a request (it has a reply subject; a relayed
        event has none), an answer (on an inbox), a task or its body."""
        return [(s, r) for s, r, d in got if r or s.startswith("_INBOX.") or s.endswith(".task") or b"secret" in d]

    try:
        await main.subscribe("aios.block.>", cb=seen_main.on)
        # everything the spy's account carries, and the very subjects of the first user's requests
        for subject in (">", "aios.block.*.task", "aios.block.>", "_INBOX.>"):
            await spy.subscribe(subject, cb=spied)
        await spy.flush()
        await main.flush()
        await main.jetstream(timeout=10).publish("aios.block.tu-b1.create", create("tu-b1"), headers=HEADERS)
        await seen_main.until("aios.block.tu-b1.ready")
        await spy_all.until("aios.block.tu-b1.ready")  # the relayed events reach every user of the tenant
        reply = await main.request("aios.block.tu-b1.task", SECRET, timeout=60)
        assert status(reply) == 200 and msgspec.json.decode(reply.data)["output"] == json.loads(SECRET), reply.data
        for ask, body in (("scale", b'{"target": 2}'), ("history", b"")):
            assert status(await main.request(f"aios.block.tu-b1.{ask}", body, timeout=30)) == 200, ask
        await main.flush()
        await spy.flush()
        assert not overheard(), got

        # streams that would keep (and answer first, with their PubAck) the other user's requests and
        # replies (not `delete`: the relayed `block.delete` event shares its subject)
        sjs = spy.jetstream(timeout=10)
        await sjs.add_stream(name="TASKS", subjects=[f"aios.block.*.{r}" for r in tn.REQUESTS if r != "delete"])
        await sjs.add_stream(name="INBOXES", subjects=["_INBOX.>"])
        await spy.flush()
        got.clear()  # (the spy's own stream creates and their answers)
        reply = await main.request("aios.block.tu-b1.task", SECRET, timeout=60)
        assert status(reply) == 200 and msgspec.json.decode(reply.data)["output"] == json.loads(SECRET), reply.data
        assert status(await main.request("aios.block.tu-b1.delete", b"", timeout=30)) == 200
        await seen_main.until("aios.block.tu-b1.deleted")
        await spy_all.until("aios.block.tu-b1.deleted")
        await spy.flush()
        assert not overheard(), got
        # its streams kept none of it: no request, and in the inboxes only its own JetStream API answers
        assert (await sjs.stream_info("TASKS")).state.messages == 0
        last = (await sjs.stream_info("INBOXES")).state.last_seq
        inboxes = [(await sjs.get_msg("INBOXES", seq)).data for seq in range(1, last + 1)]
        assert all(b'"io.nats.jetstream.api.v1.' in d for d in inboxes), inboxes
    finally:
        await main.close()
        await spy.close()
    # each user's own account, named in its credentials file
    assert json.loads(path.read_text())["account"] == "tenant-tu.spy" == tn.account("tu", "spy") != tn.account("tu")


def shared_account(t: tn.Tenant) -> str:
    """The tenant's accounts as an earlier version wrote them: every user in ``tenant-T``."""
    def entry(user: str) -> str:
        return (f"{{user: {json.dumps(tn.user_name(t.name, user))}, password: {json.dumps(t.users[user])}, "
                f"permissions: {tn.user_permissions()}}}")

    return tn._user_account(t, tn.FIRST_USER, t.users[tn.FIRST_USER]).replace(
        entry(tn.FIRST_USER), ",\n      ".join(entry(u) for u in sorted(t.users)))


async def test_a_deployment_from_before_moves_each_further_user_into_its_own_account(
        system: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running server whose config has a tenant's users in one account (before this version):
    the next tenant command's reload moves the further user into its own account (the server
    closes its connection; nats-py reconnects) with its imports resolved, and it reads no more."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    await system.client.add_sim_cluster("tm", nodes=1, gpus=1)
    auth.add_tenant(system.data_dir, "tm")
    auth.add_tenant_user(system.data_dir, "tm", "spy")
    with monkeypatch.context() as m:
        m.setattr(tn, "account_block", shared_account)
        with auth.locked(system.data_dir):
            auth.reload_and_wait(system.data_dir, auth.Secrets.load(system.data_dir, create=False), 10)
    assert '"tenant-tm.spy"' not in (system.data_dir / "nats.conf").read_text()
    back = asyncio.Event()

    async def reconnected() -> None:
        back.set()

    main = await login(system.data_dir, "tm")
    spy = await login(system.data_dir, "tm", "spy", reconnected_cb=reconnected, reconnect_time_wait=0.1)
    seen_main, tasks = Seen(), Seen()
    try:
        await main.subscribe("aios.block.>", cb=seen_main.on)
        await spy.subscribe("aios.block.*.task", cb=tasks.on)
        await spy.flush()
        await main.flush()
        await main.jetstream(timeout=10).publish("aios.block.tm-b1.create", create("tm-b1"), headers=HEADERS)
        await seen_main.until("aios.block.tm-b1.ready")
        assert status(await main.request("aios.block.tm-b1.task", SECRET, timeout=60)) == 200
        await tasks.until("aios.block.tm-b1.task")  # one account: the other user reads the task

        auth.add_tenant(system.data_dir, "tm", tn.Limits())  # any tenant command rewrites and reloads the config
        assert '"tenant-tm.spy": {' in (system.data_dir / "nats.conf").read_text()
        async with asyncio.timeout(30):
            await back.wait()
        # its requests reach the system from its own account (imports resolved: the reload came twice)
        assert status(await spy.request("aios.block.tm-b1.history", b"", timeout=10)) == 200
        tasks.subjects.clear()
        assert status(await main.request("aios.block.tm-b1.task", SECRET, timeout=60)) == 200
        await spy.flush()
        await main.flush()
        assert tasks.subjects == []
    finally:
        await main.close()
        await spy.close()
