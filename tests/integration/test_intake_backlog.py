"""``blocks check`` sees creates no parser has taken yet: since creates land in ``AIOS_INTAKE``, a
create waits there with no ``submitted`` in ``AIOS`` (the fold cannot see it), so the check reads the
parser's durable on it instead (made with the topology, before any parser runs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aios_blocks.cli.client import Client
from aios_blocks.recovery.invariants import check
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

from .conftest import COMPONENT


def _intake(lines: list[str]) -> list[str]:
    return [v for v in lines if "AIOS_INTAKE" in v]


async def test_check_reports_creates_waiting_for_a_parser_then_nothing_once_parsed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    sup: Supervisor | None = None
    client = await Client.open(servers.nats_url, servers.redis_url)
    try:
        await client.add_component(COMPONENT)
        await client.add_sim_cluster("c1", nodes=1, gpus=2)
        before = await check(client.bus, client.store, settled=True)
        assert _intake(before.violations) == []
        # no worker runs: the create is stored in AIOS_INTAKE and nothing takes it
        bid = await client.submit({"blockId": "waiting1", "blockComponentURI": COMPONENT["componentURI"],
                                   "minInstances": 1, "maxInstances": 1})
        rep = await check(client.bus, client.store, settled=True)
        assert _intake(rep.violations) == [
            "1 create(s) in AIOS_INTAKE not yet parsed (1 not delivered, 0 delivered and not acked: is a parser running?)"]
        loose = await check(client.bus, client.store, settled=False)
        assert _intake(loose.warnings) and not _intake(loose.violations)
        # the workers start: the parser takes it, the block is placed, the backlog is gone
        sup = Supervisor(servers.nats_url, servers.redis_url, log_dir=str(data / "logs"), role_env=servers.worker_env,
                         groups=DEFAULT_GROUPS).start()
        kind, _ = await client.wait(bid, 90)
        assert kind == "ready"
        async with asyncio.timeout(30):
            while _intake((rep := await check(client.bus, client.store, settled=True)).violations):
                await asyncio.sleep(0.2)
        assert _intake(rep.warnings) == []
    finally:
        await client.close()
        if sup:
            sup.stop()
        servers.stop()
