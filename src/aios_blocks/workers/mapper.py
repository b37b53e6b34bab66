"""Mapper worker (``blocks worker mapper``, started by ``blocks up``): its durable consumer
(``mapper``) turns lifecycle facts into each block's versioned instance map in the
``aios-instances`` bucket (``handlers/mapper.py`` decides, ``bus/instance_map.py`` stores with
compare-and-set). The executors only read the maps (they watch the bucket). A bucket this process
makes anew (lost with its stream, or deleted) is refilled from the state.

Every handler is a module-level function ``on_*(mp, m)``, ``mp`` the process's :class:`Mapper`."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from ..bus import subjects
from ..bus.catalog import E
from ..bus.instance_map import InstanceMaps
from ..bus.router import Inbound, Router
from ..handlers import mapper
from ..schemas.events import (
    BlockStatusReport,
    InstanceCommand,
    InstanceEvent,
    InstanceVerdict,
    NodeInventory,
    PlacementMade,
)
from ..schemas.records import BlockMap, BlockRecord
from .base import Worker

log = structlog.get_logger("aios.mapper")

#: a change of a block's map: (its map now, the block's record, now) -> its new map (None: no change)
Decide = Callable[[BlockMap | None, BlockRecord | None, float], BlockMap | None]
C = TypeVar("C")
M = TypeVar("M")


@dataclass
class Mapper:
    """A mapper process's state: its worker, the bucket (made on first use: binding needs no
    connection), and one lock per block in change."""

    w: Worker
    _maps: InstanceMaps | None = None
    #: one change of a block's map at a time in this process (its facts come in bursts: a gang of
    #: instances added together); other mapper copies are kept apart by compare-and-set
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    @property
    def maps(self) -> InstanceMaps:
        if self._maps is None:
            self._maps = InstanceMaps(self.w.bus, on_created=self.refill)
        return self._maps

    async def apply(self, bid: str, decide: Decide, need_block: bool = False) -> None:
        lock = self.locks.setdefault(bid, asyncio.Lock())
        try:
            async with lock:
                block = await self.w.store.get_block(bid)
                if need_block and block is None:
                    return
                await self.maps.update(bid, lambda cur: decide(cur, block, time.time()))
        finally:
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self.locks.pop(bid, None)

    async def refill(self) -> int:
        """The bucket was made anew by this process (lost with its stream, or deleted): every live
        block's map rebuilt from the state (``mapper.from_state``) where the bucket has none yet,
        so blocks already running answer tasks again without waiting for their next fact. A map a
        fact wrote meanwhile is newer and is kept. Returns the number of maps written."""
        n = 0
        try:
            for bid in await self.w.store.list_blocks(limit=1_000_000):
                block, insts = await self.w.store.block_view(bid)
                rebuilt = mapper.from_state(bid, block, insts, time.time())
                if rebuilt is not None and await self.maps.update(bid, only_if_absent(rebuilt)):
                    n += 1
        except Exception as exc:  # the maps then come back with each block's next fact, as before
            log.warning("instance_map.refill_failed", error=repr(exc), refilled=n)
            return n
        log.info("instance_map.refilled", blocks=n)
        return n


def only_if_absent(new: BlockMap) -> Callable[[BlockMap | None], BlockMap | None]:
    """A map change that writes ``new`` only where the block has no map (a fact's is newer)."""
    return lambda current: new if current is None else None


def _bound(fn: Callable[[C, Inbound[M]], Awaitable[None]], ctx: C) -> Callable[[Inbound[M]], Awaitable[None]]:
    """``fn`` with its context given, still naming ``fn`` (``__module__``, ``__qualname__``)."""
    return functools.update_wrapper(functools.partial(fn, ctx), fn)


def bindings(w: Worker, mp: Mapper | None = None) -> list[tuple[subjects.ConsumerSpec, Any]]:
    mp = mp or Mapper(w)
    router = Router(subjects.MAPPER)
    router.add(E.block_placement, _bound(on_placement, mp))
    router.add(E.instance_added, _bound(on_added, mp))
    router.add(E.node_instance_remove, _bound(on_remove, mp))
    router.add(E.instance_failed, _bound(on_failed, mp))
    router.add(E.instance_unhealthy, _bound(on_failed, mp))
    router.add(E.instance_verdict, _bound(on_verdict, mp))
    router.add(E.instance_removed, _bound(on_removed, mp))
    router.add(E.block_ready, _bound(on_ready, mp))
    router.add(E.node_inventory, _bound(on_inventory, mp))
    router.add(E.block_deleted, _bound(on_deleted, mp))
    return [router.binding()]


async def on_placement(mp: Mapper, m: Inbound[PlacementMade]) -> None:
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_placement(m.data, cur, b, now), need_block=True)


async def on_added(mp: Mapper, m: Inbound[InstanceEvent]) -> None:
    ev = m.data
    await mp.apply(ev.block_id, lambda cur, b, now: mapper.on_added(ev, cur, b, now)
                   if b is not None and int(b.get("gen", -1)) == ev.gen else None, need_block=True)


async def on_remove(mp: Mapper, m: Inbound[InstanceCommand]) -> None:
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_remove_command(m.data, cur, b, now))


async def on_failed(mp: Mapper, m: Inbound[InstanceEvent]) -> None:
    """``instance.failed`` and ``instance.unhealthy``."""
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_failed(m.data, cur, b, now))


async def on_verdict(mp: Mapper, m: Inbound[InstanceVerdict]) -> None:
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_verdict(m.data, cur, b, now))


async def on_removed(mp: Mapper, m: Inbound[InstanceEvent]) -> None:
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_removed(m.data, cur, b, now))


async def on_ready(mp: Mapper, m: Inbound[BlockStatusReport]) -> None:
    await mp.apply(m.data.block_id, lambda cur, b, now: mapper.on_ready(m.data, cur, b, now), need_block=True)


async def on_inventory(mp: Mapper, m: Inbound[NodeInventory]) -> None:
    """Every block with instances recorded on the node: its map takes the node's new boot."""
    nid = m.tokens["nid"]
    if m.data.node_id != nid:
        return  # the body's node is a claim; the subject's is vouched for by the server
    bids = sorted({str(rec["block_id"]) for rec in (await mp.w.store.node_instances(nid)).values()})
    for bid in bids:
        await mp.apply(bid, lambda cur, b, now: mapper.on_inventory(m.data, cur, now))


async def on_deleted(mp: Mapper, m: Inbound[BlockStatusReport]) -> None:
    cur, _ = await mp.maps.get(m.data.block_id)
    if cur is not None and int(cur.get("gen", 0)) <= m.data.gen:
        await mp.maps.delete(m.data.block_id)


async def run(w: Worker, stop: asyncio.Event) -> None:
    """The mapper's consumer until ``stop``; the bucket is looked up (or made, then refilled) first."""
    from .base import run_consumers

    mp = Mapper(w)
    await mp.maps.kv()
    await run_consumers(w, bindings(w, mp), stop)
