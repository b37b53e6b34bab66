"""The door to the instance-map bucket (NATS KV ``aios-instances``): one key per block, its
revision the map's version (docs/executor.md says why a KV bucket).

* ``update(bid, fn)``: compare-and-set; ``fn(current) -> new | None`` is retried on a conflict
  with the current value, so copies of the mapper never overwrite each other;
* ``watch(on_change)``: every key's latest value first (the full snapshot a (re)connecting service
  needs), then each change; the watch is an ordered consumer that resumes after a reconnect from
  the last revision it saw, and is re-made (a fresh snapshot) if it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import structlog
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)

from ..schemas.records import BlockMap
from .nats_bus import Bus
from .subjects import INSTANCE_BUCKET as BUCKET

log = structlog.get_logger("aios.instance_map")

#: how often an idle watch checks that its bucket is still the one it watches (``watch``)
REBORN_CHECK_S = 2.0

#: (block id, map or None when deleted, revision)
OnChange = Callable[[str, BlockMap | None, int], Awaitable[None] | None]


class InstanceMaps:
    def __init__(self, bus: Bus, create: bool = True, on_created: Callable[[], Coroutine[Any, Any, Any]] | None = None):
        self.bus = bus
        #: make the bucket when it is missing (the executors, whose role may); a reader whose role
        #: may not (the metrics collector) waits for it instead of trying, which NATS would log as
        #: a permission violation
        self.create = create
        #: called (as a task of its own) when this process made the bucket: a lost bucket is
        #: refilled from the state (the mapper's ``refill``), not left empty until facts come
        self.on_created = on_created
        self._kv: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def kv(self) -> Any:
        if self._kv is None:
            try:
                self._kv = await self.bus.js.key_value(BUCKET)
            except (BucketNotFoundError, NotFoundError):
                if not self.create:
                    raise
                try:
                    self._kv = await self.bus.js.create_key_value(bucket=BUCKET, history=1,
                                                                  replicas=self.bus.settings.stream_replicas)
                except Exception:  # created by another process meanwhile
                    self._kv = await self.bus.js.key_value(BUCKET)
                else:
                    log.info("instance_map.bucket_created", bucket=BUCKET)
                    if self.on_created is not None:
                        t: asyncio.Task[Any] = asyncio.get_running_loop().create_task(self.on_created())
                        self._tasks.add(t)
                        t.add_done_callback(self._tasks.discard)
        return self._kv

    async def _born(self) -> Any:
        """When the bucket's stream was made (a bucket deleted and made anew has a new time)."""
        return (await self.bus.js.stream_info(f"KV_{BUCKET}")).created

    def _lost(self) -> None:
        """The bucket's stream is gone (deleted): the next use looks it up, or makes it, anew."""
        log.warning("instance_map.bucket_lost", bucket=BUCKET)
        self._kv = None

    async def get(self, bid: str) -> tuple[BlockMap | None, int]:
        kv = await self.kv()
        try:
            e = await kv.get(bid)
        except (KeyNotFoundError, NotFoundError):
            return None, 0
        if not e.value:
            return None, int(e.revision or 0)
        return msgspec.json.decode(e.value), int(e.revision or 0)

    async def update(self, bid: str, fn: Callable[[BlockMap | None], BlockMap | None],
                     attempts: int = 20) -> int | None:
        """Apply ``fn`` to the block's map with compare-and-set; the new revision (None: no change)."""
        lost = False
        for _ in range(attempts):
            kv = await self.kv()
            current, rev = await self.get(bid)
            new = fn(current)
            if new is None:
                return None
            data = msgspec.json.encode(new)
            try:
                if rev == 0:
                    return int(await kv.create(bid, data))
                return int(await kv.update(bid, data, last=rev))
            except KeyWrongLastSequenceError:
                continue  # someone else wrote it: decide again on theirs
            except NoStreamResponseError:
                # the bucket was deleted under us (a get then reads "no such key"): made anew once,
                # then this map is decided again on the new bucket
                if lost or not self.create:
                    raise
                lost = True
                self._lost()
                continue
            except Exception as exc:
                if "wrong last sequence" in str(exc).lower() or "key exists" in str(exc).lower():
                    continue
                raise
        raise RuntimeError(f"instance map of {bid}: {attempts} conflicting writers in a row")

    async def delete(self, bid: str) -> None:
        kv = await self.kv()
        with contextlib.suppress(KeyNotFoundError, NotFoundError):
            try:
                await kv.delete(bid)
            except NoStreamResponseError:  # no bucket: nothing to delete; the next write makes one
                self._lost()

    async def watch(self, on_change: OnChange, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Call ``on_change`` for every block's latest map, then for each change, until ``stop``.
        ``ready`` is set once the initial snapshot has been delivered.

        A bucket deleted and made anew (its stream's creation time changed) is watched again from
        a fresh snapshot: the watch's ordered consumer would otherwise wait, silently, for
        sequences past those of the old stream."""
        while not stop.is_set():
            try:
                kv = await self.kv()
                born = await self._born()
                checked = time.monotonic()
                watcher = await kv.watchall()
                try:
                    while not stop.is_set():
                        try:
                            e = await watcher.updates(timeout=1.0)
                        except Exception as exc:
                            if not isinstance(exc, TimeoutError) and "timeout" not in type(exc).__name__.lower():
                                raise
                            if time.monotonic() - checked >= REBORN_CHECK_S:  # idle: is it still the same bucket?
                                checked = time.monotonic()
                                if await self._born() != born:
                                    log.warning("instance_map.bucket_remade", bucket=BUCKET, note="watching it afresh")
                                    break
                            continue
                        if e is None:  # end of the initial snapshot
                            if ready is not None:
                                ready.set()
                            continue
                        value = msgspec.json.decode(e.value) if e.value and e.operation is None else None
                        r = on_change(e.key, value, int(e.revision or 0))
                        if r is not None:
                            await r
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except (BucketNotFoundError, NotFoundError):  # no executor has made it yet
                log.debug("instance_map.no_bucket_yet", bucket=BUCKET)
                await asyncio.sleep(0.5)
            except Exception as exc:
                log.warning("instance_map.watch_failed", error=repr(exc))
                await asyncio.sleep(0.5)
