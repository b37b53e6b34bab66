"""The one consumer runner against a real JetStream server: retries, dead letters, no crash."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from nats.js.errors import BadRequestError

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.bus.runner import ConsumerRunner, Delivery, RunnerOptions
from aios_blocks.runtime.embedded import EmbeddedServers


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
            if d.subject == "aios.cluster.runner-test.reassignment":
                raise RuntimeError("always fails")
            if d.subject == "aios.cluster.runner-test.allocation":
                msgspec.json.decode(d.data, type=dict[str, int])
            handled.append(d.subject)

        letters: asyncio.Queue[dict] = asyncio.Queue()

        async def on_letter(msg: object) -> None:
            await letters.put(msgspec.json.decode(msg.data)["data"])  # type: ignore[attr-defined]

        await bus.subscribe("aios.dlq.runner-test.>", on_letter)
        stop = asyncio.Event()
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(max_deliver=3, backoff_s=(0.05,), fetch_timeout_s=0.2))
        task = asyncio.create_task(runner.run(stop))
        await bus.publish_raw("aios.cluster.runner-test.reassignment", b'{"x": 1}', msg_id="bad-1")
        await bus.publish_raw("aios.cluster.runner-test.allocation", b"not json", msg_id="garbage-1")
        await bus.publish_raw("aios.cluster.runner-test.scale", b"{}", msg_id="good-1")
        first = await asyncio.wait_for(letters.get(), 20)
        second = await asyncio.wait_for(letters.get(), 20)
        stop.set()
        await asyncio.wait_for(task, 10)
        by_subject = {lt["subject"]: lt for lt in (first, second)}
        bad = by_subject["aios.cluster.runner-test.reassignment"]
        assert bad["deliveries"] == 3 and "always fails" in bad["error"] and bad["data"] == '{"x": 1}'
        # the original headers, as stored: the wire id is the keyed digest of the logical one
        assert bad["headers"]["Nats-Msg-Id"] == (await bus.ids()).wire("bad-1") and bad["consumer"] == "runner-test"
        assert bad["headers"]["Content-Type"] == "application/json"
        garbage = by_subject["aios.cluster.runner-test.allocation"]
        assert garbage["deliveries"] == 1 and garbage["error"].startswith("malformed event")
        assert [n for s, n in seen if s == "aios.cluster.runner-test.reassignment"] == [1, 2, 3]
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


async def test_a_batch_is_acked_once_its_publishes_are_stored_and_a_failed_publish_retries_its_own_message(tmp_path: Path) -> None:
    """Effects per fetched batch: a handler's events go out with publish_async into its outbox and
    the runner acks the batch's inputs only once they are stored; a message whose publish failed
    comes back on its own (the others of its batch are acked), and publishes again."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.nats_bus import _OUTBOX
    from aios_blocks.schemas.events import BlockStatusReport

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        spec = subjects.ConsumerSpec("batch-test", ("aios.cluster.batch-test.*",))
        await bus.ensure_consumer(spec)
        seen: list[tuple[str, int]] = []

        async def handler(d: Delivery) -> None:
            seen.append((d.subject, d.deliveries))
            bid = "ok" if d.subject.endswith(".scale") else "flaky"
            assert await bus.emit(E.block_ready, BlockStatusReport(bid, d.deliveries, "ready")) is None  # not awaited here
            box = _OUTBOX.get()
            assert box is not None and (box.pending or box.deferred)  # held for the batch's commit
            if bid == "flaky" and d.deliveries == 1:  # its stream ack failed: as a refused publish would
                failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
                failed.set_exception(RuntimeError("stream unavailable"))
                box.pending.append(failed)

        stop = asyncio.Event()
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(backoff_s=(0.05,), fetch_timeout_s=0.2))
        await bus.publish_raw("aios.cluster.batch-test.scale", b"{}", msg_id="a")
        await bus.publish_raw("aios.cluster.batch-test.allocation", b"{}", msg_id="b")
        task = asyncio.create_task(runner.run(stop))
        for _ in range(100):
            if ("aios.cluster.batch-test.allocation", 2) in seen:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 10)
        assert seen.count(("aios.cluster.batch-test.scale", 1)) == 1 and ("aios.cluster.batch-test.scale", 2) not in seen
        assert ("aios.cluster.batch-test.allocation", 2) in seen  # came back alone
        info = await bus.js.consumer_info(subjects.STREAM, "batch-test")
        assert info.num_pending == 0 and info.num_ack_pending == 0
        for bid in ("ok", "flaky"):  # what each published is stored
            msg = await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=bid))
            assert msgspec.json.decode(msg.data)["data"]["block_id"] == bid
    finally:
        await bus.close()
        servers.stop()


