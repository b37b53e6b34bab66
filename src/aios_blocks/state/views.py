"""Read-only views for the command line's listings, over one Redis connection and a light import
graph (redis-py, the key grammar): ``blocks list`` answers without loading the workers' store
(its Lua scripts, the settings model, the spec models) or connecting to NATS.

Every key is built by ``state.keys``, as in ``state.store``.
"""

from __future__ import annotations

from typing import Any

from .keys import BLOCKS, block_key, inst_key

#: the block record's fields a listing shows (the rest, the IR first, is ``blocks get``'s)
LIST_FIELDS = ("status", "cluster", "reason", "gen")


def open_reader(url: str) -> Any:
    """A client for ``url`` (``decode_responses=True``; the caller closes it: ``aclose()``). A Redis
    Cluster (``redis+cluster://``) gets the workers' cluster client."""
    if "+cluster" in url.split("://", 1)[0].lower():
        from ..settings import current
        from .connection import open_redis

        return open_redis(url, current(), 2)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, decode_responses=True, driver_info=None)


async def _replies(pipe: Any) -> list[Any]:
    """A pipeline's replies; a server that does not answer is a ``ConnectionError`` (one line in
    the CLI), not a redis-py traceback."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        return list(await pipe.execute())
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise ConnectionError(f"cannot connect to Redis: {exc}") from exc


async def block_rows(r: Any, limit: int = 100) -> list[dict[str, Any]]:
    """The newest ``limit`` blocks, newest first, as ``{"id", "status", "cluster", "reason", "gen",
    "instances"}`` (instances: how many instance records it has), in two round trips."""
    pipe = r.pipeline(transaction=False)
    pipe.zrevrange(BLOCKS, 0, limit - 1)
    (bids,) = await _replies(pipe)
    if not bids:
        return []
    pipe = r.pipeline(transaction=False)
    for bid in bids:
        pipe.hmget(block_key(bid), *LIST_FIELDS)
        pipe.hlen(inst_key(bid))
    replies = await _replies(pipe)
    rows = []
    for bid, values, n in zip(bids, replies[::2], replies[1::2], strict=True):
        row: dict[str, Any] = {"id": bid, **dict(zip(LIST_FIELDS, values, strict=True)), "instances": n}
        row["status"] = row["status"] or "?"  # listed but its record gone (being deleted)
        row["gen"] = int(row["gen"]) if row["gen"] else None
        rows.append(row)
    return rows
