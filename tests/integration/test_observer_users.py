"""Observers are a user each (docs/security.md "Observers: a user each"), on real servers: one
observer cannot delete, read the state of, pull from or take over another's consumer, on the
observers' mirror ``AIOS_OBSERVE`` or on ``AIOS``, nor read its deliveries; each creates, reads and
deletes its own (named ``<user>_<n>``), and the ``blocks`` reads work as one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from aios_blocks.bus import subjects
from aios_blocks.bus.consumer_names import NoConsumerName, create_named, subscribe_ordered
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.cli.client import Client
from aios_blocks.runtime import auth, observers
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.roles import OBSERVER_CONSUMERS, observer_consumers

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
OB, ST = subjects.STREAM_OBSERVE, subjects.STREAM
API = "$JS.API"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServers]:
    s = EmbeddedServers(data_dir=tmp_path_factory.mktemp("observers"), auth=True).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def admin(servers: EmbeddedServers) -> AsyncIterator[Bus]:
    bus = await Bus.open(servers.nats_url)
    yield bus
    await bus.close()


def observer_url(servers: EmbeddedServers, name: str) -> str:
    _, path = observers.add_observer(servers.data_dir, name)
    creds = json.loads(path.read_text())
    assert path.stat().st_mode & 0o077 == 0 and creds["user"] == f"observer-{name}"
    url: str = creds["nats_url"]
    return url


async def mirrored(admin: Bus, subject: str, timeout: float = 20.0) -> None:
    want = (await admin.js.get_last_msg(ST, subject)).data
    for _ in range(int(timeout / 0.05)):
        try:
            if (await admin.js.get_last_msg(OB, subject)).data == want:
                return
        except NotFoundError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{OB} did not get {subject} within {timeout}s")


@pytest.mark.parametrize("stream", [OB, ST])
async def test_an_observer_cannot_touch_another_observers_consumer(servers: EmbeddedServers, admin: Bus, connect: Any,
                                                                   stream: str) -> None:
    bid = f"dash-{stream.lower().replace('_', '')}"
    for i in range(3):
        await admin.publish_raw(f"aios.block.{bid}.ready", json.dumps({"i": i}).encode(), msg_id=f"{bid}-{i}")
    await mirrored(admin, f"aios.block.{bid}.ready")
    a = await connect(observer_url(servers, "dash-a"))
    b = await connect(observer_url(servers, "dash-b"))
    shared = await connect(servers.endpoints.nats_url("observer"))  # the data dir's own observer
    mine = observer_consumers(a.user)[0]
    assert mine == "observer-dash-a_1"
    a_js = a.nc.jetstream(timeout=5)
    pull = await a_js.pull_subscribe(f"aios.block.{bid}.>", durable=mine, stream=stream)

    for other in (b, shared):
        # delete, info, pull, ack: each refused (the server drops the request), nothing changed
        assert await other.refused(f"{API}.CONSUMER.DELETE.{stream}.{mine}"), other.user
        assert await other.refused(f"{API}.CONSUMER.INFO.{stream}.{mine}"), other.user
        assert await other.refused(f"{API}.CONSUMER.MSG.NEXT.{stream}.{mine}", {"batch": 3}), other.user
        await other.nc.publish(f"$JS.ACK.{stream}.{mine}.1.1.1.1.0", b"+ACK")
        assert await other.denied(f"$JS.ACK.{stream}.{mine}.1.1.1.1.0")
        # take it over: an update under its name (its deliveries to the other's inbox), by name in
        # the subject or in the body of the unnamed create (which nats-server 2.15 would apply)
        body = {"stream_name": stream, "config": {"name": mine, "durable_name": mine, "deliver_subject": f"_INBOX.{other.user}.x",
                                                  "filter_subject": f"aios.block.{bid}.>", "ack_policy": "none"}}
        for api in (f"{API}.CONSUMER.CREATE.{stream}.{mine}", f"{API}.CONSUMER.CREATE.{stream}.{mine}.aios.block.{bid}.>",
                    f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{mine}", f"{API}.CONSUMER.CREATE.{stream}"):
            assert await other.refused(api, body), (other.user, api)
        # no listing either (it shows every consumer's state); no reading of A's inbox
        for api in (f"{API}.CONSUMER.LIST.{stream}", f"{API}.CONSUMER.NAMES.{stream}"):
            assert await other.refused(api), (other.user, api)
        await other.nc.subscribe(f"_INBOX.{a.user}.>")
        assert await other.denied(f"_INBOX.{a.user}.>", "subscription"), other.user

    info = await admin.js.consumer_info(stream, mine)
    assert info.num_pending == 3 and info.delivered.stream_seq == 0 and not info.config.deliver_subject
    # A reads and deletes its own
    assert (await a_js.consumer_info(stream, mine)).num_pending == 3
    got = await pull.fetch(3, timeout=5)
    assert [json.loads(m.data)["i"] for m in got] == [0, 1, 2]
    for m in got:
        await m.ack()
    await a_js.delete_consumer(stream, mine)
    with pytest.raises(NotFoundError):
        await admin.js.consumer_info(stream, mine)
    # B has consumers of its own (an ordered push one here), which A cannot touch in turn
    seen: asyncio.Queue[str] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await seen.put(msg.subject)

    b_js = b.nc.jetstream(timeout=5)
    refusals = len(b.errors)
    its, sub = await subscribe_ordered(b.nc, b_js, f"aios.block.{bid}.>", stream, "dash", ConsumerConfig(), cb=cb)
    assert its in observer_consumers(b.user)
    assert await asyncio.wait_for(seen.get(), 10) == f"aios.block.{bid}.ready"
    assert await a.refused(f"{API}.CONSUMER.DELETE.{stream}.{its}")
    assert (await admin.js.consumer_info(stream, its)).name == its
    await sub.unsubscribe()
    await b_js.delete_consumer(stream, its)
    assert not [e for e in b.errors[refusals:] if "permissions" in e.lower()], b.errors[refusals:]


async def test_an_added_observer_reads_events_but_no_task_data(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    c = await connect(observer_url(servers, "dash-c"))
    for subject in ("aios.block.*.task", "aios.output.*.*"):
        await c.nc.subscribe(subject)
        assert await c.denied(subject, "subscription"), subject
    await c.nc.publish("aios.block.x.create", b"{}")
    assert await c.denied("aios.block.x.create")
    await c.nc.subscribe(f"_INBOX.{c.user}.own")  # its own inbox
    await c.nc.flush(timeout=5)
    assert not [e for e in c.errors if f"_INBOX.{c.user}" in e]


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


async def test_blocks_reads_work_as_an_added_observer_and_take_only_its_own_names(servers: EmbeddedServers,
                                                                                  admin: Bus) -> None:
    new, path = await asyncio.to_thread(observers.add_observer, servers.data_dir, "console-2")
    assert new and not (await asyncio.to_thread(observers.add_observer, servers.data_dir, "console-2"))[0]
    creds = await asyncio.to_thread(_read_json, path)
    await admin.publish_raw("aios.block.dash-cli.ready", b'{"x": 1}', msg_id="dash-cli-ready")
    client = await Client.open(creds["nats_url"], creds["redis_url"])
    try:
        history = await client.history("dash-cli")  # a stream read through a consumer named after it
        assert [s for s, _, _ in history] == ["aios.block.dash-cli.ready"]
        got: list[str] = []
        async for subject, _ in client.follow("dash-cli"):  # `blocks watch`: an ordered consumer
            got.append(subject)
            break
        assert got == ["aios.block.dash-cli.ready"]
    finally:
        await client.close()
    assert "observer-console-2" in {o["user"] for o in observers.observers(servers.data_dir)}
    assert observers.remove_observer(servers.data_dir, "console-2")
    assert not await asyncio.to_thread(path.exists)
    assert not auth.nats_login(creds["nats_url"])


async def test_an_observer_whose_names_are_all_taken_is_told_so(servers: EmbeddedServers, connect: Any) -> None:
    d = await connect(observer_url(servers, "dash-d"))
    js = d.nc.jetstream(timeout=5)
    for name in observer_consumers(d.user):
        await js.add_consumer(OB, ConsumerConfig(name=name, inactive_threshold=60))

    async def create(j: Any, name: str) -> Any:  # (a config of its own, as every reader's: its inbox)
        return await j.add_consumer(OB, ConsumerConfig(name=name, inactive_threshold=60, description="mine"))

    with pytest.raises(NoConsumerName, match=f"all its {OBSERVER_CONSUMERS} consumer names in use"):
        await create_named(d.nc, js, OB, "read", create)
    assert [(await js.consumer_info(OB, n)).config.description for n in observer_consumers(d.user)] == [None] * OBSERVER_CONSUMERS
    await js.delete_consumer(OB, observer_consumers(d.user)[4])
    name, info = await create_named(d.nc, js, OB, "read", create)
    assert name == info.name == observer_consumers(d.user)[4] and info.config.description == "mine"


@pytest.mark.parametrize("stream", [OB, ST])
async def test_two_clients_of_one_observer_starting_at_once_never_share_a_consumer_name(
        servers: EmbeddedServers, connect: Any, stream: str) -> None:
    """Each takes a name by creating it (``"action": "create"``), not by looking for a free one and
    then creating it: two clients that saw the same name free both created it, and the second
    create updated the first's consumer (its deliveries sent to the second's inbox). Two clients
    of one user, each starting half its names' worth of readers at the same moment."""
    url = observer_url(servers, f"twins-{stream.lower().replace('_', '')}")
    a, b = await connect(url), await connect(url)
    half = OBSERVER_CONSUMERS // 2

    async def ignore(msg: Any) -> None:
        pass

    async def reader(c: Any) -> tuple[str, Any, str]:
        name, sub = await subscribe_ordered(c.nc, c.nc.jetstream(timeout=5), "aios.block.*.ready", stream, "dash",
                                            ConsumerConfig(inactive_threshold=60), cb=ignore)
        return name, sub, c.user

    opened = await asyncio.gather(*(reader(c) for c in (a, b) for _ in range(half)))
    names = [name for name, _, _ in opened]
    assert len(set(names)) == len(names) == OBSERVER_CONSUMERS, sorted(names)
    assert set(names) == set(observer_consumers(a.user))
    js = a.nc.jetstream(timeout=5)
    for name, sub, _ in opened:  # each consumer still delivers to the client that made it
        assert (await js.consumer_info(stream, name)).config.deliver_subject == sub.subject
    with pytest.raises(NoConsumerName):
        await reader(a)
    for name, sub, _ in opened:
        await sub.unsubscribe()
        await js.delete_consumer(stream, name)


