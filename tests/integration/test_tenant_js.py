"""A tenant's client with the official JavaScript client (npm ``nats`` 2.x, and its 3.x successor
``@nats-io/transport-node`` + ``@nats-io/jetstream``) in its DEFAULT
configuration, no ``inboxPrefix`` (docs/security.md "Tenants"): it creates its block (JetStream
publish, PubAck read), watches it, sends it a task, scales it, is told "no block of yours" for
another, deletes it. Node and the package come as in ``test_observer_replay_js``."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import subjects
from aios_blocks.runtime import auth

from .conftest import System
from .test_observer_replay_js import js_clients  # noqa: F401  (the fixture: node_modules under the venv)

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True
SCRIPT = Path(__file__).with_name("observer_js") / "tenant.mjs"


@pytest.mark.parametrize("version", ["v2", "v3"])
async def test_a_default_nats_js_client_of_a_tenant_creates_scales_tasks_and_watches_its_block(
        system: System, js_clients: Path, version: str) -> None:  # noqa: F811
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    await system.client.add_sim_cluster(f"tjs-{version}", nodes=2, gpus=4)
    team, bid = f"js-team-{version}", f"js-b1-{version}"
    _, creds = auth.add_tenant(system.data_dir, team)
    shutil.copy(SCRIPT, js_clients / SCRIPT.name)  # next to its node_modules
    proc = await asyncio.create_subprocess_exec("node", str(js_clients / SCRIPT.name), str(creds), bid, version, cwd=js_clients,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
    text = stdout.decode()
    assert proc.returncode == 0 and text.strip(), text + stderr.decode()
    out: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
    assert "fatal" not in out and out["errors"] == [], out
    assert out["create"]["stream"] == subjects.STREAM_INTAKE and out["create"]["seq"] > 0
    assert out["task"]["status"] == 200 and out["task"]["body"]["output"] == {"hello": "js"}, out["task"]
    assert out["scale"]["status"] == 200 and out["scale"]["body"]["target"] == 2 and out["added"] >= 2
    assert out["foreign"]["status"] == 404 and out["delete"]["status"] == 200
    assert {"submitted", "parsed", "ready", "scale.target", "deleted"} <= set(out["events"]), out["events"]
    block = await system.client.store.get_block(bid)
    assert block is not None and block["ir"]["labels"]["tenant"] == team
