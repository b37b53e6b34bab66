"""Rebuild Redis from the JetStream stream (``blocks recover``), read Redis as an image, and the
state epoch that keeps workers from acting on a Redis that lost its state.

Procedure (docs/reliability.md):

1. the epoch key goes away (Redis was flushed, or ``recover --force`` deletes it first): every
   worker's handlers stop acting (their messages are redelivered later, nothing is acked);
2. the whole stream is read (``recovery.reader``: one push consumer, parsed off the connection
   with the ordered consumer's sequence checks) and folded (``recovery.fold``), the cyclic GC
   paused meanwhile;
3. the image is written; the epoch is set to a new value: workers resume, drop their inventory
   caches, and redo any message whose handling overlapped the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy

from ..bus import subjects
from ..bus.catalog import E
from ..bus.consumer_names import subscribe_ordered
from ..bus.nats_bus import Bus
from ..gcpause import gc_paused
from ..schemas.events import InventoryHint
from ..state.store import EPOCH_KEY, GATHER_DUE, Store, due_member
from . import image as im
from . import reader
from .fold import Fold

log = structlog.get_logger("aios.recovery")

WRITE_BATCH = 2000


def fold_filters() -> list[str]:
    """The stream subjects the fold uses (decision records, inputs and dead letters are not
    state): the filters of the events it has a method for. Not used as the consumer's filter:
    several filters make the server deliver ~15x slower than reading everything (see read_stream)."""
    return [e.filter() for e in Fold.handlers if e.stored and e.stream == subjects.STREAM]


async def read_stream(
    bus: Bus, on_msg: Callable[[str, bytes, int, float], None], filters: list[str] | None = None,
    idle_s: float = 10.0,
) -> int:
    """Feed every stored message matching ``filters`` (default: all of them), oldest first, to
    ``on_msg(subject, body, seq, ts)``. Returns how many. Stops at the last message that was
    pending when it started.

    Through ``recovery.reader`` (one push consumer whose messages are parsed off the connection
    in bulk, with the ordered consumer's sequence checks), else nats-py's ordered consumer."""
    # One filter reads far faster than several (measured on nats-server 2.15 with 30k stored:
    # 1.5 s for all of them vs 45 s for the fold's ~20 filters, which deliver 2/3 of them): by
    # default read everything and let the fold skip what it does not use, by subject, undecoded.
    whole = not filters
    filters = filters or [f"{subjects.ROOT}.>"]
    info = await bus.js.stream_info(subjects.STREAM)
    if info.state.messages == 0:
        return 0
    if not reader.usable(bus.nc):
        return await _read_ordered(bus, on_msg, filters, idle_s)
    seen = 0

    def tracked(subject: str, body: bytes, seq: int, ts: float) -> None:
        nonlocal seen
        seen = seq
        on_msg(subject, body, seq, ts)

    count = await reader.read(bus.js, bus.nc, subjects.STREAM, tracked, filters, idle_s)
    # The read's consumer (R1) may sit on a replica still catching up with its leader (a server
    # just back from a partition): it ends at that replica's last message. The whole stream read
    # must reach the last sequence its leader reported before the read, else it goes on from
    # where it ended (a new consumer), and fails rather than return a partial history (a recover
    # would write it: the partition suite's seed 14 lost 20 blocks so).
    def short() -> bool:  # (a tail deleted by hand: the count has every message the stream holds)
        return whole and seen < info.state.last_seq and count < info.state.messages

    for wait in READ_SHORT_WAITS_S:
        if not short():
            break
        log.warning("recovery.read_short", read_to=seen, stream_last=info.state.last_seq, retry_in_s=wait)
        await asyncio.sleep(wait)
        count += await reader.read(bus.js, bus.nc, subjects.STREAM, tracked, filters, idle_s, from_seq=seen + 1)
    if short():
        raise TimeoutError(f"the stream read ended at sequence {seen}, before the last one its leader reported "
                           f"({info.state.last_seq}): a replica behind its leader? try again")
    return count


#: the pauses before reading on from where a short read of the whole stream ended
READ_SHORT_WAITS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


async def _read_ordered(bus: Bus, on_msg: Callable[[str, bytes, int, float], None], filters: list[str], idle_s: float) -> int:
    """``read_stream`` through nats-py's ordered consumer, one awaited callback per message."""
    done = asyncio.Event()
    count = 0
    last = time.monotonic()

    async def cb(msg: Any) -> None:
        nonlocal count, last
        if done.is_set():
            return
        seq, ts, pending = _reply_meta(msg)
        on_msg(msg.subject, msg.data, seq, ts)
        count += 1
        last = time.monotonic()
        if pending == 0:
            done.set()

    # named after the user for an observer, race-free (bus.consumer_names)
    cfg = ConsumerConfig(filter_subjects=filters if len(filters) > 1 else None)
    name, sub = await subscribe_ordered(
        bus.nc, bus.js, filters[0] if len(filters) == 1 else f"{subjects.ROOT}.>", subjects.STREAM, "read", cfg, cb=cb,
        deliver_policy=DeliverPolicy.ALL, pending_msgs_limit=1_000_000, pending_bytes_limit=512 * 1024 * 1024,
    )
    try:
        ci = await sub.consumer_info()
        # nothing to read: none pending and none delivered (by the consumer's own count: its
        # delivered stream sequence moves past messages its filter skips, to the stream's last)
        if ci.num_pending == 0 and (ci.delivered is None or not ci.delivered.consumer_seq) and count == 0:
            return 0
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0)
            if not done.is_set() and time.monotonic() - last > idle_s:
                raise TimeoutError(f"stream read stalled after {count} messages")
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):  # its name free again at once (an observer has few)
            await bus.js.delete_consumer(subjects.STREAM, name)
    return count


