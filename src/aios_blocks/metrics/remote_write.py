"""Push the collector's samples to the global metrics DBs (seed 000: the metrics system "actively
writes" to them) with Prometheus remote write 1.0: an HTTP POST of a snappy-compressed protobuf
``prometheus.WriteRequest`` (what Prometheus's ``--web.enable-remote-write-receiver``, Mimir,
Thanos Receive, VictoriaMetrics and Grafana Cloud accept). docs/metrics.md lists the series.

The protobuf is the handful of fields remote write uses, encoded here (no generated code, no
protobuf runtime); snappy is ``cramjam``'s. Each receiver has its own queue: a sample is sent to
each URL once, in time order; a receiver that is down or overloaded (connection error, timeout,
429, 5xx) keeps its queue for the next flush, up to ``max_samples`` (the oldest go first); a batch
a receiver refuses as bad (another 4xx) is dropped, as Prometheus's own remote write does.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypedDict

import aiohttp
import cramjam
import structlog

from ..runtime.ticker import Ticker
from ..schemas.records import TickSamples

log = structlog.get_logger("aios.remote_write")

#: a point: (sorted labels with ``__name__``, value, timestamp in ms)
Labels = tuple[tuple[str, str], ...]
Point = tuple[Labels, float, int]

BLOCK_PREFIX = "aios_block_"
INSTANCE_PREFIX = "aios_block_instance_"
#: samples in one request (Prometheus's own sender uses 2,000 by default; receivers take more)
PER_REQUEST = 5000
HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": "aios-blocks-collector",
}


# -- samples -> points ---------------------------------------------------------------------------


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def _labels(name: str, labels: dict[str, str]) -> Labels:
    return tuple(sorted({"__name__": name, **{k: v for k, v in labels.items() if v}}.items()))


def points(samples: TickSamples) -> list[Point]:
    """One collector tick (``Windows.tick``: block -> (block sample, instance -> sample)) as points:
    every numeric field ``F`` of a block's sample is ``aios_block_F{block, cluster}``, of an
    instance's ``aios_block_instance_F{block, instance, cluster, node}`` (booleans 1/0; ``t``,
    text and figures nobody reports are left out), stamped with the sample's ``t``."""
    out: list[Point] = []
    for bid, (block, insts) in sorted(samples.items()):
        cluster = str(block.get("cluster") or "")
        ts = round(float(block.get("t") or time.time()) * 1000)
        for key, v in sorted(block.items()):
            x = _number(v) if key != "t" else None
            if x is not None:
                out.append((_labels(BLOCK_PREFIX + key, {"block": bid, "cluster": cluster}), x, ts))
        for iid, s in sorted(insts.items()):
            its = round(float(s.get("t") or ts / 1000) * 1000)
            labels = {"block": bid, "instance": iid, "cluster": cluster, "node": str(s.get("node") or "")}
            for key, v in sorted(s.items()):
                x = _number(v) if key != "t" else None
                if x is not None:
                    out.append((_labels(INSTANCE_PREFIX + key, labels), x, its))
    return out


# -- WriteRequest encoding -----------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 as protobuf writes it (two's complement)
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _sample(value: float, ts_ms: int) -> bytes:
    # Sample { double value = 1; int64 timestamp = 2; }
    return b"\x09" + struct.pack("<d", value) + b"\x10" + _varint(ts_ms)


def write_request(pts: list[Point]) -> bytes:
    """``prometheus.WriteRequest`` (protobuf, uncompressed): one TimeSeries per label set, its
    samples in time order. TimeSeries { repeated Label labels = 1; repeated Sample samples = 2; },
    Label { string name = 1; string value = 2; }, WriteRequest { repeated TimeSeries timeseries = 1; }."""
    series: dict[Labels, list[tuple[int, float]]] = {}
    for labels, value, ts in pts:
        series.setdefault(labels, []).append((ts, value))
    out = bytearray()
    for labels, samples in series.items():
        body = bytearray()
        for name, text in labels:
            body += _field(1, _field(1, name.encode()) + _field(2, text.encode()))
        for ts, x in sorted(samples, key=lambda s: s[0]):
            body += _field(2, _sample(x, ts))
        out += _field(1, bytes(body))
    return bytes(out)