async def test_a_task_that_outlives_its_handler_publishes_with_its_ack_awaited(tmp_path: Path) -> None:
    """A task a handler starts (a probe watcher, say) inherits its outbox but outlives it: once the
    handler is done, what the task publishes is awaited as usual, never left in a closed outbox."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.nats_bus import outbox
    from aios_blocks.schemas.events import BlockStatusReport

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        go = asyncio.Event()

        async def later() -> object:
            await go.wait()
            return await bus.emit(E.block_ready, BlockStatusReport("late", 1, "ready"))

        with outbox() as box:
            inside = await bus.emit(E.block_ready, BlockStatusReport("inside", 1, "ready"))
            task = asyncio.create_task(later())
        assert inside is None and len(box.pending) == 1 and box.closed
        go.set()
        ack = await asyncio.wait_for(task, 10)
        assert ack is not None and ack.seq > 0 and len(box.pending) == 1  # acked by the stream, outside the box
        assert (await asyncio.wait_for(box.pending[0], 10)).seq > 0
    finally:
        await bus.close()
        servers.stop()


async def test_a_batch_commits_its_events_atomically_and_a_refused_batch_goes_event_by_event(tmp_path: Path) -> None:
    """``Bus.commit``: enough events for one stream go as one atomic batch (stored together); a
    batch holding an event id the stream has seen (a redelivered step's) is refused whole by the
    server and then stored event by event: nothing is lost and nothing stored twice."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.nats_bus import outbox
    from aios_blocks.schemas.events import BlockStatusReport

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        assert subjects.STREAM in bus.atomic_streams
        n = bus.settings.atomic_batch_min + 6

        async def held(first: int, count: int) -> list:  # type: ignore[type-arg]
            with outbox(defer=True) as box:
                for i in range(first, first + count):
                    assert await bus.emit(E.block_ready, BlockStatusReport(f"b{i}", 1, "ready")) is None
            assert not box.pending and len(box.deferred) == count
            return box.deferred

        before = (await bus.js.stream_info(subjects.STREAM)).state.messages
        groups = [await held(0, n // 2), await held(n // 2, n - n // 2)]
        assert await bus.commit(groups, 10) == ["", ""]
        info = await bus.js.stream_info(subjects.STREAM)
        assert info.state.messages == before + n
        batch_ids = set()
        for i in range(n):
            msg = await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=f"b{i}"))
            batch_ids.add((msg.headers or {}).get("Nats-Batch-Id"))
        assert len(batch_ids) == 1 and None not in batch_ids  # one atomic batch for both groups
        # the same events again plus new ones: the server refuses the batch (ids seen), the
        # fallback stores only the new ones
        again = [await held(0, n), await held(n, 3)]
        assert await bus.commit(again, 10) == ["", ""]
        assert (await bus.js.stream_info(subjects.STREAM)).state.messages == before + n + 3
        for i in (0, n - 1, n + 2):
            msg = await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=f"b{i}"))
            assert msgspec.json.decode(msg.data)["data"]["block_id"] == f"b{i}"
            # the first ones kept their first (atomic) copy; the new ones came one by one
            assert ("Nats-Batch-Id" in (msg.headers or {})) == (i < n)
        # a few events go one by one (below the threshold): stored all the same
        assert await bus.commit([await held(100, 2)], 10) == [""]
        assert (await bus.js.stream_info(subjects.STREAM)).state.messages == before + n + 5
    finally:
        await bus.close()
        servers.stop()


