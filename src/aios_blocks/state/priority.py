"""The door to priority classes and tenants' quotas in Redis (docs/priority.md), and to what the
quota accounting reads of the state (the running blocks' instances and their GPUs' models).

Both records are rebuilt from the stream (``priorityclass.registered`` / ``removed``,
``quota.set``) by ``blocks recover``; writers publish the event first, then write here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog

from ..policies import quota as qp
from .keys import (
    BLOCKS,
    CLUSTERS,
    NODE_INDEX,
    PRIORITY_CLASSES,
    QUOTAS,
    block_key,
    inst_key,
    node_key,
    quota_res_key,
    quota_usage_key,
    res_key,
    res_pattern,
)
from .scripts import QUOTA_MIGRATE

_json = msgspec.json
log = structlog.get_logger("aios.priority")


def classes_of(raw: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The classes by name from the hash ``PRIORITY_CLASSES`` as read (``PriorityStore.classes``;
    the parser reads it in a pipeline of its own reads)."""
    return {k: _json.decode(v) for k, v in raw.items()}


class PriorityStore:
    def __init__(self, r: Any):
        self.r = r

    # -- priority classes ------------------------------------------------------------------------
    async def classes(self) -> dict[str, dict[str, Any]]:
        """Every class by name (``schemas.priority.PriorityClass`` JSON)."""
        return classes_of(await self.r.hgetall(PRIORITY_CLASSES))

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
        """The tenants' quotas, each one ``Quota`` accepts: a record it refuses (a NaN amount an
        older version stored, as null) is read as no quota for that tenant, with a warning logged,
        never a failed step (the quota gate of every placement reads these)."""
        from pydantic import ValidationError

        from ..schemas.priority import Quota

        out: dict[str, dict[str, Any]] = {}
        for tenant, raw in (await self.r.hgetall(QUOTAS)).items():
            record = _json.decode(raw)
            try:
                Quota.model_validate(record)
            except ValidationError as exc:
                log.warning("priority.quota_unreadable", tenant=tenant, record=raw[:300],
                            error=" ".join(str(exc).split())[:300],
                            action="read as no quota; `blocks quota set` replaces it, `--remove` drops it")
                continue
            out[tenant] = record
        return out

    async def quota_tenants(self) -> list[str]:
        """Every tenant with a stored quota, one ``quotas`` skips included (it may be removed)."""
        return sorted(await self.r.hkeys(QUOTAS))

    async def put_quota(self, record: dict[str, Any] | None, tenant: str) -> None:
        if record is None:
            await self.r.hdel(QUOTAS, tenant)
        else:
            await self.r.hset(QUOTAS, tenant, _json.encode(record))

    # -- what the accounting reads ---------------------------------------------------------------
    async def usage_counters(self) -> list[dict[str, str]]:
        """Each cluster's quota usage counters (``quota_usage_key``: ``tenant<TAB>model<TAB>resource``
        -> amount), kept by the capacity scripts with every reservation taken or given back: one
        read per cluster, whatever the number of blocks (``policies.quota.from_fields`` sums them).
        A cluster's hash without the counters' version (``qp.VERSION_FIELD``: reservations made
        before the counters existed, or the hash dropped) is migrated first (``migrate``)."""
        cids = sorted(await self.r.hkeys(CLUSTERS))
        hashes = await self._counters(cids)
        stale = [cid for cid, h in zip(cids, hashes, strict=True) if h.get(qp.VERSION_FIELD) != qp.COUNTERS_VERSION]
        if not stale:
            return hashes
        for cid in stale:
            await self.migrate(cid)
        return await self._counters(cids)

    async def _counters(self, cids: list[str]) -> list[dict[str, str]]:
        pipe = self.r.pipeline(transaction=False)
        for cid in cids:
            pipe.hgetall(quota_usage_key(cid))
        return list(await pipe.execute()) if cids else []

    async def migrate(self, cid: str) -> bool:
        """Bring a cluster's counters to the version: each reservation without its amounts
        (``quota_res_key``) gets what ``policies.quota.with_quota`` would have given it (its
        block's tenant, its GPUs' models), and the usage is summed again from the amounts, in one
        script (``QUOTA_MIGRATE``: a reservation taken or given back meanwhile is not counted
        twice). A scan of the cluster's reservations, once. Returns whether it migrated."""
        known = set(await self.r.hkeys(quota_res_key(cid)))
        missing: list[str] = []
        async for key in self.r.scan_iter(match=res_pattern(cid), count=500):
            iid = str(key).rsplit(":", 1)[1]
            if iid not in known:
                missing.append(iid)
        amounts: dict[str, dict[str, float]] = {}
        if missing:
            pipe = self.r.pipeline(transaction=False)
            for iid in missing:
                pipe.hgetall(res_key(cid, iid))
            held = dict(zip(missing, await pipe.execute(), strict=True))
            irs = await self._irs(sorted({h["block"] for h in held.values() if h.get("block")}))
            models = await self._models(cid, sorted({h["node"] for h in held.values() if h.get("node")}))
            for iid, h in held.items():
                ir = irs.get(h.get("block", ""))
                tenant = qp.tenant_of(ir) if ir else None
                if tenant is None:
                    continue
                gpus = list(_json.decode(h["gpus"])) if h.get("gpus") else []
                got = qp.fields(tenant, qp.instance_usage(ir.get("resources") or {}, gpus, models.get(h.get("node", ""), {})))  # type: ignore[union-attr]
                if got:
                    amounts[iid] = got
        script = self.r.register_script(QUOTA_MIGRATE)
        return bool(await script(keys=[quota_usage_key(cid), quota_res_key(cid)],
                                 args=[_json.encode(amounts).decode(), res_key(cid, ""), qp.COUNTERS_VERSION]))

    async def _irs(self, bids: list[str]) -> dict[str, dict[str, Any]]:
        pipe = self.r.pipeline(transaction=False)
        for bid in bids:
            pipe.hget(block_key(bid), "ir")
        return {bid: _json.decode(ir) for bid, ir in zip(bids, await pipe.execute() if bids else [], strict=True) if ir}

    async def _models(self, cid: str, nids: list[str]) -> dict[str, dict[str, str]]:
        """Node -> its GPUs' models (gpu id -> model)."""
        pipe = self.r.pipeline(transaction=False)
        for nid in nids:
            pipe.hget(node_key(cid, nid), "spec")
        out: dict[str, dict[str, str]] = {}
        for nid, spec in zip(nids, await pipe.execute() if nids else [], strict=True):
            if spec:
                out[nid] = {str(g["id"]): str(g.get("model") or "") for g in _json.decode(spec).get("gpus", [])}
        return out

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
