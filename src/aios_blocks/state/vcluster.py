"""Virtual clusters in Redis (seed 003): records, node places, and the one atomic commit.

All keys of a cluster's virtual clusters carry the cluster's hash tag (``{c:<cid>}``): the records,
the set of ids, every node hash (whose ``vc`` field is the node's place) and the cluster's state
index. So one Lua script (``VC_COMMIT``) re-checks and applies a whole change at once, also on
Redis Cluster: revisions (optimistic concurrency), each node still where the plan found it, idle
and alive where the plan needs it. A change is applied whole or not at all.

``aios:vcindex`` (vid -> cid, another slot) is claimed before a create (``HSETNX``), dropped
when the create is refused and after a remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import msgspec

from ..schemas.vcluster import NodeMove, RecordWrite, VClusterRecord
from .keys import VC_INDEX, index_key, node_key, vc_key, vc_outbox_key, vc_set_key
from .store import Store

_rec = msgspec.json.Decoder(VClusterRecord)
_enc = msgspec.json.Encoder()

# KEYS: [the cluster's state index, its vc id set, its outbox, record keys..., node keys...]
# ARGV[1]: JSON {recs: [{k, vid, expect, put}], moves: [{k, node, from, to, idle, alive}], oid, out}
#   oid/out: the outbox entry (the change's events, published after the commit; "" = none),
#   stored as "<index>|<out>" in the same step (a transactional outbox)
#   expect: -1 the record must not exist; n >= 0 its revision must be n; absent: no check
#   put: the new record's JSON ("" = delete it)
#   from/to: the node's place before/after ("" = the primary); idle: nothing reserved on it;
#   alive: healthy
# Returns {1, "ok", "", the cluster's state index after it} or {0, kind, detail, current revision}:
# kind "revision" | "node". The index orders a cluster's changes (the fold applies them in it).
VC_COMMIT = r"""
local a = cjson.decode(ARGV[1])
for _, r in ipairs(a.recs) do
  if r.expect ~= nil then
    local cur = redis.call('GET', KEYS[r.k])
    if r.expect == -1 then
      if cur then
        return {0, 'revision', 'virtual cluster ' .. r.vid .. ' exists', cjson.decode(cur).revision}
      end
    else
      if not cur then return {0, 'revision', 'virtual cluster ' .. r.vid .. ' does not exist', 0} end
      local rev = cjson.decode(cur).revision
      if rev ~= r.expect then
        return {0, 'revision', 'virtual cluster ' .. r.vid .. ' is at revision ' .. rev .. ', not ' .. r.expect, rev}
      end
    end
  end
end
for _, m in ipairs(a.moves) do
  local nk = KEYS[m.k]
  if redis.call('EXISTS', nk) == 0 then return {0, 'node', 'node ' .. m.node .. ' does not exist', 0} end
  local place = redis.call('HGET', nk, 'vc') or ''
  if place ~= m.from then
    local where = place == '' and 'the primary' or place
    return {0, 'node', 'node ' .. m.node .. ' is now in ' .. where, 0}
  end
  if m.alive and redis.call('HGET', nk, 'healthy') ~= '1' then
    return {0, 'node', 'node ' .. m.node .. ' is not healthy', 0}
  end
  if m.idle then
    local h = redis.call('HGETALL', nk)
    for i = 1, #h, 2 do
      local f, v = h[i], h[i+1]
      if (f == 'cpu_used' or f == 'mem_used' or string.match(f, '^g:.*:n$')) and math.abs(tonumber(v) or 0) > 1e-9 then
        return {0, 'node', 'node ' .. m.node .. ' is not idle (' .. f .. ' ' .. v .. ')', 0}
      end
    end
  end
end
for _, r in ipairs(a.recs) do
  if r.put == '' then
    redis.call('DEL', KEYS[r.k])
    redis.call('SREM', KEYS[2], r.vid)
  else
    redis.call('SET', KEYS[r.k], r.put)
    redis.call('SADD', KEYS[2], r.vid)
  end
end
for _, m in ipairs(a.moves) do
  if m.to == '' then redis.call('HDEL', KEYS[m.k], 'vc') else redis.call('HSET', KEYS[m.k], 'vc', m.to) end
end
local idx = redis.call('INCR', KEYS[1])
if a.oid ~= '' then redis.call('HSET', KEYS[3], a.oid, idx .. '|' .. a.out) end
return {1, 'ok', '', idx}
"""


class _RecordWrite(TypedDict):
    """One record write as ``VC_COMMIT`` takes it: its key's index, the virtual cluster, the new
    record's JSON ("" removes it) and the revision it expects."""

    k: int
    vid: str
    put: str
    expect: NotRequired[int]


