"""``read_stream`` against a real nats-server: the wire reader (``recovery.reader``) hands out
exactly what nats-py's ordered consumer does (every stored message once, oldest first, with its
sequence and time), with one filter or several, after a lost message (it restarts its consumer
after the last message it handed out), and leaves the connection to nats-py afterwards."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import subjects
from aios_blocks.cli.client import Client
from aios_blocks.recovery import reader
from aios_blocks.recovery.rebuild import read_stream
from aios_blocks.runtime.embedded import EmbeddedServers

pytestmark = pytest.mark.integration

N = 600


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    if os.environ.get("AIOS_NATS_URL"):
        pytest.skip("writes its own events into the stream: embedded servers only")
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    c = await Client.open(servers.nats_url, servers.redis_url)
    try:
        acks = []
        for i in range(N):
            subject = f"aios.block.b{i % 7}.ready" if i % 3 else f"aios.node.n{i % 5}.health"
            body = b"x" * (i * 131 % 9000)  # some messages span several reads
            acks.append(await c.bus.js.publish(subject, body, headers={"Nats-Msg-Id": f"t{i}"}))
        assert len({a.seq for a in acks}) == N
        yield c
    finally:
        await c.close()
        servers.stop()


async def _read(c: Client, wire: bool, filters: list[str] | None = None, on_msg: Any = None) -> list[tuple[str, bytes, int, float]]:
    got: list[tuple[str, bytes, int, float]] = []
    usable = reader.usable

    def record(s: str, b: bytes, q: int, t: float) -> None:
        got.append((s, bytes(b), q, t))
        if on_msg:
            on_msg(len(got))

    try:
        if not wire:
            reader.usable = lambda nc: False  # type: ignore[assignment]
        n = await read_stream(c.bus, record, filters=filters)
    finally:
        reader.usable = usable  # type: ignore[assignment]
    assert n == len(got)
    return got


async def test_the_wire_reader_reads_what_the_ordered_consumer_reads(client: Client) -> None:
    c = client
    ordered = await _read(c, wire=False)
    assert len(ordered) >= N and [q for _, _, q, _ in ordered] == sorted(q for _, _, q, _ in ordered)
    parser = c.bus.nc._ps
    assert await _read(c, wire=True) == ordered
    assert c.bus.nc._ps is parser  # the connection's own parser is back
    filters = ["aios.node.*.health", "aios.block.b3.>"]
    some = await _read(c, wire=True, filters=filters)
    assert some == await _read(c, wire=False, filters=filters)
    assert some == [m for m in ordered if m[0].startswith("aios.node.") or m[0].startswith("aios.block.b3.")]
    assert await _read(c, wire=True, filters=["aios.block.nobody.>"]) == []  # nothing matches: no wait
    assert await _read(c, wire=False, filters=["aios.block.nobody.>"]) == []  # nor through the ordered consumer
    # the connection still serves requests and other subscriptions
    assert (await c.bus.js.stream_info(subjects.STREAM)).state.messages == len(ordered)


async def test_a_lost_message_restarts_the_consumer_after_the_last_one_handed_out(client: Client) -> None:
    c = client
    ordered = await _read(c, wire=False)
    lost = []

    def drop_next(count: int) -> None:
        if count in (50, 51, 400):  # the tap now expects a consumer sequence that will not come
            tap = c.bus.nc._ps
            tap.next_dseq += 1
            lost.append(count)

    assert await _read(c, wire=True, on_msg=drop_next) == ordered
    assert lost == [50, 51, 400]


async def test_the_packed_image_writer_writes_what_pipelines_write(client: Client) -> None:
    """``write_image`` packs its commands itself on one server: same keys and values as redis-py's
    pipelines (every kind of value, a batch boundary crossed, a float score, a unicode value)."""
    from aios_blocks.recovery import image as im
    from aios_blocks.recovery import rebuild

    r = client.store.r
    img: im.Image = {f"aios:block:w{i}": {"status": "ready", "gen": str(i), "ir": '{"é": 1}'} for i in range(rebuild.WRITE_BATCH + 5)}
    img.update({"aios:clusters": {"c0": '{"id":"c0"}'}, "aios:{c:c0}:nodes": {"n1", "n2"}, "aios:component:x": "v",
                "aios:blocks": im.ZSet({"w1": 1.5, "w2": 1e-7, "w3": 3.0}), "aios:policies": set()})
    await rebuild.drop_project_keys(r)
    assert await rebuild.write_image(r, img) == len(img)
    packed = await rebuild.read_image(r)
    await rebuild.drop_project_keys(r)
    await rebuild._write_pipelined(r, img)
    assert await rebuild.read_image(r) == packed
    assert packed["aios:blocks"] == {"w1": 1.5, "w2": 1e-7, "w3": 3.0} and "aios:policies" not in packed
    assert packed["aios:block:w7"] == img["aios:block:w7"] and packed["aios:{c:c0}:nodes"] == {"n1", "n2"}


async def test_a_read_served_by_a_replica_behind_its_leader_reads_on_to_the_leaders_last(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read's consumer (R1) may sit on a replica that has not caught up with its leader (a
    server just back from a partition: the partition suite's seed 14, whose recover then wrote 20
    blocks fewer than the stream held). Here the first read ends 200 messages early, as such a
    replica's would; the read goes on from where it ended, and every message is handed out once."""
    real = reader.read
    calls: list[int] = []

    async def behind_then_caught_up(js: Any, nc: Any, stream: str, on_msg: Any, filters: list[str], idle_s: float = 10.0,
                                    from_seq: int = 0) -> int:
        calls.append(from_seq)
        if len(calls) > 1:
            return await real(js, nc, stream, on_msg, filters, idle_s, from_seq=from_seq)
        n = 0

        def until_the_replicas_last(s: str, b: bytes, q: int, t: float) -> None:
            nonlocal n
            if q <= N - 200:
                n += 1
                on_msg(s, b, q, t)

        await real(js, nc, stream, until_the_replicas_last, filters, idle_s)
        return n

    monkeypatch.setattr(reader, "read", behind_then_caught_up)
    got = await _read(client, wire=True)
    assert [q for _, _, q, _ in got] == list(range(1, N + 1)) and calls == [0, N - 200 + 1]


async def test_a_read_that_stays_behind_fails_rather_than_hand_out_a_partial_history(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aios_blocks.recovery import rebuild

    real = reader.read

    async def always_behind(js: Any, nc: Any, stream: str, on_msg: Any, filters: list[str], idle_s: float = 10.0,
                            from_seq: int = 0) -> int:
        n = 0

        def short(s: str, b: bytes, q: int, t: float) -> None:
            nonlocal n
            if from_seq <= q <= N - 200:
                n += 1
                on_msg(s, b, q, t)

        await real(js, nc, stream, short, filters, idle_s, from_seq=from_seq)
        return n

    monkeypatch.setattr(reader, "read", always_behind)
    monkeypatch.setattr(rebuild, "READ_SHORT_WAITS_S", (0.01, 0.01))
    with pytest.raises(TimeoutError, match=f"ended at sequence {N - 200}, before the last one its leader reported \\({N}\\)"):
        await read_stream(client.bus, lambda *a: None)
