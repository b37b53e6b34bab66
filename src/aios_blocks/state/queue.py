"""The pending queue in Redis (docs/priority.md): one sorted set per scope (a virtual cluster, or
``_`` for the primary's nodes), ordered by priority (highest first) then by since when the block
waits (oldest first), so a capacity event reads the head of each scope's queue: O(k), never the
whole queue. The keys are under ``aios:meta:`` (scratch, like the gathers: not in the state
digest): they index the blocks whose record says ``pending``, and ``blocks recover`` rebuilds them
from those (``image``; the fold calls it).

    aios:meta:queue:q:<scope> zset: "<since ms, 15 digits>:<bid>" -> -priority (ties: oldest first)
    aios:meta:queues          set of the scopes that have had a queue
    aios:meta:queue:index     hash bid -> JSON [scope, member] (to take a block out in O(1))
    aios:meta:queue:due       zset bid -> when it fails if still waiting (maxPendingS)
    aios:meta:queue:lease     the controller copy whose queue walker runs now (one at a time)
    aios:meta:queue:wake      pub/sub channel: a capacity event another controller copy saw
                              (``Wakeups``: the leader's walker passes at once)
    aios:meta:queue:nominated hash bid -> JSON {gen, nodes, until}: preemptors retried, not placed
                              yet, whose freed room is held for them, and short ready blocks'
                              missing instances (``Nominations``)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from ..schemas.records import BlockIR
from .keys import P
from .scripts import LEASE

PREFIX = f"{P}:meta:queue:"
SCOPES = f"{P}:meta:queues"
INDEX = f"{PREFIX}index"
DUE = f"{PREFIX}due"
LEASE_KEY = f"{PREFIX}lease"
WAKE = f"{PREFIX}wake"
NOMINATED = f"{PREFIX}nominated"
PRIMARY = "_"


def scope_of(ir: BlockIR) -> str:
    """The queue a block waits in: its virtual cluster's, else the primary's."""
    return str(ir.get("virtualClusterId") or PRIMARY)


def queue_key(scope: str) -> str:
    return f"{PREFIX}q:{scope}"


def member(bid: str, since: float) -> str:
    """Equal priorities (equal scores) sort by member: the oldest first."""
    return f"{round(since * 1000):015d}:{bid}"


def bid_of(m: str) -> str:
    return m.split(":", 1)[1]


def image(rows: Iterable[tuple[str, str, int, float, float]]) -> dict[str, Any]:
    """The keys for these pending blocks (bid, scope, priority, since, deadline): what ``add``
    leaves, as a recovery image (zsets as ``{member: score}``, marked by the caller)."""
    out: dict[str, Any] = {}
    for bid, scope, priority, since, deadline in rows:
        m = member(bid, since)
        out.setdefault(queue_key(scope), {})[m] = float(-priority)
        out.setdefault(SCOPES, set()).add(scope)
        out.setdefault(INDEX, {})[bid] = msgspec.json.encode([scope, m]).decode()
        if deadline:
            out.setdefault(DUE, {})[bid] = float(deadline)
    return out


class PendingQueue:
    def __init__(self, r: Any):
        self.r = r
        self._lease = r.register_script(LEASE)

    async def add(self, bid: str, scope: str, priority: int, since: float, deadline: float) -> None:
        """Put (or keep) the block in its scope's queue; idempotent (a redelivery adds it again)."""
        m = member(bid, since)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(queue_key(scope), {m: float(-priority)})
        pipe.sadd(SCOPES, scope)
        pipe.hset(INDEX, bid, msgspec.json.encode([scope, m]).decode())
        if deadline:
            pipe.zadd(DUE, {bid: float(deadline)})
        else:
            pipe.zrem(DUE, bid)
        await pipe.execute()

    async def remove(self, bid: str) -> None:
        """Take the block out (placed, retried, deleted, failed); idempotent."""
        raw = await self.r.hget(INDEX, bid)
        pipe = self.r.pipeline(transaction=False)
        if raw:
            scope, m = msgspec.json.decode(raw)
            pipe.zrem(queue_key(scope), m)
        pipe.hdel(INDEX, bid)
        pipe.zrem(DUE, bid)
        await pipe.execute()

    async def scopes(self) -> list[str]:
        return sorted(str(s) for s in await self.r.smembers(SCOPES))

    async def head(self, scope: str, k: int) -> list[str]:
        """The first ``k`` blocks of the scope's queue, in order (none for ``k`` <= 0: ZRANGE 0 -1 is
        the whole queue, so the first block was 'behind' itself)."""
        if k <= 0:
            return []
        return [bid_of(str(m)) for m in await self.r.zrange(queue_key(scope), 0, k - 1)]

    async def ahead(self, scope: str, priority: int) -> int:
        """How many blocks a new block of ``priority`` would wait behind (equal or higher: older)."""
        return int(await self.r.zcount(queue_key(scope), "-inf", float(-priority)))

    async def due(self, now: float, limit: int = 100) -> list[str]:
        """Blocks whose wait is over (``maxPendingS``), the longest over first."""
        return [str(b) for b in await self.r.zrangebyscore(DUE, "-inf", now, start=0, num=limit)]

    async def position(self, bid: str) -> tuple[str, int, int] | None:
        """(scope, 1-based place, queue length) of a waiting block; None when it waits nowhere."""
        raw = await self.r.hget(INDEX, bid)
        if not raw:
            return None
        scope, m = msgspec.json.decode(raw)
        rank = await self.r.zrank(queue_key(scope), m)
        if rank is None:
            return None
        return scope, int(rank) + 1, int(await self.r.zcard(queue_key(scope)))

    async def all(self) -> list[tuple[str, str, int]]:
        """Every waiting block: (bid, scope, place), each scope's queue in order (``blocks list
        --pending``: reads the whole queue, unlike a capacity event)."""
        out = []
        for scope in await self.scopes():
            for i, m in enumerate(await self.r.zrange(queue_key(scope), 0, -1)):
                out.append((bid_of(str(m)), scope, i + 1))
        return out

    async def lead(self, holder: str, ttl_s: float) -> bool:
        """Take or keep the walker's lease: one controller copy walks the queue at a time."""
        return bool(await self._lease(keys=[LEASE_KEY], args=[holder, max(1, int(ttl_s * 1000))]))


