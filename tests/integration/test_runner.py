"""The one consumer runner against a real JetStream server: retries, dead letters, no crash."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.runner import ConsumerRunner, Delivery, RunnerOptions
from aios_blocks.workers.embedded import EmbeddedServers


async def test_failing_message_is_retried_then_dead_lettered_and_others_flow(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        # stored subjects (the stream keeps only catalog events) that no worker consumes here
        spec = subjects.ConsumerSpec("runner-test", ("aios.cluster.runner-test.*",))
        await bus.ensure_consumer(spec)
        seen: list[tuple[str, int]] = []
        handled: list[str] = []

        async def handler(d: Delivery) -> None:
            seen.append((d.subject, d.deliveries))
            if d.subject == "aios.cluster.runner-test.dry_run":
                raise RuntimeError("always fails")
            if d.subject == "aios.cluster.runner-test.allocation":
                msgspec.json.decode(d.data, type=dict[str, int])
            handled.append(d.subject)

        letters: asyncio.Queue[dict] = asyncio.Queue()

        async def on_letter(msg: object) -> None:
            await letters.put(msgspec.json.decode(msg.data))  # type: ignore[attr-defined]

        await bus.subscribe("aios.dlq.runner-test.>", on_letter)
        stop = asyncio.Event()
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(max_deliver=3, backoff_s=(0.05,), fetch_timeout_s=0.2))
        task = asyncio.create_task(runner.run(stop))
        await bus.publish_raw("aios.cluster.runner-test.dry_run", b'{"x": 1}', msg_id="bad-1")
        await bus.publish_raw("aios.cluster.runner-test.allocation", b"not json", msg_id="garbage-1")
        await bus.publish_raw("aios.cluster.runner-test.scale", b"{}", msg_id="good-1")
        first = await asyncio.wait_for(letters.get(), 20)
        second = await asyncio.wait_for(letters.get(), 20)
        stop.set()
        await asyncio.wait_for(task, 10)
        by_subject = {lt["subject"]: lt for lt in (first, second)}
        bad = by_subject["aios.cluster.runner-test.dry_run"]
        assert bad["deliveries"] == 3 and "always fails" in bad["error"] and bad["data"] == '{"x": 1}'
        # the original headers, as stored: the wire id is the keyed digest of the logical one
        assert bad["headers"]["Nats-Msg-Id"] == (await bus.ids()).wire("bad-1") and bad["consumer"] == "runner-test"
        assert bad["headers"]["Content-Type"] == "application/json"
        garbage = by_subject["aios.cluster.runner-test.allocation"]
        assert garbage["deliveries"] == 1 and garbage["error"].startswith("malformed event")
        assert [n for s, n in seen if s == "aios.cluster.runner-test.dry_run"] == [1, 2, 3]
        assert handled == ["aios.cluster.runner-test.scale"]
        # dead-lettered messages were terminated: nothing left pending for the consumer
        info = await bus.js.consumer_info(subjects.STREAM, "runner-test")
        assert info.num_pending == 0 and info.num_ack_pending == 0
    finally:
        await bus.close()
        servers.stop()


def test_embedded_servers_start_with_a_relative_data_dir(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    servers = EmbeddedServers(data_dir=Path("rel/data")).start()
    try:
        assert servers.data_dir.is_absolute()
        assert (tmp_path / "rel" / "data" / "endpoints.json").exists()
        assert (tmp_path / "rel" / "data" / "redis.log").exists()
    finally:
        servers.stop()
