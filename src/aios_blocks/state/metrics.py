"""The door to the local cluster metrics store (Redis): the metrics collector's short windows per
block and instance, and the registry of the workers' ``/metrics`` targets (docs/metrics.md).

Why Redis: it is already every cluster's state store and every worker has a client to it, so a
policy input (the controller's ``block_metrics``, the executor's instance metrics) costs one
round trip and no new service; a window is a capped list (``LPUSH`` + ``LTRIM``, O(1) per
sample) that expires by itself (``EXPIRE``) when its block or instance is gone. Long-term
history is Prometheus's job, not this store's.

Keys (``state.keys``): ``aios:metrics:blocks`` (latest block samples), per block
``aios:metrics:{b:<bid>}:inst`` (latest instance samples), ``...:win`` and ``...:win:<iid>``
(samples, newest first), ``aios:metrics:targets`` (zset of targets scored by when they lapse),
``aios:metrics:leader:<scope>`` (the collector that writes a scope).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..schemas.records import BlockSample, InstanceSample, JSONObject, MetricsTarget, TickSamples
from . import scripts
from .keys import METRICS_BLOCKS, METRICS_TARGETS, metrics_inst_key, metrics_leader_key, metrics_win_key

_json = msgspec.json


def _dumps(v: Any) -> str:
    return _json.encode(v).decode()


def _loads(raw: str | None) -> Any:
    return _json.decode(raw) if raw else None


class MetricsStore:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(scripts.LEASE)

    # -- the workers' /metrics targets ---------------------------------------------------------------
    async def register_target(self, target: MetricsTarget, ttl_s: float) -> None:
        """Announce (or refresh) a worker's ``/metrics`` target for ``ttl_s`` seconds."""
        await self.r.zadd(METRICS_TARGETS, {_dumps(target): time.time() + ttl_s})

    async def unregister_target(self, target: MetricsTarget) -> None:
        await self.r.zrem(METRICS_TARGETS, _dumps(target))

    async def targets(self, kind: str | None = None) -> list[MetricsTarget]:
        """The live targets (lapsed ones are left out, and pruned by whoever may write); with
        ``kind``, those of the processes that run it (alone, or in a group: ``kinds``)."""
        raw = await self.r.zrangebyscore(METRICS_TARGETS, time.time(), "+inf")
        out: list[MetricsTarget] = [_json.decode(m) for m in raw]
        return [t for t in out if kind is None or kind in (t.get("kinds") or [t.get("kind")])]

    async def prune_targets(self) -> int:
        return int(await self.r.zremrangebyscore(METRICS_TARGETS, "-inf", time.time()))

    # -- the collector's lease ----------------------------------------------------------------------
    async def lead(self, scope: str, holder: str, ttl_s: float) -> bool:
        """Take or keep the lease on ``scope``: one collector writes a scope's windows; copies wait."""
        return bool(await self._lease(keys=[metrics_leader_key(scope)], args=[holder, max(1, int(ttl_s * 1000))]))

    # -- windows ------------------------------------------------------------------------------------
    async def write(self, samples: TickSamples, keep: int, ttl_s: float,
                    gone: tuple[str, ...] | list[str] = ()) -> None:
        """One tick: per block its sample and its instances' samples (latest, and pushed onto the
        windows of at most ``keep`` samples, expiring ``ttl_s`` after the last write); ``gone``:
        blocks this writer no longer covers (their latest sample is removed; windows expire)."""
        ttl = max(1, int(ttl_s))
        pipe = self.r.pipeline(transaction=False)
        for bid, (block, insts) in samples.items():
            pipe.hset(METRICS_BLOCKS, bid, _dumps(block))
            ikey = metrics_inst_key(bid)
            pipe.delete(ikey)
            if insts:
                pipe.hset(ikey, mapping={iid: _dumps(s) for iid, s in insts.items()})
                pipe.expire(ikey, ttl)
            for key, sample in ((metrics_win_key(bid), block), *((metrics_win_key(bid, i), s) for i, s in insts.items())):
                pipe.lpush(key, _dumps(sample))
                pipe.ltrim(key, 0, keep - 1)
                pipe.expire(key, ttl)
        if gone:
            pipe.hdel(METRICS_BLOCKS, *gone)
            for bid in gone:
                pipe.delete(metrics_inst_key(bid))
        await pipe.execute()

    async def blocks(self) -> dict[str, BlockSample]:
        """Every block's latest sample."""
        raw = await self.r.hgetall(METRICS_BLOCKS)
        return {bid: _json.decode(v) for bid, v in raw.items()}

    async def block(self, bid: str) -> BlockSample | None:
        out: BlockSample | None = _loads(await self.r.hget(METRICS_BLOCKS, bid))
        return out

    async def instances(self, bid: str) -> dict[str, InstanceSample]:
        """The latest sample of each instance of the block."""
        raw = await self.r.hgetall(metrics_inst_key(bid))
        return {iid: _json.decode(v) for iid, v in raw.items()}

    async def instances_many(self, bids: list[str]) -> dict[str, dict[str, InstanceSample]]:
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.hgetall(metrics_inst_key(bid))
        out = await pipe.execute()
        return {bid: {iid: _json.decode(v) for iid, v in raw.items()} for bid, raw in zip(bids, out, strict=True)}

    async def window(self, bid: str, iid: str | None = None, n: int = -1) -> list[BlockSample] | list[InstanceSample]:
        """The block's (or one instance's) samples, oldest first (the last ``n``; -1: all)."""
        raw = await self.r.lrange(metrics_win_key(bid, iid), 0, n - 1 if n > 0 else -1)
        return [_json.decode(x) for x in reversed(raw)]

    async def block_metrics(self, bid: str, history: int = -1) -> JSONObject:
        """The resourceAllocator's ``block_metrics`` (docs/policies.md): the block's latest sample,
        its instances' latest samples and its window; ``{}`` when the collector has none."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(METRICS_BLOCKS, bid)
        pipe.hgetall(metrics_inst_key(bid))
        pipe.lrange(metrics_win_key(bid), 0, history - 1 if history > 0 else -1)
        block, insts, win = await pipe.execute()
        if not block:
            return {}
        return {**_json.decode(block), "per_instance": {iid: _json.decode(v) for iid, v in insts.items()},
                "history": [_json.decode(x) for x in reversed(win)]}
