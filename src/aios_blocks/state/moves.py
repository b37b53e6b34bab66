"""The door to make-before-break moves' claims in Redis (docs/rebalance.md).

A move is claimed in its block's hash ``aios:meta:{b:<bid>}:moves`` (move id -> JSON record,
``handlers.moves.MoveRecord``) by one atomic script that also counts the block's disruption budget
(its moves open now) and refuses a second move of an instance already moving. The record's phase
only moves forward (compare-and-set); a finished move's record stays a while (``keep_s``) so a
request delivered again is still one move. The cluster's rate limit is a sorted set of the moves
started in the window. Volatile state (``aios:meta:``): outside the digest, not rebuilt from the
stream; an open move whose record is lost is finished by its instances' facts like any instance.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .keys import MOVES_DUE, move_key, move_rate_key

_json = msgspec.json

#: claim: KEYS[1] the block's moves; ARGV move id, record JSON, budget, instance id, now, keep_s
#: -> {'ok'|'exists'|'moving'|'budget', detail}; finished records older than keep_s are pruned
CLAIM = r"""
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then return {'exists', cur} end
local all = redis.call('HGETALL', KEYS[1])
local active = 0
local now, keep = tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 1, #all, 2 do
  local r = cjson.decode(all[i + 1])
  if r.phase == 'claimed' or r.phase == 'started' or r.phase == 'switched' then
    active = active + 1
    if r.old == ARGV[4] then return {'moving', r.move_id} end
  elseif (tonumber(r.finished_at) or 0) < now - keep then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
if active >= tonumber(ARGV[3]) then return {'budget', tostring(active)} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {'ok', ''}
"""

#: a phase change: KEYS[1] the block's moves; ARGV move id, expected phases (comma list), record
#: JSON -> the record now (JSON; the new one when it was in an expected phase), '' when none
ADVANCE = r"""
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return '' end
local r = cjson.decode(cur)
for p in string.gmatch(ARGV[2], '[^,]+') do
  if r.phase == p then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
    return ARGV[3]
  end
end
return cur
"""

#: the rate limit: KEYS[1] the cluster's recent moves; ARGV move id, now, window, limit -> 1 taken
#: (or already held by this move), 0 over the limit
RATE = r"""
local now, window = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.floor(window * 1000) + 1000)
return 1
"""


class MoveStore:
    def __init__(self, r: Any):
        self.r = r
        self._claim = r.register_script(CLAIM)
        self._advance = r.register_script(ADVANCE)
        self._rate = r.register_script(RATE)

    async def get(self, bid: str, mid: str) -> dict[str, Any] | None:
        raw = await self.r.hget(move_key(bid), mid)
        return _json.decode(raw) if raw else None

    async def of_block(self, bid: str) -> dict[str, dict[str, Any]]:
        """Every move record of the block (open and lately finished), by move id."""
        return {k: _json.decode(v) for k, v in (await self.r.hgetall(move_key(bid))).items()}

    async def claim(self, rec: dict[str, Any], budget: int, now: float, keep_s: float) -> tuple[str, str]:
        """Claim move ``rec`` within its block's budget: ('ok', ''), ('exists', the record's JSON),
        ('moving', the move of that instance) or ('budget', how many are open)."""
        out = await self._claim(keys=[move_key(rec["block_id"])],
                                args=[rec["move_id"], _json.encode(rec), str(int(budget)), rec["old"], repr(now), repr(keep_s)])
        word, detail = (x.decode() if isinstance(x, bytes) else str(x) for x in out)
        return word, detail

    async def tombstone(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Record a move refused before it was claimed (``HSETNX``): a redelivery finds it decided.
        The record now (another delivery's, if it was first)."""
        key = move_key(rec["block_id"])
        if await self.r.hsetnx(key, rec["move_id"], _json.encode(rec)):
            return rec
        return await self.get(rec["block_id"], rec["move_id"]) or rec

    async def advance(self, rec: dict[str, Any], expected: tuple[str, ...]) -> tuple[bool, dict[str, Any] | None]:
        """Write ``rec`` if its stored phase is one of ``expected``: (written, the record now)."""
        new = _json.encode(rec)
        out = await self._advance(keys=[move_key(rec["block_id"])], args=[rec["move_id"], ",".join(expected), new])
        raw = out.encode() if isinstance(out, str) else out
        if not raw:
            return False, None
        return raw == new, _json.decode(raw)

    async def take_rate(self, cid: str, mid: str, now: float, window_s: float, limit: int) -> bool:
        return bool(await self._rate(keys=[move_rate_key(cid)], args=[mid, repr(now), repr(window_s), str(int(limit))]))

    async def give_rate(self, cid: str, mid: str) -> None:
        await self.r.zrem(move_rate_key(cid), mid)

    # -- the sweep's index (another slot: written after the record, read as a hint) ----------------
    async def due(self, bid: str, mid: str, at: float) -> None:
        await self.r.zadd(MOVES_DUE, {f"{bid}|{mid}": at})

    async def undue(self, bid: str, mid: str) -> None:
        await self.r.zrem(MOVES_DUE, f"{bid}|{mid}")

    async def overdue(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        """Open moves whose time is up (block id, move id)."""
        out = []
        for m in await self.r.zrangebyscore(MOVES_DUE, "-inf", now, start=0, num=limit):
            bid, _, mid = (m.decode() if isinstance(m, bytes) else m).partition("|")
            out.append((bid, mid))
        return out
