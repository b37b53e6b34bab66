"""The door to the health checker's volatile state in Redis (docs/health.md):

* the executors' **passive counts** per block: one hash field per executor (its id), a JSON of
  ``{iid: {ok, errors, timeouts, consecutive_errors, ejections, ejected, inflight, stalled_s, ...}}``
  and the time it was written; readers keep fields younger than a TTL and merge them;
* the checker's **lease** per block: one checker copy decides a block's verdicts at a time
  (the same take-or-keep script as the metrics collector's lease);
* the **rate limit** of recorded tick failures (one ``block.health.failed`` per reason per period);
* the **suspect nodes**: nodes every probed instance of which fails its probes, marked by the
  checker until a time (renewed while it holds), cleared by a passing probe or a heartbeat that
  resumes; placements leave them out (docs/health.md "Suspect nodes").

Nothing here is rebuilt from the stream: it is measured again within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TypedDict, cast

import msgspec

from ..schemas.records import PassiveCounts
from .keys import HEARTBEATS, SUSPECT, health_failed_key, health_lease_key, health_passive_key
from .scripts import LEASE

_json = msgspec.json


class SuspectMark(TypedDict):
    """A suspect node's mark (``mark_suspect``): since when, until when (s), why."""

    since: float
    until: float
    reason: str


class HealthStore:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)

    async def write_passive(self, holder: str, per_block: dict[str, dict[str, PassiveCounts]], ttl_s: float) -> None:
        """One executor's counts of each block it routes (``per_block``: bid -> iid -> counts)."""
        if not per_block:
            return
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        for bid, insts in per_block.items():
            key = health_passive_key(bid)
            pipe.hset(key, holder, _json.encode({"t": now, "instances": insts}).decode())
            pipe.expire(key, max(1, int(ttl_s)))
        await pipe.execute()

    async def passive(self, bid: str, max_age_s: float) -> dict[str, list[PassiveCounts]]:
        """Every fresh executor's counts of the block's instances: iid -> [counts, one per executor]."""
        raw = await self.r.hgetall(health_passive_key(bid))
        now = time.time()
        out: dict[str, list[PassiveCounts]] = {}
        for v in raw.values():
            try:
                d = _json.decode(v)
            except msgspec.DecodeError:
                continue
            if not isinstance(d, dict) or now - float(d.get("t", 0)) > max_age_s:
                continue
            for iid, counts in (d.get("instances") or {}).items():
                if isinstance(counts, dict):  # as an executor wrote them (``write_passive``)
                    out.setdefault(iid, []).append(cast(PassiveCounts, counts))
        return out

    async def lead(self, bid: str, holder: str, ttl_s: float) -> bool:
        """Take or keep the lease on deciding ``bid``: one checker copy a block at a time."""
        return bool(await self._lease(keys=[health_lease_key(bid)], args=[holder, max(1, int(ttl_s * 1000))]))

    async def should_record(self, bid: str, reason_key: str, period_s: float) -> bool:
        """True at most once per ``period_s`` for one (block, reason): the rate limit of recorded
        tick failures (a policy that fails every tick is one event a minute, not one a second)."""
        key = health_failed_key(bid)
        now = time.time()
        last = await self.r.hget(key, reason_key)
        if last is not None and now - float(last) < period_s:
            return False
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, reason_key, str(now))
        pipe.expire(key, max(1, int(period_s * 2)))
        await pipe.execute()
        return True

    # -- suspect nodes -------------------------------------------------------------------------
    async def last_heartbeats(self, nodes: list[str]) -> dict[str, float | None]:
        """When each node's last heartbeat was recorded (None: it never sent one)."""
        if not nodes:
            return {}
        return {n: None if v is None else float(v) for n, v in zip(nodes, await self.r.zmscore(HEARTBEATS, nodes), strict=True)}

    async def mark_suspect(self, marks: dict[str, str], ttl_s: float) -> list[str]:
        """Mark (or renew) ``marks`` (node -> why) suspect for ``ttl_s``; a node already suspect
        keeps its ``since``. Returns the nodes newly marked."""
        if not marks:
            return []
        now = time.time()
        nodes = sorted(marks)
        old = dict(zip(nodes, await self.r.hmget(SUSPECT, nodes), strict=True))
        new: list[str] = []
        fields: dict[str, str] = {}
        for nid in nodes:
            prev = _decode(old[nid])
            live = prev is not None and float(prev.get("until", 0)) > now
            if not live:
                new.append(nid)
            since = float(prev["since"]) if live and prev is not None else now
            fields[nid] = _json.encode({"since": round(since, 3), "until": round(now + ttl_s, 3), "reason": marks[nid][:500]}).decode()
        await self.r.hset(SUSPECT, mapping=fields)
        return new

    async def clear_suspect(self, nodes: list[str]) -> list[str]:
        """Clear the marks of ``nodes``; returns those that were marked."""
        if not nodes:
            return []
        held = [n for n, v in zip(nodes, await self.r.hmget(SUSPECT, nodes), strict=True) if v is not None]
        if held:
            await self.r.hdel(SUSPECT, *held)
        return held

    async def suspects(self, read: Mapping[str, str] | None = None) -> dict[str, SuspectMark]:
        """The nodes suspect now: nid -> {since, until, reason}. Lapsed marks are dropped.
        ``read``: the marks' hash as the caller read it (``SUSPECT``), else read here."""
        now = time.time()
        out: dict[str, SuspectMark] = {}
        lapsed: list[str] = []
        for nid, raw in (read if read is not None else await self.r.hgetall(SUSPECT)).items():
            d = _decode(raw)
            if d is None or float(d.get("until", 0)) <= now:
                lapsed.append(nid)
            else:
                out[nid] = d
        if lapsed:
            await self.r.hdel(SUSPECT, *lapsed)
        return out


def _decode(raw: str | None) -> SuspectMark | None:
    if raw is None:
        return None
    try:
        d = _json.decode(raw)
    except msgspec.DecodeError:
        return None
    return cast(SuspectMark, d) if isinstance(d, dict) else None  # (as ``mark_suspect`` wrote it)
