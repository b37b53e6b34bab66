"""The door to tenants' pending-create limits in Redis (docs/security.md "Tenants").

A tenant (a NATS account, ``runtime.tenants``) may have at most ``pending_creates`` blocks that are
not yet placed, failed, rejected or deleted; the parser refuses its next create beyond that, with
the reason. ``blocks tenant add`` writes the limit here (``aios:tenants:limits``); the parser keeps
each tenant's creates in a set and drops, when it counts, those that are no longer pending (a
block's status is the record, so nothing else has to remember to take them out).
"""

from __future__ import annotations

import json
from typing import Any

from ..schemas.lifecycle import BlockStatus
from .keys import P, block_key

LIMITS = f"{P}:tenants:limits"
#: the statuses of a create that still waits for its outcome
PENDING = frozenset({BlockStatus.PARSED, BlockStatus.SELECTING, BlockStatus.ALLOCATING, BlockStatus.PLACING,
                     BlockStatus.PENDING})


def _tenant_of(ir: Any) -> str | None:
    """The ``tenant`` label of a block record's IR (its JSON as stored)."""
    try:
        labels = (json.loads(ir) or {}).get("labels") if ir else None
    except ValueError:
        return None
    tenant = labels.get("tenant") if isinstance(labels, dict) else None
    return str(tenant) if tenant else None


def pending_key(tenant: str) -> str:
    return f"{P}:tenant:{{{tenant}}}:pending"


class TenantStore:
    def __init__(self, r: Any):
        self.r = r

    async def set_limit(self, tenant: str, pending_creates: int) -> None:
        await self.r.hset(LIMITS, tenant, str(int(pending_creates)))

    async def forget(self, tenant: str) -> None:
        await self.r.hdel(LIMITS, tenant)

    async def is_account(self, name: str) -> bool:
        """Whether ``name`` is a tenant with an account (``blocks tenant add`` wrote its limit)."""
        return bool(await self.r.hexists(LIMITS, name))

    async def limit(self, tenant: str) -> int | None:
        """The tenant's pending-create limit (``None``: none set)."""
        raw = await self.r.hget(LIMITS, tenant)
        return int(raw) if raw is not None else None

    async def pending(self, tenant: str) -> list[str]:
        """The tenant's creates still pending (those that are not any more leave the set)."""
        key = pending_key(tenant)
        bids = sorted(b.decode() if isinstance(b, bytes) else str(b) for b in await self.r.smembers(key))
        if not bids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.hmget(block_key(bid), "status", "ir")
        rows = await pipe.execute()
        # no longer pending, or the id is another tenant's now (this tenant's block was deleted or
        # failed and another tenant made one with the id before this set was counted)
        done = [b for b, (s, ir) in zip(bids, rows, strict=True)
                if (s.decode() if isinstance(s, bytes) else s) not in PENDING or _tenant_of(ir) != tenant]
        if done:
            await self.r.srem(key, *done)
        return [b for b in bids if b not in set(done)]

    async def add_pending(self, tenant: str, bid: str) -> None:
        await self.r.sadd(pending_key(tenant), bid)