def encode(pts: list[Point]) -> bytes:
    """The request body: the WriteRequest, snappy block format."""
    return bytes(cramjam.snappy.compress_raw(write_request(pts)))


# -- the queues ----------------------------------------------------------------------------------


class ReceiverStatus(TypedDict):
    """One receiver's figures (``RemoteWrite.status``): samples queued, sent, dropped (its queue
    full or a refusal), its last error and when it last took a batch."""

    pending: int
    sent: int
    dropped: int
    last_error: str
    last_ok: float


@dataclass
class Receiver:
    url: str
    queue: deque[list[Point]] = field(default_factory=deque)
    pending: int = 0
    sent: int = 0
    dropped: int = 0
    last_error: str = ""
    last_ok: float = 0.0

    def status(self) -> ReceiverStatus:
        return {"pending": self.pending, "sent": self.sent, "dropped": self.dropped, "last_error": self.last_error,
                "last_ok": round(self.last_ok, 3)}


class RemoteWrite:
    """Per receiver URL, the points not yet accepted; ``flush`` sends them."""

    def __init__(self, urls: list[str], timeout_s: float = 5.0, max_samples: int = 200_000):
        self.receivers = [Receiver(u) for u in urls]
        self.timeout_s, self.max_samples = timeout_s, max_samples

    def add(self, pts: list[Point]) -> None:
        chunks = [pts[i:i + PER_REQUEST] for i in range(0, len(pts), PER_REQUEST)]
        for r in self.receivers:
            for chunk in chunks:
                r.queue.append(chunk)
                r.pending += len(chunk)
            while r.pending > self.max_samples and len(r.queue) > 1:
                old = r.queue.popleft()
                r.pending -= len(old)
                r.dropped += len(old)

    async def flush(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._flush(session, r) for r in self.receivers))

    async def _flush(self, session: aiohttp.ClientSession, r: Receiver) -> None:
        while r.queue:
            batch: list[Point] = []
            while r.queue and (not batch or len(batch) + len(r.queue[0]) <= PER_REQUEST):
                batch += r.queue.popleft()
            verdict = await self._post(session, r, batch)
            if verdict == "retry":  # keep it, in front, for the next flush
                r.queue.appendleft(batch)
                return
            r.pending -= len(batch)
            if verdict == "ok":
                r.sent += len(batch)
                r.last_ok = time.time()
            else:
                r.dropped += len(batch)

    async def _post(self, session: aiohttp.ClientSession, r: Receiver, batch: list[Point]) -> str:
        try:
            async with session.post(r.url, data=encode(batch), headers=HEADERS,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status < 300:
                    r.last_error = ""
                    return "ok"
                text = (await resp.text())[:200].strip()
                r.last_error = f"HTTP {resp.status}: {text}"
                if resp.status == 429 or resp.status >= 500:
                    return "retry"
                log.warning("remote_write.refused", url=r.url, status=resp.status, samples=len(batch), error=text)
                return "refused"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            r.last_error = repr(exc)
            return "retry"

    def status(self) -> dict[str, ReceiverStatus]:
        """Each receiver's queue and outcome, by URL (the collector's status page)."""
        return {r.url: r.status() for r in self.receivers}

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Flush every ``interval_s`` until ``stop``, then once more (a flush that raises is logged:
        never the collector's end, the next flush tries again)."""
        async with aiohttp.ClientSession() as session:
            ticker = Ticker(interval_s, "remote_write.flush_failed", log, wait_first=True)
            await ticker.run(lambda: self.flush(session), stop)
            try:
                await self.flush(session)
            except Exception as exc:
                log.warning("remote_write.flush_failed", error=repr(exc))


def urls_of(setting: str | None) -> list[str]:
    """The receivers of ``AIOS_METRICS_REMOTE_WRITE_URL`` (comma-separated)."""
    return [u.strip() for u in (setting or "").split(",") if u.strip()]