class Wakeups:
    """Capacity events across controller copies (docs/priority.md "Event-driven re-placement"):
    the copy that handled one but does not hold the walker's lease publishes on ``WAKE`` (Redis
    pub/sub: fire and forget, nothing stored), and every walker listening wakes, so the leader's
    passes at once instead of at its next periodic pass. A message missed (a listener
    reconnecting) is covered by that periodic pass."""

    def __init__(self, r: Any):
        self.r = r

    async def notify(self, sender: str) -> int:
        """Wake the other copies' walkers; how many listeners got it."""
        return int(await self.r.publish(WAKE, sender))

    async def listen(self, me: str, on_wake: Callable[[], None], stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """Call ``on_wake`` for each notice another copy (not ``me``) sends, until ``stop``."""
        ps = self.r.pubsub(ignore_subscribe_messages=True)
        try:
            await ps.subscribe(WAKE)
            while not stop.is_set():
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=poll_s)
                if msg is None:
                    continue
                data = msg.get("data")
                if (data.decode() if isinstance(data, bytes) else str(data)) != me:
                    on_wake()
        finally:
            with contextlib.suppress(Exception):
                await ps.unsubscribe(WAKE)
            with contextlib.suppress(Exception):
                await ps.aclose()


def plan_key(bid: str) -> str:
    """A preemptor's claimed plan (``aios:meta:{b:<bid>}:preempt``: live state, like the other
    per-block claims, left out of the digest; it expires with the preemptor's hold)."""
    return f"{P}:meta:{{b:{bid}}}:preempt"


class PreemptPlans:
    """One preemption per block, on any controller copy: the plan is claimed (SET NX PX) before the
    preemptor is marked and the victims evicted, so a copy that comes second, or one restarted after a
    SIGKILL mid-way, carries out the same plan (the same request id: the stream drops what was
    already published) instead of choosing victims again."""

    def __init__(self, r: Any):
        self.r = r

    async def claim(self, bid: str, plan: Mapping[str, object], ttl_s: float) -> bool:
        return bool(await self.r.set(plan_key(bid), msgspec.json.encode(plan), nx=True, px=max(1, int(ttl_s * 1000))))

    async def get(self, bid: str) -> dict[str, Any] | None:
        raw = await self.r.get(plan_key(bid))
        return msgspec.json.decode(raw) if raw else None

    async def finish(self, bid: str, plan: Mapping[str, object]) -> None:
        """The plan carried out to the end (kept, with its expiry, so it is not carried out again)."""
        await self.r.set(plan_key(bid), msgspec.json.encode(plan), xx=True, keepttl=True)

    async def drop(self, bid: str) -> None:
        await self.r.delete(plan_key(bid))


class Nominations:
    """The room a preemption freed, held for its preemptor from its retry until it is placed
    (kube-scheduler's nominatedNodeName; ``handlers.queue.Nominee``), and the room moves make for
    a waiting block, from their request (``moves``): one hash field per block (its generation,
    the nodes its victims were on or its moves leave, until when). Live state, left out
    of the digest; a field whose block moved on is dropped by the walker that reads it."""

    def __init__(self, r: Any):
        self.r = r

    async def nominate(self, bid: str, gen: int, nodes: Iterable[str], until: float, moves: bool = False,
                       replaces: str = "", short: bool = False) -> None:
        """``moves``: the room is what moves for a block still waiting free (the rebalancer's,
        docs/rebalance.md): held while it is ``pending`` too, not only on its way through selection.
        ``replaces``: the instance of a ``ready`` block that runs nowhere (lost, failed) and whose
        replacement fits nowhere beside its reservation: the room it frees is held for the block's
        missing instances while it is short (``workers.queue.nominees``). ``short``: the room a short
        ready block's missing instances fit in (its preemption freed it, or it was free) while the
        walker's ask for them places them: held the same way."""
        doc: dict[str, Any] = {"gen": gen, "nodes": sorted(nodes), "until": until}
        if moves:
            doc["moves"] = True
        if replaces:
            doc["replaces"] = replaces
        if short:
            doc["short"] = True
        await self.r.hset(NOMINATED, bid, msgspec.json.encode(doc))

    async def all(self) -> dict[str, dict[str, Any]]:
        return self.decode(await self.r.hgetall(NOMINATED))

    @staticmethod
    def decode(raw: Mapping[Any, Any]) -> dict[str, dict[str, Any]]:
        """The nominations of the hash ``NOMINATED`` as read."""
        return {(k.decode() if isinstance(k, bytes) else str(k)): msgspec.json.decode(v) for k, v in raw.items()}

    async def drop(self, bid: str) -> bool:
        """Placed, waiting again, gone or expired: the room is everybody's; True if it was held."""
        return bool(await self.r.hdel(NOMINATED, bid))
