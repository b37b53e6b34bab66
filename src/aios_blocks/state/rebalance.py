"""The rebalancer's scratch state in Redis (docs/rebalance.md): who acts, when each cluster was last
rebalanced, and the pending blocks whose moves are under way. Volatile (``aios:meta:``: outside
the state digest, not rebuilt from the stream): losing it costs at most one early round.

    aios:meta:rebalance:lease        the rebalancer copy that acts now (one at a time)
    aios:meta:rebalance:last         hash cluster -> when moves were last requested there (the cooldown)
    aios:meta:rebalance:for:<bid>    moves requested to make room for a pending block (TTL: the hold)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .inventory import affinity_index
from .keys import P
from .scripts import LEASE

PREFIX = f"{P}:meta:rebalance:"
LEASE_KEY = f"{PREFIX}lease"
LAST = f"{PREFIX}last"


def hold_key(bid: str) -> str:
    return f"{PREFIX}for:{bid}"


class RebalanceState:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)

    async def lead(self, holder: str, ttl_s: float) -> bool:
        """Take or keep the rebalancer's lease: one copy acts at a time."""
        return bool(await self._lease(keys=[LEASE_KEY], args=[holder, max(1, int(ttl_s * 1000))]))

    async def last(self) -> dict[str, float]:
        """Cluster -> when moves were last requested there."""
        return {str(k): float(v) for k, v in (await self.r.hgetall(LAST)).items()}

    async def mark(self, cid: str, at: float) -> None:
        await self.r.hset(LAST, cid, f"{at:.3f}")

    async def hold(self, bid: str, what: str, ttl_s: float) -> bool:
        """Record that moves were requested for the pending block ``bid`` (True), unless some
        already are (False: another walk or copy asked first)."""
        return bool(await self.r.set(hold_key(bid), what, nx=True, px=max(1, int(ttl_s * 1000))))

    async def held(self, bid: str) -> str:
        """The moves under way for the pending block (what ``hold`` recorded), or ''."""
        return str(await self.r.get(hold_key(bid)) or "")

    async def release(self, bid: str) -> None:
        await self.r.delete(hold_key(bid))


async def affinity_indexes(store: Any, placed: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Block -> its affinity index (``state.inventory.affinity_index``, what its placement reads),
    for the blocks with affinity entries (placed rows, or pending block records: ``ir.blockId``):
    a move's target is checked against it, and a pending block's room is made where it admits
    (``handlers.rebalance.placement_filters``; a block with affinity and no index is not moved, nor
    gets room)."""
    out = {}
    for row in placed:
        ir = row.get("ir") or {}
        if ir.get("affinity"):
            out[str(row.get("block_id") or ir.get("blockId"))] = await affinity_index(store, ir)  # type: ignore[arg-type]
    return out
