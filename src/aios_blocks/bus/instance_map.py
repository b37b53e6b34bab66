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
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from .nats_bus import Bus
from .subjects import INSTANCE_BUCKET as BUCKET

log = structlog.get_logger("aios.instance_map")

#: (block id, map or None when deleted, revision)
OnChange = Callable[[str, dict[str, Any] | None, int], Awaitable[None] | None]


class InstanceMaps:
    def __init__(self, bus: Bus, create: bool = True):
        self.bus = bus
        #: make the bucket when it is missing (the executors, whose role may); a reader whose role
        #: may not (the metrics collector) waits for it instead of trying, which NATS would log as
        #: a permission violation
        self.create = create
        self._kv: Any = None

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
        return self._kv

    async def get(self, bid: str) -> tuple[dict[str, Any] | None, int]:
        kv = await self.kv()
        try:
            e = await kv.get(bid)
        except (KeyNotFoundError, NotFoundError):
            return None, 0
        if not e.value:
            return None, int(e.revision or 0)
        return msgspec.json.decode(e.value), int(e.revision or 0)

    async def update(self, bid: str, fn: Callable[[dict[str, Any] | None], dict[str, Any] | None],
                     attempts: int = 20) -> int | None:
        """Apply ``fn`` to the block's map with compare-and-set; the new revision (None: no change)."""
        kv = await self.kv()
        for _ in range(attempts):
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
            except Exception as exc:
                if "wrong last sequence" in str(exc).lower() or "key exists" in str(exc).lower():
                    continue
                raise
        raise RuntimeError(f"instance map of {bid}: {attempts} conflicting writers in a row")

    async def delete(self, bid: str) -> None:
        kv = await self.kv()
        with contextlib.suppress(KeyNotFoundError, NotFoundError):
            await kv.delete(bid)

    async def watch(self, on_change: OnChange, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Call ``on_change`` for every block's latest map, then for each change, until ``stop``.
        ``ready`` is set once the initial snapshot has been delivered."""
        while not stop.is_set():
            try:
                kv = await self.kv()
                watcher = await kv.watchall()
                try:
                    while not stop.is_set():
                        try:
                            e = await watcher.updates(timeout=1.0)
                        except TimeoutError:
                            continue
                        except Exception as exc:
                            if "timeout" in type(exc).__name__.lower():
                                continue
                            raise
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
