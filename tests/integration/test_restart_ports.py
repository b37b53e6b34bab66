"""A `blocks up` restarted on the same data dir listens where it did. Found trying the README as a
stranger: a `blocks agent` (and anything else connected to the first run: a `blocks worker` on
another host, a client of the tasks' HTTP port) kept retrying the old port for ever after `blocks
up` was stopped and started again, because every start took new free ports; its block stayed
`ready` with 0 instances."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest

from aios_blocks.cli.up import _publish_port
from aios_blocks.runtime.embedded import PORTS_FILE, EmbeddedServers, port_again


def test_servers_restarted_on_their_data_dir_listen_where_they_did_and_a_client_reconnects(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = EmbeddedServers(data_dir=data).start()
    ports, url = (first.nats_port, first.redis_port), first.nats_url

    async def scenario() -> None:
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, reconnected_cb=on_reconnect)
        again: EmbeddedServers | None = None
        try:
            first.stop()
            again = EmbeddedServers(data_dir=data).start()
            assert (again.nats_port, again.redis_port) == ports
            assert json.loads((data / "endpoints.json").read_text())["nats"].endswith(f":{ports[0]}")
            await asyncio.wait_for(reconnected.wait(), 60)  # the client's own retries find the server again
            info = await nc.jetstream().stream_info("AIOS")
            assert info.config.name == "AIOS"
        finally:
            await nc.close()
            if again is not None:
                again.stop()

    try:
        asyncio.run(scenario())
    finally:
        first.stop()


def test_a_remembered_port_taken_meanwhile_gives_way_to_a_free_one(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        (tmp_path / PORTS_FILE).write_text(json.dumps({"nats": busy, "redis": 1}))
        port = port_again(tmp_path, "nats")
        assert port != busy
        assert json.loads((tmp_path / PORTS_FILE).read_text()) == {"nats": port, "redis": 1}
    assert port_again(tmp_path, "nats") == port  # remembered: the next start takes it again


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"nats": "4222"}', '{"nats": 70000}'])
def test_an_unreadable_ports_file_means_a_free_port(tmp_path: Path, text: str) -> None:
    (tmp_path / PORTS_FILE).write_text(text)
    port = port_again(tmp_path, "nats")
    assert 0 < port < 65536
    assert json.loads((tmp_path / PORTS_FILE).read_text())["nats"] == port


def test_the_tasks_http_port_is_the_same_after_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    servers = SimpleNamespace(data_dir=tmp_path)
    seen = []
    for _ in range(2):  # two starts of `blocks up` on one data dir
        monkeypatch.delenv("AIOS_EXECUTOR_HTTP_PORT", raising=False)
        (tmp_path / "endpoints.json").write_text("{}")
        _publish_port(servers, "AIOS_EXECUTOR_HTTP_PORT", "AIOS_EXECUTOR_HTTP_HOST", "http")  # type: ignore[arg-type]
        seen.append(json.loads((tmp_path / "endpoints.json").read_text())["http"])
    assert seen[0] == seen[1]
    monkeypatch.setenv("AIOS_EXECUTOR_HTTP_PORT", "0")  # (0: choose) also takes it again
    _publish_port(servers, "AIOS_EXECUTOR_HTTP_PORT", "AIOS_EXECUTOR_HTTP_HOST", "http")  # type: ignore[arg-type]
    assert json.loads((tmp_path / "endpoints.json").read_text())["http"] == seen[0]