async def test_events_emitted_together_are_stored_as_atomic_batches_and_each_gets_its_own_ack(tmp_path: Path) -> None:
    """``Bus.emit_together`` (``Client.create`` and ``scale``): calls gathered in one turn of the
    loop are stored as atomic batches (from ``atomic_batch_min`` on, at most ``atomic_batch_max``
    each), and each caller's ack is its own event's stream sequence; a batch the server refuses
    (an id it has seen) goes event by event, each ack then saying whether it was a duplicate; a
    few calls go one by one. A client that has not made the stream (and may not read its config)
    tries atomic batches on a server that has them; a stream that refuses them (atomic publish
    disabled) gets its events one by one, and is not tried again."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import BlockStatusReport
    from aios_blocks.settings import Settings

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    maker = await Bus.open(servers.nats_url)
    await maker.ensure_stream()
    bus = await Bus.open(servers.nats_url, settings=Settings(atomic_batch_min=4, atomic_batch_max=10))
    try:
        assert not bus.atomic_streams  # this one did not make the stream: it tries

        async def burst(bids: list[str], ids: list[str | None]) -> list:  # type: ignore[type-arg]
            return list(await asyncio.gather(*(
                bus.emit_together(E.block_ready, BlockStatusReport(b, 1, "ready"), msg_id=i, bid=b) for b, i in zip(bids, ids, strict=True)
            )))

        bids = [f"tog{i}" for i in range(25)]
        acks = await burst(bids, [f"tog-{b}" for b in bids])
        batches: dict[str | None, int] = {}
        for b, ack in zip(bids, acks, strict=True):
            msg = await bus.js.get_msg(subjects.STREAM, ack.seq)  # each ack: that event's own sequence
            assert msg.subject == E.block_ready.subject(bid=b) and not ack.duplicate
            assert msg.headers["Nats-Msg-Id"] == (await bus.ids()).wire(f"tog-{b}")
            batch = msg.headers.get("Nats-Batch-Id")
            batches[batch] = batches.get(batch, 0) + 1
        assert sorted(batches.values()) == [5, 10, 10] and None not in batches  # 25 = 10 + 10 + 5
        # again, with 5 new ones: the batch holding seen ids is refused; event by event instead
        more = [f"tog{i}" for i in range(25, 30)]
        again = await burst(bids[:5] + more, [f"tog-{b}" for b in bids[:5] + more])
        assert [bool(a.duplicate) for a in again] == [True] * 5 + [False] * 5
        assert [a.seq for a in again[:5]] == [a.seq for a in acks[:5]]
        for b, ack in zip(more, again[5:], strict=True):
            msg = await bus.js.get_msg(subjects.STREAM, ack.seq)
            assert msg.subject == E.block_ready.subject(bid=b) and "Nats-Batch-Id" not in (msg.headers or {})
        # below the threshold: one by one
        few = await burst(["tog-a", "tog-b"], [None, None])
        for b, ack in zip(["tog-a", "tog-b"], few, strict=True):
            msg = await bus.js.get_msg(subjects.STREAM, ack.seq)
            assert msg.subject == E.block_ready.subject(bid=b) and "Nats-Batch-Id" not in (msg.headers or {})
        # a publish_async the stream refuses fails with the stream's error (nats-py alone left it
        # waiting for its timeout: the refused batch above fell back only after 10 s)
        fut = await bus.js.publish_async(E.block_ready.subject(bid="tog-c"), b"{}", headers={"Nats-Expected-Last-Sequence": "1"})
        with pytest.raises(BadRequestError, match="wrong last sequence"):
            await asyncio.wait_for(fut, 5)
        # a stream with atomic publish disabled: the batch is refused whole, the events go one by
        # one, and this client does not try that stream again
        info = await maker.js.stream_info(subjects.STREAM)
        info.config.allow_atomic = False
        await maker.js.update_stream(info.config)
        late = [f"tog-off{i}" for i in range(6)]
        tried: list[int] = []
        send_atomic = bus._send_atomic

        async def counted(items: list, timeout: float) -> tuple:  # type: ignore[type-arg]
            tried.append(len(items))
            return await send_atomic(items, timeout)

        bus._send_atomic = counted  # type: ignore[method-assign]
        for attempt in range(2):
            ids = [f"tog-{b}-{attempt}" for b in late]
            acks = await burst(late, ids)
            assert subjects.STREAM in bus._no_atomic
            for b, ack in zip(late, acks, strict=True):
                msg = await bus.js.get_msg(subjects.STREAM, ack.seq)
                assert msg.subject == E.block_ready.subject(bid=b) and "Nats-Batch-Id" not in (msg.headers or {})
        assert tried == [6]  # the second burst went one by one without trying
    finally:
        await bus.close()
        await maker.close()
        servers.stop()


async def test_a_publish_awaited_inside_a_handler_never_overtakes_its_earlier_events(tmp_path: Path) -> None:
    """In a deferring outbox, a ``sync`` emit (the caller reads its ack) first sends what the handler
    published before it: the stream keeps the handler's order."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.nats_bus import outbox
    from aios_blocks.schemas.events import BlockStatusReport

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        with outbox(defer=True) as box:
            await bus.emit(E.block_ready, BlockStatusReport("ord-a", 1, "ready"))
            await bus.emit(E.block_ready, BlockStatusReport("ord-b", 1, "ready"))
            ack = await bus.emit(E.block_ready, BlockStatusReport("ord-c", 1, "ready"), sync=True)
            assert ack is not None and not box.deferred and len(box.pending) == 2
        await asyncio.gather(*box.pending)
        seqs = [(await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=b))).seq for b in ("ord-a", "ord-b", "ord-c")]
        assert seqs == sorted(seqs) and seqs[2] == ack.seq
    finally:
        await bus.close()
        servers.stop()


