"""Auto-pipelining (``state.autopipeline``) on a real Redis: concurrent callers' commands go out
together (fewer server read events than commands) and each caller gets its own reply or error,
scripts included (a script the server lost is loaded again), and a caller's own pipeline keeps
its order inside the gathered one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.exceptions

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.settings import Settings
from aios_blocks.state.autopipeline import AutoPipelineRedis
from aios_blocks.state.connection import open_redis


@pytest.fixture
def redis_url(tmp_path: Path):  # type: ignore[no-untyped-def]
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    try:
        yield servers.redis_url
    finally:
        servers.stop()


async def _reads(r: AutoPipelineRedis) -> int:
    return int((await r.info("stats"))["total_reads_processed"])


async def test_concurrent_callers_share_round_trips_and_get_their_own_replies(redis_url: str) -> None:
    r = open_redis(redis_url, Settings())
    plain = open_redis(redis_url, Settings(redis_autopipeline=False))
    assert isinstance(r, AutoPipelineRedis) and not isinstance(plain, AutoPipelineRedis)
    try:
        await r.set("ap:warm", "1")  # the pool's first connection
        before = await _reads(plain)

        async def caller(i: int) -> tuple[str | None, int, dict[str, str]]:
            await r.set(f"ap:k{i}", f"v{i}")
            n = await r.incr("ap:counter")
            await r.hset(f"ap:h{i}", mapping={"a": str(i)})
            return await r.get(f"ap:k{i}"), n, await r.hgetall(f"ap:h{i}")

        out = await asyncio.gather(*(caller(i) for i in range(200)))
        used = await _reads(plain) - before - 1  # the INFO read itself
        assert [o[0] for o in out] == [f"v{i}" for i in range(200)]
        assert sorted(o[1] for o in out) == list(range(1, 201))  # every INCR applied once
        assert [o[2] for o in out] == [{"a": str(i)} for i in range(200)]
        assert used < 200 * 4 / 10, f"{used} server reads for 800 commands: not gathered"
    finally:
        await r.aclose()
        await plain.aclose()


async def test_an_error_reaches_only_its_caller(redis_url: str) -> None:
    r = open_redis(redis_url, Settings())
    try:
        await r.set("ap:str", "x")

        async def bad() -> None:
            await r.hgetall("ap:str")  # WRONGTYPE

        results = await asyncio.gather(bad(), r.get("ap:str"), r.incr("ap:n"), return_exceptions=True)
        assert isinstance(results[0], redis.exceptions.ResponseError) and "WRONGTYPE" in str(results[0])
        assert results[1:] == ["x", 1]
    finally:
        await r.aclose()


async def test_scripts_and_caller_pipelines_keep_their_order(redis_url: str) -> None:
    r = open_redis(redis_url, Settings())
    try:
        script = r.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])")
        assert await script(keys=["ap:list"], args=["a"]) == 1
        await r.script_flush()  # the server lost it: loaded again on NOSCRIPT, the caller sees no error
        assert await script(keys=["ap:list"], args=["b"]) == 2

        async def piped(i: int) -> list[object]:
            pipe = r.pipeline(transaction=False)
            pipe.rpush(f"ap:l{i}", "1")
            pipe.rpush(f"ap:l{i}", "2")
            pipe.lrange(f"ap:l{i}", 0, -1)
            return await pipe.execute()

        outs = await asyncio.gather(*(piped(i) for i in range(50)), script(keys=["ap:list"], args=["c"]))
        assert outs[:50] == [[1, 2, ["1", "2"]]] * 50
        assert outs[50] == 3
        async with r.pipeline(transaction=True) as tx:  # transactions go out on their own, as before
            tx.incr("ap:tx")
            tx.incr("ap:tx")
            assert await tx.execute() == [1, 2]
    finally:
        await r.aclose()


async def test_a_connection_the_server_dropped_is_replaced_and_the_call_goes_through(redis_url: str) -> None:
    """The gathered pipeline keeps its own connections: one the server closed fails on its first
    reply, before anything was read, and the exchange is sent again on a fresh connection (as
    redis-py's retry would); the caller sees its reply. A closed client gives them back."""
    r = open_redis(redis_url, Settings())
    plain = open_redis(redis_url, Settings(redis_autopipeline=False))
    try:
        assert await r.incr("ap:kill") == 1
        assert isinstance(r, AutoPipelineRedis) and r._kept, "the exchange's connection is kept"
        killed = await plain.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert killed == 1  # the one kept connection (the plain client skipped)
        assert await asyncio.gather(*(r.incr("ap:kill") for _ in range(5))) == [2, 3, 4, 5, 6]
        assert await r.get("ap:kill") == "6"  # each INCR applied once: nothing sent twice
    finally:
        await r.aclose()
        await plain.aclose()
    assert r._kept == []


async def test_the_kept_connections_come_back_after_a_redis_restart(tmp_path: Path) -> None:
    """Redis killed and started again on its port (its AOF kept): every kept connection is dead.
    A call made while the server is down fails with a connection error (nothing is sent twice);
    once it is back, calls go through on fresh connections, and what was written before is there."""
    import signal

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    r = open_redis(servers.redis_url, Settings())
    try:
        await asyncio.gather(*(r.incr("ap:restart") for _ in range(20)))  # several kept connections' worth
        assert isinstance(r, AutoPipelineRedis) and r._kept
        await r.execute_command("BGREWRITEAOF")  # on disk before the kill (appendfsync everysec)
        for _ in range(100):
            await asyncio.sleep(0.05)
            info = await r.info("persistence")
            if not info["aof_rewrite_in_progress"] and not info.get("aof_rewrite_scheduled"):
                break
        proc = next(p for p in servers.procs if "redis" in str(p.args[0]))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        servers.procs.remove(proc)
        with pytest.raises(redis.exceptions.ConnectionError):
            await r.incr("ap:restart")
        servers.start_redis()
        assert await asyncio.gather(*(r.incr("ap:restart") for _ in range(5))) == [21, 22, 23, 24, 25]
        assert await r.get("ap:restart") == "25"
    finally:
        await r.aclose()
        servers.stop()


async def test_commands_queued_while_a_pipeline_is_out_go_together_in_the_next(redis_url: str) -> None:
    """One gathered pipeline in flight at a time (``MAX_INFLIGHT``): callers that queue commands
    in separate turns while one is out are sent together once it is back, in one server read."""
    from aios_blocks.state import autopipeline

    assert autopipeline.MAX_INFLIGHT == 1
    r = open_redis(redis_url, Settings())
    plain = open_redis(redis_url, Settings(redis_autopipeline=False))
    try:
        await r.set("ap:warm", "1")
        slow = r.register_script("local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]; "
                                 "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 50000; return 1")
        assert await slow(keys=[], args=[]) == 1  # loaded (a first call is EVALSHA, SCRIPT LOAD, EVALSHA)
        before = await _reads(plain)
        out = asyncio.ensure_future(slow(keys=[], args=[]))
        await asyncio.sleep(0.01)  # the slow script is out
        late = []
        for _ in range(20):  # one caller per turn: alone, each would be its own pipeline
            late.append(asyncio.ensure_future(r.incr("ap:late")))
            await asyncio.sleep(0)
        assert await out == 1
        assert sorted(await asyncio.gather(*late)) == list(range(1, 21))
        used = await _reads(plain) - before - 1  # the INFO read itself
        assert used == 2, f"{used} server reads for a script and 20 INCRs queued behind it"
    finally:
        await r.aclose()
        await plain.aclose()
