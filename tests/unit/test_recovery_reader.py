"""The stream reader's tap (``recovery.reader._Tap``), without servers: it cuts the read's
messages out of the connection's bytes however they are split, checks the consumer sequence,
answers flow control, and hands everything else, whole, to nats-py's parser."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aios_blocks.recovery import reader


class Inner:
    """nats-py's parser, as the tap sees it: what it was given."""

    def __init__(self) -> None:
        self.units: list[bytes] = []
        self.resets = 0

    async def parse(self, data: bytes = b"") -> None:
        self.units.append(bytes(data))

    def reset(self) -> None:
        self.resets += 1


class Conn:
    def __init__(self) -> None:
        self._ps: Any = Inner()
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes = b"") -> None:
        self.published.append((subject, payload))


def hmsg(subject: str, sid: int, reply: str, headers: bytes, body: bytes) -> bytes:
    return (f"HMSG {subject} {sid} {reply} {len(headers)} {len(headers) + len(body)}\r\n".encode()
            + headers + body + b"\r\n")


def stored(i: int, total: int, sid: int = 7, dseq: int | None = None) -> bytes:
    """The i-th (from 1) of ``total`` stored messages, as the consumer delivers it."""
    reply = f"$JS.ACK.AIOS.cons.1.{100 + i}.{dseq or i}.{i * 1_000_000_000}.{total - i}"
    return hmsg(f"aios.block.b{i}.ready", sid, reply, b"NATS/1.0\r\nNats-Msg-Id: m" + str(i).encode() + b"\r\n\r\n",
                b'{"data":{"n":%d}}' % i)


def tap_on(conn: Conn, sid: int = 7) -> tuple[reader._Tap, list[tuple[str, bytes, int, float]]]:
    got: list[tuple[str, bytes, int, float]] = []
    tap = reader._Tap(conn, lambda s, b, q, t: got.append((s, b, q, t)))
    tap.sid = str(sid).encode()
    tap.ours.add(tap.sid)
    conn._ps = tap
    return tap, got


@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_messages_in_order_however_the_bytes_are_split(chunk: int) -> None:
    conn = Conn()
    inner = conn._ps
    tap, got = tap_on(conn)
    wire = b"".join(stored(i, 5) for i in range(1, 6))

    async def go() -> None:
        for i in range(0, len(wire), chunk):
            await tap.parse(wire[i : i + chunk])

    asyncio.run(go())
    assert [(s, q, t) for s, _, q, t in got] == [(f"aios.block.b{i}.ready", 100 + i, float(i)) for i in range(1, 6)]
    assert [b for _, b, _, _ in got] == [b'{"data":{"n":%d}}' % i for i in range(1, 6)]
    assert tap.done.is_set() and tap.error is None and tap.count == 5 and tap.last_sseq == 105
    assert inner.units == [] and tap.buf == b""


def test_everything_else_goes_whole_to_nats_py() -> None:
    conn = Conn()
    inner = conn._ps
    tap, got = tap_on(conn)
    other = hmsg("_INBOX.x.1", 3, "", b"NATS/1.0\r\n\r\n", b'{"type":"io.nats.jetstream.api.v1.stream_info_response"}')
    plain = b"MSG foo 4 5\r\nhello\r\n"
    wire = stored(1, 3) + b"PING\r\n" + other + stored(2, 3) + plain + b"+OK\r\n" + stored(3, 3)

    async def go() -> None:
        for i in range(0, len(wire), 5):
            await tap.parse(wire[i : i + 5])

    asyncio.run(go())
    assert [q for _, _, q, _ in got] == [101, 102, 103]
    assert inner.units == [b"PING\r\n", other, plain, b"+OK\r\n"]


