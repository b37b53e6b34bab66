"""A command line tool against a Redis Cluster in a primary's failover (soak finding,
docs/reliability.md): the killed primary still owns its slots until a replica is promoted, and
``blocks check`` run in that window exited 2 ("cannot connect to Redis") whichever node its URL
named first. ``Store.reachable`` (every ``blocks`` command's first PING) now waits, bounded, while
some node answers; a cluster with no node up is still refused at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from aios_blocks.recovery.rebuild import read_image
from aios_blocks.state.store import Store, StoreUnreachable

from ..integration.cluster_servers import RedisCluster

pytestmark = pytest.mark.integration


async def test_a_cli_store_waits_through_a_primarys_failover_and_not_for_a_dead_cluster(tmp_path: Path) -> None:
    rc = RedisCluster(tmp_path / "redis").start()
    try:
        dead = rc.primaries()[0]
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in [dead, *(p for p in rc.ports if p != dead)])
        store = Store.open(url)
        try:
            await store.r.set("aios:component:kept", "{}")
        finally:
            await store.close()
        rc.kill(dead)  # its replica is promoted after cluster-node-timeout (3 s here) and the election
        store = Store.open(url)  # the dead primary named first
        try:
            await store.reachable()
            assert rc.role(dead) == ""  # still down: the replica took over
            img = await read_image(store.r)
            assert img["aios:component:kept"] == "{}"
        finally:
            await store.close()
    finally:
        rc.stop()
    store = Store.open(url)  # every node down: refused, in one line
    try:
        with pytest.raises(StoreUnreachable, match="cannot connect to Redis"):
            await store.reachable()
    finally:
        await store.close()