def _blocks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "blocks"), *args], capture_output=True, text=True, timeout=60)


async def test_blocks_observer_add_list_remove(servers: EmbeddedServers, admin: Bus, connect: Any) -> None:
    d = str(servers.data_dir)
    r = await asyncio.to_thread(_blocks, "observer", "add", "cli-dash", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["user"] == "observer-cli-dash" and out["new"] is True
    creds = await asyncio.to_thread(_read_json, Path(out["credentials"]))
    assert auth.nats_login(creds["nats_url"]) and creds["inbox_prefix"] == "_INBOX.observer-cli-dash"
    listed = await asyncio.to_thread(_blocks, "observer", "list", "--json", "--data-dir", d)
    assert "observer-cli-dash" in {o["user"] for o in json.loads(listed.stdout)}
    dash = await connect(creds["nats_url"])  # a durable of its own on each stream: removed with it
    mine = observer_consumers("observer-cli-dash")[0]
    for stream in (OB, ST):
        await dash.nc.jetstream().add_consumer(stream, ConsumerConfig(durable_name=mine, filter_subject="aios.block.x.>"))
    r = await asyncio.to_thread(_blocks, "observer", "remove", "cli-dash", "--data-dir", d)
    assert r.returncode == 0 and "removed (2 consumers deleted)" in r.stdout, (r.stdout, r.stderr)
    assert not auth.nats_login(creds["nats_url"])
    for stream in (OB, ST):  # the same name added again starts from none, not at the old one's position
        with pytest.raises(NotFoundError):
            await admin.js.consumer_info(stream, mine)
    r = await asyncio.to_thread(_blocks, "observer", "add", "a.b", "--data-dir", d)
    assert r.returncode != 0 and "invalid observer name" in (r.stdout + r.stderr)