def test_flow_control_and_stalled_heartbeats_are_answered() -> None:
    conn = Conn()
    tap, got = tap_on(conn)
    fc = hmsg("_INBOX.r", 7, "$JS.FC.AIOS.abc.1", b"NATS/1.0 100 FlowControl Request\r\n\r\n", b"")
    hb = hmsg("_INBOX.r", 7, "", b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1\r\nNats-Consumer-Stalled: $JS.FC.AIOS.x.2\r\n\r\n", b"")
    asyncio.run(tap.parse(stored(1, 2) + fc + hb + stored(2, 2)))
    assert conn.published == [("$JS.FC.AIOS.abc.1", b""), ("$JS.FC.AIOS.x.2", b"")]
    assert [q for _, _, q, _ in got] == [101, 102] and tap.done.is_set() and not tap.gap.is_set()


def test_a_missing_message_stops_the_consumer_for_a_restart_after_the_last_one_handed_out() -> None:
    conn = Conn()
    tap, got = tap_on(conn)
    asyncio.run(tap.parse(stored(1, 4) + stored(3, 4) + stored(4, 4)))  # consumer sequence 2 never came
    assert [q for _, _, q, _ in got] == [101]
    assert tap.gap.is_set() and not tap.done.is_set() and tap.last_sseq == 101


def test_a_heartbeat_reporting_more_than_arrived_is_a_gap() -> None:
    conn = Conn()
    tap, got = tap_on(conn)
    hb = hmsg("_INBOX.r", 7, "", b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 2\r\nNats-Last-Stream: 102\r\n\r\n", b"")
    asyncio.run(tap.parse(stored(1, 2) + hb))
    assert len(got) == 1 and tap.gap.is_set()


def test_another_status_or_a_failing_fold_ends_the_read_with_the_error() -> None:
    conn = Conn()
    tap, _ = tap_on(conn)
    gone = hmsg("_INBOX.r", 7, "", b"NATS/1.0 409 Consumer Deleted\r\n\r\n", b"")
    asyncio.run(tap.parse(gone))
    assert tap.done.is_set() and isinstance(tap.error, reader.StreamReadError) and "409" in str(tap.error)

    conn = Conn()

    def boom(*_: Any) -> None:
        raise ValueError("bad event")

    tap = reader._Tap(conn, boom)
    tap.sid = b"7"
    asyncio.run(tap.parse(stored(1, 2) + stored(2, 2)))  # no exception into nats-py's read loop
    assert tap.done.is_set() and isinstance(tap.error, ValueError) and tap.count == 0


def test_detach_hands_the_parser_back_once_no_partial_unit_is_left() -> None:
    conn = Conn()
    inner = conn._ps
    tap, got = tap_on(conn)
    other = b"MSG foo 4 5\r\nhello\r\n"
    asyncio.run(tap.parse(stored(1, 1) + other[:8]))
    assert tap.done.is_set()
    tap.detach()
    assert conn._ps is tap  # half a unit is still here
    asyncio.run(tap.parse(other[8:] + stored(2, 3, dseq=2)))  # a straggler of the read: dropped
    assert conn._ps is inner and inner.units == [other] and len(got) == 1


def test_a_large_message_is_gathered_then_cut_once() -> None:
    conn = Conn()
    tap, got = tap_on(conn)
    big = hmsg("aios.block.b1.ready", 7, "$JS.ACK.AIOS.cons.1.101.1.1000000000.1", b"NATS/1.0\r\n\r\n", b"x" * 300_000)

    async def go() -> None:
        wire = big + stored(2, 2)
        for i in range(0, len(wire), 32768):
            await tap.parse(wire[i : i + 32768])

    asyncio.run(go())
    assert [(q, len(b)) for _, b, q, _ in got] == [(101, 300_000), (102, len(b'{"data":{"n":2}}'))]
    assert tap.done.is_set() and tap.buf == b"" and tap.need == 0


def test_a_unit_nats_py_had_begun_is_left_to_it() -> None:
    conn = Conn()
    inner = conn._ps
    inner.buf = bytearray(b"MSG foo 4 5\r\nhel")  # what it held when the tap came

    async def parse(data: bytes = b"") -> None:
        inner.units.append(bytes(data))
        inner.buf = bytearray()  # it completed the unit

    inner.parse = parse
    tap, got = tap_on(conn)
    asyncio.run(tap.parse(b"lo\r\n"))
    asyncio.run(tap.parse(stored(1, 1)))
    assert inner.units == [b"lo\r\n"] and [q for _, _, q, _ in got] == [101]
