"""The remote-write push's pure parts (metrics/remote_write.py): which series a collector tick
becomes, the WriteRequest's structure (read back with a minimal protobuf reader), snappy framing,
and the per-receiver queue's bound. The wire itself is checked against a real Prometheus in
tests/integration/test_metrics_remote_write.py."""

from __future__ import annotations

import struct
from typing import Any

import cramjam

from aios_blocks.metrics import remote_write as rw


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, bytes | int | float) of one protobuf message."""
    out: list[tuple[int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 2:
            n, i = _varint(buf, i)
            out.append((num, buf[i:i + n]))
            i += n
        elif wt == 0:
            v, i = _varint(buf, i)
            out.append((num, v))
        elif wt == 1:
            out.append((num, struct.unpack("<d", buf[i:i + 8])[0]))
            i += 8
        else:
            raise AssertionError(f"wire type {wt}")
    return out


def decode(body: bytes) -> list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]:
    series = []
    for num, ts in _fields(bytes(cramjam.snappy.decompress_raw(body))):
        assert num == 1
        labels, samples = [], []
        for n, part in _fields(ts):
            f = dict(_fields(part))
            if n == 1:
                labels.append((f[1].decode(), f[2].decode()))
            else:
                samples.append((f[1], f[2]))
        series.append((labels, samples))
    return series


TICK: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {
    "svc": (
        {"t": 100.5, "cluster": "c0", "instances": 2, "ready": 2, "rate": 11.1, "queue_wait_p99_ms": None},
        {"svc-0": {"t": 100.5, "state": "ready", "node": "n0", "up": True, "inflight": 2.0, "latency_p50_ms": None},
         "svc-1": {"t": 100.5, "state": "ready", "node": "", "up": False, "inflight": 0.0}},
    )
}


def test_a_tick_becomes_block_and_instance_series() -> None:
    pts = rw.points(TICK)
    got = {(dict(labels)["__name__"], tuple((k, v) for k, v in labels if k != "__name__")): (value, ts)
           for labels, value, ts in pts}
    assert got == {
        ("aios_block_instances", (("block", "svc"), ("cluster", "c0"))): (2.0, 100500),
        ("aios_block_ready", (("block", "svc"), ("cluster", "c0"))): (2.0, 100500),
        ("aios_block_rate", (("block", "svc"), ("cluster", "c0"))): (11.1, 100500),
        ("aios_block_instance_up", (("block", "svc"), ("cluster", "c0"), ("instance", "svc-0"), ("node", "n0"))): (1.0, 100500),
        ("aios_block_instance_inflight", (("block", "svc"), ("cluster", "c0"), ("instance", "svc-0"), ("node", "n0"))): (2.0, 100500),
        # an empty label is no label (Prometheus's rule)
        ("aios_block_instance_up", (("block", "svc"), ("cluster", "c0"), ("instance", "svc-1"))): (0.0, 100500),
        ("aios_block_instance_inflight", (("block", "svc"), ("cluster", "c0"), ("instance", "svc-1"))): (0.0, 100500),
    }
    assert all(list(labels) == sorted(labels) for labels, _, _ in pts)


def test_the_write_request_groups_points_by_series_in_time_order() -> None:
    a = (("__name__", "aios_block_ready"), ("block", "b"))
    b = (("__name__", "aios_block_rate"), ("block", "b"))
    body = rw.encode([(a, 2.0, 3000), (b, 0.5, 1000), (a, 1.0, 1000), (a, -1.5, 2000)])
    assert decode(body) == [
        ([("__name__", "aios_block_ready"), ("block", "b")], [(1.0, 1000), (-1.5, 2000), (2.0, 3000)]),
        ([("__name__", "aios_block_rate"), ("block", "b")], [(0.5, 1000)]),
    ]
    assert rw.encode([]) == bytes(cramjam.snappy.compress_raw(b""))


def test_each_receiver_queues_alone_within_its_bound_oldest_dropped() -> None:
    q = rw.RemoteWrite(["http://a/api/v1/write", "http://b/api/v1/write"], max_samples=50)
    lab = (("__name__", "x"),)
    for t in range(10):
        q.add([(lab, float(t), t * 1000 + i) for i in range(10)])
    for r in q.receivers:
        assert r.pending == 50 and r.dropped == 50 and len(r.queue) == 5
        assert r.queue[0][0][2] == 5000  # the newest five ticks are kept
    big = rw.RemoteWrite(["http://a"], max_samples=10**6)
    big.add([(lab, 1.0, i) for i in range(rw.PER_REQUEST * 2 + 1)])
    assert [len(c) for c in big.receivers[0].queue] == [rw.PER_REQUEST, rw.PER_REQUEST, 1]


def test_urls_of_the_setting() -> None:
    assert rw.urls_of(None) == [] and rw.urls_of(" ") == []
    assert rw.urls_of("http://a/api/v1/write, http://b/w") == ["http://a/api/v1/write", "http://b/w"]
