"""The console's read side: a live ``Fold`` of the stream ``AIOS`` fed through a named ordered
consumer (what an observer may make: it takes nothing from any worker), each block's events for
its page, a tail of recent events for the live view and server-sent events, and the stream
folded up to a past sequence (``at``) with the same fold."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import pickle
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from ..bus import subjects
from ..bus.consumer_names import subscribe_ordered
from ..bus.nats_bus import Bus
from ..recovery.fold import Fold
from ..recovery.rebuild import _reply_meta, read_stream
from .checkpoints import Checkpoints, freeze, restore

_json = msgspec.json

#: how many recent events the tail keeps (the live view's list, and SSE clients' catch-up)
TAIL = 2000
#: past folds kept (a slider dragged back and forth asks the same few again)
PAST_CACHE = 4
#: the stored messages kept in memory for past folds, in chunks of ``CHUNK`` messages compressed
#: (zlib level 1: ~6x on the stream's JSON), up to this many compressed bytes; past that the
#: oldest chunks go, and a past moment before the oldest kept message reads the stream again
KEEP_BYTES = 256 * 1024 * 1024
CHUNK = 4096
#: a checkpoint of the live fold (``console.checkpoints``: the entities changed since the one before
#: it, copied; the rest shared with it) every this many events at first; at most ``CHECKPOINTS``
#: are kept, holding at most ``CHECK_BYTES`` (past either, every other one goes and the interval
#: doubles): a past moment starts from the nearest checkpoint before it and folds only the events
#: after it
CHECK_EVERY = 5_000
CHECKPOINTS = 256
CHECK_BYTES = 1024 * 1024 * 1024


class Kept:
    """The stored messages read so far, oldest first, as ``(subject, body, seq, ts)``: full chunks
    pickled and compressed, the last one open. ``first``: the oldest sequence still kept (0: none
    has gone)."""

    def __init__(self, budget: int = KEEP_BYTES, chunk: int = CHUNK):
        self.budget, self.chunk = budget, chunk
        #: (first seq, last seq, compressed pickle of the chunk's messages)
        self.chunks: list[tuple[int, int, bytes]] = []
        self.open: list[tuple[str, bytes, int, float]] = []
        self.bytes = 0
        self.first = 0

    def add(self, subject: str, raw: bytes, seq: int, ts: float) -> None:
        self.open.append((subject, raw, seq, ts))
        if len(self.open) >= self.chunk:
            blob = zlib.compress(pickle.dumps(self.open, protocol=pickle.HIGHEST_PROTOCOL), 1)
            self.chunks.append((self.open[0][2], self.open[-1][2], blob))
            self.bytes += len(blob)
            self.open = []
            while self.bytes > self.budget and self.chunks:
                _, last, gone = self.chunks.pop(0)
                self.bytes -= len(gone)
                self.first = last + 1

    def covers(self, after: int) -> bool:
        """Whether every message after sequence ``after`` is still kept."""
        return self.first == 0 or after + 1 >= self.first

    def between(self, after: int, upto: int) -> Iterator[tuple[str, bytes, int, float]]:
        """The kept messages with ``after < seq <= upto``, in order."""
        at = bisect.bisect_right(self.chunks, after, key=lambda c: c[1])
        for first, _, blob in self.chunks[at:]:
            if first > upto:
                return
            for m in pickle.loads(zlib.decompress(blob)):
                if m[2] > upto:
                    return
                if m[2] > after:
                    yield m
        for m in self.open:
            if m[2] > upto:
                return
            if m[2] > after:
                yield m


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcards: ``*`` one token, ``>`` the rest; a pattern without either is a substring."""
    if not pattern:
        return True
    if "*" not in pattern and ">" not in pattern:
        return pattern in subject
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _envelope(raw: bytes) -> dict[str, Any]:
    try:
        env = _json.decode(raw)
    except msgspec.DecodeError:
        return {}
    return env if isinstance(env, dict) else {}


