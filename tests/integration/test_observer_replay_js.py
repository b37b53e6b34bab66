"""Observers replay stored events with the official JavaScript clients (npm ``nats`` 2.x, and its
3.x successor ``@nats-io/jetstream`` + ``@nats-io/transport-node``) on ``AIOS_OBSERVE``, the
observers' mirror of ``AIOS``, through consumers named after their user (docs/security.md
"Observers: a user each"): the clients' ordered consumers, which name themselves, are refused, and
another observer's consumer and the workers' consumers on ``AIOS`` stay out of their reach."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import Bus, security_options
from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth, observers
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.settings import Settings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("observer_js") / "replay.mjs"
#: the last 2.x of npm ``nats``, and the 3.x packages that replace it (``nats`` itself ends at 2.x)
PACKAGES = ("nats@2.29.3", "@nats-io/jetstream@3.4.0", "@nats-io/transport-node@3.4.0")
OBSERVE = subjects.STREAM_OBSERVE


@pytest.fixture(scope="module")
def js_clients() -> Path:
    """The JS clients installed once under the venv (npm reaches the registry on CI)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("node and npm are needed to test the JavaScript clients (apt-get install nodejs npm)")
        pytest.skip("node/npm not installed")
    where = ROOT / ".venv" / "observer-js"
    stamp = where / "installed.txt"
    if not stamp.exists() or stamp.read_text() != " ".join(PACKAGES):
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund", "--silent", *PACKAGES],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        stamp.write_text(" ".join(PACKAGES))
    shutil.copy(SCRIPT, where / SCRIPT.name)  # next to its node_modules
    return where


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServers]:
    s = EmbeddedServers(data_dir=tmp_path_factory.mktemp("observe"), auth=True).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def admin(servers: EmbeddedServers) -> AsyncIterator[Bus]:
    bus = await Bus.open(servers.nats_url)
    yield bus
    await bus.close()


async def mirrored(admin: Bus, subject: str, timeout: float = 20.0) -> None:
    """Until the mirror holds the last message stored on ``subject`` (a mirror trails its origin)."""
    want = (await admin.js.get_last_msg(subjects.STREAM, subject)).data
    for _ in range(int(timeout / 0.05)):
        try:
            if (await admin.js.get_last_msg(OBSERVE, subject)).data == want:
                return
        except NotFoundError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{OBSERVE} did not get {subject} within {timeout}s")


