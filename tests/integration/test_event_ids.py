"""What a client may publish can never suppress or forge a system event (issue: an upstream create
carrying a block's future step id froze the block). Driven with a real nats-py client logged in as
the ``upstream`` role, against the embedded servers with their real permissions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import CLOUDEVENTS_JSON, connect
from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import Supervisor

from .conftest import COMPONENT

pytestmark = pytest.mark.integration


@dataclass
class Parts:
    servers: EmbeddedServers
    client: Client
    sups: list[Supervisor]

    def start(self, *kinds: str) -> Supervisor:
        sup = Supervisor(self.servers.nats_url, self.servers.redis_url, {k: 1 for k in kinds},
                         log_dir=str(self.servers.data_dir / "logs"), role_env=self.servers.worker_env).start()
        self.sups.append(sup)
        return sup


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[Parts]:
    if os.environ.get("AIOS_NATS_URL"):
        pytest.skip("needs the embedded servers and their role permissions")
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    client = await Client.open(servers.nats_url, servers.redis_url)
    p = Parts(servers, client, [])
    try:
        await client.add_component(COMPONENT)
        await client.add_sim_cluster("c1", nodes=2, gpus=2)
        yield p
    finally:
        await client.close()
        for sup in p.sups:
            sup.stop()
        servers.stop()


def _spec(bid: str) -> bytes:
    return json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": bid, "minInstances": 1, "maxInstances": 1}).encode()


async def test_an_upstream_create_carrying_a_blocks_step_ids_cannot_freeze_it(parts: Parts) -> None:
    # room for the victim and its 6 decoys at once (c1 holds 4): the victim never waits behind a decoy
    await parts.client.add_sim_cluster("c2", nodes=1, gpus=4)
    parts.start("gateway", "controller", "agent-sim")  # the parser comes last: the trap is set first
    ack = await parts.client.bus.js.publish(subjects.block_create("victim"), _spec("victim"))
    gen = ack.seq  # the victim's generation: its create's stream sequence
    # the old scheme's ids of the victim's next steps, and guesses at the new one
    guesses = [f"victim:{gen}:parsed:0", f"victim:{gen}:rejected", f"victim:{gen}:ready", f"victim:{gen}:selection:0",
               f"k1:victim:{gen}:parsed:0", "k1:" + "0" * 40]
    up = await connect(parts.servers.endpoints.nats_url("upstream"), "third-party-upstream")
    try:
        js = up.jetstream(timeout=5)
        for i, guess in enumerate(guesses):
            pa = await js.publish(subjects.block_create(f"decoy{i}"), _spec(f"decoy{i}"), headers={"Nats-Msg-Id": guess})
            assert not pa.duplicate  # stored: the client may pick its own ids, just not suppress ours
    finally:
        await up.close()
    parts.start("parser")
    kind, _ = await parts.client.wait("victim", 60)
    assert kind == "ready"

    # on the wire: a keyed id (not the logical one), structured-mode CloudEvents, absolute source
    raw = await parts.client.bus.js.get_last_msg(subjects.STREAM, subjects.block_event("victim", "parsed"))
    headers = raw.headers or {}
    assert headers["Nats-Msg-Id"].startswith("k1:") and "victim" not in headers["Nats-Msg-Id"]
    assert headers["Content-Type"] == CLOUDEVENTS_JSON
    try:
        from cloudevents.v1.http import from_http
    except ImportError:  # cloudevents < 2
        from cloudevents.http import from_http  # type: ignore[no-redef]
    event = from_http({"Content-Type": headers["Content-Type"]}, raw.data)
    assert event["id"] == f"victim:{gen}:parsed:0"  # the logical id stays readable
    assert event["source"].startswith("aios-blocks://") and event["source"].endswith("/parser")
    assert event["type"] == "io.aios.block.parsed" and event.data["block_id"] == "victim"


async def test_upstream_cannot_publish_a_system_event(parts: Parts) -> None:
    parts.start("parser", "gateway", "controller", "agent-sim")
    up = await connect(parts.servers.endpoints.nats_url("upstream"), "third-party-upstream")
    try:
        js = up.jetstream(timeout=2)
        for subject in (subjects.block_event("victim", "ready"), subjects.block_event("victim", "deleted"),
                        subjects.cluster_command("c1", "allocation"), "$KV.AIOS_KEYS.event"):
            with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
                await js.publish(subject, b"{}")
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):  # nor read the id key
            await js.key_value("AIOS_KEYS")
    finally:
        await up.close()
    info = await parts.client.bus.js.stream_info(subjects.STREAM, subjects_filter="aios.block.victim.>")
    assert not info.state.subjects  # nothing stored


def _check(parts: Parts, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIOS_NATS_URL": parts.servers.nats_url, "AIOS_REDIS_URL": parts.servers.redis_url}
    env.pop("AIOS_STUCK_AFTER_S", None)
    return subprocess.run([sys.executable, "-m", "aios_blocks.cli", "check", *args], env=env, capture_output=True,
                          text=True, timeout=120)


async def test_check_reports_a_block_that_stopped_moving(parts: Parts) -> None:
    parts.start("parser", "controller", "agent-sim")  # no gateway: nothing will ever select it
    await parts.client.submit(msgspec.json.decode(_spec("frozen")))
    deadline = time.time() + 30
    while (await parts.client.store.r.hget("aios:block:frozen", "status")) != "parsed":
        assert time.time() < deadline
        await asyncio.sleep(0.1)
    await asyncio.sleep(2.5)
    r = await asyncio.to_thread(_check, parts, "--live", "--stuck-after", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "block frozen: stuck parsed for" in r.stdout and "no event since parsed" in r.stdout
    r = await asyncio.to_thread(_check, parts, "--live")  # default limit (600 s): in flight, not stuck yet
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stuck parsed" not in r.stdout and "blocks_stuck': 0" in r.stdout
