"""The door to the autoscaler's Redis keys (docs/autoscaling.md): per block a lease (which copy of
the autoscaler decides for it: ``SET NX PX``, renewed each tick, given back on a clean stop) and
the framework's memory of the block (``handlers.autoscale.State``: recent proposals, delays,
burst, last decisions), written only while the lease is held; and the live copies
(``aios:meta:autoscalers``), among which the blocks are split by rendezvous hashing. Both are volatile (under
``aios:meta:``): a lost state costs one stable window of history, never a wrong count.

One tick costs three pipelined round trips whatever the block count: the block heads, the leases,
and the reads of the held blocks (state, instance records, metrics samples), plus one pipeline of
state writes.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec

from ..schemas.records import BlockSample, InstanceRecord, InstanceSample
from .keys import (
    AUTOSCALERS,
    autoscale_lease_key,
    autoscale_state_key,
    block_key,
    inst_key,
    metrics_inst_key,
    metrics_win_key,
)
from .scripts import LEASE, LEASE_RELEASE

_json = msgspec.json

#: KEYS[1] lease, KEYS[2] state; ARGV holder, state, ttl ms -> 1 if written (the lease is ours)
SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""


class AutoscaleRead(TypedDict):
    """One block's part of ``AutoscaleStore.read``: its saved state (JSON, or None), its instance
    records, the collector's latest sample of each, and its window of block samples (oldest first;
    empty for a block not windowed)."""

    state: str | None
    instances: dict[str, InstanceRecord]
    samples: dict[str, InstanceSample]
    window: list[BlockSample]


class AutoscaleStore:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)
        self._save = r.register_script(SAVE)
        self._release = r.register_script(LEASE_RELEASE)

    async def heads(self, bids: list[str]) -> dict[str, tuple[str, int]]:
        """bid -> (status, gen) of the blocks that have a record."""
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.hmget(block_key(bid), "status", "gen")
        out = await pipe.execute()
        return {bid: (str(st), int(gen)) for bid, (st, gen) in zip(bids, out, strict=True) if st is not None and gen is not None}

    async def lease(self, bids: list[str], holder: str, ttl_s: float) -> list[str]:
        """Take or keep the lease of each block; the blocks ``holder`` holds now."""
        if not bids:
            return []
        ttl = str(max(1, int(ttl_s * 1000)))
        # the first through the script object (it loads the script after a Redis restart), the rest pipelined
        out = [await self._lease(keys=[autoscale_lease_key(bids[0])], args=[holder, ttl])]
        if len(bids) > 1:
            pipe = self.r.pipeline(transaction=False)
            for bid in bids[1:]:
                pipe.evalsha(self._lease.sha, 1, autoscale_lease_key(bid), holder, ttl)
            out += await pipe.execute()
        return [bid for bid, ok in zip(bids, out, strict=True) if ok]

    async def release(self, bids: list[str], holder: str, leave: bool = True) -> None:
        """Give back these leases (and, with ``leave``, this copy's registration: a clean stop)."""
        for bid in bids:
            await self._release(keys=[autoscale_lease_key(bid)], args=[holder])
        if leave:
            await self.r.zrem(AUTOSCALERS, holder)

    async def copies(self, holder: str, ttl_s: float, now: float) -> list[str]:
        """Register (or refresh) this copy for ``ttl_s``; every live copy, sorted."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(AUTOSCALERS, {holder: now + ttl_s})
        pipe.zremrangebyscore(AUTOSCALERS, "-inf", now)
        pipe.zrange(AUTOSCALERS, 0, -1)
        out = await pipe.execute()
        return sorted(out[2])

    async def read(self, bids: list[str], history: int, windowed: set[str] | None = None) -> dict[str, AutoscaleRead]:
        """Per block: ``state`` (raw JSON or None), ``instances`` (records), ``samples`` (the
        instances' latest metrics samples), ``window`` (the block's last ``history`` samples, oldest
        first; only for the blocks in ``windowed``, default all: the window is most of the bytes)."""
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.get(autoscale_state_key(bid))
            pipe.hgetall(inst_key(bid))
            pipe.hgetall(metrics_inst_key(bid))
            if windowed is None or bid in windowed:
                pipe.lrange(metrics_win_key(bid), 0, history - 1 if history > 0 else -1)
            else:
                pipe.echo("")  # keeps four replies per block
        out = await pipe.execute()
        res: dict[str, AutoscaleRead] = {}
        for i, bid in enumerate(bids):
            state, insts, samples, win = out[4 * i: 4 * i + 4]
            win = win if isinstance(win, list) else []
            res[bid] = {
                "state": state,
                "instances": {iid: _json.decode(v) for iid, v in insts.items()},
                "samples": {iid: _json.decode(v) for iid, v in samples.items()},
                "window": [_json.decode(x) for x in reversed(win)],
            }
        return res

    async def save(self, states: dict[str, str], holder: str, ttl_s: float) -> dict[str, bool]:
        """Write each block's state if ``holder`` still holds its lease; bid -> written."""
        if not states:
            return {}
        ttl = str(max(1000, int(ttl_s * 1000)))
        bids = list(states)
        out = [await self._save(keys=[autoscale_lease_key(bid), autoscale_state_key(bid)], args=[holder, states[bid], ttl])
               for bid in bids[:1]]  # the first by the script object: loads the script into Redis if needed
        if len(bids) > 1:
            pipe = self.r.pipeline(transaction=False)
            for bid in bids[1:]:
                pipe.evalsha(self._save.sha, 2, autoscale_lease_key(bid), autoscale_state_key(bid), holder, states[bid], ttl)
            out += await pipe.execute()
        return {bid: bool(ok) for bid, ok in zip(bids, out, strict=True)}

    async def state(self, bid: str) -> str | None:
        raw: str | None = await self.r.get(autoscale_state_key(bid))
        return raw
