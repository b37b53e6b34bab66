"""The executors' HTTP task port asks for the credentials NATS asks for (docs/security.md "The
executors' HTTP port"), on the embedded servers with auth on and the workers as ``blocks up`` runs
them: no or wrong credentials are 401 with a Basic challenge, ``upstream`` and ``admin`` may send
any block a task, a tenant's user its own tenant's blocks only (403 for another's or the default
tenant's, or a block that does not exist), ``/health`` stays open, tenant users added or removed
while the executor runs are let in or out, and no password reaches a log."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from aios_blocks.bus.instance_map import InstanceMaps
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import free_port

from .conftest import System
from .test_tenants import HEADERS, SPEC, create, login

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


@pytest.fixture
def http_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The executor's HTTP port (before ``system``, which starts the workers)."""
    port = free_port()
    monkeypatch.setenv("AIOS_EXECUTOR_HTTP_PORT", str(port))
    return port


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@dataclass(frozen=True)
class Login:
    login: str
    password: str

    def header(self) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{self.login}:{self.password}".encode()).decode()}


def upstream_header(data_dir: Path) -> dict[str, str]:
    """What an upstream client sends the HTTP port of the system in ``data_dir`` (nothing without auth)."""
    if not (data_dir / "auth" / "secrets.json").exists():
        return {}
    return Login("upstream", auth.Secrets.load(data_dir, create=False).nats["upstream"]).header()


def tenant_login(data_dir: Path, tenant: str, user: str = "main") -> Login:
    creds = json.loads(auth.credentials_path(data_dir, tenant, user).read_text())
    return Login(creds["user"], creds["password"])


async def post(http: aiohttp.ClientSession, port: int, bid: str, login: Login | None,
               path: str = "tasks") -> tuple[int, dict[str, str], bytes]:
    async with http.post(f"http://127.0.0.1:{port}/blocks/{bid}/{path}", json={"x": 1},
                         headers=login.header() if login else {}) as r:
        return r.status, dict(r.headers), await r.read()


async def ready(system: System, http: aiohttp.ClientSession, port: int, bid: str, login: Login) -> None:
    """Until the block has a ready instance and the executor answers its task."""
    maps = InstanceMaps(system.client.bus)
    async with asyncio.timeout(90):
        while True:
            m, _ = await maps.get(bid)
            if m and any(i["state"] == "ready" for i in m["instances"].values()):
                break
            await asyncio.sleep(0.1)
        while True:
            with contextlib.suppress(aiohttp.ClientConnectionError):  # the port opens once the maps are read
                if (await post(http, port, bid, login))[0] == 200:
                    return
            await asyncio.sleep(0.1)


async def test_the_http_task_port_asks_for_the_users_nats_asks_for(http_port: int, system: System,
                                                                    http: aiohttp.ClientSession) -> None:
    if system.servers is None or not system.servers.auth:
        pytest.skip("the embedded servers with auth: the executor is given their users")
    data, c = system.data_dir, system.client
    await c.add_sim_cluster("hc", nodes=1, gpus=4)
    for t in ("ha", "hb"):
        auth.add_tenant(data, t)
    secrets = auth.Secrets.load(data, create=False)
    upstream = Login("upstream", secrets.nats["upstream"])
    admin = Login("admin", secrets.nats["admin"])
    ha, hb = tenant_login(data, "ha"), tenant_login(data, "hb")

    await c.submit({**SPEC, "blockId": "hu-b1"})  # the default tenant's
    nc = await login(data, "ha")
    try:
        await nc.jetstream(timeout=10).publish("aios.block.ha-b1.create", create("ha-b1"), headers=HEADERS)
    finally:
        await nc.close()
    await ready(system, http, http_port, "hu-b1", upstream)
    await ready(system, http, http_port, "ha-b1", upstream)

    # no credentials, wrong ones, an unknown user, another scheme: 401 with the challenge, nothing sent
    for login_ in (None, Login("upstream", "wrong"), Login("nobody", secrets.nats["upstream"]),
                   Login("observer", secrets.nats["observer"]), Login("ha.main", "x")):
        for bid in ("hu-b1", "ha-b1"):
            status, headers, body = await post(http, http_port, bid, login_)
            assert status == 401, (login_, bid, status, body)
            assert headers["WWW-Authenticate"].startswith('Basic realm="aios-blocks"')
            refusal = json.loads(body)
            assert refusal["status"] == 401 and refusal["error"] and "instance_id" not in refusal
    async with http.post(f"http://127.0.0.1:{http_port}/blocks/hu-b1/tasks", data=b"{}",
                         headers={"Authorization": "Bearer " + secrets.nats["upstream"]}) as r:
        assert r.status == 401
    status, _, _ = await post(http, http_port, "hu-b1", None, "v1/models")  # the pass-through path too
    assert status == 401
    async with http.get(f"http://127.0.0.1:{http_port}/health") as r:  # open: no task goes anywhere
        assert r.status == 200

    # upstream and admin: any block
    for login_ in (upstream, admin):
        for bid in ("hu-b1", "ha-b1"):
            status, _, body = await post(http, http_port, bid, login_)
            assert status == 200, (login_.login, bid, body)
            assert json.loads(body)["output"] == {"x": 1}

    # a tenant's user: its own tenant's blocks only
    status, _, _ = await post(http, http_port, "ha-b1", ha)
    assert status == 200
    for login_, bid in ((hb, "ha-b1"), (hb, "hu-b1"), (ha, "hu-b1"), (ha, "no-such-block")):
        status, headers, body = await post(http, http_port, bid, login_)
        assert status == 403, (login_.login, bid, status, body)
        refusal = json.loads(body)
        assert refusal["status"] == 403 and login_.login in refusal["error"] and "WWW-Authenticate" not in headers

    # users added and removed while the executor runs: let in, then out (it reads its file again)
    await asyncio.to_thread(auth.add_tenant_user, data, "ha", "two")
    two = tenant_login(data, "ha", "two")
    async with asyncio.timeout(10):
        while (await post(http, http_port, "ha-b1", two))[0] != 200:
            await asyncio.sleep(0.1)
    await asyncio.to_thread(auth.remove_tenant_user, data, "ha", "two")
    async with asyncio.timeout(10):
        while (await post(http, http_port, "ha-b1", two))[0] != 401:
            await asyncio.sleep(0.1)

    # the file holds hashes only, for the owner alone; no log holds a password
    users_file = data / "auth" / "task-users.json"
    assert oct(users_file.stat().st_mode & 0o777) == "0o600"
    text = users_file.read_text()
    passwords = [secrets.nats["upstream"], secrets.nats["admin"], ha.password, hb.password, two.password]
    assert sorted(json.loads(text)["users"]) == ["admin", "ha.main", "hb.main", "upstream"]
    for p in passwords:
        assert p not in text
    for log in (data / "logs").glob("*.log"):
        content = log.read_text(errors="replace")
        for p in passwords:
            assert p not in content, log
