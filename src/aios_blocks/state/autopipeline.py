"""Auto-pipelining for one Redis server: the commands that a process's concurrent handlers issue
in the same turn of the event loop go to Redis as one pipeline (one write, one read event on the
server), the way ioredis' ``enableAutoPipelining`` and Lettuce do.

Why: a worker runs a fetched batch's handlers concurrently, and each awaits a few Redis calls of
its own. Sent one by one, a burst of 64 handlers costs 64 writes, 64 server wake-ups and 64
replies per step; on this machine (a VM where every socket write and wake-up is costly) that was
the largest share of every worker's CPU. Gathered, it is one of each.

Semantics are unchanged: each command (or script) is still atomic on its own, a caller's commands
still run in the order it awaits them, and a non-transactional pipeline a caller builds
(``Store._pipeline``) joins the gathered one as a group, in order. Transactions (MULTI/EXEC) and
anything that holds a connection (pub/sub, MONITOR, blocking commands) go to the server as
before. Each command's reply (or error) reaches only its own caller. Redis Cluster clients are
not wrapped (their pipelines route per slot).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

#: commands that hold their connection, or change its state: never gathered
DIRECT = frozenset({
    "BLPOP", "BRPOP", "BLMOVE", "BRPOPLPUSH", "BZPOPMIN", "BZPOPMAX", "BLMPOP", "BZMPOP", "XREAD", "XREADGROUP",
    "WAIT", "WAITAOF", "SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "MONITOR", "MULTI", "EXEC", "DISCARD", "WATCH",
    "UNWATCH", "SELECT", "AUTH", "HELLO", "CLIENT", "QUIT", "RESET", "SHUTDOWN",
})
#: commands gathered into one pipeline at most (the rest go in the next one)
MAX_BATCH = 512

_Command = tuple[tuple[Any, ...], Any]  # (args, options)
_Item = tuple[list[_Command], "asyncio.Future[list[Any]]"]


class AutoPipelineRedis(aioredis.Redis):
    """``redis.asyncio.Redis`` whose commands are gathered per event-loop turn (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queued: list[_Item] = []
        self._queued_commands = 0
        self._flush_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper() if args else ""
        if name in DIRECT or name.split(" ", 1)[0] in DIRECT:
            return await super().execute_command(*args, **options)
        (result,) = await self._submit([(args, options)])
        if isinstance(result, Exception):
            raise result
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        if transaction or shard_hint is not None:
            return super().pipeline(transaction, shard_hint)
        return _GatheredPipeline(self)

    def _submit(self, commands: list[_Command]) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        self._queued.append((commands, fut))
        self._queued_commands += len(commands)
        if self._flush_task is None:
            # runs once every handler made ready in this turn has queued its command
            self._flush_task = loop.create_task(self._flush())
        return fut

    async def _flush(self) -> None:
        self._flush_task = None
        while self._queued:
            take, n = 0, 0
            while take < len(self._queued) and (n == 0 or n + len(self._queued[take][0]) <= MAX_BATCH):
                n += len(self._queued[take][0])
                take += 1
            batch, self._queued = self._queued[:take], self._queued[take:]
            self._queued_commands -= n
            if self._queued:  # more than one pipeline's worth: send this one, carry on at once
                task = asyncio.get_running_loop().create_task(self._send(batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                await self._send(batch)

    async def _send(self, batch: list[_Item]) -> None:
        pipe = Pipeline(self.connection_pool, self.response_callbacks, False, None)
        for commands, _fut in batch:
            for args, options in commands:
                Pipeline.execute_command(pipe, *args, **options)
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # the connection failed: every caller gets the error
            for _commands, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        i = 0
        for commands, fut in batch:
            part = list(results[i:i + len(commands)])
            i += len(commands)
            if not fut.done():
                fut.set_result(part)


class _GatheredPipeline(Pipeline):
    """A non-transactional pipeline that joins its client's gathered one as a group, in order."""

    def __init__(self, client: AutoPipelineRedis) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, False, None)
        self._client = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = self.command_stack
        if not stack:
            return []
        self.command_stack = []
        results = await self._client._submit([(args, options) for args, options in stack])
        if raise_on_error:
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results
