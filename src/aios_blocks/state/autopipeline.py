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
import contextlib
import hashlib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import EMPTY_RESPONSE, NEVER_DECODE, Pipeline
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: commands that hold their connection, or change its state: never gathered
DIRECT = frozenset({
    "BLPOP", "BRPOP", "BLMOVE", "BRPOPLPUSH", "BZPOPMIN", "BZPOPMAX", "BLMPOP", "BZMPOP", "XREAD", "XREADGROUP",
    "WAIT", "WAITAOF", "SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "MONITOR", "MULTI", "EXEC", "DISCARD", "WATCH",
    "UNWATCH", "SELECT", "AUTH", "HELLO", "CLIENT", "QUIT", "RESET", "SHUTDOWN",
})
#: commands gathered into one pipeline at most (the rest go in the next one)
MAX_BATCH = 512
#: connections kept aside for gathered pipelines
KEEP_CONNECTIONS = 4
#: gathered pipelines in flight at once: the commands queued meanwhile wait for one to come back
#: and go together in the next, so a loaded process sends fewer, larger pipelines (each exchange
#: is a write and a read of the socket, costly on a VM) while an idle one sends at once
MAX_INFLIGHT = 1

_hiredis_pack: Any
try:  # hiredis (a dependency) packs a command in C: ~0.7 us against redis-py's ~4 us in Python
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is a dependency
    _hiredis_pack = None

_Command = tuple[tuple[Any, ...], Any]  # (args, options)
_Item = tuple[list[_Command], "asyncio.Future[list[Any]]"]


def pack(conn: Connection, commands: list[tuple[Any, ...]]) -> bytes | list[bytes]:
    """The commands in the Redis protocol, as ``conn.pack_commands`` makes them (the same bytes),
    by hiredis where it can: it takes str (as UTF-8), bytes, int and float; anything else, a
    connection with another encoding, or a command name of two words (``SCRIPT LOAD``, which
    redis-py splits) goes to redis-py, with its errors."""
    enc = conn.encoder
    if _hiredis_pack is not None and enc.encoding == "utf-8" and enc.encoding_errors == "strict":
        try:
            out = []
            for args in commands:
                first = args[0]
                if (b" " if isinstance(first, bytes) else " ") in first:
                    raise TypeError("a command name of two words")
                out.append(_hiredis_pack(args))
            return b"".join(out)
        except (TypeError, UnicodeError):
            pass
    return conn.pack_commands(commands)