@dataclass(frozen=True)
class CommitResult:
    ok: bool
    kind: str = ""  # "revision" | "node"
    reason: str = ""
    revision: int = 0
    #: the cluster's state index after the change (orders changes; ``VClusterChanged.index``)
    index: int = 0


class VClusterStore:
    """The virtual clusters' door to Redis (on top of the store's connection)."""

    def __init__(self, store: Store):
        self.store = store
        self.r: Any = store.r
        self._commit = self.r.register_script(VC_COMMIT)

    async def ids(self, cid: str) -> list[str]:
        return sorted(await self.r.smembers(vc_set_key(cid)))

    async def records(self, cid: str) -> dict[str, VClusterRecord]:
        """Every virtual cluster of ``cid`` (one slot: a set and its records)."""
        ids = await self.ids(cid)
        if not ids:
            return {}
        raws = await self.r.mget([vc_key(cid, v) for v in ids])
        return {v: _rec.decode(raw) for v, raw in zip(ids, raws, strict=True) if raw}

    async def get(self, vid: str) -> VClusterRecord | None:
        cid = await self.cluster_of(vid)
        if cid is None:
            return None
        raw = await self.r.get(vc_key(cid, vid))
        return _rec.decode(raw) if raw else None

    async def cluster_of(self, vid: str) -> str | None:
        return await self.r.hget(VC_INDEX, vid)

    async def index(self) -> dict[str, str]:
        return dict(await self.r.hgetall(VC_INDEX))

    async def claim(self, vid: str, cid: str) -> str:
        """Claim ``vid`` for ``cid`` in the index; returns the cluster that holds it now (``cid``
        when the claim is ours). A claim of another cluster is never taken over, even without its
        record: that create may be committing now (a claim left by a crash before the commit
        keeps the id in that cluster; creating it there again works)."""
        if await self.r.hsetnx(VC_INDEX, vid, cid):
            return cid
        holder = await self.r.hget(VC_INDEX, vid)
        if holder is None:
            return cid if await self.r.hsetnx(VC_INDEX, vid, cid) else str(await self.r.hget(VC_INDEX, vid))
        return str(holder)

    async def release_claim(self, vid: str, cid: str) -> None:
        """Drop the index entry of ``vid`` if it names ``cid`` and the record is gone."""
        if await self.r.hget(VC_INDEX, vid) == cid and not await self.r.exists(vc_key(cid, vid)):
            await self.r.hdel(VC_INDEX, vid)

    async def commit(self, cid: str, writes: list[RecordWrite], moves: list[NodeMove], outbox: tuple[str, str] = ("", "")
                     ) -> CommitResult:
        """Apply record writes and node moves atomically (``VC_COMMIT``), or nothing; with them,
        ``outbox`` (an id, the change's events as JSON) for ``outbox_done`` / ``outbox_pending``."""
        keys = [index_key(cid), vc_set_key(cid), vc_outbox_key(cid)]
        recs, mv = [], []
        for w in writes:
            keys.append(vc_key(cid, w.vid))
            entry: _RecordWrite = {"k": len(keys), "vid": w.vid, "put": _enc.encode(w.record).decode() if w.record else ""}
            if w.expect is not None:
                entry["expect"] = w.expect
            recs.append(entry)
        for m in moves:
            keys.append(node_key(cid, m.node))
            mv.append({"k": len(keys), "node": m.node, "from": m.src, "to": m.dst, "idle": m.idle, "alive": m.alive})
        arg = _enc.encode({"recs": recs, "moves": mv, "oid": outbox[0], "out": outbox[1]}).decode()
        ok, kind, reason, n = await self._commit(keys=keys, args=[arg])
        if ok:
            return CommitResult(True, index=int(n))
        return CommitResult(False, str(kind), str(reason), int(n or 0))

    async def outbox_done(self, cid: str, oid: str) -> None:
        await self.r.hdel(vc_outbox_key(cid), oid)

    async def outbox_pending(self, cid: str) -> dict[str, tuple[int, str]]:
        """oid -> (the cluster index of the change, its events' JSON): committed, not published."""
        out = {}
        for oid, raw in (await self.r.hgetall(vc_outbox_key(cid))).items():
            idx, _, events = raw.partition("|")
            out[oid] = (int(idx), events)
        return out

    async def index_of(self, cid: str) -> int:
        return int(await self.r.get(index_key(cid)) or 0)