async def test_an_early_event_of_a_batch_of_one_is_stored_while_its_handler_still_works(tmp_path: Path) -> None:
    """``Emit.early`` (the parser's ``submitted``): in a batch of one delivery it is published at
    once, so it is stored while the handler goes on (its disk sync overlaps the handler's work);
    the input is acked only after everything is stored, in the handler's order. In a batch of
    several (atomic batches to join) and behind an event already held, it is held like the rest."""
    from aios_blocks.bus.catalog import E, Emit
    from aios_blocks.bus.nats_bus import outbox
    from aios_blocks.schemas.events import BlockStatusReport

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        assert bus.atomic_streams  # the runner holds a handler's events for its batch's commit
        spec = subjects.ConsumerSpec("early-test", ("aios.cluster.early-test.*",))
        await bus.ensure_consumer(spec)
        stored_while_handling: dict[str, bool] = {}

        async def stored(bid: str) -> bool:
            try:
                await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=bid))
                return True
            except Exception:
                return False

        async def handler(d: Delivery) -> None:
            name = d.subject.rsplit(".", 1)[-1]
            await bus.emit_all([Emit(E.block_ready, BlockStatusReport(f"{name}-early", 1, "ready"), early=True)])
            await bus.emit(E.block_ready, BlockStatusReport(f"{name}-late", 1, "ready"))
            seen = False
            for _ in range(40):  # stored by now if it went out (a few ms), never if it is held
                if seen := await stored(f"{name}-early"):
                    break
                await asyncio.sleep(0.05)
            stored_while_handling[name] = seen

        stop = asyncio.Event()
        task = asyncio.create_task(ConsumerRunner(bus, spec, handler, RunnerOptions(fetch_timeout_s=0.2)).run(stop))
        await bus.publish_raw("aios.cluster.early-test.scale", b"{}", msg_id="e-1")
        for _ in range(100):
            if "scale" in stored_while_handling:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)
        # two at once: one batch of two deliveries, their events held for the batch's commit
        spec2 = subjects.ConsumerSpec("early-test-2", ("aios.cluster.early-test-2.*",))
        await bus.ensure_consumer(spec2)
        for name, mid in (("allocation", "e-2"), ("reassignment", "e-3")):
            await bus.publish_raw(f"aios.cluster.early-test-2.{name}", b"{}", msg_id=mid)
        sub = await bus.js.pull_subscribe_bind(spec2.durable, subjects.STREAM)
        msgs = await sub.fetch(2, timeout=5)
        assert len(msgs) == 2
        await ConsumerRunner(bus, spec2, handler, RunnerOptions(fetch_timeout_s=0.2)).batch(msgs)
        assert stored_while_handling == {"scale": True, "allocation": False, "reassignment": False}
        for name in ("scale", "allocation", "reassignment"):  # all stored, in each handler's order
            early, late = [(await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=f"{name}-{w}"))).seq
                           for w in ("early", "late")]
            assert early < late
        for durable in (spec.durable, spec2.durable):  # acked once stored
            info = await bus.js.consumer_info(subjects.STREAM, durable)
            assert info.num_ack_pending == 0 and info.num_pending == 0
        # held like the rest behind an event held before it, and where early is not allowed
        for early_ok, before in ((False, False), (True, True)):
            with outbox(defer=True, early=early_ok) as box:
                if before:
                    await bus.emit(E.block_ready, BlockStatusReport("held-first", 1, "ready"))
                await bus.emit_all([Emit(E.block_ready, BlockStatusReport("held-early", 1, "ready"), early=True)])
            assert not box.pending and len(box.deferred) == 1 + before
    finally:
        await bus.close()
        servers.stop()