class Feed:
    """The live fold and what the views need beside it. ``line(subject, env)``: an event's one-line
    text (``blocks replay``'s)."""

    def __init__(self, bus: Bus, line: Callable[[str, dict[str, Any]], str], keep_bytes: int = KEEP_BYTES,
                 check_every: int = CHECK_EVERY, chunk: int = CHUNK, checkpoints: int = CHECKPOINTS,
                 check_bytes: int = CHECK_BYTES):
        self.bus = bus
        self.line = line
        self.fold = Fold()
        #: the live fold's checkpoints (``checks.items``: oldest first); its dicts note what the
        #: fold reaches (``checkpoints.Tracked``)
        self.checks = Checkpoints(self.fold)
        self._check_every, self._since_check = check_every, 0
        self._max_checks, self._check_bytes = checkpoints, check_bytes
        #: the stored messages so far (the newest ``keep_bytes`` of them, compressed)
        self.kept = Kept(keep_bytes, chunk)
        #: block -> [(seq, ts, subject, body)]: bodies as stored (the same bytes ``kept`` holds),
        #: decoded when a block's page asks
        self.events: dict[str, list[tuple[int, float, str, bytes]]] = {}
        self.tail: deque[dict[str, Any]] = deque(maxlen=TAIL)
        self.listeners: set[asyncio.Queue[dict[str, Any]]] = set()
        self.caught_up = asyncio.Event()
        self._past: OrderedDict[int, Fold] = OrderedDict()
        self._sub: Any = None
        #: (monotonic time, step) of recent block events, for the overview's rates
        self._recent: deque[tuple[float, str]] = deque(maxlen=20000)

    async def start(self) -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def cb(msg: Any) -> None:
            queue.put_nowait(msg)

        info = await self.bus.js.stream_info(subjects.STREAM)
        if info.state.messages == 0:
            self.caught_up.set()
        _, self._sub = await subscribe_ordered(self.bus.nc, self.bus.js, f"{subjects.ROOT}.>", subjects.STREAM, "console",
                                               ConsumerConfig(deliver_policy=DeliverPolicy.ALL), cb=cb,
                                               pending_msgs_limit=1_000_000, pending_bytes_limit=512 * 1024 * 1024)
        self._task = asyncio.create_task(self._drain(queue))

    async def _drain(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            msg = await queue.get()
            seq, ts, pending = _reply_meta(msg)
            self.apply(msg.subject, msg.data, seq, ts)
            if pending == 0:
                self.caught_up.set()

    def apply(self, subject: str, raw: bytes, seq: int, ts: float) -> None:
        if seq and seq <= self.fold.last_seq:
            return  # (a redelivery after a reconnect)
        gate = self.checks.gate
        gate.open = True
        try:
            self.fold.apply(subject, raw, seq, ts)
        finally:
            gate.open = False
        self._since_check += 1
        if self._since_check >= self._check_every:
            self._checkpoint()
        self.kept.add(subject, raw, seq, ts)
        parts = subject.split(".", 3)
        env = _envelope(raw)
        if len(parts) == 4 and parts[1] == "block":
            self.events.setdefault(parts[2], []).append((seq, ts, subject, raw))
            self._recent.append((time.monotonic(), parts[3]))
        try:
            text = self.line(subject, env)
        except Exception:  # an event this version cannot describe still shows, as its subject
            text = ""
        item = {"seq": seq, "ts": ts, "subject": subject, "line": text}
        self.tail.append(item)
        for q in list(self.listeners):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(item)

    def _checkpoint(self) -> None:
        """The live fold as it is now: the entities changed since the last checkpoint copied (a
        pause of the feed that grows with the events since, not with the state)."""
        self._since_check = 0
        checks = self.checks
        checks.take()
        while len(checks.items) > 1 and (len(checks.items) > self._max_checks or checks.bytes() > self._check_bytes):
            checks.thin()
            self._check_every *= 2

    def rates(self, window_s: float = 10.0) -> dict[str, float]:
        """Placements and block events per second over the last ``window_s``."""
        cutoff = time.monotonic() - window_s
        recent = [step for t, step in self._recent if t >= cutoff]
        return {"placements_per_s": round(sum(1 for s in recent if s == "placement") / window_s, 2),
                "events_per_s": round(len(recent) / window_s, 2)}

    def block_events(self, bid: str, upto: int | None = None) -> list[tuple[int, float, str, dict[str, Any]]]:
        return [(seq, ts, s, _envelope(raw)) for seq, ts, s, raw in self.events.get(bid, []) if upto is None or seq <= upto]

    async def at(self, seq: int) -> Fold:
        """The stream folded up to ``seq`` (inclusive): the state as it was then."""
        if seq >= self.fold.last_seq and self.caught_up.is_set():
            return self.fold
        hit = self._past.get(seq)
        if hit is not None:
            self._past.move_to_end(seq)
            return hit
        f, after = Fold(), 0
        items = self.checks.items
        at = bisect.bisect_right(items, seq, key=lambda c: c.seq)
        if at:
            after, f = items[at - 1].seq, restore(items[at - 1])
        if self.kept.covers(after) and self.caught_up.is_set():
            for subject, raw, s, ts in self.kept.between(after, seq):
                f.apply(subject, raw, s, ts)
            return self._remember(seq, freeze(f))

        def on_msg(subject: str, raw: bytes, s: int, ts: float) -> None:
            if after < s <= seq:
                f.apply(subject, raw, s, ts)

        await read_stream(self.bus, on_msg)
        return self._remember(seq, freeze(f))

    def _remember(self, seq: int, f: Fold) -> Fold:
        f.last_seq = min(f.last_seq, seq)
        self._past[seq] = f
        while len(self._past) > PAST_CACHE:
            self._past.popitem(last=False)
        return f

    async def close(self) -> None:
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
