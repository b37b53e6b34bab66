"""Benchmark item 5: rebuild Redis from 100k and 1M stored events (``blocks recover``), and
``blocks replay BID`` with 1M events in the stream.

The events are synthetic but valid: whole block lifecycles (create, parsed, selection, dry_runs,
results, decisions, post_dry_run, allocation, placement, instance create/added, ready; most
blocks then delete/remove/removed/deleted so capacity is reused), published fast (see
``Generator``) into embedded servers in a temp dir (never your own servers: recover writes Redis).
The stored count and the generated state are checked: the rebuilt Redis digest equals the fold's.

Sizes: 100k then 1M events (the 1M stream is the 100k one, filled up); ``--quick``: 100k only.
On 2 shared cores the full module takes about 1-2.5 minutes (generating 1M ~25 s, recover 1M
~14-22 s depending on the other sessions' load; each figure notes the client CPU and the load).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from bench import common

NODES, GPUS, CLUSTERS = 100, 8, 2
KEEP = 1000  # blocks left running at the end; the others are deleted after ready
IR = {
    "blockId": "", "blockComponentURI": "aios://bench/model", "minInstances": 1, "maxInstances": 1,
    "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024},
    "policies": {
        "clusterAllocator": {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        "resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}},
    },
}


def inventory() -> Iterator[tuple[str, str, Any]]:
    for c in range(CLUSTERS):
        cid = f"c{c}"
        yield f"aios.cluster.{cid}.registered", "cluster.registered", {"cluster": {"id": cid, "labels": {}}}
        for n in range(NODES):
            nid = f"{cid}-n{n}"
            node = {"id": nid, "cluster": cid, "labels": {"rack": str(n % 4)}, "cpu": 64.0, "memory": 524288,
                    "gpus": [{"id": f"{nid}-g{g}", "model": "sim", "memory": 81920} for g in range(GPUS)], "healthy": True}
            yield f"aios.node.{nid}.registered", "node.registered", {"node": node, "agent": "", "runtime": "sim"}


def lifecycle(i: int, gen: int, keep: bool) -> Iterator[tuple[str, str, Any]]:
    """One block's events after its create message (which is stream sequence ``gen``)."""
    bid = f"b{i}"
    cid = f"c{i % CLUSTERS}"
    slot = (i // CLUSTERS) % (NODES * GPUS)
    nid, gpu = f"{cid}-n{slot // GPUS}", f"{cid}-n{slot // GPUS}-g{slot % GPUS}"
    iid = f"{bid}-0"
    ir = {**IR, "blockId": bid}
    b = f"aios.block.{bid}"
    cands = [f"c{c}" for c in range(CLUSTERS)]
    yield f"{b}.parsed", "block.parsed", {"block_id": bid, "gen": gen, "ir": ir, "attempt": 0}
    yield f"{b}.selection", "block.selection", {"block_id": bid, "gen": gen, "candidates": cands, "filtered": {}, "policy": "builtin:cluster-rank", "attempt": 0, "deadline": 0.0}
    # the dry_run answers travel over core NATS; the round's post_dry_run stores them, each with its decision
    answers = [{"block_id": bid, "gen": gen, "cluster_id": c, "score": 0.5, "node_info": {"node_id": nid, "gpus": [gpu]}, "attempt": 0,
                "decisions": [{"block_id": bid, "kind": "resourceAllocator", "policy": "resourceAllocator", "uri": "builtin:binpack",
                               "version": None, "action": "dry_run", "input_digest": f"{i:024x}",
                               "output": {"selection_score_data": {"score": 0.5}}, "duration_us": 120}]}
               for c in cands]
    yield f"{b}.post_dry_run", "block.post_dry_run", {"block_id": bid, "gen": gen, "cluster_id": cid, "scores": dict.fromkeys(cands, 0.5), "attempt": 0,
                                                      "answers": answers}
    yield f"aios.cluster.{cid}.allocation", "cluster.allocation", {"block_id": bid, "gen": gen, "cluster_id": cid, "attempt": 0}
    yield f"{b}.placement", "block.placement", {"block_id": bid, "gen": gen, "cluster_id": cid, "action": "allocation", "placements": [{"instance_id": iid, "node_id": nid, "gpus": [gpu]}]}
    yield f"aios.node.{nid}.instance.create", "node.instance.create", {"block_id": bid, "gen": gen, "cluster_id": cid, "instance_id": iid, "node_id": nid, "gpus": [gpu]}
    yield f"{b}.instance.{iid}.added", "block.instance.added", {"block_id": bid, "gen": gen, "instance_id": iid, "node_id": nid, "gpus": [gpu]}
    yield f"{b}.ready", "block.ready", {"block_id": bid, "gen": gen, "status": "ready", "cluster_id": cid, "instances": [iid]}
    if keep:
        return
    yield f"{b}.delete", "block.delete", {"block_id": bid, "request_id": f"d{i}"}
    yield f"aios.node.{nid}.instance.remove", "node.instance.remove", {"block_id": bid, "gen": gen, "cluster_id": cid, "instance_id": iid, "node_id": nid, "gpus": []}
    yield f"{b}.instance.{iid}.removed", "block.instance.removed", {"block_id": bid, "gen": gen, "instance_id": iid, "node_id": nid, "gpus": [gpu], "reason": "block deleted"}
    yield f"{b}.deleted", "block.deleted", {"block_id": bid, "gen": gen, "status": "deleted"}


class Generator:
    """Publishes synthetic lifecycles until the stream holds ``total`` messages.

    Stored exactly as the workers store events (same subjects, envelopes, ``Nats-Msg-Id``), but
    sent as core NATS publishes with every ``SYNC``-th one an acked JetStream publish: the ack
    means the server stored everything before it (one connection, one stream, in order), so at
    most ``SYNC`` messages wait in the server's queue. ~3x faster to generate than awaiting an
    ack future per message (the figure is the read side); ``fill`` checks the stored count."""

    SYNC = 2000

    def __init__(self, bus: Any):
        self.bus = bus
        self.seq = 0
        self.block = 0

    async def _pub(self, subject: str, payload: bytes) -> None:
        self.seq += 1
        headers = {"Nats-Msg-Id": f"bench:{self.seq}"}
        if self.seq % self.SYNC == 0:
            await self.bus.js.publish(subject, payload, headers=headers)
        else:
            await self.bus.nc.publish(subject, payload, headers=headers)

    async def event(self, subject: str, kind: str, data: Any) -> None:
        await self._pub(subject, self.bus.encode(subject, kind, data, f"bench:{self.seq + 1}"))

    async def fill(self, total: int, keep_from: int) -> None:
        from aios_blocks.bus import subjects

        # messages others stored (e.g. the epoch record of a recover between two fills); every
        # message of ours is stored by now (the previous fill checked it)
        others = max(0, (await self.bus.js.stream_info(subjects.STREAM)).state.messages - self.seq)
        if self.seq == 0:
            for ev in inventory():
                await self.event(*ev)
        while self.seq < total:
            i = self.block
            self.block += 1
            spec = {**IR, "blockId": f"b{i}"}
            spec.pop("policies")
            await self._pub(f"aios.block.b{i}.create", msgspec.json.encode(spec))
            gen = self.seq
            for ev in lifecycle(i, gen, keep=i >= keep_from):
                await self.event(*ev)
        await self.bus.nc.flush()
        stored = 0
        for _ in range(300):  # the last messages since the last sync point: stored within seconds
            stored = (await self.bus.js.stream_info(subjects.STREAM)).state.messages
            if stored >= self.seq + others:
                break
            await asyncio.sleep(0.1)
        if stored != self.seq + others:
            raise RuntimeError(f"published {self.seq:,} events (+{others} by others), the stream holds {stored:,}")


async def _measure(quick: bool) -> list[common.Row]:
    from aios_blocks.cli.client import Client
    from aios_blocks.recovery import image as im
    from aios_blocks.recovery.rebuild import drop_project_keys, read_image, recover
    from aios_blocks.runtime import embedded

    rows: list[common.Row] = []
    data = Path(tempfile.mkdtemp(prefix="aios-bench-recovery-"))
    # generating 1M events: nats-server's default fsync (the figure is the read side)
    srv = embedded.EmbeddedServers(data_dir=data, nats_sync="2m").start()
    client = await Client.open(srv.nats_url, srv.redis_url)
    try:
        gen = Generator(client.bus)
        sizes = [100_000] if quick else [100_000, 1_000_000]
        per_block = sum(1 for _ in lifecycle(0, 1, keep=False)) + 1
        for total in sizes:
            started = time.perf_counter()
            await gen.fill(total, keep_from=total // per_block - KEEP)
            publish_s = time.perf_counter() - started
            await drop_project_keys(client.store.r)
            started, cpu = time.perf_counter(), time.process_time()
            rep = await recover(client.bus, client.store)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            load = os.getloadavg()[0]
            assert im.digest(await read_image(client.store.r)) == rep.digest
            note = (
                f"{rep.events:,} events read and folded ({gen.block:,} blocks, {KEEP} left running); read+fold "
                f"{rep.seconds_read:.1f}s, write {rep.keys:,} keys {rep.seconds_write:.1f}s; client CPU {cpu:.1f}s; load {load:.1f} on "
                f"{os.cpu_count()} cores; generating took {publish_s:.0f}s"
            )
            label = f"{total // 1000}k" if total < 1_000_000 else f"{total // 1_000_000}M"
            rows.append(common.row("recovery", f"blocks recover from {label} stored events", seconds, "s", None, note))
            rows.append(common.row("recovery", f"recover rate at {label} events", gen.seq / seconds, "events/s", None,
                                   "stored events per second of recover (all of them are scanned by the server)"))
        bid = f"b{gen.block // 2}"
        started = time.perf_counter()
        events = await client.history(bid)
        seconds = time.perf_counter() - started
        rows.append(common.row(
            "recovery", f"blocks replay BID with {gen.seq / 1e6:.1f}M events in the stream", seconds, "s", None,
            f"{len(events)} events of one block (ordered consumer filtered on aios.block.BID.>)",
        ))
    finally:
        await client.close()
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(_measure(quick))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
