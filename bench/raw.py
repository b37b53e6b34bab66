"""The raw limit of this stack on this machine: what nats-py and redis-py do alone, one process.

* JetStream publish awaiting each ack (file stream, the embedded server's ``sync_interval``);
* a pull-consume *step*: ``fetch(1)``, decode, publish one result with a ``Nats-Msg-Id`` awaiting
  its ack, ack the input — what a worker does per message at the least — and the same step with a
  fetched batch's results published async and acked together (DESIGN §13);
* Redis: the project's atomic gang reservation (``state.scripts.RESERVE_GANG`` through
  ``Store.reserve_gang``), one round trip at a time.

Every other figure is reported as a fraction of these. Bounded in count and time.

    .venv/bin/python -m bench.raw [--quick]
"""

from __future__ import annotations

import asyncio
import time

import msgspec

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

from aios_blocks.bus.nats_bus import Bus
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import Store

GROUP = "1 raw limit"
STREAM = "BENCHRAW"


async def _stream(bus: Bus) -> None:
    from nats.js.api import StorageType, StreamConfig

    await bus.js.add_stream(StreamConfig(name=STREAM, subjects=["benchraw.>"], storage=StorageType.FILE, duplicate_window=120))


async def publish_rate(bus: Bus, n: int, budget_s: float) -> float:
    t0 = time.perf_counter()
    done = 0
    for i in range(n):
        await bus.js.publish(f"benchraw.pub.{i % 16}", b'{"i":%d}' % i, headers={"Nats-Msg-Id": f"p{i}"})
        done += 1
        if time.perf_counter() - t0 > budget_s:
            break
    return done / (time.perf_counter() - t0)


async def _fill(bus: Bus, subject: str, n: int) -> None:
    futs = [await bus.js.publish_async(subject, msgspec.json.encode({"i": i})) for i in range(n)]
    await asyncio.gather(*futs)


async def step_rate(bus: Bus, n: int, budget_s: float, batch: int) -> float:
    """Steps/s: in (pull), out (publish with msg id, ack awaited), ack the input."""
    from nats.js.api import AckPolicy, ConsumerConfig

    subject = f"benchraw.in{batch}"
    await _fill(bus, subject, n)
    durable = f"step{batch}"
    await bus.js.add_consumer(STREAM, ConsumerConfig(durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT,
                                                     max_ack_pending=4096))
    sub = await bus.js.pull_subscribe_bind(durable=durable, stream=STREAM)
    t0 = time.perf_counter()
    done = 0
    while done < n and time.perf_counter() - t0 < budget_s:
        msgs = await sub.fetch(batch, timeout=2)
        if batch == 1:
            for m in msgs:
                doc = msgspec.json.decode(m.data)
                await bus.js.publish(f"benchraw.out{batch}", msgspec.json.encode({"r": doc["i"]}),
                                     headers={"Nats-Msg-Id": f"o{batch}-{doc['i']}"})
                await m.ack()
        else:
            futs = []
            for m in msgs:
                doc = msgspec.json.decode(m.data)
                futs.append(await bus.js.publish_async(f"benchraw.out{batch}", msgspec.json.encode({"r": doc["i"]}),
                                                       headers={"Nats-Msg-Id": f"o{batch}-{doc['i']}"}))
            await asyncio.gather(*futs)
            for m in msgs:
                await m.ack()
        done += len(msgs)
    rate = done / (time.perf_counter() - t0)
    await bus.nc.flush()
    await sub.unsubscribe()
    return rate


async def reserve_rate(redis_url: str, n: int, budget_s: float) -> float:
    store = Store.open(redis_url)
    try:
        node = Node(id="raw-n", cluster="rawc", cpu=1e9, memory=10**12, gpus=[Gpu(id="raw-g", memory=10**9)])
        await store.put_node(node)
        t0 = time.perf_counter()
        done = 0
        for i in range(n):
            p = {"iid": f"raw-{i}", "block": "raw", "node": "raw-n", "gpus": ["raw-g"], "cpu": 1, "mem": 1,
                 "gpu_mem": 1, "exclusive": False, "share": True}
            ok, reason, _ = await store.reserve_gang("rawc", [p])
            if not ok:
                raise RuntimeError(f"raw reservation refused: {reason}")
            done += 1
            if time.perf_counter() - t0 > budget_s:
                break
        return done / (time.perf_counter() - t0)
    finally:
        await store.close()


async def measure(nats_url: str, redis_url: str, quick: bool) -> list[common.Row]:
    n, budget = (600, 3.0) if quick else (3000, 8.0)
    bus = await Bus.open(nats_url, "bench-raw")
    try:
        await _stream(bus)
        pub = await publish_rate(bus, n, budget)
        step1 = await step_rate(bus, n, budget, 1)
        step64 = await step_rate(bus, n * 2, budget, 64)
        await bus.js.delete_stream(STREAM)
    finally:
        await bus.close()
    res = await reserve_rate(redis_url, n, budget)
    rows = [
        common.row(GROUP, "JetStream publish, ack awaited", pub, "msg/s", 1.0, "nats-py, 1 process, file stream"),
        common.row(GROUP, "pull-consume step (fetch 1, publish+ack, ack)", step1, "step/s", 1.0,
                   "the per-message floor of a worker; its inverse is the raw step latency"),
        common.row(GROUP, "pull-consume step, batched (fetch 64, publish_async, ack)", step64, "step/s", step64 / step1,
                   "DESIGN §13 batching; of_raw_limit here = gain over the plain step"),
        common.row(GROUP, "Redis RESERVE_GANG round trip (Store.reserve_gang)", res, "op/s", 1.0, "redis-py, 1 process, sequential"),
        common.row(GROUP, "raw step latency", 1000 / step1, "ms", 1.0, "1 / step rate"),
    ]
    rows[0]["key"], rows[1]["key"], rows[3]["key"] = common.JS_PUBLISH, common.JS_STEP, common.REDIS_RESERVE
    return rows


async def _run(quick: bool) -> list[common.Row]:
    async with common.servers("raw") as (nats_url, redis_url, _):
        return await measure(nats_url, redis_url, quick)


def figures(quick: bool = False) -> list[common.Row]:
    rows = common.run(_run(quick))
    common.set_raw(rows)
    return rows


def ensure_raw(quick: bool = True) -> None:
    """For a module run alone: measure the raw limit unless run_all already did."""
    if common.raw(common.JS_STEP) is None:
        figures(quick=quick)


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
