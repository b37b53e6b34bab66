"""A tenant's limits hold for the tenant as a whole, though each of its users has an account of its
own (docs/security.md "Per-tenant limits"): on the real embedded nats-server, raw nats-py clients
of two users of one tenant together open no more connections, and their JetStream streams reserve
no more bytes, than its operator set; a user whose share would be none is refused, naming the flag."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.errors import Error as NatsError
from nats.js.errors import APIError

from aios_blocks.runtime import auth, tenant_usage
from aios_blocks.runtime import tenants as tn
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.locate import with_userinfo

from .test_tenants import login

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True
KIB = 1024


@pytest.fixture
async def data_dir(tmp_path: Path) -> AsyncIterator[Path]:
    """The embedded servers alone (a tenant's limits are its accounts' on nats-server: no worker needed)."""
    if os.environ.get("AIOS_NATS_URL"):
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    try:
        yield data.resolve()
    finally:
        servers.stop()


async def blocks(*args: str) -> tuple[int, str, str]:
    """The ``blocks`` command next to the running servers: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), " ".join(err.decode().split())


async def open_all(data_dir: Path, tenant: str, user: str, most: int) -> list[nats.NATS]:
    """As many connections of the user as the server lets in (at most ``most``): each refused one
    with the server's reason for it."""
    held: list[nats.NATS] = []
    for _ in range(most):
        try:
            held.append(await login(data_dir, tenant, user, allow_reconnect=False, max_reconnect_attempts=0))
        except NatsError as exc:
            assert "maximum account active connections exceeded" in str(exc), exc
            break
    return held


async def close(conns: list[nats.NATS]) -> None:
    for nc in conns:
        await nc.close()


async def test_a_tenants_users_together_open_no_more_connections_than_the_tenants_limit(data_dir: Path) -> None:
    code, _, _ = await blocks("tenant", "add", "tl", "--max-connections", "4", "--data-dir", str(data_dir))
    assert code == 0
    # one user: the whole of it
    held = await open_all(data_dir, "tl", "main", 10)
    assert len(held) == 4
    # a second user shrinks its JetStream share, whose use is read first: through the server's
    # system account, so while it uses every connection it has too (read as its user, that needed
    # one more: refused, "try again once one closes"); the split is made, and the server closes
    # what the first user holds beyond its new share (2)
    assert all(nc.is_connected for nc in held)
    auth.add_tenant_user(data_dir, "tl", "two")
    async with asyncio.timeout(30):
        while sum(nc.is_connected for nc in held) != 2:
            await asyncio.sleep(0.05)
    await close(held)
    # lowered: split anew (main 2, two 1), no account's JetStream share shrinks, nothing is read
    code, _, err = await blocks("tenant", "add", "tl", "--max-connections", "3", "--data-dir", str(data_dir))
    assert code == 0, err
    # each user as many as it can get, the first user first and then the other, and the other way round
    for first, second in (("main", "two"), ("two", "main")):
        a = await open_all(data_dir, "tl", first, 10)
        b = await open_all(data_dir, "tl", second, 10)
        try:
            assert len(a) + len(b) == 3 and a and b, (first, len(a), second, len(b))
        finally:
            await close(a + b)
    row = json.loads((await blocks("tenant", "get", "tl", "--json", "--data-dir", str(data_dir)))[1])
    assert row["limits"]["connections"] == 3 and row["fits"] is True
    assert row["shares"]["tenant-tl"]["connections"] == 2 and row["shares"]["tenant-tl.two"]["connections"] == 1

    # a third user: 1 each; a fourth would leave one account without a connection: refused, naming
    # the flag to raise, and nothing changes
    auth.add_tenant_user(data_dir, "tl", "three")
    held = [await open_all(data_dir, "tl", u, 10) for u in ("three", "two", "main")]
    await close([nc for conns in held for nc in conns])
    assert [len(conns) for conns in held] == [1, 1, 1]
    code, _, err = await blocks("tenant", "user", "add", "tl", "four", "--data-dir", str(data_dir))
    assert code == 2 and "--max-connections 3 cannot give each of its 4 users" in err, err
    assert "blocks tenant add tl --max-connections 4" in err, err
    assert "four" not in auth.Secrets.load(data_dir, create=False).tenants["tl"]["users"]
    assert not auth.credentials_path(data_dir, "tl", "four").exists()
    assert auth.remove_tenant_user(data_dir, "tl", "three")
    # ... and so is lowering the limit below the users it has
    code, _, err = await blocks("tenant", "add", "tl", "--max-connections", "1", "--data-dir", str(data_dir))
    assert code == 2 and "--max-connections 1 cannot give each of its 2 users" in err, err

    # a user removed: its share goes back to the others (the config is split anew)
    assert auth.remove_tenant_user(data_dir, "tl", "two")
    a = await open_all(data_dir, "tl", "main", 10)
    await close(a)
    assert len(a) == 3