class AutoPipelineRedis(aioredis.Redis):
    """``redis.asyncio.Redis`` whose commands are gathered per event-loop turn (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queued: list[_Item] = []
        self._queued_commands = 0
        self._flush_task: asyncio.Task[None] | None = None
        self._inflight = 0
        #: connections this client keeps for its gathered pipelines (see ``_exchange``)
        self._kept: list[Connection] = []

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper() if args else ""
        if name in DIRECT or name.split(" ", 1)[0] in DIRECT:
            return await super().execute_command(*args, **options)
        (result,) = await self._submit([(args, options)])
        if isinstance(result, Exception):
            raise result
        return result

    def register_script(self, script: Any) -> Any:
        return GatheredScript(self, script)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        if transaction or shard_hint is not None:
            return super().pipeline(transaction, shard_hint)
        return _GatheredPipeline(self)

    def _submit(self, commands: list[_Command]) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Any]] = loop.create_future()
        self._queued.append((commands, fut))
        self._queued_commands += len(commands)
        self._kick(loop)
        return fut

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start a flush if commands wait and another exchange may start; it runs once every
        handler made ready in this turn has queued its command."""
        if self._flush_task is None and self._queued and self._inflight < MAX_INFLIGHT:
            self._flush_task = loop.create_task(self._flush())

    async def _flush(self) -> None:
        self._flush_task = None
        if not self._queued:
            return
        take, n = 0, 0
        while take < len(self._queued) and (n == 0 or n + len(self._queued[take][0]) <= MAX_BATCH):
            n += len(self._queued[take][0])
            take += 1
        batch, self._queued = self._queued[:take], self._queued[take:]
        self._queued_commands -= n
        self._inflight += 1
        loop = asyncio.get_running_loop()
        self._kick(loop)  # more than one pipeline's worth, and room for it: the next one at once
        try:
            await self._send(batch)
        finally:
            self._inflight -= 1
            self._kick(loop)  # what queued meanwhile goes now, together

    async def _send(self, batch: list[_Item]) -> None:
        commands = [c for cs, _fut in batch for c in cs]
        try:
            results = await self._exchange(commands)
        except BaseException as exc:  # the connection failed: every caller gets the error
            for _commands, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        i = 0
        for cs, fut in batch:
            part = results[i:i + len(cs)]
            i += len(cs)
            if not fut.done():
                fut.set_result(part)

    async def _exchange(self, commands: list[_Command]) -> list[Any]:
        """Send ``commands`` as one write and read every reply (a ``ResponseError`` in its place).

        This is redis-py's non-transactional pipeline without what it costs per command here: the
        connection is one this client keeps (no pool checkout per flush) with its socket timeout
        off, and one deadline covers the whole exchange instead of a timer per reply. A connection
        that fails, or whose deadline passes, is dropped (its replies could be out of step); a
        failure before anything was read is tried once more on a fresh connection, as redis-py's
        retry would."""
        for attempt in (1, 2):
            conn = self._kept.pop() if self._kept else await self._take()
            read_any = False
            try:
                async with asyncio.timeout(conn_timeout(conn)):
                    await conn.send_packed_command(pack(conn, [args for args, _ in commands]))
                    out: list[Any] = []
                    for args, options in commands:
                        try:
                            out.append(await self._reply(conn, args[0], options))
                        except ResponseError as exc:
                            out.append(exc)
                        read_any = True
            except BaseException as exc:
                await self._drop(conn)
                retry = attempt == 1 and not read_any and isinstance(exc, (RedisConnectionError, OSError))
                if not retry:
                    if isinstance(exc, TimeoutError):
                        raise RedisTimeoutError("Timeout reading from Redis (gathered pipeline)") from None
                    raise
                continue
            if len(self._kept) < KEEP_CONNECTIONS:
                self._kept.append(conn)
            else:
                await self._give_back(conn)
            return out
        raise AssertionError("unreachable")

    async def _reply(self, conn: Connection, name: Any, options: dict[str, Any]) -> Any:
        """One reply, as ``Redis.parse_response`` makes it (same options, same callbacks)."""
        try:
            if NEVER_DECODE in options:
                options = dict(options)
                options.pop(NEVER_DECODE)
                response = await conn.read_response(disable_decoding=True)
            else:
                response = await conn.read_response()
        except ResponseError:
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise
        if EMPTY_RESPONSE in options or "keys" in options:
            options = {k: v for k, v in options.items() if k not in (EMPTY_RESPONSE, "keys")}
        callback = self.response_callbacks.get(name)
        if callback is None:
            return response
        value = callback(response, **options)
        return await value if inspect.isawaitable(value) else value

    async def _take(self) -> Connection:
        conn: Connection = await self.connection_pool.get_connection()
        # the exchange's own deadline covers it: no timer per reply
        conn._aios_timeout = conn.socket_timeout  # type: ignore[attr-defined]
        conn.socket_timeout = None
        return conn

    async def _give_back(self, conn: Connection) -> None:
        conn.socket_timeout = getattr(conn, "_aios_timeout", conn.socket_timeout)
        await self.connection_pool.release(conn)

    async def _drop(self, conn: Connection) -> None:
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)
        with contextlib.suppress(Exception):
            await self._give_back(conn)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        kept, self._kept = self._kept, []
        for conn in kept:
            with contextlib.suppress(Exception):
                await self._give_back(conn)
        await super().aclose(close_connection_pool)


class GatheredScript:
    """A Lua script called by digest (EVALSHA, gathered like any command) and loaded again when
    the server lost it: redis-py's ``AsyncScript`` without its check of each call's client against
    ``Pipeline``, an ``isinstance`` against a ``typing.Protocol`` subclass that cost ~2 % of a
    worker's CPU. Pipelines queue a script by its ``sha`` (``Store._pipeline``)."""

    def __init__(self, client: AutoPipelineRedis, script: str | bytes) -> None:
        self.registered_client = client
        self.script = script
        raw = script.encode() if isinstance(script, str) else script
        self.sha = hashlib.sha1(raw).hexdigest()

    async def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None) -> Any:
        keys = list(keys or ())
        argv = (*keys, *(args or ()))
        client = self.registered_client
        try:
            return await client.evalsha(self.sha, len(keys), *argv)
        except NoScriptError:  # the server restarted or was flushed: load it and run again
            self.sha = await client.script_load(self.script)
            return await client.evalsha(self.sha, len(keys), *argv)


def conn_timeout(conn: Connection) -> float | None:
    """The deadline of one gathered exchange: the connection's configured socket timeout."""
    return getattr(conn, "_aios_timeout", None)


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
