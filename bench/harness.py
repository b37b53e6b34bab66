"""A running stack for the end-to-end benchmarks: servers, supervised workers, a client and a
tracker that timestamps terminal events as they are published (core NATS subscriptions, so
measuring adds no consumer per block)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.cli.client import Client
from aios_blocks.handlers.controller import instance_id
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor

COMPONENT = {
    "componentURI": "aios://bench/model",
    "resources": {"gpus": 1, "cpu": 1, "memory": 1024},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"},
    ],
}
SPEC = {"blockComponentURI": "aios://bench/model", "minInstances": 1, "maxInstances": 1}


@dataclass
class Tracker:
    """bid -> (terminal kind, perf_counter time); instance id -> time of its ``added``."""

    done: dict[str, tuple[str, float]] = field(default_factory=dict)
    added: dict[str, float] = field(default_factory=dict)
    step_failed: dict[str, float] = field(default_factory=dict)  # scale request id -> time
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def attach(self, client: Client) -> None:
        async def on_terminal(msg: Any) -> None:
            bid, kind = msg.subject.split(".")[2], msg.subject.rsplit(".", 1)[1]
            self.done.setdefault(bid, (kind, time.perf_counter()))
            self._changed.set()

        async def on_added(msg: Any) -> None:
            self.added.setdefault(msg.subject.split(".")[4], time.perf_counter())
            self._changed.set()

        async def on_failed(msg: Any) -> None:
            with contextlib.suppress(Exception):
                data = msgspec.json.decode(msg.data).get("data") or {}
                self.step_failed.setdefault(str(data.get("request_id", "")), time.perf_counter())
            self._changed.set()

        for kind in ("ready", "failed", "rejected"):
            await client.bus.subscribe(subjects.block_event("*", kind), on_terminal)
        await client.bus.subscribe(subjects.instance_event("*", "*", "added"), on_added)
        await client.bus.subscribe(subjects.block_event("*", "scale.failed"), on_failed)
        await client.bus.nc.flush()

    async def until(self, pred: Any, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while not pred():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.5))
        return True


@dataclass
class Stack:
    client: Client
    tracker: Tracker
    sup: Supervisor
    data: Path
    #: create->ready of the first block after the clusters were added (workers' caches cold)
    cold_s: float = 0.0

    async def stream_messages(self) -> int:
        info = await self.client.bus.js.stream_info(subjects.STREAM)
        return int(info.state.messages)

    async def stream_bytes(self) -> int:
        info = await self.client.bus.js.stream_info(subjects.STREAM)
        return int(info.state.bytes)

    async def submit_wait(self, spec: dict[str, Any] | None = None, timeout: float = 60) -> tuple[str, float]:
        """One block, create -> terminal: (kind, seconds)."""
        t0 = time.perf_counter()
        bid = await self.client.submit(dict(spec or SPEC))
        await self.tracker.until(lambda: bid in self.tracker.done, timeout)
        kind, t = self.tracker.done.get(bid, ("timeout", time.perf_counter()))
        return kind, t - t0

    async def burst(self, n: int, timeout: float, spec: dict[str, Any] | None = None,
                    one_by_one: bool = False) -> tuple[list[str], float]:
        """n blocks submitted at once; (their ids, seconds until the last one is terminal).
        ``Client.submit`` stores creates gathered at once together (``Bus.emit_together``: atomic
        batches); ``one_by_one`` publishes each create on its own, as a plain NATS client does (one
        disk sync each)."""
        t0 = time.perf_counter()
        if one_by_one:
            bids = [f"blk-{uuid.uuid4().hex[:12]}" for _ in range(n)]
            await asyncio.gather(*(self.client.bus.emit(E.block_create, {**(spec or SPEC), "blockId": b},
                                                        msg_id=f"create:{b}:{uuid.uuid4().hex}", bid=b) for b in bids))
        else:
            bids = list(await asyncio.gather(*(self.client.submit(dict(spec or SPEC)) for _ in range(n))))
        await self.tracker.until(lambda: all(b in self.tracker.done for b in bids), timeout)
        end = max((self.tracker.done[b][1] for b in bids if b in self.tracker.done), default=time.perf_counter())
        return bids, end - t0

    async def paced(self, n: int, rate: float, timeout: float) -> list[float]:
        """n blocks submitted open-loop at ``rate``/s; create -> terminal latency of each."""
        sent: dict[str, float] = {}

        async def one(i: int, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            t = time.perf_counter()
            sent[await self.client.submit(dict(SPEC))] = t

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, t0) for i in range(n)))
        await self.tracker.until(lambda: all(b in self.tracker.done for b in sent), timeout)
        return [self.tracker.done[b][1] - t for b, t in sent.items() if b in self.tracker.done and self.tracker.done[b][0] == "ready"]

    async def scale_burst(self, bids: list[str], n: int, timeout: float) -> tuple[int, int, float]:
        """n scale calls spread over ``bids`` at once: (placed, failed, seconds)."""
        t0 = time.perf_counter()
        # all at once, as ``burst`` submits its blocks and the Ray side its groups (16 in flight,
        # from when the client's Redis pool failed past its bound, made the client the bottleneck:
        # ~700 ms of a ~750 ms run was its submission; the pool now waits for a free connection)
        rids = await asyncio.gather(*(self.client.scale(bids[i % len(bids)]) for i in range(n)))
        iids = [instance_id(bids[i % len(bids)], rid) for i, rid in enumerate(rids)]

        def settled() -> bool:
            return all(iid in self.tracker.added or rid in self.tracker.step_failed for iid, rid in zip(iids, rids, strict=True))

        await self.tracker.until(settled, timeout)
        times = [self.tracker.added[i] for i in iids if i in self.tracker.added]
        times += [self.tracker.step_failed[r] for r in rids if r in self.tracker.step_failed]
        placed = sum(1 for i in iids if i in self.tracker.added)
        return placed, n - placed, (max(times) if times else time.perf_counter()) - t0


@contextlib.asynccontextmanager
async def stack(
    clusters: int, nodes: int, gpus: int = 8, layout: dict[str, int] | None = None, tag: str = "bench",
    grouped: bool | None = None,
) -> AsyncIterator[Stack]:
    """Servers + workers (``Supervisor``) + ``clusters`` simulated clusters of ``nodes`` nodes.
    ``grouped``: the kinds in ``blocks up``'s processes (``supervisor.DEFAULT_GROUPS``), else a
    process per kind; default from ``AIOS_BENCH_GROUPED`` (off)."""
    if grouped is None:
        grouped = os.environ.get("AIOS_BENCH_GROUPED", "") not in ("", "0", "false")
    async with common.servers(tag) as (nats_url, redis_url, data):
        sup_layout = layout or {"parser": 1, "gateway": 1, "controller": 1, "agent-sim": 1}
        sup = Supervisor(nats_url, redis_url, layout=sup_layout, log_dir=str(data / "logs"),
                         groups=DEFAULT_GROUPS if grouped else None).start()
        client = await Client.open(nats_url, redis_url)
        try:
            tracker = Tracker()
            await tracker.attach(client)
            await client.add_component(COMPONENT)
            for i in range(clusters):
                await client.add_sim_cluster(f"c{i}", nodes=nodes, gpus=gpus)
            st = Stack(client, tracker, sup, data)
            kind, st.cold_s = await st.submit_wait(timeout=120)  # workers up
            if kind != "ready":
                raise RuntimeError(f"warm-up block ended {kind}; see {data / 'logs'}")
            # adding the clusters made every worker reload them (in the background): measure
            # once that is over (three blocks in a row within 2x the fastest, at most 15 tries)
            times: list[float] = []
            for _ in range(15):
                times.append((await st.submit_wait(timeout=120))[1])
                if len(times) >= 3 and max(times[-3:]) < 2 * min(times):
                    break
            yield st
        finally:
            await client.close()
            sup.stop()
