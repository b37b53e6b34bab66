"""The door to the reconciler's state in Redis (docs/reliability.md, "Reconciler"): the lease that
lets one controller copy reconcile at a time, its memory of the blocks that are short (backoff),
and the read of every block's sizes and instance statuses it decides from. Not rebuilt from the
stream (``aios:health:`` keys): a lost memory costs one early ask, deduplicated or refused as
already reached."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import msgspec

from ..schemas.records import InstanceRecord
from .keys import BLOCKS, RECONCILE_LEASE, RECONCILE_STATE, block_key, inst_key
from .scripts import LEASE

_json = msgspec.json
CHUNK = 500


class _Sizes(msgspec.Struct):
    """The two fields of a block's IR the reconciler needs (the rest is skipped, not decoded)."""

    minInstances: int = 0
    maxInstances: int = 0


_sizes = msgspec.json.Decoder(_Sizes)
class MemoryRecord(TypedDict, total=False):
    """The reconciler's memory of one block as kept (``handlers.reconcile.Memory``'s fields)."""

    since: float
    attempts: int
    next_at: float
    request_id: str


_memory = msgspec.json.Decoder(MemoryRecord)


class ReadyBlock(msgspec.Struct, frozen=True):
    """A ready block's sizes and instance records, as read."""

    block_id: str
    gen: int
    cluster: str
    min_instances: int
    max_instances: int
    desired: int
    instances: dict[str, InstanceRecord]


class ReconcileStore:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)

    async def lead(self, holder: str, ttl_s: float) -> bool:
        """Take or keep the reconciler's lease: one controller copy reconciles at a time, another
        takes over when it lapses."""
        return bool(await self._lease(keys=[RECONCILE_LEASE], args=[holder, max(1, int(ttl_s * 1000))]))

    async def memory(self) -> dict[str, MemoryRecord]:
        """bid -> the reconciler's memory of it (``handlers.reconcile.Memory`` fields); an
        unreadable entry is left out (the block starts afresh)."""
        out: dict[str, MemoryRecord] = {}
        for bid, raw in (await self.r.hgetall(RECONCILE_STATE)).items():
            try:
                d = _memory.decode(raw)
            except msgspec.MsgspecError:  # not JSON, or not the record's shape
                continue
            out[bid] = d
        return out

    async def save(self, changed: Mapping[str, Mapping[str, object]], dropped: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        if changed:
            pipe.hset(RECONCILE_STATE, mapping={bid: _json.encode(m).decode() for bid, m in changed.items()})
        if dropped:
            pipe.hdel(RECONCILE_STATE, *dropped)
        if changed or dropped:
            await pipe.execute()

    async def ready_blocks(self, limit: int = 1_000_000) -> list[ReadyBlock]:
        """Every ``ready`` block's sizes and instances, a chunk of blocks per round trip (the
        status first; only a ready block's IR sizes and instances are read and decoded)."""
        out: list[ReadyBlock] = []
        bids = await self.r.zrevrange(BLOCKS, 0, limit - 1)
        for i in range(0, len(bids), CHUNK):
            chunk = bids[i:i + CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for bid in chunk:
                pipe.hget(block_key(bid), "status")
            ready = [bid for bid, status in zip(chunk, await pipe.execute(), strict=True) if status == "ready"]
            if not ready:
                continue
            pipe = self.r.pipeline(transaction=False)
            for bid in ready:
                pipe.hmget(block_key(bid), ["status", "gen", "cluster", "desired", "ir"])
                pipe.hgetall(inst_key(bid))
            replies = await pipe.execute()
            for bid, (status, gen, cluster, desired, ir), insts in zip(ready, replies[::2], replies[1::2], strict=True):
                if status != "ready" or ir is None:
                    continue
                try:
                    sizes = _sizes.decode(ir)
                    records = {iid: _json.decode(v) for iid, v in insts.items()}
                except msgspec.DecodeError:
                    continue
                out.append(ReadyBlock(bid, int(gen or 0), cluster or "", sizes.minInstances, sizes.maxInstances,
                                      int(desired or 0), records))
        return out