async def test_a_query_runner_takes_each_query_once_commits_its_events_retries_and_dead_letters(tmp_path: Path) -> None:
    """``CoreRunner`` on a real server: queries (core NATS, not stored) reach one of the queue
    group's runners each; what a handler publishes is stored with its batch; a handler that keeps
    failing is retried with backoff, then dead-lettered with the reason. The stream never holds a
    query."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.bus.router import Inbound, Router
    from aios_blocks.bus.runner import CoreRunner
    from aios_blocks.schemas.events import DryRunRequest, PostDryRun

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        spec = subjects.consumer("core-test", E.cluster_dry_run, cid="q1")
        assert spec.filters == () and spec.core_filters == ("aios.cluster.q1.dry_run",)
        handled: list[tuple[str, int]] = []

        def router(name: str) -> Router:
            r = Router(spec)

            async def on_query(m: Inbound[DryRunRequest]) -> None:
                handled.append((m.data.block_id, m.deliveries))
                if m.data.block_id == "bad":
                    raise RuntimeError("always fails")
                await bus.emit(E.block_post_dry_run, PostDryRun(m.data.block_id, m.data.gen, "q1", {"q1": 1.0}))

            r.add(E.cluster_dry_run, on_query)
            return r

        letters: asyncio.Queue[dict] = asyncio.Queue()

        async def on_letter(msg: object) -> None:
            await letters.put(msgspec.json.decode(msg.data)["data"])  # type: ignore[attr-defined]

        await bus.subscribe("aios.dlq.core-test.>", on_letter)
        stop = asyncio.Event()
        opts = RunnerOptions(max_deliver=3, backoff_s=(0.05,), fetch_timeout_s=0.2)
        runners = [CoreRunner(bus, spec, router(n), opts) for n in ("a", "b")]
        tasks = [asyncio.create_task(r.run(stop)) for r in runners]
        await bus.nc.flush()
        await asyncio.sleep(0.2)  # both subscriptions are in the group
        before = (await bus.js.stream_info(subjects.STREAM)).state.messages
        for i in range(20):
            await bus.emit(E.cluster_dry_run, DryRunRequest(f"b{i}", 1, "q1"), cid="q1")
        await bus.emit(E.cluster_dry_run, DryRunRequest("bad", 1, "q1"), cid="q1")
        letter = await asyncio.wait_for(letters.get(), 20)
        for _ in range(100):
            if len({b for b, _ in handled if b != "bad"}) == 20:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
        good = [b for b, _ in handled if b != "bad"]
        assert sorted(good) == sorted(f"b{i}" for i in range(20))  # each once, over the two runners
        assert [n for b, n in handled if b == "bad"] == [1, 2, 3]
        assert letter["subject"] == "aios.cluster.q1.dry_run" and "always fails" in letter["error"]
        assert letter["deliveries"] == 3 and letter["consumer"] == "core-test"
        info = await bus.js.stream_info(subjects.STREAM)
        assert info.state.messages == before + 20 + 1  # the 20 answers and the dead letter, no query
        for i in (0, 19):
            msg = await bus.js.get_last_msg(subjects.STREAM, E.block_post_dry_run.subject(bid=f"b{i}"))
            assert msgspec.json.decode(msg.data)["data"]["cluster_id"] == "q1"
    finally:
        await bus.close()
        servers.stop()


async def test_a_handlers_queries_go_out_only_once_its_stored_events_are_stored(tmp_path: Path) -> None:
    """A query's answer must never precede, in the stream, the facts that asked for it: the runner
    holds a handler's queries until the batch's stored events are stored; a handler that fails
    sends none (its redelivery asks again)."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import BlockStatusReport, DryRunRequest

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        spec = subjects.ConsumerSpec("order-test", ("aios.cluster.order-test.scale",))
        await bus.ensure_consumer(spec)
        calls = {"n": 0}

        async def handler(d: Delivery) -> None:
            calls["n"] += 1
            await bus.emit(E.block_ready, BlockStatusReport(f"o{calls['n']}", 1, "ready"))
            await bus.emit(E.cluster_dry_run, DryRunRequest(f"o{calls['n']}", 1, "order-q"), cid="order-q")
            if calls["n"] == 1:
                raise RuntimeError("fails once, after publishing")

        seen: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

        async def on_query(msg: object) -> None:
            bid = msgspec.json.decode(msg.data)["data"]["block_id"]  # type: ignore[attr-defined]
            try:
                await bus.js.get_last_msg(subjects.STREAM, E.block_ready.subject(bid=bid))
                stored = True
            except Exception:
                stored = False
            await seen.put((bid, stored))

        await bus.subscribe("aios.cluster.order-q.dry_run", on_query)
        stop = asyncio.Event()
        runner = ConsumerRunner(bus, spec, handler, RunnerOptions(backoff_s=(0.05,), fetch_timeout_s=0.2))
        task = asyncio.create_task(runner.run(stop))
        await bus.publish_raw("aios.cluster.order-test.scale", b"{}", msg_id="order-1")
        bid, stored = await asyncio.wait_for(seen.get(), 20)
        stop.set()
        await asyncio.wait_for(task, 10)
        assert (bid, stored) == ("o2", True)  # the failed first handling sent no query; the second did, after its event
        assert seen.empty()
    finally:
        await bus.close()
        servers.stop()