async def test_a_tenants_users_streams_together_reserve_no_more_bytes_than_the_tenants_limit(data_dir: Path) -> None:
    auth.add_tenant(data_dir, "tb", tn.Limits(stream_bytes=1024 * KIB))
    main = await login(data_dir, "tb")
    # one user's stream holds the whole of it: a second user (half each) would add its share to it
    # (nats-server keeps an account's streams when its limits shrink): refused, saying what to do
    await main.jetstream(timeout=10).add_stream(name="ALL", subjects=list(tn.REPLAYABLE), max_bytes=1024 * KIB)
    # read through the system account, its use is what its own JetStream says
    ep, s = auth.read_endpoints(data_dir), auth.Secrets.load(data_dir, create=False)
    assert ep is not None
    jsz = tenant_usage.account_jsz(with_userinfo(ep.nats, tn.MONITOR_USER, s.nats[tn.MONITOR_USER]), "tenant-tb",
                                   ep.nats_ca)
    info = tenant_usage.account_info(auth.tenant_user_url(data_dir, "tb"), ep.nats_ca)
    assert {k: jsz[k] for k in ("reserved_storage", "streams", "consumers")} == \
        {k: info[k] for k in ("reserved_storage", "streams", "consumers")} == \
        {"reserved_storage": 1024 * KIB, "streams": 1, "consumers": 0}, (jsz, info)
    with pytest.raises(ValueError, match=r"account tenant-tb .* holds 1048576 stream bytes .* more than its share 524288") as over:
        auth.add_tenant_user(data_dir, "tb", "two")
    assert "--max-stream-bytes" in str(over.value)
    assert "two" not in auth.Secrets.load(data_dir, create=False).tenants["tb"]["users"]
    await main.jetstream(timeout=10).delete_stream("ALL")
    auth.add_tenant_user(data_dir, "tb", "two")
    two = await login(data_dir, "tb", "two")
    try:
        mjs, tjs = main.jetstream(timeout=10), two.jetstream(timeout=10)
        # the whole of the tenant's bytes for one user's stream: more than its share
        for js in (mjs, tjs):
            with pytest.raises(APIError) as too_big:
                await js.add_stream(name="ALL", subjects=list(tn.REPLAYABLE), max_bytes=1024 * KIB)
            assert "insufficient storage resources" in str(too_big.value), too_big.value
        # its share (half each) is there for each user, and nothing beyond it
        await mjs.add_stream(name="MINE", subjects=list(tn.REPLAYABLE), max_bytes=512 * KIB)
        await tjs.add_stream(name="MINE", subjects=list(tn.REPLAYABLE), max_bytes=512 * KIB)
        for js in (mjs, tjs):
            with pytest.raises(APIError, match="insufficient storage resources"):
                await js.add_stream(name="MORE", subjects=["more.x"], max_bytes=KIB)
    finally:
        await main.close()
        await two.close()


async def test_a_command_of_a_tenant_whose_connections_are_all_in_use_says_so_and_what_to_do(data_dir: Path) -> None:
    """``blocks submit --tenant`` / ``tenant history -c`` while the tenant's connections are all in
    use: the server's refusal and the flag to raise, not the ``Connection reset by peer`` of the
    attempts after it (what it said), nor "cannot reach" alone."""
    code, _, err = await blocks("tenant", "add", "tc", "--max-connections", "1", "--data-dir", str(data_dir))
    assert code == 0, err
    held = await open_all(data_dir, "tc", "main", 1)
    assert len(held) == 1
    try:
        code, _, err = await blocks("tenant", "history", "blk-1", "-c", str(auth.credentials_path(data_dir, "tc", "main")))
    finally:
        await close(held)
    assert code != 0
    assert "maximum account active connections exceeded" in err, err
    assert "--max-connections N" in err and "blocks tenant get T" in err, err
    assert "Connection reset" not in err, err


async def test_a_tenants_first_user_is_not_removed_alone_and_tenant_add_brings_it_back(data_dir: Path) -> None:
    """``tenant user remove T main`` took the tenant's account with it: ``submit --tenant T`` said
    "no tenant", and ``tenant add T`` wrote a main.json whose password the server never got
    ("no user 'main'", exit 1, each run another). Now: refused (exit 2, naming what to do), and a
    first user an older version removed is brought back by ``tenant add T``."""
    assert (await blocks("tenant", "add", "tm", "--data-dir", str(data_dir)))[0] == 0
    assert (await blocks("tenant", "user", "add", "tm", "two", "--data-dir", str(data_dir)))[0] == 0
    code, _, err = await blocks("tenant", "user", "remove", "tm", "main", "--data-dir", str(data_dir))
    assert code == 2 and "'tm.main' is the first user of tenant 'tm'" in err and "blocks tenant remove tm" in err, err
    assert "main" in auth.Secrets.load(data_dir, create=False).tenants["tm"]["users"]
    await close([await login(data_dir, "tm", "main")])
    # a data dir where it was removed (as before): tenant add gives it back, logging in
    s = auth.Secrets.load(data_dir, create=False)
    del s.tenants["tm"]["users"]["main"]
    s.save()
    auth.credentials_path(data_dir, "tm", "main").unlink()
    code, _, err = await blocks("tenant", "add", "tm", "--data-dir", str(data_dir))
    assert code == 0, err
    assert "main" in auth.Secrets.load(data_dir, create=False).tenants["tm"]["users"]
    await close([await login(data_dir, "tm", "main"), await login(data_dir, "tm", "two")])
