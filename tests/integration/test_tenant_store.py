"""A data dir made before tenants keeps its stream: the system's users moved from NATS's global
account (``$G``) to the account ``AIOS`` (runtime/tenants.py), and JetStream keeps each account's
streams apart, so ``EmbeddedServers`` moves the global account's store before nats-server starts
(``embedded.move_account_store``)."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from aios_blocks.bus import subjects
from aios_blocks.runtime.embedded import EmbeddedServers

pytestmark = pytest.mark.integration


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
