"""The door to the reconciler's state in Redis (docs/reliability.md, "Reconciler"): the lease that
lets one controller copy reconcile at a time, its memory of the blocks that are short (backoff),
the read of every block's sizes and instance statuses it decides from, the short marks it writes on
the blocks' records (``schemas.condition``) and the controller's notes of failed scale /
reassignment steps (their reasons). Not rebuilt from the stream (``aios:health:`` keys): a lost
memory costs one early ask, deduplicated or refused as already reached; a lost note, a mark
that says why in fewer words."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

import msgspec

from ..schemas.records import InstanceRecord
from .keys import BLOCKS, RECONCILE_FAILED, RECONCILE_LEASE, RECONCILE_STATE, block_key, inst_key
from .scripts import LEASE, SHORT_MARK

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
    degraded: bool


_memory = msgspec.json.Decoder(MemoryRecord)


class FailedStep(msgspec.Struct, frozen=True):
    """A block's latest failed ``scale`` / ``reassignment`` step, as the controller noted it."""

    gen: int
    step: str
    reason: str
    at: float


_failed = msgspec.json.Decoder(FailedStep)


class ReadyBlock(msgspec.Struct, frozen=True):
    """A ready block's sizes, instance records and short mark, as read; or another block that still
    carries a mark (``status`` not ``ready``: only its id, gen and mark)."""

    block_id: str
    gen: int
    cluster: str
    min_instances: int
    max_instances: int
    desired: int
    instances: dict[str, InstanceRecord]
    #: the record's ``short`` field as stored (None: no mark)
    short: str | None = None
    status: str = "ready"


class ReconcileStore:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)
        self._mark = r.register_script(SHORT_MARK)

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
        """Every ``ready`` block's sizes, instances and short mark, a chunk of blocks per round
        trip (the status first; only a ready block's IR sizes and instances are read and decoded),
        and every other block still marked short (its mark to clear)."""
        out: list[ReadyBlock] = []
        bids = await self.r.zrevrange(BLOCKS, 0, limit - 1)
        for i in range(0, len(bids), CHUNK):
            chunk = bids[i:i + CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for bid in chunk:
                pipe.hmget(block_key(bid), ["status", "gen", "short"])
            ready: list[str] = []
            for bid, (status, gen, short) in zip(chunk, await pipe.execute(), strict=True):
                if status == "ready":
                    ready.append(bid)
                elif short is not None and status is not None:
                    out.append(ReadyBlock(bid, int(gen or 0), "", 0, 0, 0, {}, short, status))
            if ready:
                out += await self._ready(ready)
        return out

    async def _ready(self, ready: list[str]) -> list[ReadyBlock]:
        out: list[ReadyBlock] = []
        pipe = self.r.pipeline(transaction=False)
        for bid in ready:
            pipe.hmget(block_key(bid), ["status", "gen", "cluster", "desired", "ir", "short"])
            pipe.hgetall(inst_key(bid))
        replies = await pipe.execute()
        for bid, (status, gen, cluster, desired, ir, short), insts in zip(ready, replies[::2], replies[1::2], strict=True):
            if status != "ready" or ir is None:
                continue
            try:
                sizes = _sizes.decode(ir)
                records = {iid: _json.decode(v) for iid, v in insts.items()}
            except msgspec.DecodeError:
                continue
            out.append(ReadyBlock(bid, int(gen or 0), cluster or "", sizes.minInstances, sizes.maxInstances,
                                  int(desired or 0), records, short))
        return out

    async def mark(self, marks: Mapping[str, tuple[int, str]], clear: Iterable[tuple[str, int]]) -> int:
        """Write short marks (bid -> (gen, the mark's JSON): on a ``ready`` block of that gen only)
        and clear others ((bid, gen)), compare-and-set each: how many took. Few per pass (a mark
        changes when a spell begins or ends, or its figures or reason change)."""
        n = 0
        for bid, (gen, raw) in marks.items():
            n += int(await self._mark(keys=[block_key(bid)], args=[str(gen), raw]) or 0)
        for bid, gen in clear:
            n += int(await self._mark(keys=[block_key(bid)], args=[str(gen), ""]) or 0)
        return n

    async def note_failed(self, bid: str, gen: int, step: str, reason: str, at: float) -> None:
        """The controller's note of a block's failed scale / reassignment step (the latest wins)."""
        await self.r.hset(RECONCILE_FAILED, bid, _json.encode(FailedStep(gen, step, reason[:500], at)).decode())

    async def failed_steps(self) -> dict[str, FailedStep]:
        """bid -> its latest failed step noted (an unreadable note is left out)."""
        out: dict[str, FailedStep] = {}
        for bid, raw in (await self.r.hgetall(RECONCILE_FAILED)).items():
            with contextlib.suppress(msgspec.MsgspecError):
                out[bid] = _failed.decode(raw)
        return out

    async def drop_failed(self, bids: Iterable[str]) -> None:
        bids = list(bids)
        if bids:
            await self.r.hdel(RECONCILE_FAILED, *bids)
