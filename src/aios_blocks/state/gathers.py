"""The gateways' gathers (one per selection round), the policies' shared context and the
affinity placement index: the coordination half of the Redis door (a mixin of ``state.store.Store``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..schemas.records import AffinityIndex, BlockRecord, GatherRecord, JSONObject
from .keys import AFF_LEASE, GATHER_DUE, aff_svc_key, block_key, ctx_key, due_member, gather_key
from .records import _block, _dumps

_json = msgspec.json


class GatherRecords:
    """``Store``'s methods over gathers, policy contexts and the affinity index."""

    r: Any
    _gather_add: Any
    _gather_settle: Any
    _claim_due: Any
    _transition: Any
    _pipeline: Any

    # -- affinity placement index (who runs where, by 128-bit id) ------------------------------
    async def index_add(self, svc: str, lease: str, iid: str, node: str, rack: str) -> None:
        # not a transaction: two lookups in two Redis Cluster slots, each write idempotent
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(aff_svc_key(svc), iid, _dumps([node, rack]))
        pipe.hset(AFF_LEASE, lease, node)
        await pipe.execute()

    async def index_remove(self, svc: str, lease: str, iid: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(aff_svc_key(svc), iid)
        pipe.hdel(AFF_LEASE, lease)
        await pipe.execute()

    async def index_read(self, svcs: list[str], leases: list[str]) -> AffinityIndex:
        """``{"services": {uuid: [[node, rack], ...]}, "leases": {uuid: node}}`` for these ids."""
        pipe = self.r.pipeline(transaction=False)
        for svc in svcs:
            pipe.hvals(aff_svc_key(svc))
        if leases:
            pipe.hmget(AFF_LEASE, leases)
        out = await pipe.execute()
        # each service's placements sorted: the order of a hash's values is not state
        services = {svc: sorted(_json.decode(v) for v in vals) for svc, vals in zip(svcs, out[: len(svcs)], strict=True)}
        lease_nodes = dict(zip(leases, out[len(svcs)], strict=True)) if leases else {}
        return {"services": services, "leases": {k: v for k, v in lease_nodes.items() if v}}

    # -- gather ----------------------------------------------------------------------------
    async def gather_open(
        self, bid: str, gen: int, attempt: int, expected: list[str], deadline: float, ttl: int = 3600, at: int = 0,
        due: float | None = None,
    ) -> None:
        """Open a gather and set its timer (``GATHER_DUE``: the gateways' timer loop claims it when
        due; nothing about it is stored in the stream), at ``due`` when given, else at the deadline.
        ``at``: the state version the round started from, which a dry_run request asked again
        carries (``DryRunRequest.at``)."""
        key = gather_key(bid, gen, attempt)
        # not a transaction: the timer key is in another Redis Cluster slot, and every write is NX
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(key, "expected", _dumps(expected))
        pipe.hsetnx(key, "deadline", deadline)
        if at:
            pipe.hsetnx(key, "at", at)
        pipe.expire(key, ttl)
        pipe.zadd(GATHER_DUE, {due_member(bid, gen, attempt): deadline if due is None else due}, nx=True)
        await pipe.execute()

    async def gather_skip(
        self, bid: str, gen: int, attempt: int, cid: str, answer: Mapping[str, object], selection: bytes,
        deadline: float, due: float, choose: list[str], ttl: int = 3600, at: int = 0,
    ) -> tuple[bool, str, bool]:
        """A round that asks no dry_run (``workers.gateway.skip_reason``), opened and decided in one
        exchange, in this order: the gather (``gather_open``, its timer at ``due``, and the round's
        ``selection`` event, which a decider that runs again stores first), its skipped answer
        (``gather_add``), its decision (``skipped``), its outcome ``cid`` (``gather_settle``) and
        the block's CHOOSE step (``choose``: ``store.transition_args``). Every write is idempotent
        (NX, or the same value again: a redelivery redoes it; a crash leaves a prefix of it).
        Returns (this call opened the round: its selection was not there, the recorded outcome,
        the CHOOSE was done)."""
        key = gather_key(bid, gen, attempt)

        def build(pipe: Any) -> None:
            pipe.hsetnx(key, "expected", _dumps([cid]))
            pipe.hsetnx(key, "deadline", deadline)
            pipe.hsetnx(key, "at", at)
            pipe.hsetnx(key, "selection", selection)
            pipe.expire(key, ttl)
            pipe.zadd(GATHER_DUE, {due_member(bid, gen, attempt): due}, nx=True)
            pipe.evalsha(self._gather_add.sha, 1, key, cid, _dumps(answer), ttl)
            pipe.hsetnx(key, "decided", "skipped")
            pipe.evalsha(self._gather_settle.sha, 1, key, cid)
            pipe.evalsha(self._transition.sha, 1, block_key(bid), *choose)

        out = await self._pipeline(build)
        opened, outcome, (chosen, _info) = out[3], out[8], out[9]
        return bool(opened), str(outcome), bool(chosen)

    async def gather_claim_due(self, now: float, lease_s: float = 30.0, limit: int = 64) -> tuple[list[tuple[str, int, int]], float | None]:
        """Gathers whose timer is due, claimed for ``lease_s``; and when the next one is due."""
        out = await self._claim_due(keys=[GATHER_DUE], args=[now, lease_s, limit])
        nxt = float(out[-1]) if out and out[-1] != "" else None
        claimed = []
        for m in out[:-1]:
            bid, gen, attempt = m.split("|")
            claimed.append((bid, int(gen), int(attempt)))
        return claimed, nxt

    async def gather_timer(self, bid: str, gen: int, attempt: int, at: float | None, *, if_set: bool = False) -> None:
        """Move a gather's timer to ``at`` (``None``: it is done, drop it). ``if_set``: only a
        timer that is still there (a round finished meanwhile keeps none)."""
        if at is None:
            await self.r.zrem(GATHER_DUE, due_member(bid, gen, attempt))
        else:
            await self.r.zadd(GATHER_DUE, {due_member(bid, gen, attempt): at}, xx=if_set)

    async def gather_add(
        self, bid: str, gen: int, attempt: int, cid: str, result: Mapping[str, object], ttl: int = 3600
    ) -> tuple[int, int]:
        answered, expected, _, _ = await self.gather_add_state(bid, gen, attempt, cid, result, ttl)
        return answered, expected

    async def gather_add_state(
        self, bid: str, gen: int, attempt: int, cid: str, result: Mapping[str, object], ttl: int = 3600
    ) -> tuple[int, int, str | None, float]:
        """Record one cluster's answer: (answered, expected, the decision token or None, the
        deadline), all as of right after the write."""
        answered, expected, decided, deadline = await self._gather_add(
            keys=[gather_key(bid, gen, attempt)], args=[cid, _dumps(result), ttl]
        )
        return int(answered), int(expected), decided or None, float(deadline or 0)

    async def gather_read(self, bid: str, gen: int, attempt: int) -> GatherRecord:
        return _gather(await self.r.hgetall(gather_key(bid, gen, attempt)))

    async def gather_decide_read(
        self, bid: str, gen: int, attempt: int, token: str
    ) -> tuple[bool, BlockRecord | None, GatherRecord]:
        """``gather_decide``, then the block and the gather as they are after the claim, in one
        round trip: (this caller decides, the block record, the gather)."""
        key = gather_key(bid, gen, attempt)
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(key, "decided", token)
        pipe.hgetall(block_key(bid))
        pipe.hgetall(key)
        _, block, g = await pipe.execute()
        return g.get("decided") == token, _block(block), _gather(g)

    async def gather_finish(self, bid: str, gen: int, attempt: int) -> None:
        """A round whose decision is stored: its timer and its gather go (the answers it holds are
        in the ``post_dry_run`` now; a late answer finds no open round and decides nothing)."""
        pipe = self.r.pipeline(transaction=False)  # two slots on Redis Cluster: not one transaction
        pipe.zrem(GATHER_DUE, due_member(bid, gen, attempt))
        pipe.delete(gather_key(bid, gen, attempt))
        await pipe.execute()

    async def gather_decide(self, bid: str, gen: int, attempt: int, token: str) -> bool:
        """Claim the one decision of this gather (results complete vs deadline race)."""
        key = gather_key(bid, gen, attempt)
        if await self.r.hsetnx(key, "decided", token):
            return True
        return await self.r.hget(key, "decided") == token

    async def gather_settle(self, bid: str, gen: int, attempt: int, outcome: str) -> str:
        """Record the round's outcome (a cluster id, or ``!reason``) once; return the recorded one.
        A decider that runs again (redelivery) publishes what the first run decided."""
        return str(await self._gather_settle(keys=[gather_key(bid, gen, attempt)], args=[outcome]))

    # -- policy context (seed 000: an external cache shared by all workers) -----------------
    async def context_load(self, rule_id: str) -> JSONObject:
        raw = await self.r.hgetall(ctx_key(rule_id))
        return {k: _json.decode(v) for k, v in raw.items()}

    async def context_save(self, rule_id: str, changed: Mapping[str, object], deleted: Iterable[str]) -> None:
        key = ctx_key(rule_id)
        pipe = self.r.pipeline(transaction=True)
        if changed:
            pipe.hset(key, mapping={k: _dumps(v) for k, v in changed.items()})
        deleted = list(deleted)
        if deleted:
            pipe.hdel(key, *deleted)
        if changed or deleted:
            await pipe.execute()


def _gather(h: dict[str, str]) -> GatherRecord:
    g: GatherRecord = {
        "expected": _json.decode(h["expected"]) if "expected" in h else [],
        "deadline": float(h.get("deadline", 0)),
        "results": {k[2:]: _json.decode(v) for k, v in h.items() if k.startswith("r:")},
        "decided": h.get("decided"),
        "at": int(h.get("at") or 0),
    }
    if "selection" in h:
        g["selection"] = h["selection"]
    return g
