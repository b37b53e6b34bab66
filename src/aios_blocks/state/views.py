"""Read-only views for the command line's listings, over one Redis connection and a light import
graph: ``blocks list`` answers without loading the workers' store (its Lua scripts, the settings
model, the spec models), redis-py (whose import alone costs more than twice typer's and rich's)
or asyncio, and without connecting to NATS.

A plain ``redis://`` server is read by ``Reader``: RESP over one socket, replies parsed by hiredis
(the C parser redis-py uses too), commands sent as one pipeline. TLS (``rediss://``), Unix sockets
and Redis Cluster go through redis-py (``RedisPyReader``). Every key is built by ``state.keys``, as
in ``state.store``.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Protocol, TypedDict
from urllib.parse import unquote, urlsplit

from .keys import BLOCKS, block_key, inst_key

#: the block record's fields a listing shows (the rest, the IR first, is ``blocks get``'s)
LIST_FIELDS = ("status", "cluster", "reason", "gen", "short")
#: seconds to connect, and to wait for each reply (a CLI gives up, as its NATS connection does)
WAIT_S = 5.0


class Pipeline(Protocol):
    def pipeline(self, commands: list[tuple[str, ...]]) -> list[Any]: ...

    def close(self) -> None: ...


class Reader:
    """One connection to one Redis server: ``pipeline`` sends its commands at once and returns
    their replies in order (no answer, or an error reply: ``ConnectionError``, one line in the CLI)."""

    def __init__(self, url: str) -> None:
        import hiredis

        u = urlsplit(url)
        self._replies = hiredis.Reader(encoding="utf-8")
        self._error = hiredis.ReplyError
        try:
            self._sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=WAIT_S)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to Redis at {u.hostname}:{u.port or 6379}: {exc}") from None
        hello: list[tuple[str, ...]] = []
        if u.password:
            hello.append(("AUTH", unquote(u.username), unquote(u.password)) if u.username else ("AUTH", unquote(u.password)))
        db = u.path.strip("/") or "0"
        if db != "0":
            hello.append(("SELECT", db))
        if hello:
            self.pipeline(hello)

    def pipeline(self, commands: list[tuple[str, ...]]) -> list[Any]:
        out = bytearray()
        for cmd in commands:
            out += b"*%d\r\n" % len(cmd)
            for arg in cmd:
                b = arg.encode()
                out += b"$%d\r\n%b\r\n" % (len(b), b)
        replies: list[Any] = []
        try:
            self._sock.sendall(out)
            while len(replies) < len(commands):
                reply = self._replies.gets()
                if reply is False:  # more bytes needed
                    data = self._sock.recv(65536)
                    if not data:
                        raise ConnectionError("Redis closed the connection")
                    self._replies.feed(data)
                    continue
                replies.append(reply)
        except TimeoutError:
            raise ConnectionError(f"Redis did not answer within {WAIT_S:g} s") from None
        except OSError as exc:
            raise ConnectionError(f"cannot talk to Redis: {exc}") from None
        for cmd, reply in zip(commands, replies, strict=True):
            if isinstance(reply, self._error):  # (a wrong password, a command the user may not run)
                raise ConnectionError(f"Redis refused {cmd[0]}: {reply}")
        return replies

    def close(self) -> None:
        self._sock.close()


class RedisPyReader:
    """``Reader``'s interface over redis-py: TLS, Unix sockets, Redis Cluster (``redis+cluster://``)."""

    def __init__(self, url: str) -> None:
        import redis

        scheme = url.split("://", 1)[0].lower()
        if scheme.endswith("+cluster"):
            from redis.cluster import ClusterNode, RedisCluster

            from .connection import cluster_nodes

            first, others = cluster_nodes(url)
            self._r: Any = RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in others],
                                                 decode_responses=True, socket_timeout=WAIT_S)
        else:
            self._r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=WAIT_S,
                                           socket_connect_timeout=WAIT_S)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

    def pipeline(self, commands: list[tuple[str, ...]]) -> list[Any]:
        pipe = self._r.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        try:
            return list(pipe.execute())
        except self._errors as exc:
            raise ConnectionError(f"cannot connect to Redis: {exc}") from exc

    def close(self) -> None:
        self._r.close()


def open_reader(url: str) -> Pipeline:
    """A reader for ``url`` (the caller closes it)."""
    if url.split("://", 1)[0].lower() == "redis":
        return Reader(url)
    return RedisPyReader(url)


class BlockRow(TypedDict):
    """One row of ``blocks list`` (``block_rows``)."""

    id: str
    #: "?" when it is listed but its record is gone (being deleted)
    status: str
    cluster: str | None
    reason: str | None
    gen: int | None
    #: how many instance records it has
    instances: int
    #: a ready block below its minInstances that the reconciler could not bring back
    #: (``schemas.condition.BlockShort``: live, running, min_instances, since, reason), else None
    short: dict[str, Any] | None


def block_rows(r: Pipeline, limit: int = 100) -> list[BlockRow]:
    """The newest ``limit`` blocks, newest first, as ``{"id", "status", "cluster", "reason", "gen",
    "instances"}`` (instances: how many instance records it has), in two round trips."""
    (bids,) = r.pipeline([("ZREVRANGE", BLOCKS, "0", str(limit - 1))])
    if not bids:
        return []
    commands: list[tuple[str, ...]] = []
    for bid in bids:
        commands += [("HMGET", block_key(bid), *LIST_FIELDS), ("HLEN", inst_key(bid))]
    replies = r.pipeline(commands)
    rows: list[BlockRow] = []
    for bid, values, n in zip(bids, replies[::2], replies[1::2], strict=True):
        status, cluster, reason, gen, short = values  # (LIST_FIELDS)
        rows.append({"id": bid, "status": status or "?", "cluster": cluster, "reason": reason,
                     "gen": int(gen) if gen else None, "instances": n,
                     "short": short_of(short) if status == "ready" else None})
    return rows


# -- a ready block's short condition (``schemas.condition``), read with the standard library ------
def short_of(raw: object) -> dict[str, Any] | None:
    """The record's ``short`` field decoded (None: absent or unreadable)."""
    if not raw or not isinstance(raw, str | bytes):
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def clock(t: object) -> str:
    """``HH:MM:SS`` (UTC), as ``blocks explain`` prints its times."""
    try:
        return time.strftime("%H:%M:%S", time.gmtime(float(t)))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return "?"


def describe_short(d: dict[str, Any]) -> str:
    """``short 0/1 since 12:01:03: scale failed: no healthy node ...``."""
    reason = d.get("reason") or ""
    return f"short {d.get('live', '?')}/{d.get('min_instances', '?')} since {clock(d.get('since'))}" + (f": {reason}" if reason else "")


def status_text(status: str, raw: object) -> str:
    """A block's status as the listings show it: ``ready (short 0/1 since ...)`` while its record
    carries the condition, else the status alone (a mark left on a block no longer ``ready`` is
    not shown: the reconciler clears it at its next pass)."""
    d = short_of(raw) if status == "ready" else None
    return status if d is None else f"{status} ({describe_short(d)})"
