"""A data dir made before tenants keeps its stream: the system's users moved from NATS's global
account (``$G``) to the account ``AIOS`` (runtime/tenants.py), and JetStream keeps each account's
streams apart, so ``EmbeddedServers`` moves the global account's store before nats-server starts
(``embedded.move_account_store``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import nats
import pytest

from aios_blocks.bus import subjects
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.state.tenants import TenantStore

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


async def _last_seq(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(subjects.STREAM)).state.last_seq
    finally:
        await nc.close()


async def test_a_global_account_store_is_adopted_by_the_system_account(tmp_path: Path) -> None:
    data = tmp_path / "d"
    # without credentials the stream lives in the global account, as every data dir did before
    plain = EmbeddedServers(data_dir=data, auth=False).start()
    try:
        nc = await nats.connect(plain.nats_url)
        js = nc.jetstream()
        await js.add_stream(name=subjects.STREAM, subjects=["aios.block.*.ready"])
        for n in range(3):
            await js.publish(f"aios.block.b{n}.ready", b"{}")
        await nc.close()
    finally:
        plain.stop()
    assert (data / "jetstream" / "jetstream" / "$G").is_dir()
    secured = EmbeddedServers(data_dir=data, auth=True).start()
    try:
        assert await _last_seq(secured.nats_url) >= 3  # the three events are still there
    finally:
        secured.stop()
    assert (data / "jetstream" / "jetstream" / "AIOS").is_dir() and not (data / "jetstream" / "jetstream" / "$G").exists()


async def test_tenants_survive_a_restart_of_the_server(tmp_path: Path) -> None:
    """Accounts come from the generated config: a restarted server (same data dir) loads them with
    their imports resolved, and a tenant's request reaches the system's account as before."""
    from aios_blocks.runtime import auth

    s = EmbeddedServers(data_dir=tmp_path / "d", auth=True).start()
    auth.add_tenant(s.data_dir, "keep")
    s.stop()
    s = EmbeddedServers(data_dir=tmp_path / "d", auth=True).start()
    try:
        admin = await nats.connect(s.nats_url)

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(msg.subject.encode())

        await admin.subscribe("aios.tenant.*.block.*.task", cb=answer)
        await admin.flush()
        url = auth.tenant_user_url(s.data_dir, "keep")
        tenant = await nats.connect(url)
        reply = await tenant.request("aios.block.b1.task", b"", timeout=5)
        assert reply.data == b"aios.tenant.keep.block.b1.task"
        await tenant.close()
        await admin.close()
    finally:
        s.stop()


async def _blocks(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_tenant_commands_add_list_and_remove_tenants_and_users(tmp_path: Path) -> None:
    from aios_blocks.runtime import auth

    s = EmbeddedServers(data_dir=tmp_path / "d", auth=True).start()
    d = str(s.data_dir)
    try:
        rc, out, err = await _blocks("tenant", "add", "t1", "--max-pending-creates", "5", "--json", "--data-dir", d)
        assert rc == 0, err
        made = json.loads(out)
        rc, out, err = await _blocks("tenant", "user", "add", "t1", "bob", "--json", "--data-dir", d)
        assert rc == 0, err
        bob = json.loads(out)
        assert bob["user"] == "t1.bob" and bob["credentials"] != made["credentials"]
        bob_password = _file(bob["credentials"])["password"]
        for creds in (made["credentials"], bob["credentials"]):
            c = _file(creds)
            nc = await nats.connect(c["url"], user=c["user"], password=c["password"])
            await nc.close()
        rc, out, _ = await _blocks("tenant", "list", "--json", "--data-dir", d)
        [row] = json.loads(out)
        assert row["users"] == ["t1.bob", "t1.main"] and row["limits"]["pending_creates"] == 5
        assert await TenantStore(await _redis(s)).limit("t1") == 5  # where the parser reads it

        # a user removed: its file goes, its login is refused; the tenant's other user stays
        rc, _, err = await _blocks("tenant", "user", "remove", "t1", "bob", "--data-dir", d)
        assert rc == 0, err
        assert not _exists(bob["credentials"])
        assert not auth.nats_login(auth.with_userinfo(s.endpoints.nats, "t1.bob", bob_password))
        assert auth.nats_login(auth.tenant_user_url(s.data_dir, "t1"))
        # the tenant removed: refused, its limit gone; a second remove says there is none (exit 1)
        url = auth.tenant_user_url(s.data_dir, "t1")
        rc, _, err = await _blocks("tenant", "remove", "t1", "--data-dir", d)
        assert rc == 0, err
        assert not auth.nats_login(url) and not _exists(made["credentials"])
        assert await TenantStore(await _redis(s)).limit("t1") is None
        rc, _, err = await _blocks("tenant", "remove", "t1", "--data-dir", d)
        assert rc == 1 and "no tenant 't1'" in err
    finally:
        s.stop()


def _file(path: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(Path(path).read_text())
    return out


def _exists(path: str) -> bool:
    return Path(path).exists()


async def _redis(s: EmbeddedServers) -> Any:
    import redis.asyncio as aioredis

    return aioredis.from_url(s.redis_url)