def run_node(where: Path, gen: str, config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / f"{gen}.json"
    path.write_text(json.dumps(config))
    r = subprocess.run(["node", str(where / SCRIPT.name), gen, str(path)], capture_output=True, text=True, timeout=240,
                       cwd=where)
    assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("gen", ["v2", "v3"])
async def test_an_observer_replays_through_its_own_named_consumer_with_the_js_client(
        servers: EmbeddedServers, admin: Bus, js_clients: Path, gen: str, tmp_path: Path) -> None:
    bid = f"js-{gen}"
    stored = [f"aios.block.{bid}.rejected", f"aios.block.{bid}.selection", f"aios.block.{bid}.autoscaled"]
    for i, subject in enumerate(stored):
        await admin.publish_raw(subject, json.dumps({"i": i}).encode(), msg_id=f"{bid}-{i}")
    await mirrored(admin, stored[-1])
    # a worker's consumer on AIOS (the parser's is on AIOS_INTAKE, out of observers' reach altogether)
    parser_before = await admin.js.consumer_info(subjects.STREAM, subjects.GATEWAY.durable)
    # another observer's consumer on the mirror
    other_url = json.loads((await asyncio.to_thread(observers.add_observer, servers.data_dir, "js-other"))[1].read_text())["nats_url"]
    other = await nats.connect(servers=[other_url], allow_reconnect=False, connect_timeout=5, **security_options(other_url))
    theirs = "observer-js-other_1"
    await other.jetstream(timeout=5).add_consumer(OBSERVE, ConsumerConfig(name=theirs, filter_subject=f"aios.block.{bid}.>",
                                                                          inactive_threshold=120))
    u = urlsplit(servers.endpoints.nats_url("observer"))
    out = run_node(js_clients, gen, {
        "servers": f"{u.hostname}:{u.port}", "user": u.username, "pass": u.password, "stream": OBSERVE,
        "subject": f"aios.block.{bid}.>", "expected": stored, "otherConsumer": theirs,
        "workerStream": subjects.STREAM, "workerConsumer": subjects.GATEWAY.durable}, tmp_path)
    replays = out["replays"]
    assert replays["named"]["subjects"] == stored and replays["named"]["ack_pending"] == 0, out
    assert replays["named"]["named"] == "observer_1", out
    assert out["replay_errors"] == [], out  # no permissions violation, no flood of status errors
    assert "error" in replays["ordered_pull"], out  # names itself: refused
    # the other observer's consumer: no info, no pull, not deleted; untouched
    assert set(out["other"]) == {"info_error", "pull_error", "delete_error"}, out
    info = await other.jetstream(timeout=5).consumer_info(OBSERVE, theirs)
    assert info.num_pending == len(stored) and info.delivered.stream_seq == 0
    await other.close()
    # the worker's consumer on AIOS stays out of reach: nothing pulled, its config not updated
    assert not out["worker"].get("pulled") and not out["worker"].get("updated"), out
    assert "permissions violation" in out["worker"]["update_error"].lower(), out
    parser_after = await admin.js.consumer_info(subjects.STREAM, subjects.GATEWAY.durable)
    assert parser_after.config.filter_subjects == parser_before.config.filter_subjects
    assert not parser_after.config.inactive_threshold
    assert parser_after.num_pending == parser_before.num_pending and parser_after.num_ack_pending == 0
    # every consumer the observer made is on the mirror; none is left on the workers' stream
    names = {c.name for c in await admin.js.consumers_info(subjects.STREAM)}
    assert names <= set(auth.WORKER_DURABLES), names


async def test_a_push_consumer_on_the_mirror_injects_nothing_into_the_stream(servers: EmbeddedServers, admin: Bus) -> None:
    """The mirror takes no subject, so the server's cycle check does not stop an observer's push
    consumer there from delivering onto a stored subject: what it delivers must not be stored
    (events forged from replayed ones), and carries a ``$JS.ACK`` reply like any replay (which the
    core handlers drop: docs/security.md)."""
    await admin.publish_raw("aios.block.inj-src.rejected", b'{"x": 1}', msg_id="inj-src")
    await mirrored(admin, "aios.block.inj-src.rejected")
    url = servers.endpoints.nats_url("observer")
    nc = await nats.connect(servers=[url], allow_reconnect=False, connect_timeout=5, **security_options(url))
    try:
        target = "aios.block.inj-dst.ready"
        sub = await nc.subscribe(target)  # the delivery needs interest: the observer's own
        await nc.flush()
        body = {"stream_name": OBSERVE, "config": {"name": "observer_9", "deliver_subject": target, "ack_policy": "none",
                                                   "filter_subject": "aios.block.inj-src.rejected", "deliver_policy": "all"}}
        reply = await nc.request(f"$JS.API.CONSUMER.CREATE.{OBSERVE}.observer_9", json.dumps(body).encode(), timeout=5)
        assert "error" not in json.loads(reply.data), reply.data
        msg = await sub.next_msg(timeout=10)
        assert msg.data == b'{"x": 1}' and msg.reply.startswith(f"$JS.ACK.{OBSERVE}.")
        await nc.request(f"$JS.API.CONSUMER.DELETE.{OBSERVE}.observer_9", b"", timeout=5)
    finally:
        await nc.close()
    with pytest.raises(NotFoundError):
        await admin.js.get_last_msg(subjects.STREAM, target)


async def test_the_mirror_is_rebuilt_when_missing_by_the_admin_not_by_an_observer(servers: EmbeddedServers,
                                                                                  admin: Bus) -> None:
    await admin.publish_raw("aios.block.rebuilt.rejected", b"{}", msg_id="rebuilt")
    await admin.js.delete_stream(OBSERVE)
    ep = servers.endpoints
    observer_redis = ep.redis_url("observer")
    assert observer_redis is not None
    observer = await Client.open(ep.nats_url("observer"), observer_redis)  # may not create streams: does not try
    await observer.close()
    with pytest.raises(NotFoundError):
        await admin.js.stream_info(OBSERVE)
    client = await Client.open(servers.nats_url, servers.redis_url)  # any command of the admin's
    await client.close()
    info = await admin.js.stream_info(OBSERVE)
    assert info.config.mirror is not None and info.config.mirror.name == subjects.STREAM
    await mirrored(admin, "aios.block.rebuilt.rejected")  # with the events stored before


async def test_without_credentials_the_first_client_creates_the_mirror(tmp_path: Path) -> None:
    """``AIOS_AUTH=0`` servers (or your own, as a user that may create streams): the embedded setup
    makes no topology, the first worker or command does, the mirror included."""
    s = EmbeddedServers(data_dir=tmp_path / "noauth", auth=False).start()
    try:
        client = await Client.open(s.nats_url, s.redis_url)
        try:
            info = await client.bus.js.stream_info(OBSERVE)
            assert info.config.mirror is not None and info.config.mirror.name == subjects.STREAM
            # AIOS_OBSERVE_MIRROR=0: none is made
            await client.bus.js.delete_stream(OBSERVE)
            off = await Bus.open(s.nats_url, settings=Settings(observe_mirror=False))
            try:
                await off.ensure_topology()
                with pytest.raises(NotFoundError):
                    await off.js.stream_info(OBSERVE)
            finally:
                await off.close()
        finally:
            await client.close()
    finally:
        s.stop()