async def test_a_query_sent_before_any_receiver_subscribes_is_sent_again_until_one_does(tmp_path: Path) -> None:
    """NATS drops a plain publish nobody is subscribed to (e.g. a dry_run while the controller
    process is still starting): the sender hears *no responders* on the query's reply subject and
    sends it again with backoff, so a receiver that subscribes later still gets it, once; a query
    nobody ever takes is given up after ``give_up_s``."""
    from aios_blocks.bus.catalog import E
    from aios_blocks.schemas.events import DryRunRequest

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_nats()
    bus = await Bus.open(servers.nats_url)
    other = await Bus.open(servers.nats_url)
    try:
        await bus.emit(E.cluster_dry_run, DryRunRequest("late-1", 1, "late"), cid="late")
        await asyncio.sleep(0.4)  # nobody listens yet: the query came back as "no responders", more than once
        assert bus.query_sender.resent >= 2
        got: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

        async def on_query(msg: object) -> None:
            data = msgspec.json.decode(msg.data)["data"]  # type: ignore[attr-defined]
            await got.put((data["block_id"], msg.reply))  # type: ignore[attr-defined]

        await other.nc.subscribe("aios.cluster.late.dry_run", queue="controller-late", cb=on_query)
        await other.nc.flush()
        bid, reply = await asyncio.wait_for(got.get(), 5)
        assert bid == "late-1" and reply.startswith("_INBOX.")
        await asyncio.sleep(0.5)
        assert got.empty()  # taken once: nothing answers it, and nothing is sent again once someone listens
        # a query no one ever takes is given up, not sent forever
        bus.query_sender.give_up_s = 0.3
        await bus.emit(E.cluster_dry_run, DryRunRequest("never", 1, "nobody"), cid="nobody")
        for _ in range(50):
            if bus.query_sender.dropped:
                break
            await asyncio.sleep(0.05)
        assert bus.query_sender.dropped == 1
    finally:
        await other.close()
        await bus.close()
        servers.stop()