def _reply_meta(msg: Any) -> tuple[int, float, int]:
    """(stream sequence, timestamp in s, pending) from a JetStream message's reply subject: one
    split instead of ``msg.metadata`` (a dataclass and a datetime per message, a third of the
    client's time when reading the whole stream)."""
    t = (msg.reply or "").split(".")
    if len(t) == 9 and t[0] == "$JS":  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(t[5]), int(t[7]) / 1e9, int(t[8])
    if len(t) >= 11 and t[0] == "$JS":  # v2: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]
        return int(t[7]), int(t[9]) / 1e9, int(t[10])
    meta = msg.metadata  # raises NotJSMessageError, as before
    return meta.sequence.stream, meta.timestamp.timestamp() if meta.timestamp else 0.0, meta.num_pending


async def fold_stream(bus: Bus) -> Fold:
    f = Fold()
    with gc_paused():
        await read_stream(bus, f.apply)
    return f


# -- Redis images ---------------------------------------------------------------------------------
async def project_keys(r: aioredis.Redis, kinds: tuple[str, ...] = ("rebuilt", "volatile")) -> list[str]:
    out = []
    async for key in r.scan_iter(match="aios:*", count=2000):
        if im.classify(key) in kinds:
            out.append(key)
    return out


async def read_image(r: aioredis.Redis, kinds: tuple[str, ...] = ("rebuilt",)) -> im.Image:
    """The project's keys of these kinds, as an image."""
    keys = await project_keys(r, kinds)
    img: im.Image = {}
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        pipe = r.pipeline(transaction=False)
        for k in chunk:
            pipe.type(k)
        types = await pipe.execute()
        pipe = r.pipeline(transaction=False)
        for k, t in zip(chunk, types, strict=True):
            if t == "string":
                pipe.get(k)
            elif t == "hash":
                pipe.hgetall(k)
            elif t == "set":
                pipe.smembers(k)
            elif t == "zset":
                pipe.zrange(k, 0, -1, withscores=True)
            else:
                pipe.exists(k)
        for k, t, v in zip(chunk, types, await pipe.execute(), strict=True):
            if t not in ("string", "hash", "set", "zset"):
                continue  # gone between SCAN and read (or a type the project never writes)
            img[k] = im.ZSet(v) if t == "zset" else set(v) if t == "set" else v
    return img


def _commands(img: im.Image) -> Iterator[list[Any]]:
    """The commands that write an image (an empty set, hash or zset is no key in Redis)."""
    for key, v in img.items():
        if isinstance(v, im.ZSet):
            if v:
                zargs: list[Any] = ["ZADD", key]
                for member, score in v.items():
                    zargs += (score, member)
                yield zargs
        elif isinstance(v, set):
            if v:
                yield ["SADD", key, *v]
        elif isinstance(v, dict):
            if v:
                hargs: list[Any] = ["HSET", key]
                for f, x in v.items():
                    hargs += (f, x)
                yield hargs
        else:
            yield ["SET", key, v]


