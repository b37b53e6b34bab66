"""state.views, the listing's Redis reader (`blocks list`): RESP over one socket on a real Redis,
the same rows as through redis-py, and a wrong password or a database number taken as given."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from aios_blocks.state.views import Reader, RedisPyReader, block_rows

from .conftest import System


async def test_the_socket_reader_lists_what_redis_py_lists(system: System) -> None:
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    for bid in ("view-1", "view-2"):
        _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": bid,
                                                   "minInstances": 1, "maxInstances": 1})
        assert kind == "ready"
    url = system.supervisor.redis_url
    if not url.startswith("redis://"):
        pytest.skip("the socket reader serves plain redis:// servers (TLS and Redis Cluster go through redis-py)")
    fast, slow = Reader(url), RedisPyReader(url)
    try:
        rows = block_rows(fast)
        assert rows == block_rows(slow)
        assert [(r["id"], r["status"], r["cluster"], r["instances"]) for r in rows] == [
            ("view-2", "ready", "c1", 1), ("view-1", "ready", "c1", 1)]
        assert [r["id"] for r in block_rows(fast, limit=1)] == ["view-2"]
        assert fast.pipeline([("PING",), ("ECHO", "x y\r\nz")]) == ["PONG", "x y\r\nz"]
    finally:
        fast.close()
        slow.close()

    u = urlsplit(url)
    if u.password:  # credentials required (the embedded servers')
        wrong = urlunsplit((u.scheme, f"{u.username or ''}:wrong@{u.hostname}:{u.port}", u.path, "", ""))
        with pytest.raises(ConnectionError, match="refused AUTH"):
            Reader(wrong)
    other = Reader(urlunsplit((u.scheme, u.netloc, "/1", "", "")))  # database 1: no blocks there
    try:
        assert block_rows(other) == []
    finally:
        other.close()
