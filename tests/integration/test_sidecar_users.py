"""Side-cars: a NATS user per block (docs/security.md "Side-cars: a user per block"), on a real
nats-server with nats-py. The side-car user of block A makes, reads and acks its own durable on
``AIOS_OUTPUTS`` (as the SDK does), and reaches nothing of block B's: no consumer on B's outputs
under any name, no pull, info or ack of B's durable, no subscription to B's outputs or inbox, no
alert or dead letter as B; a create whose body names another filter than its subject is refused by
the server. The user goes when the last node running the block's side-cars lets it go."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from aios_blocks.bus import event_ids, subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus, security_options
from aios_blocks.bus.nats_bus import connect as nats_connect
from aios_blocks.runtime import auth
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.sidecar_users import SidecarUsers
from aios_blocks.schemas.events import DeadLetter

from .conftest import Conn

pytestmark = pytest.mark.integration


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[EmbeddedServers]:
    s = EmbeddedServers(data_dir=tmp_path / "d", auth=True).start()
    try:
        yield s
    finally:
        s.stop()


async def raw(url: str) -> Conn:
    c = Conn(None, auth.url_user(url) or "")

    async def error_cb(exc: Exception) -> None:
        c.errors.append(str(exc))

    c.nc = await nats.connect(servers=[url], error_cb=error_cb, allow_reconnect=False, connect_timeout=5,
                              **security_options(url))
    return c


async def sidecar_bus(url: str) -> Bus:
    return Bus(await nats_connect(url, "test/sidecar"), "test/sidecar", event_key=event_ids.new_key())


async def test_a_blocks_sidecar_user_reaches_only_its_own_blocks_outputs(servers: EmbeddedServers) -> None:
    users = SidecarUsers(servers.data_dir)
    url_a, url_b = users.grant("ba", "store", "n1"), users.grant("bb", "store", "n2")
    assert auth.url_user(url_a) == "sidecar-ba" and auth.url_user(url_b) == "sidecar-bb"
    assert users.grant("ba", "store", "n1") == url_a  # the same again: no change
    admin = await nats.connect(servers.nats_url, **security_options(servers.nats_url))
    a = await raw(url_a)
    a_bus, b_bus = await sidecar_bus(url_a), await sidecar_bus(url_b)
    try:
        ajs = admin.jetstream(timeout=10)
        for bid in ("ba", "bb"):
            await ajs.publish(f"aios.output.{bid}.ok", json.dumps({"block_id": bid}).encode())
        # each side-car makes its own durable, as the SDK does, and pulls its own block's output
        for bus, bid in ((a_bus, "ba"), (b_bus, "bb")):
            await bus.ensure_sidecar_consumer(subjects.sidecar(bid, "store"), 5, 30.0)
        puller = await a_bus.js.pull_subscribe_bind(durable=subjects.sidecar_durable("ba", "store"),
                                                    stream=subjects.STREAM_OUTPUTS)
        (msg,) = await puller.fetch(1, timeout=10)
        assert msg.subject == "aios.output.ba.ok"
        await msg.ack_sync()

        # nothing of block bb's, whatever A asks
        so, theirs = subjects.STREAM_OUTPUTS, subjects.sidecar_durable("bb", "store")
        mine = subjects.sidecar_durable("ba", "store")
        for subject in (f"$JS.API.CONSUMER.CREATE.{so}.{theirs}.aios.output.bb.>",  # B's durable
                        f"$JS.API.CONSUMER.CREATE.{so}.{mine}.aios.output.bb.>",  # its own name on B's outputs
                        f"$JS.API.CONSUMER.CREATE.{so}.steal.aios.output.bb.>",
                        f"$JS.API.CONSUMER.DURABLE.CREATE.{so}.{mine}",  # the filter only in the body
                        f"$JS.API.CONSUMER.CREATE.{so}.{mine}", f"$JS.API.CONSUMER.CREATE.{so}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{so}.{theirs}", f"$JS.API.CONSUMER.INFO.{so}.{theirs}",
                        f"$JS.API.CONSUMER.DELETE.{so}.{theirs}", f"$JS.ACK.{so}.{theirs}.1.2.2.0.0",
                        "aios.block.bb.sidecar.store.alert", "aios.dlq.sidecar-bb-store.aios.output.bb.ok",
                        "aios.output.bb.dlq.store.ok", "aios.output.bb.ok", f"$JS.API.STREAM.INFO.{so}"):
            await a.nc.publish(subject, b"{}")
            assert await a.denied(subject), subject
        # its own block's output dead letter, stored with the outputs (as the SDK sends it)
        letter = DeadLetter(subject="aios.output.ba.ok", consumer=mine, error="refused", deliveries=5, stream_seq=1, data="{}")
        ack = await a_bus.emit(E.output_dead_letter, letter, sync=True, bid="ba", name="store", outcome="ok")
        assert ack.stream == so and (await ajs.get_last_msg(so, "aios.output.ba.dlq.store.ok")).seq == ack.seq
        for subject in ("aios.output.bb.>", "aios.output.>", "_INBOX.sidecar-bb.>", "_INBOX.>"):
            await a.nc.subscribe(subject)
            assert await a.denied(subject, "subscription"), subject
        # its own create subject with another filter in the body: the server refuses the mismatch
        body = {"stream_name": so, "config": {"name": mine, "durable_name": mine, "filter_subject": "aios.output.bb.>",
                                              "ack_policy": "explicit"}}
        reply = await a.nc.request(f"$JS.API.CONSUMER.CREATE.{so}.{mine}.aios.output.ba.>", json.dumps(body).encode(),
                                   timeout=10)
        assert "error" in json.loads(reply.data), reply.data
        # so the two durables are as their side-cars made them, and B's output still waits for B
        for durable, bid in ((mine, "ba"), (theirs, "bb")):
            info = await ajs.consumer_info(so, durable)
            assert (info.config.filter_subject or "") == f"aios.output.{bid}.*" or \
                info.config.filter_subjects == [f"aios.output.{bid}.*"], info.config
        assert (await ajs.consumer_info(so, theirs)).num_pending == 1
    finally:
        await a.nc.close()
        await a_bus.close()
        await b_bus.close()
    # the block's user goes with the last node running its side-cars
    assert users.grant("ba", "alert", "n3") == url_a
    assert users.release("ba", "n1") is False and auth.nats_login(url_a, servers.endpoints.nats_ca)
    assert users.release("ba", "n3") is True
    assert not auth.nats_login(url_a, servers.endpoints.nats_ca)
    assert auth.nats_login(url_b, servers.endpoints.nats_ca)
    await admin.close()


def test_two_blocks_cannot_share_one_durable_name(servers: EmbeddedServers) -> None:
    """``sidecar-{bid}-{name}``: block ``a`` with side-car ``b-x`` and block ``a-b`` with ``x`` name
    the same durable; the second grant is refused, so neither reads the other's outputs."""
    users = SidecarUsers(servers.data_dir)
    users.grant("a", "b-x", "n1")
    with pytest.raises(ValueError, match="is block a's already"):
        users.grant("a-b", "x", "n1")