def _resp(args: list[Any]) -> bytes:
    """One command in the Redis protocol, its arguments encoded as redis-py encodes them."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            b = a.encode()
        elif isinstance(a, bytes):
            b = a
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            b = repr(a).encode()
        else:
            raise TypeError(f"cannot write {type(a).__name__} to Redis: {a!r}")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


async def write_image(r: aioredis.Redis, img: im.Image) -> int:
    """Write every key of ``img``; returns how many. On one Redis server the commands are packed
    here and sent in batches of WRITE_BATCH on one connection, the next batch sent before the
    previous one's replies are read (a third of redis-py's pipeline CPU: no command objects,
    response callbacks or per-argument encoder); on a Redis Cluster, non-transactional pipelines."""
    pool = getattr(r, "connection_pool", None)
    if not isinstance(r, aioredis.Redis) or pool is None:
        return await _write_pipelined(r, img)
    try:
        conn = await pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name
        conn = await pool.get_connection("SET")
    try:
        sent: list[int] = []  # batches sent whose replies are not read yet: their sizes
        batch: list[bytes] = []
        for args in _commands(img):
            batch.append(_resp(args))
            if len(batch) == WRITE_BATCH:
                await conn.send_packed_command(b"".join(batch), check_health=not sent)
                sent.append(len(batch))
                batch = []
                if len(sent) > 1:
                    for _ in range(sent.pop(0)):
                        await conn.read_response()  # raises the first error reply
        if batch:
            await conn.send_packed_command(b"".join(batch), check_health=not sent)
            sent.append(len(batch))
        for size in sent:
            for _ in range(size):
                await conn.read_response()
    except BaseException:
        await conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        await pool.release(conn)
    return len(img)


async def _write_pipelined(r: Any, img: im.Image) -> int:
    pipe = r.pipeline(transaction=False)
    n = 0
    for args in _commands(img):
        pipe.execute_command(*args)
        n += 1
        if n % WRITE_BATCH == 0:
            await pipe.execute()
            pipe = r.pipeline(transaction=False)
    await pipe.execute()
    return len(img)


async def drop_project_keys(r: aioredis.Redis, keep_context: bool = True) -> int:
    """Delete the keys this project owns and can rebuild (plus gathers and the epoch); policy
    contexts are kept unless ``keep_context`` is False. Never touches other keys, never FLUSHDB."""
    keys = await project_keys(r)
    if keep_context:
        keys = [k for k in keys if not k.startswith("aios:ctx:")]
    for i in range(0, len(keys), 1000):
        await r.delete(*keys[i : i + 1000])
    return len(keys)


# -- recover ----------------------------------------------------------------------------------------
class RecoverRefused(Exception):
    """Redis already holds project state and ``force`` was not given."""


@dataclass
class RecoverReport:
    events: int
    keys: int
    digest: str
    seconds_read: float
    seconds_write: float
    dropped: int = 0
    anomalies: list[str] = field(default_factory=list)
    #: steps Redis had taken whose events the stream had not acked, published before the read
    announced: int = 0


async def recover(bus: Bus, store: Store, force: bool = False) -> RecoverReport:
    """Rebuild the project's Redis state from the stream. Refuses when project keys exist unless
    ``force`` (then only the project's rebuildable keys are replaced)."""
    r = store.r
    present = await project_keys(r, ("rebuilt",))
    if present and not force:
        raise RecoverRefused(f"{len(present)} project keys already in Redis (e.g. {present[0]}); use --force to replace them")
    dropped = 0
    # first what Redis took and the stream has not heard (docs/reliability.md, "Announcements"):
    # rebuilt without it, the block would go back to the step before, and nothing takes it again
    from ..workers.announce import publish_pending  # (workers import this module)

    announced, _dropped, failed = await publish_pending(r, bus, 0.0)
    if failed:
        raise RecoverRefused(f"{failed} status steps taken in Redis could not be published to the stream "
                             "(is it reachable?): recovering now would undo them; try again")
    indexes = await store.scan_indexes()  # state indexes only ever go up, across recovers too
    if force:
        await r.delete(EPOCH_KEY)  # workers pause before anything changes under them
        dropped = await drop_project_keys(r)
    with gc_paused():  # the fold's state, its image and the pipelines: see gc_paused
        started = time.perf_counter()
        f = await fold_stream(bus)
        read_s = time.perf_counter() - started
        img = f.image(include_gathers=False)
        open_gathers = f.open_gathers()
        img.update(f.gather_image(open_gathers))
        started = time.perf_counter()
        if force:  # anything written while we read (a CLI registration) is replaced too
            dropped += await drop_project_keys(r)
        keys = await write_image(r, img)
        last_seq = (await bus.js.stream_info(subjects.STREAM)).state.last_seq
        await store.restart_indexes(f.clusters, indexes, last_seq)
        for bid, gen, attempt in open_gathers:
            await r.expire(f"aios:gather:{bid}:{gen}:{attempt}", 3600)
            # the gateways' timer of the round (a deadline already past fires at once)
            await r.zadd(GATHER_DUE, {due_member(bid, gen, attempt): float(f.gathers[(bid, gen, attempt)]["deadline"] or 0)})
        await store.set_epoch(uuid.uuid4().hex)
        write_s = time.perf_counter() - started
        digest = im.digest(img)
    for cid in f.clusters:
        with contextlib.suppress(Exception):
            await bus.emit(E.inventory_hint, InventoryHint(cid))
    return RecoverReport(f.events, keys, digest, read_s, write_s, dropped, f.anomalies, announced)


async def ensure_epoch(bus: Bus, store: Store) -> str | None:
    """The current epoch; on a fresh system (empty stream, no epoch) start one. ``None`` means
    Redis lost its state while the stream has history: run ``blocks recover``."""
    cur = await store.epoch()
    if cur is not None:
        return cur
    try:
        info = await bus.js.stream_info(subjects.STREAM)
        empty = info.state.messages == 0
    except Exception:
        return None
    if not empty:
        return None
    await store.set_epoch(uuid.uuid4().hex, only_if_absent=True)
    return await store.epoch()


async def state_digest(store: Store) -> str:
    return im.digest(await read_image(store.r))
