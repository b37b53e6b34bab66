"""The door to priority classes and tenants' quotas in Redis (docs/priority.md), and to what the
quota accounting reads of the state (the running blocks' instances and their GPUs' models).

Both records are rebuilt from the stream (``priorityclass.registered`` / ``removed``,
``quota.set``) by ``blocks recover``; writers publish the event first, then write here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .keys import (
    BLOCKS,
    CLUSTERS,
    NODE_INDEX,
    PRIORITY_CLASSES,
    QUOTAS,
    block_key,
    inst_key,
    node_key,
    quota_usage_key,
)

_json = msgspec.json


class PriorityStore:
    def __init__(self, r: Any):
        self.r = r

    # -- priority classes ------------------------------------------------------------------------
    async def classes(self) -> dict[str, dict[str, Any]]:
        """Every class by name (``schemas.priority.PriorityClass`` JSON)."""
        return {k: _json.decode(v) for k, v in (await self.r.hgetall(PRIORITY_CLASSES)).items()}

    async def put_class(self, record: dict[str, Any]) -> None:
        """Store a class; a new default class takes the flag from the old one (one default)."""
        pipe = self.r.pipeline(transaction=True)
        if record.get("default"):
            for name, old in (await self.classes()).items():
                if old.get("default") and name != record["name"]:
                    pipe.hset(PRIORITY_CLASSES, name, _json.encode({**old, "default": False}))
        pipe.hset(PRIORITY_CLASSES, record["name"], _json.encode(record))
        await pipe.execute()

    async def remove_class(self, name: str) -> bool:
        return bool(await self.r.hdel(PRIORITY_CLASSES, name))

    # -- quotas ----------------------------------------------------------------------------------
    async def quotas(self) -> dict[str, dict[str, Any]]:
        return {k: _json.decode(v) for k, v in (await self.r.hgetall(QUOTAS)).items()}

    async def put_quota(self, record: dict[str, Any] | None, tenant: str) -> None:
        if record is None:
            await self.r.hdel(QUOTAS, tenant)
        else:
            await self.r.hset(QUOTAS, tenant, _json.encode(record))

    # -- what the accounting reads ---------------------------------------------------------------
    async def usage_counters(self) -> list[dict[str, str]]:
        """Each cluster's quota usage counters (``quota_usage_key``: ``tenant<TAB>model<TAB>resource``
        -> amount), kept by the capacity scripts with every reservation taken or given back: one
        read per cluster, whatever the number of blocks (``policies.quota.from_fields`` sums them)."""
        cids = sorted(await self.r.hkeys(CLUSTERS))
        pipe = self.r.pipeline(transaction=False)
        for cid in cids:
            pipe.hgetall(quota_usage_key(cid))
        return list(await pipe.execute()) if cids else []

    async def placed(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The blocks with instances (``{block_id, status, ir, created, instances}``) and every
        GPU's model (gpu id -> model). A scan of every block: for listings, not for hot paths."""
        bids = await self.r.zrange(BLOCKS, 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.hgetall(block_key(bid))
            pipe.hgetall(inst_key(bid))
        replies = await pipe.execute() if bids else []
        rows = []
        for i, bid in enumerate(bids):
            rec, insts = replies[2 * i], replies[2 * i + 1]
            if not rec or not insts or "ir" not in rec:
                continue
            rows.append({"block_id": bid, "status": rec.get("status", ""), "gen": int(rec.get("gen") or 0), "ir": _json.decode(rec["ir"]),
                         "created": float(rec.get("created") or 0), "instances": {k: _json.decode(v) for k, v in insts.items()}})
        index = await self.r.hgetall(NODE_INDEX)
        pipe = self.r.pipeline(transaction=False)
        for nid, cid in index.items():
            pipe.hget(node_key(cid, nid), "spec")
        models: dict[str, str] = {}
        for spec in (await pipe.execute() if index else []):
            if spec:
                for g in _json.decode(spec).get("gpus", []):
                    models[g["id"]] = g.get("model", "")
        return rows, models
